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
use crate::ledger::AppendError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: ErrorCode,
    pub message: String,
    pub details: Vec<Value>,
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
    /// For batches: `{"index", "code", "message"}` per offending event.
    pub details: Vec<Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
            details: Vec::new(),
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
        let mut chain = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            chain.push_str(": ");
            chain.push_str(&cause.to_string());
            source = cause.source();
        }
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
        let body =
            json!({"error": {"code": self.code, "message": self.message, "details": self.details}});
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
            BodyError::Shape(_) | BodyError::EmptyBatch => {
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

impl From<AppendError> for ApiError {
    fn from(error: AppendError) -> Self {
        match error {
            AppendError::IdempotencyConflict { index, id } => ApiError {
                details: vec![json!({
                    "index": index,
                    "code": ErrorCode::IdempotencyConflict,
                    "message": format!("id {id} was stored before with different content"),
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
}

impl From<anyhow::Error> for ApiError {
    fn from(error: anyhow::Error) -> Self {
        match error.downcast_ref::<sqlx::Error>() {
            Some(store) => ApiError::from_store(store),
            None => ApiError::internal(error.as_ref()),
        }
    }
}
