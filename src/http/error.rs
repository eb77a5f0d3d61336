//! The one place where errors become HTTP responses.
//!
//! Every error body is `{"error": {"code", "message", "details"}}`. Client errors carry a
//! stable snake_case code; server errors are opaque to the caller and logged with their
//! whole cause chain here.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;
use serde_json::{json, Value};

use crate::error_code::ErrorCode;
use crate::event::parse::BodyError;
use crate::ledger::{self, AppendError};
use crate::{finance, projection};

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
    pub details: Vec<Value>,
    /// For a refused provider report: its bad lines beyond those in `details`.
    pub more_errors: Option<u64>,
    /// Seconds, for 503s that a client should retry.
    pub retry_after_seconds: Option<u64>,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorBody {
    pub error: ErrorContent,
}

#[derive(Serialize, utoipa::ToSchema)]
pub struct ErrorContent {
    /// Stable, snake_case; the same list as the `code` of each entry of `details`.
    pub code: ErrorCode,
    pub message: String,
    /// For batches: `{"index", "code", "message"}` per offending event. For a refused
    /// provider report: `{"line", "column", "code", "message"}` per bad line, in file
    /// order, at most 100; the first is the one `code` and `message` describe.
    pub details: Vec<Value>,
    /// Only for a refused provider report: how many more bad lines it has than `details`
    /// lists (0 when `details` lists them all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub more_errors: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: Vec::new(),
            more_errors: None,
            retry_after_seconds: None,
        }
    }

    /// 422: the request is well formed but breaks a rule.
    pub fn invalid(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
    }

    pub fn with_details(mut self, details: Vec<Value>) -> Self {
        self.details = details;
        self
    }

    pub fn unavailable(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            retry_after_seconds: Some(1),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
        }
    }

    /// A bug or an outage we cannot name to the caller: logged in full, answered opaquely.
    pub fn internal(error: &(dyn std::error::Error + 'static)) -> Self {
        let chain = crate::telemetry::cause_chain(error);
        tracing::error!(error = chain, "internal error");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Internal,
            "internal error; it has been logged",
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body =
            json!({"error": {"code": self.code, "message": self.message, "details": self.details}});
        if let Some(more) = self.more_errors {
            body["error"]["more_errors"] = Value::from(more);
        }
        let mut response = (self.status, Json(body)).into_response();
        if let Some(seconds) = self.retry_after_seconds {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

impl From<BodyError> for ApiError {
    fn from(error: BodyError) -> Self {
        let code = error.code();
        match error {
            BodyError::Malformed(message) => ApiError::new(StatusCode::BAD_REQUEST, code, message),
            BodyError::BatchTooLarge { .. } => {
                ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, code, error.to_string())
            }
            BodyError::UnsupportedMediaType(message) => {
                ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, code, message)
            }
            BodyError::Shape(_) | BodyError::Duplicate(_) | BodyError::EmptyBatch => {
                ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, error.to_string())
            }
            BodyError::Invalid(ref errors) => ApiError {
                details: errors
                    .iter()
                    .map(|e| json!({"index": e.index, "code": e.error.code, "message": e.error.message}))
                    .collect(),
                ..ApiError::new(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    code,
                    format!("{}; nothing was stored", error),
                )
            },
        }
    }
}

/// Is this a database we cannot reach (503, retry) rather than a bug (500)?
pub fn is_unavailable(error: &sqlx::Error) -> bool {
    matches!(
        error,
        sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
    ) || matches!(error, sqlx::Error::Database(e) if e.code().is_some_and(|c| c.starts_with("57") || c.starts_with("08")))
}

impl From<sqlx::Error> for ApiError {
    fn from(error: sqlx::Error) -> Self {
        ApiError::from_store(&error)
    }
}

impl From<ledger::Error> for ApiError {
    fn from(error: ledger::Error) -> Self {
        ApiError::failure(&error, error.database())
    }
}

impl From<projection::Error> for ApiError {
    fn from(error: projection::Error) -> Self {
        ApiError::failure(&error, error.database())
    }
}

