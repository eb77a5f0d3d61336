//! `GET /v1/exports/usage.csv?period=YYYY-MM` (contract §6): usage per org, streamed as CSV
//! (or `?format=json`); period close as a job (`POST /v1/periods/{p}/close`, its status at
//! `GET /v1/periods/{p}/close`) and the closed period (`GET /v1/periods/{p}`).

use axum::body::{Body, Bytes};
use axum::extract::Path;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, SubsecRound, Utc};
use futures::StreamExt;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Principal;
use super::consistency::Consistency;
use super::error::{ApiError, ErrorBody};

use super::query::{wants_json, QueryParams, StrictQuery};
use super::replica::ReadPool;
use super::AppState;
use crate::error_code::ErrorCode;
use crate::finance::export::{self, Part};
use crate::finance::periods::{CloseError, CloseJob, JobStatus, Start};
use crate::finance::pricing::USAGE_CSV_HEADER;
use crate::runtime::Period;

/// The response header naming the ledger position a finance export reflects.
pub const POSITION_HEADER: &str = "tally-position";

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_usage_export))
        .routes(routes!(post_close, get_close))
        .routes(routes!(get_period))
        .routes(routes!(list_periods))
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PeriodResponse {
    period: String,
    closed_at: String,
    orgs: i64,
    /// Of the snapshot's usage-export bytes.
    sha256: String,
    /// The stored snapshot still hashes to `sha256`.
    verified: bool,
    /// The ledger position the snapshot reflects: every event at or below it is in it, so
    /// only events recorded after it show as adjustments.
    position: i64,
}

impl From<crate::finance::periods::Closed> for PeriodResponse {
    fn from(closed: crate::finance::periods::Closed) -> Self {
        PeriodResponse {
            period: closed.period.to_string(),
            closed_at: crate::event::canonical::timestamp(closed.closed_at),
            orgs: closed.orgs,
            sha256: closed.sha256,
            verified: closed.verified,
            position: closed.position,
        }
    }
}

/// A close job: `running`, then `done` with the closed period or `failed` with why.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct CloseJobResponse {
    id: uuid::Uuid,
    period: String,
    /// `running`, `done` or `failed`.
    status: &'static str,
    requested_by: String,
    started_at: String,
    finished_at: Option<String>,
    /// When `failed`: `{"code", "message"}`; retry with another `POST`.
    error: Option<serde_json::Value>,
    /// When `done`: the closed period.
    closed: Option<PeriodResponse>,
}

impl From<CloseJob> for CloseJobResponse {
    fn from(job: CloseJob) -> Self {
        CloseJobResponse {
            id: job.id,
            period: job.period.to_string(),
            status: job.status.as_str(),
            requested_by: job.requested_by,
            started_at: crate::event::canonical::timestamp(job.started_at),
            finished_at: job.finished_at.map(crate::event::canonical::timestamp),
            error: job.error.map(|error| error.json()),
            closed: job.closed.map(PeriodResponse::from),
        }
    }
}

/// The status URL of a period's close.
fn close_location(period: Period) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&format!("/v1/periods/{period}/close"))
            .expect("a period is a valid header value"),
    );
    headers
}

/// Close a finished period: freeze every org's figures in a hashed snapshot. The close runs
/// as a job: `202` with the job (a new one, or the one already running; `Location` is its
/// status), `200` with the done job when the period is already closed. The request first
/// waits until the projection has reached the ledger head taken at its start, so that every
/// event acknowledged before it (by any instance) is in the snapshot and none shows as an
/// adjustment; past `TALLY_READ_WAIT_MS`, 503 `projection_lagging` with `Retry-After`.
/// Global: a token bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    post,
    path = "/v1/periods/{period}/close",
    tag = "finance",
    params(("period" = String, Path, description = "YYYY-MM")),
    responses(
        (status = 200, body = CloseJobResponse, description = "already closed"),
        (status = 202, body = CloseJobResponse, description = "closing"),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "still running"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "projection_lagging (with Retry-After), close_starting or unavailable"),
    ),
    security(("bearer" = []))
)]
pub async fn post_close(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(period): Path<String>,
) -> Result<Response, ApiError> {
    let period = Period::parse(&period)
        .map_err(|error| ApiError::invalid(ErrorCode::InvalidPeriod, error.to_string()))?;
    // The job starts after the wait, so its snapshot (which reads the checkpoint with the
    // rows) is at or past this request's head.
    Consistency::Head.settle(&state).await?;
    let started = crate::finance::periods::start(
        &state.pool,
        period,
        state.clock.now(),
        &principal.id,
        state.finance_batch_orgs,
    )
    .await;
    let job = match started {
        Ok(Start::Claimed(claim)) => {
            let job = claim.job.clone();
            // The close outlives the request; how it ends is stored on the job.
            tokio::spawn(claim.run());
            job
        }
        Ok(Start::Existing(job)) => job,
        Err(error) => return Err(close_error(error)),
    };
    let status = match job.status {
        JobStatus::Done => StatusCode::OK,
        JobStatus::Running | JobStatus::Failed => StatusCode::ACCEPTED,
    };
    Ok((
        status,
        close_location(period),
        Json(CloseJobResponse::from(job)),
    )
        .into_response())
}

