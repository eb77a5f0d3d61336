//! `POST /v1/provider-reports` (contract §5, §6): a FOCUS CSV report, plain or gzipped,
//! streamed into the database all-or-nothing; the same CSV text again answers 200 with the
//! same report.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::{Extension, Json};
use serde::Deserialize;
use serde::Serialize;
use serde_json::json;
use utoipa::IntoParams;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::listing;
use super::query::{QueryParams, StrictQuery};
use super::AppState;
use crate::billing::report::reader::Refusal;
use crate::error_code::ErrorCode;
use crate::event::canonical;
use crate::finance::catalog;
use crate::finance::report_input::InputError;
use crate::finance::reports::{self, Encoding, ImportError, Imported, StoredReport};

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(post_report, list_reports))
}

/// Reports listed when `limit` is not given.
pub const REPORTS_DEFAULT: usize = 100;
/// The most reports one page lists.
pub const REPORTS_MAX: usize = 1_000;

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

/// Import a provider cost and usage report (a FOCUS 1.0–1.2 export): CSV text
/// (`text/csv`), or CSV gzipped, sent either as `application/gzip` (`application/x-gzip`)
/// or as `text/csv` with `Content-Encoding: gzip`. Every line is kept, runtime or not. The
/// report is identified by the sha256 of its CSV text, so the same report gzipped or not
/// is one report. Global (a report spans orgs): a token bound to an org gets 403
/// `org_bound_token`. A refused report lists its bad lines in `details` (`{"line",
/// "column", "code", "message"}`, at most 100, the first being the one the top-level
/// `code` and `message` describe) and counts the rest in `more_errors`. Imports and usage
/// exports run at most a quarter of `TALLY_DB_POOL_MAX` at once on an instance; past
/// `TALLY_READ_WAIT_MS`, 503 `overloaded`.
#[utoipa::path(
    post,
    path = "/v1/provider-reports",
    tag = "finance",
    params(
        ("Content-Encoding" = Option<String>, Header, description = "`gzip` (or `x-gzip`) for a gzipped `text/csv` body; absent or `identity` for plain text; any other is 415 `unsupported_content_encoding`"),
    ),
    request_body(
        description = "A FOCUS 1.0-1.2 export. Required columns: ChargePeriodStart, ChargePeriodEnd, ChargeCategory, BilledCost, BillingCurrency; read when present: ResourceId, ConsumedQuantity, ConsumedUnit, BillingPeriodStart, BillingPeriodEnd, ChargeClass, Tags, ProviderName. Every line is kept; every record has as many fields as the header",
        content(
            (String = "text/csv"),
            ("application/gzip"),
            ("application/x-gzip"),
        )
    ),
    responses(
        (status = 201, body = ReportResponse, description = "a new report"),
        (status = 200, body = ReportResponse, description = "the same CSV text was imported before"),
        (status = 400, body = ErrorBody, description = "`malformed_gzip`: the body is not valid gzip; `unreadable_body`"),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 413, body = ErrorBody, description = "`report_too_large` (bytes sent, `TALLY_REPORT_MAX_BYTES`) or `report_inflated_too_large` (CSV text inflated from gzip, `TALLY_REPORT_MAX_INFLATED_BYTES`); nothing stored"),
        (status = 415, body = ErrorBody, description = "`unsupported_media_type` or `unsupported_content_encoding`"),
        (status = 422, body = ErrorBody, description = "the report is refused and nothing stored: `details` lists every bad line up to 100 (`line`, the header being line 1; `column`; `code`; `message`), `more_errors` counts the rest"),
        (status = 503, body = ErrorBody, description = "`overloaded`: as many imports and exports as the instance runs at once are in progress"),
    ),
    security(("bearer" = []))
)]
pub async fn post_report(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Result<(StatusCode, Json<ReportResponse>), ApiError> {
    let encoding = encoding(&headers)?;
    // The import's transaction is open while the client sends its body.
    let _turn =
        super::take_turn(&state, &state.finance_streams, super::FINANCE_STREAMS_BUSY).await?;
    let imported = reports::import(
        &state.pool,
        body.into_data_stream(),
        encoding,
        state.report_limits,
        &principal.id,
    )
    .await
    .map_err(import_error)?;
    Ok(match imported {
        Imported::Created(report) => (StatusCode::CREATED, Json(report.into())),
        Imported::Existing(report) => (StatusCode::OK, Json(report.into())),
    })
}

/// The query of the report list, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReportsParams {
    /// List the reports after this one (the page before's `next_after`).
    #[param(value_type = Option<String>, format = Uuid)]
    after: Option<String>,
    /// 1–1000, default 100.
    #[param(value_type = Option<usize>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

impl QueryParams for ReportsParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this list"),
        )
    }
}