impl From<finance::Error> for ApiError {
    fn from(error: finance::Error) -> Self {
        ApiError::failure(&error, error.database())
    }
}

impl From<AppendError> for ApiError {
    fn from(error: AppendError) -> Self {
        match error {
            AppendError::IdempotencyConflict { index, id } => ApiError {
                details: vec![json!({
                    "index": index,
                    "code": ErrorCode::IdempotencyConflict,
                    "message": format!(
                        "id {id} was stored before, or given earlier in this batch, with \
                         different content"
                    ),
                })],
                ..ApiError::new(
                    StatusCode::CONFLICT,
                    ErrorCode::IdempotencyConflict,
                    format!(
                        "event {index} reuses id {id} with different content; nothing was stored"
                    ),
                )
            },
            AppendError::Overloaded => {
                ApiError::unavailable(ErrorCode::Overloaded, "the append queue is full; retry later")
            }
            AppendError::Stopped => {
                ApiError::unavailable(ErrorCode::ShuttingDown, "the service is stopping; retry later")
            }
            // The caller's own content, refused by Postgres after every other request of its
            // group commit was stored: a 422, never a 5xx.
            AppendError::Unstorable { sqlstate, reason } => ApiError::invalid(
                ErrorCode::UnstorableEvent,
                format!("the ledger cannot store this request's content: {reason}; nothing was stored"),
            )
            .with_details(vec![json!({
                "code": ErrorCode::UnstorableEvent,
                "message": format!("postgres refused the content with sqlstate {sqlstate}: {reason}"),
            })]),
            AppendError::Store(error) => ApiError::from_store(&error),
        }
    }
}

impl ApiError {
    fn from_store(error: &sqlx::Error) -> Self {
        if is_unavailable(error) {
            tracing::warn!(error = %error, "database unavailable");
            ApiError::unavailable(
                ErrorCode::DatabaseUnavailable,
                "the database is unavailable; retry later",
            )
        } else {
            ApiError::internal(error)
        }
    }

    /// A layer's failure (`database`, the database error it comes from, if any): 503 when
    /// the database cannot be reached, else a 500 logged with `error`'s whole cause chain.
    pub fn failure(
        error: &(dyn std::error::Error + 'static),
        database: Option<&sqlx::Error>,
    ) -> Self {
        match database {
            Some(store) if is_unavailable(store) => ApiError::from_store(store),
            _ => ApiError::internal(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body_util::BodyExt;

    use super::*;
    use crate::admission::AdmissionError;

    /// The status and the body's `code` of `error`'s answer.
    async fn answered(error: ApiError) -> (StatusCode, String) {
        let response = error.into_response();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        (status, body["error"]["code"].as_str().unwrap().to_owned())
    }

    #[tokio::test]
    async fn a_layer_error_from_an_unreachable_database_is_a_503_to_retry() {
        let finance = finance::Error::Projection(projection::Error::Ledger(
            ledger::Error::Database(sqlx::Error::PoolTimedOut),
        ));
        assert_eq!(
            answered(finance.into()).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "database_unavailable".to_owned()
            )
        );
        let shared = AdmissionError::Group(Arc::new(AdmissionError::Projection(
            projection::Error::Database(sqlx::Error::PoolClosed),
        )));
        let error = ApiError::failure(&shared, shared.database());
        assert_eq!(error.retry_after_seconds, Some(1));
        assert_eq!(
            answered(error).await,
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "database_unavailable".to_owned()
            )
        );
    }

    #[tokio::test]
    async fn a_layer_error_that_is_not_an_outage_is_an_opaque_500() {
        let corrupt = projection::Error::Corrupt("anomaly kind \"x\"".to_owned());
        assert_eq!(
            answered(corrupt.into()).await,
            (StatusCode::INTERNAL_SERVER_ERROR, "internal".to_owned())
        );
        let bug = ledger::Error::Database(sqlx::Error::RowNotFound);
        assert_eq!(
            answered(bug.into()).await,
            (StatusCode::INTERNAL_SERVER_ERROR, "internal".to_owned())
        );
    }
}