fn close_error(error: CloseError) -> ApiError {
    match error {
        CloseError::Running(period, until) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::PeriodRunning,
            format!(
                "period {period} runs until {}",
                crate::event::canonical::timestamp(until)
            ),
        ),
        CloseError::AlreadyClosed(period) => ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::PeriodClosed,
            format!("period {period} is already closed"),
        ),
        CloseError::Starting(period) => ApiError::unavailable(
            ErrorCode::CloseStarting,
            format!("a close of period {period} is starting; retry"),
        ),
        CloseError::Store(error) => ApiError::from(error),
    }
}

/// The latest close job of a period: `running`, `done` (with the closed period) or
/// `failed` (with why; a close whose process stopped reads as failed).
#[utoipa::path(
    get,
    path = "/v1/periods/{period}/close",
    tag = "finance",
    params(("period" = String, Path, description = "YYYY-MM")),
    responses(
        (status = 200, body = CloseJobResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "no close asked for"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_close(
    State(state): State<AppState>,
    Path(period): Path<String>,
) -> Result<Json<CloseJobResponse>, ApiError> {
    let period = Period::parse(&period)
        .map_err(|error| ApiError::invalid(ErrorCode::InvalidPeriod, error.to_string()))?;
    match crate::finance::periods::job(&state.pool, period).await? {
        Some(job) => Ok(Json(job.into())),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::CloseNotFound,
            format!("no close of period {period} was asked for"),
        )),
    }
}

/// A closed period, with its snapshot verified against its hash. Global (the snapshot and
/// its hash cover every org): a token bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    get,
    path = "/v1/periods/{period}",
    tag = "finance",
    params(("period" = String, Path, description = "YYYY-MM")),
    responses(
        (status = 200, body = PeriodResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "not closed"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_period(
    State(state): State<AppState>,
    Path(period): Path<String>,
) -> Result<Json<PeriodResponse>, ApiError> {
    let period = Period::parse(&period)
        .map_err(|error| ApiError::invalid(ErrorCode::InvalidPeriod, error.to_string()))?;
    match crate::finance::periods::get(&state.pool, period).await? {
        Some(closed) => Ok(Json(closed.into())),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::PeriodNotClosed,
            format!("period {period} is not closed"),
        )),
    }
}

/// Periods listed when `limit` is not given: two years.
pub const PERIODS_DEFAULT: usize = 24;
/// The most periods one answer lists: ten years, a bounded answer whatever the ledger's
/// age.
pub const PERIODS_MAX: usize = 120;

/// The query of the period list, read as text and checked by the route.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct PeriodsParams {
    /// 1–120, default 24.
    #[param(value_type = Option<usize>, minimum = 1, maximum = 120)]
    limit: Option<String>,
}

impl QueryParams for PeriodsParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this list"),
        )
    }
}

/// One period and where it stands.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PeriodEntryResponse {
    /// `YYYY-MM`
    period: String,
    /// `open` (no close asked for, or the month still runs), `closing` (a close job runs),
    /// `closed`, or `failed` (the latest close failed or its process stopped; nothing of
    /// it was stored).
    #[schema(pattern = "^(open|closing|closed|failed)$")]
    state: &'static str,
    /// When `closed`.
    closed_at: Option<String>,
    /// When `closed`: the orgs in its snapshot.
    orgs: Option<i64>,
    /// When `closed`: the sha256 of the snapshot's usage-export bytes, as stored (verify
    /// it with `GET /v1/periods/{period}`).
    sha256: Option<String>,
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PeriodsResponse {
    /// Newest first.
    periods: Vec<PeriodEntryResponse>,
}

