//! `GET /v1/ledger/verify`: recompute the hash chain and name the first broken position —
//! from the last verified checkpoint, or from the start with `?full=true`; with
//! `?stream=true` also compare every row with its `TALLY_LEDGER` message.

use std::collections::HashMap;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};

use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::ledger::verify::{self, VerifyReport};

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/ledger/verify", get(get_verify))
}

/// Verify the hash chain: the rows after the last verified checkpoint, or every row with
/// `full=true`.
#[utoipa::path(
    get,
    path = "/v1/ledger/verify",
    tag = "audit",
    params(
        ("full" = Option<bool>, Query, description = "verify from the first row (default false)"),
        ("stream" = Option<bool>, Query, description = "also compare every row with its TALLY_LEDGER message (default false)"),
    ),
    responses(
        (status = 200, body = crate::http::ops::VerifyReportSchema),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_verify(
    State(state): State<AppState>,
    Query(params): Query<HashMap<String, String>>,
) -> Result<Json<VerifyReport>, ApiError> {
    if let Some(unknown) = params
        .keys()
        .find(|name| !["full", "stream"].contains(&name.as_str()))
    {
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "unknown_parameter",
            format!("{unknown}: is not a parameter of verify"),
        ));
    }
    let full = match params.get("full").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_full",
                format!("full: {other:?} is not true or false"),
            ))
        }
    };
    let stream = match params.get("stream").map(String::as_str) {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_stream",
                format!("stream: {other:?} is not true or false"),
            ))
        }
    };
    let report = if full {
        verify::verify(&state.pool).await?
    } else {
        verify::verify_incremental(&state.pool).await?
    };
    if stream {
        let context = crate::bus::jetstream(state.nats.clone());
        let compared = crate::bus::check::verify_stream(&state.pool, &context, &state.nats_names)
            .await
            .map_err(stream_error)?;
        return Ok(Json(report.with_stream(compared)));
    }
    Ok(Json(report))
}

/// A failure to read the stream is NATS being unavailable (503, retry); one to read the
/// ledger is mapped as any store error.
fn stream_error(error: anyhow::Error) -> ApiError {
    if error.downcast_ref::<sqlx::Error>().is_some() {
        return ApiError::from(error);
    }
    tracing::warn!(
        error = format!("{error:#}"),
        "cannot compare the ledger stream"
    );
    ApiError::unavailable(
        "stream_unavailable",
        "cannot read the TALLY_LEDGER stream; try again",
    )
}
