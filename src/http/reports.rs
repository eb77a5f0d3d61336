//! `POST /v1/provider-reports` (contract §5, §6): a FOCUS CSV report, streamed into the
//! database all-or-nothing; the same bytes again answer 200 with the same report.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::{Extension, Json};
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::canonical;
use crate::finance::reports::{self, ImportError, Imported, StoredReport};

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(post_report))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReportResponse {
    report_id: Uuid,
    lines: i64,
    sha256: String,
    window_start: String,
    window_end: String,
}

impl From<StoredReport> for ReportResponse {
    fn from(report: StoredReport) -> Self {
        ReportResponse {
            report_id: report.id,
            lines: report.lines,
            sha256: report.sha256,
            window_start: canonical::timestamp(report.window_start),
            window_end: canonical::timestamp(report.window_end),
        }
    }
}

/// Import a provider cost and usage report (a FOCUS 1.0–1.2 export, `text/csv`): every
/// line is kept, runtime or not. Global (a report spans
/// orgs): a token bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    post,
    path = "/v1/provider-reports",
    tag = "finance",
    request_body(content = String, content_type = "text/csv", description = "A FOCUS 1.0-1.2 export. Required columns: ChargePeriodStart, ChargePeriodEnd, ChargeCategory, BilledCost, BillingCurrency; read when present: ResourceId, ConsumedQuantity, ConsumedUnit, BillingPeriodStart, BillingPeriodEnd, ChargeClass, Tags, ProviderName. Every line is kept"),
    responses(
        (status = 201, body = ReportResponse, description = "a new report"),
        (status = 200, body = ReportResponse, description = "the same bytes were imported before"),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "details name the line and column"),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn post_report(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<ReportResponse>), ApiError> {
    let is_csv = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.split(';').next().map(str::trim) == Some("text/csv"));
    if !is_csv {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::UnsupportedMediaType,
            "Content-Type must be text/csv",
        ));
    }
    let imported = reports::import(
        &state.pool,
        body.into_data_stream(),
        state.report_max_bytes,
        &principal.id,
    )
    .await
    .map_err(import_error)?;
    Ok(match imported {
        Imported::Created(report) => (StatusCode::CREATED, Json(report.into())),
        Imported::Existing(report) => (StatusCode::OK, Json(report.into())),
    })
}

pub fn import_error(error: ImportError) -> ApiError {
    match error {
        ImportError::Invalid(error) => ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            error.code,
            format!("{error}; nothing was stored"),
        )
        .with_details(vec![json!({
            "line": error.line,
            "column": error.column,
            "code": error.code,
            "message": error.message,
        })]),
        ImportError::TooLarge(max) => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::ReportTooLarge,
            format!("the report is larger than {max} bytes; nothing was stored"),
        ),
        ImportError::Read(message) => ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::UnreadableBody,
            format!("the report could not be read: {message}"),
        ),
        ImportError::Store(error) => ApiError::from(error),
    }
}