/// The periods and their close states, newest first: every month from that of the earliest
/// ledger event (the current month when the ledger is empty) to the current month, and any
/// period whose close was asked for; the newest `limit` of them. Reads stored closes and
/// jobs only, no derived figure, so it has no position and does not wait for the
/// projection. Global: a token bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    get,
    path = "/v1/periods",
    tag = "finance",
    params(PeriodsParams),
    responses(
        (status = 200, body = PeriodsResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn list_periods(
    State(state): State<AppState>,
    StrictQuery(params): StrictQuery<PeriodsParams>,
) -> Result<Json<PeriodsResponse>, ApiError> {
    let limit = super::listing::limit(params.limit.as_deref(), PERIODS_DEFAULT, PERIODS_MAX)?;
    let entries = crate::finance::catalog::periods(&state.pool, state.clock.now(), limit).await?;
    let periods = entries
        .into_iter()
        .map(|entry| PeriodEntryResponse {
            period: entry.period.to_string(),
            state: entry.state.as_str(),
            closed_at: entry.closed_at.map(crate::event::canonical::timestamp),
            orgs: entry.orgs,
            sha256: entry.sha256,
        })
        .collect();
    Ok(Json(PeriodsResponse { periods }))
}

/// The query of the usage export, read as text and checked by the route.
#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ExportParams {
    /// YYYY-MM
    #[param(value_type = String, required = true)]
    period: Option<String>,
    /// `csv` (the default) or `json`
    #[param(pattern = "^(csv|json)$")]
    format: Option<String>,
    /// wait only until the projection has reached this ledger position, rather than the head
    #[param(value_type = Option<i64>, minimum = 0)]
    min_position: Option<String>,
    /// `eventual`: export at once from the projection as it stands
    #[param(pattern = "^eventual$")]
    consistency: Option<String>,
}

impl QueryParams for ExportParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this export"),
        )
    }
}

/// Usage of every org in a period that has begun (else 422 `invalid_period`), priced: one
/// row per org (a token bound to an org gets that org's row only). A closed period is its
/// snapshot: the rows its close stored, byte for byte what its `sha256` covers, at the
/// position it was closed at, read at once from the primary (the consistency parameters
/// are checked, and have nothing to wait for). Otherwise the export first waits until the
/// projection has reached the ledger head taken at its start (`min_position` /
/// `Tally-Min-Position` waits for that position instead, `consistency=eventual` not at all;
/// past `TALLY_READ_WAIT_MS`, 503 `projection_lagging`). With a read database (`TALLY_READ_DATABASE_URL`) the export
/// reads there and waits until its replayed projection has reached that position (past the
/// wait, 503 `replica_lagging`). Every row comes from one snapshot; the ledger position it
/// reflects is the `Tally-Position` header, and also `position` in a JSON answer. Exports
/// and report imports run at most a quarter of `TALLY_DB_POOL_MAX` at once on an instance
/// (each holds a connection while its client reads); past `TALLY_READ_WAIT_MS`, 503
/// `overloaded`.
#[utoipa::path(
    get,
    path = "/v1/exports/usage.csv",
    tag = "finance",
    params(
        ExportParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 200, description = "CSV, one line per org and then one per adjustment; with `format=json`, one JSON object",
         content((String = "text/csv"), (UsageExportSchema = "application/json")),
         headers(("Tally-Position" = i64, description = "the ledger position the figures reflect"))),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "projection_lagging or replica_lagging (with Retry-After), overloaded, or unavailable"),
    ),
    security(("bearer" = []))
)]
pub async fn get_usage_export(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    StrictQuery(params): StrictQuery<ExportParams>,
) -> Result<Response, ApiError> {
    let period = export_period(params.period.as_deref(), state.clock.now())?;
    let json_format = wants_json(params.format.as_deref())?;
    let consistency = Consistency::parse(
        params.min_position.as_deref(),
        params.consistency.as_deref(),
        &headers,
    )?;
    // A closed period is the snapshot its close stored, read on the primary: nothing to
    // wait for, and a read database may not hold the close yet. Any other is read on the
    // read database when one is set, once it has replayed the position wanted.
    let closed = crate::finance::periods::close_position(&state.pool, period).await?;
    let reads = match closed {
        Some(_) => {
            consistency.check(&state).await?;
            ReadPool::primary(&state)
        }
        None => consistency.settle_reads(&state).await?,
    };
    let as_of = state.clock.now().trunc_subsecs(3).min(period.end());
    // Held by the body until its last byte is taken, as the snapshot is.
    let turn =
        super::take_turn(&state, &state.finance_streams, super::FINANCE_STREAMS_BUSY).await?;
    // A token bound to one org is served that org's row and adjustments only, and only
    // that org is priced.
    let export = export::usage_export(
        &reads.pool,
        period,
        as_of,
        state.finance_batch_orgs,
        principal.org_id.clone(),
    )
    .await
    .map_err(|error| reads.error(error))?;
    let (position, parts) = (export.position, export.parts);
    let head = futures::stream::once(async move {
        Ok::<Bytes, std::io::Error>(Bytes::from(if json_format {
            format!("{{\"position\":{position},\"rows\":[")
        } else {
            format!("{USAGE_CSV_HEADER}\n")
        }))
    });
    let mut writer = ExportWriter {
        json: json_format,
        rows_written: false,
        adjustments_written: false,
    };
    // `None` after the last part: the place to close the JSON.
    let parts = parts.map(Some).chain(futures::stream::once(async { None }));
    let body = parts.map(move |part| {
        let _turn = &turn;
        writer.write(part)
    });
    let content_type = if json_format {
        "application/json"
    } else {
        "text/csv; charset=utf-8"
    };
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(POSITION_HEADER, position)
        .body(Body::from_stream(head.chain(body)))
        .map_err(|error| ApiError::internal(&error))
}