/// An imported report, as the import answered it, and when it was imported.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReportEntryResponse {
    report_id: Uuid,
    sha256: String,
    lines: i64,
    window_start: String,
    window_end: String,
    imported_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReportsPage {
    /// Newest import first.
    reports: Vec<ReportEntryResponse>,
    /// Pass as `after` for the next page; null when this page is the last.
    next_after: Option<Uuid>,
}

/// The imported provider reports, newest import first, a page at a time. Reads what the
/// imports stored, no derived figure, so it has no position and does not wait for the
/// projection. Global (a report spans orgs): a token bound to an org gets 403
/// `org_bound_token`.
#[utoipa::path(
    get,
    path = "/v1/provider-reports",
    tag = "finance",
    params(ReportsParams),
    responses(
        (status = 200, body = ReportsPage),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "`invalid_limit`, `invalid_after` (not a UUID, or no such report), `unknown_parameter`"),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn list_reports(
    State(state): State<AppState>,
    StrictQuery(params): StrictQuery<ReportsParams>,
) -> Result<Json<ReportsPage>, ApiError> {
    let limit = listing::limit(params.limit.as_deref(), REPORTS_DEFAULT, REPORTS_MAX)?;
    let after = match listing::after_id(params.after.as_deref())? {
        None => None,
        Some(id) => Some(
            catalog::report_cursor(&state.pool, id)
                .await?
                .ok_or_else(|| listing::unknown_after(id))?,
        ),
    };
    // One row past the page tells whether another page follows.
    let mut rows = catalog::reports(&state.pool, after, limit as i64 + 1).await?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let next_after = more.then(|| rows.last().map(|row| row.id)).flatten();
    let reports = rows
        .into_iter()
        .map(|row| ReportEntryResponse {
            report_id: row.id,
            sha256: hex::encode(&row.sha256),
            lines: row.lines,
            window_start: canonical::timestamp(row.window_start),
            window_end: canonical::timestamp(row.window_end),
            imported_at: canonical::timestamp(row.imported_at),
        })
        .collect();
    Ok(Json(ReportsPage {
        reports,
        next_after,
    }))
}

/// The body's encoding, from its `Content-Type` and `Content-Encoding`: 415 for any other
/// media type or coding, and for gzip named by both (which would mean gzip twice).
fn encoding(headers: &HeaderMap) -> Result<Encoding, ApiError> {
    let media_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .map(|value| value.trim().to_ascii_lowercase());
    let gzip_type = match media_type.as_deref() {
        Some("text/csv") => false,
        Some("application/gzip" | "application/x-gzip") => true,
        _ => {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorCode::UnsupportedMediaType,
                "Content-Type must be text/csv or application/gzip",
            ))
        }
    };
    let unsupported = super::body::unsupported_coding;
    let codings = super::body::content_codings(headers)?;
    match (codings.as_slice(), gzip_type) {
        ([], false) => Ok(Encoding::Plain),
        ([], true) => Ok(Encoding::Gzip),
        ([coding], false) if coding == "gzip" || coding == "x-gzip" => Ok(Encoding::Gzip),
        ([_], true) => Err(unsupported(
            "an application/gzip body with a Content-Encoding would be compressed twice: \
             send gzip as application/gzip, or as text/csv with Content-Encoding: gzip"
                .into(),
        )),
        _ => Err(unsupported(format!(
            "Content-Encoding {:?} is not supported: send gzip, or none",
            codings.join(", ")
        ))),
    }
}

pub fn import_error(error: ImportError) -> ApiError {
    match error {
        ImportError::Invalid(refusal) => refused(&refusal),
        ImportError::Input(InputError::TooLarge(max)) => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::ReportTooLarge,
            format!("the report is larger than {max} bytes; nothing was stored"),
        ),
        ImportError::Input(InputError::InflatedTooLarge(max)) => ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::ReportInflatedTooLarge,
            format!("the report inflates to more than {max} bytes of CSV; nothing was stored"),
        ),
        ImportError::Input(InputError::Gzip(message)) => ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::MalformedGzip,
            format!("the body is not valid gzip ({message}); nothing was stored"),
        ),
        ImportError::Input(InputError::Read(message)) => ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::UnreadableBody,
            format!("the report could not be read: {message}"),
        ),
        ImportError::Store(error) => ApiError::from(error),
    }
}

/// 422 with every listed bad line in `details` and the count of the rest in
/// `more_errors`; the code and message are the first line's.
fn refused(refusal: &Refusal) -> ApiError {
    let details = refusal
        .errors()
        .iter()
        .map(|error| {
            json!({
                "line": error.line,
                "column": error.column,
                "code": error.code,
                "message": error.message,
            })
        })
        .collect();
    ApiError {
        details,
        more_errors: Some(refusal.more_errors()),
        ..ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            refusal.first().code,
            format!("{refusal}; nothing was stored"),
        )
    }
}
