//! `GET /v1/ledger/verify`: recompute the hash chain and name the first broken position.

use axum::extract::State;
use axum::routing::get;
use axum::{Json, Router};

use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::ledger::verify::{self, VerifyReport};

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/ledger/verify", get(get_verify))
}

/// Verify the whole hash chain.
#[utoipa::path(
    get,
    path = "/v1/ledger/verify",
    tag = "audit",
    responses(
        (status = 200, body = crate::http::ops::VerifyReportSchema),
        (status = 401, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_verify(State(state): State<AppState>) -> Result<Json<VerifyReport>, ApiError> {
    Ok(Json(verify::verify(&state.pool).await?))
}