/// The usage export as JSON (`format=json`): the CSV's lines as objects. The answer is
/// streamed a row at a time, never built as one value; this type is its description.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct UsageExportSchema {
    /// The ledger position the figures reflect, as the `Tally-Position` header.
    position: i64,
    rows: Vec<UsageRowSchema>,
    /// Changes to closed periods whose next open period is this one.
    adjustments: Vec<AdjustmentSchema>,
}

/// One org's figures in a period: the columns of the CSV.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct UsageRowSchema {
    org_id: String,
    plan: String,
    /// `YYYY-MM`
    period: String,
    runtime_ms: i64,
    included_ms: i64,
    overage_ms: i64,
    /// A decimal number as text, rounded to the currency's minor unit.
    overage_amount: String,
    currency: String,
    commands: i64,
    ports_published: i64,
}

/// How a closed period's figures for one org differ now from its snapshot: the columns of
/// a row as differences (`included_ms` 0, `period` the closed one), and the events
/// recorded after the close that made the difference.
#[derive(utoipa::ToSchema)]
#[allow(dead_code)]
pub struct AdjustmentSchema {
    org_id: String,
    plan: String,
    period: String,
    runtime_ms: i64,
    included_ms: i64,
    overage_ms: i64,
    overage_amount: String,
    currency: String,
    commands: i64,
    ports_published: i64,
    caused_by: Vec<uuid::Uuid>,
}

/// The export's `period`, required: `YYYY-MM`, begun by `now` (a period still to come has
/// no usage; its export would list running orgs with zeros).
fn export_period(period: Option<&str>, now: DateTime<Utc>) -> Result<Period, ApiError> {
    let period = period.ok_or_else(|| {
        ApiError::invalid(ErrorCode::InvalidPeriod, "period is required: YYYY-MM")
    })?;
    let period = Period::parse(period)
        .map_err(|error| ApiError::invalid(ErrorCode::InvalidPeriod, error.to_string()))?;
    if period.start() > now {
        return Err(ApiError::invalid(
            ErrorCode::InvalidPeriod,
            format!("period {period} has not begun; it has no usage to export"),
        ));
    }
    Ok(period)
}

/// Writes a usage export's parts as CSV lines or as the members of one JSON object.
struct ExportWriter {
    json: bool,
    /// Whether a row or an adjustment has been written yet, for JSON's separators.
    rows_written: bool,
    adjustments_written: bool,
}

impl ExportWriter {
    /// The text of one part; `None` is the end, where the JSON closes.
    fn write<E: std::fmt::Display>(
        &mut self,
        part: Option<Result<Part, E>>,
    ) -> Result<Bytes, std::io::Error> {
        let mut text = String::new();
        match part {
            None if self.json && !self.adjustments_written => {
                text.push_str("],\"adjustments\":[]}")
            }
            None if self.json => text.push_str("]}"),
            None => {}
            Some(Ok(Part::Rows(rows))) => {
                for row in rows {
                    if self.json {
                        text.push_str(if self.rows_written { "," } else { "" });
                        text.push_str(&row.json().to_string());
                    } else {
                        text.push_str(&row.csv());
                    }
                    self.rows_written = true;
                }
            }
            // Adjustments of closed periods whose next open period is this one, after
            // the rows.
            Some(Ok(Part::Adjustments(adjustments))) => {
                for adjustment in adjustments {
                    if self.json {
                        text.push_str(if self.adjustments_written {
                            ","
                        } else {
                            "],\"adjustments\":["
                        });
                        text.push_str(&adjustment.json().to_string());
                    } else {
                        text.push_str(&adjustment.delta.csv());
                    }
                    self.adjustments_written = true;
                }
            }
            Some(Err(error)) => {
                tracing::error!(error = format!("{error:#}"), "usage export failed midway");
                return Err(std::io::Error::other(error.to_string()));
            }
        }
        Ok(Bytes::from(text))
    }
}
