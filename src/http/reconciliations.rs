//! Reconciliations (contract §5, §6): `POST /v1/reconciliations` runs one;
//! `GET /v1/reconciliations/{id}/lines.csv` streams its lines (`?format=json` for JSON).

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::body::{present, RequestBody, StrictJson};
use super::consistency::Consistency;
use super::error::{ApiError, ErrorBody};
use super::exports::POSITION_HEADER;
use super::listing;

use super::query::{wants_json, QueryParams, StrictQuery};
use super::AppState;
use crate::billing::reconcile::{Tolerance, TOLERANCE_MS_MAX};
use crate::billing::report::exact_decimal;
use crate::error_code::ErrorCode;
use crate::event::canonical;
use crate::finance::catalog::{self, ReconciliationEntry};
use crate::finance::jobs::JobStatus;
use crate::finance::reconciliation::{self, ReconcileError, LINES_CSV_HEADER};

/// Lines read per query while streaming an export.
const EXPORT_CHUNK_LINES: i64 = 1_000;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(post_reconciliation, list_reconciliations))
        .routes(routes!(get_reconciliation))
        .routes(routes!(get_lines))
}

/// Reconciliations listed when `limit` is not given.
pub const RECONCILIATIONS_DEFAULT: usize = 100;
/// The most reconciliations one page lists.
pub const RECONCILIATIONS_MAX: usize = 1_000;

/// The body of a reconciliation. Each field is checked by the route, with its own code.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconciliationRequest {
    /// The stored provider report to reconcile.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, format = Uuid, required = true)]
    report_id: Option<Value>,
    /// The smallest runtime difference that counts, 0 to a day; default 2000.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = u64, maximum = 86_400_000)]
    tolerance_ms: Option<Value>,
    /// The smallest runtime difference that counts as a share of the runtime, a decimal
    /// from 0 to 1 as a string or a number; default 0.005.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, example = "0.005")]
    tolerance_ratio: Option<Value>,
}

impl RequestBody for ReconciliationRequest {
    const WHAT: &'static str = "a reconciliation";
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReconciliationResponse {
    reconciliation_id: Uuid,
    /// Lines per status.
    #[schema(value_type = Object)]
    counts: Value,
    /// Money per currency (`currencies`), overall, per status and per org: each figure
    /// rounded once to the currency's minor unit, and exactly (`*_exact`); `rounding` names
    /// the rule.
    #[schema(value_type = Object)]
    totals: Value,
    /// The ledger position the ledger figures reflect: every event acknowledged before the
    /// request, by any instance, is at or below it.
    position: i64,
}

/// Reconciliations running at once on one instance. Each runs on a session of its own,
/// outside the pool, for as long as it takes: past this many, 503 `reconciliations_busy`.
pub const RECONCILIATIONS_RUNNING_MAX: usize = 4;

/// `Retry-After` of a reconciliation still running, and of one refused for the others.
const RUNNING_RETRY_AFTER_SECONDS: u64 = 2;

/// A reconciliation asked for that has not finished, or failed: how it was asked and how
/// it stands. A done one reads as the reconciliation itself.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReconciliationJobResponse {
    reconciliation_id: Uuid,
    /// `running` or `failed`.
    status: &'static str,
    report_id: Uuid,
    tolerance_ms: i64,
    /// A decimal number as text.
    #[schema(value_type = String, example = "0.005")]
    tolerance_ratio: String,
    requested_by: String,
    started_at: String,
    finished_at: Option<String>,
    /// When `failed`: `{"code", "message"}`; nothing was stored; ask again with another
    /// `POST`.
    #[schema(value_type = Option<Object>)]
    error: Option<Value>,
}

impl From<reconciliation::Job> for ReconciliationJobResponse {
    fn from(job: reconciliation::Job) -> Self {
        ReconciliationJobResponse {
            reconciliation_id: job.id,
            status: job.status.as_str(),
            report_id: job.report_id,
            tolerance_ms: job.tolerance.min_ms,
            tolerance_ratio: job.tolerance.ratio.to_string(),
            requested_by: job.requested_by,
            started_at: canonical::timestamp(job.started_at),
            finished_at: job.finished_at.map(canonical::timestamp),
            error: job.error.map(|error| error.json()),
        }
    }
}

/// Reconcile a stored provider report against the ledger. The run first waits until the
/// projection has reached the ledger head taken at the request's start, so that every event
/// acknowledged before it (by any instance) is counted; past `TALLY_READ_WAIT_MS`, 503
/// `projection_lagging` with `Retry-After`. The reconciliation runs as a job that outlives
/// the request: `201` with its figures when it ends within half of
/// `TALLY_REQUEST_TIMEOUT_MS`, else `202` with the running job, `Location` (its
/// `GET /v1/reconciliations/{id}`) and `Retry-After`. At most four run at once per
/// instance; past them 503 `reconciliations_busy`. Global (a report spans orgs): a token
/// bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    post,
    path = "/v1/reconciliations",
    tag = "finance",
    request_body(content = ReconciliationRequest),
    responses(
        (status = 201, body = ReconciliationResponse),
        (status = 202, body = ReconciliationJobResponse, description = "still running: poll `Location`"),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "projection_lagging or reconciliations_busy (with Retry-After), or unavailable"),
    ),
    security(("bearer" = []))
)]
pub async fn post_reconciliation(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    StrictJson(body): StrictJson<ReconciliationRequest>,
) -> Result<Response, ApiError> {
    // Answered well inside the request's deadline, whatever the wait for the head took.
    let answer_by = tokio::time::Instant::now() + state.request_timeout / 2;
    let report_id = body
        .report_id
        .as_ref()
        .and_then(Value::as_str)
        .and_then(|id| Uuid::try_parse(id).ok())
        .ok_or_else(|| {
            ApiError::invalid(ErrorCode::InvalidReportId, "report_id: a UUID is required")
        })?;
    let tolerance = tolerance(&body)?;
    // The run reads the checkpoint in its own snapshot, after the wait: at or past the head.
    Consistency::Head.settle(&state).await?;
    // An unknown report is the caller's mistake, whatever else runs.
    let window = reconciliation::report_window(&state.pool, report_id)
        .await
        .map_err(reconcile_error)?;
    let Ok(permit) = state.reconciliations.clone().try_acquire_owned() else {
        metrics::counter!(crate::telemetry::RECONCILIATIONS, "outcome" => "refused").increment(1);
        return Err(busy());
    };
    let asked = reconciliation::Asked {
        report_id,
        tolerance,
        actor: principal.id.clone(),
    };
    let claim = reconciliation::claim(&state.pool, asked, window)
        .await
        .map_err(reconcile_error)?;
    let job = claim.job().clone();
    let now = state.clock.now();
    // The run holds its permit to its end, answered or not.
    let running = tokio::spawn(async move {
        let _permit = permit;
        let gauge = metrics::gauge!(crate::telemetry::RECONCILIATIONS_RUNNING);
        gauge.increment(1.0);
        let summary = claim.run(now).await;
        gauge.decrement(1.0);
        let outcome = if summary.is_ok() { "done" } else { "failed" };
        metrics::counter!(crate::telemetry::RECONCILIATIONS, "outcome" => outcome).increment(1);
        summary
    });
    match tokio::time::timeout_at(answer_by, running).await {
        Ok(Ok(summary)) => {
            let summary = summary.map_err(reconcile_error)?;
            Ok((
                StatusCode::CREATED,
                Json(ReconciliationResponse {
                    reconciliation_id: summary.id,
                    counts: summary.counts,
                    totals: summary.totals,
                    position: summary.position,
                }),
            )
                .into_response())
        }
        Ok(Err(panicked)) => Err(ApiError::internal(&panicked)),
        Err(_) => Ok(accepted(job)),
    }
}

/// 503 `reconciliations_busy`: [`RECONCILIATIONS_RUNNING_MAX`] are running here.
fn busy() -> ApiError {
    ApiError {
        retry_after_seconds: Some(RUNNING_RETRY_AFTER_SECONDS),
        ..ApiError::unavailable(
            ErrorCode::ReconciliationsBusy,
            format!(
                "{RECONCILIATIONS_RUNNING_MAX} reconciliations are running on this instance; \
                 retry when one has finished"
            ),
        )
    }
}

/// 202 with the running `job`, where to read it and when.
fn accepted(job: reconciliation::Job) -> Response {
    (
        StatusCode::ACCEPTED,
        [
            (header::LOCATION, format!("/v1/reconciliations/{}", job.id)),
            (header::RETRY_AFTER, RUNNING_RETRY_AFTER_SECONDS.to_string()),
        ],
        Json(ReconciliationJobResponse::from(job)),
    )
        .into_response()
}

/// What a caller is told of a reconciliation that could not be run or stored.
fn reconcile_error(error: ReconcileError) -> ApiError {
    match error {
        ReconcileError::UnknownReport(id) => ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ReportNotFound,
            format!("no report {id}"),
        ),
        ReconcileError::OutOfRange(out_of_range) => ApiError::invalid(
            ErrorCode::AmountsOutOfRange,
            reconciliation::out_of_range_refusal(&out_of_range),
        ),
        ReconcileError::Store(error) => ApiError::from(error),
    }
}

/// The query of the reconciliation list, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReconciliationsParams {
    /// Only this report's reconciliations.
    #[param(value_type = Option<String>, format = Uuid)]
    report_id: Option<String>,
    /// List the reconciliations after this one (the page before's `next_after`).
    #[param(value_type = Option<String>, format = Uuid)]
    after: Option<String>,
    /// 1–1000, default 100.
    #[param(value_type = Option<usize>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

impl QueryParams for ReconciliationsParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this list"),
        )
    }
}

/// A stored reconciliation in a list: how it was run and its lines per status.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReconciliationEntryResponse {
    reconciliation_id: Uuid,
    report_id: Uuid,
    created_at: String,
    /// The ledger position its ledger figures reflect.
    position: i64,
    tolerance_ms: i64,
    /// A decimal number as text.
    #[schema(value_type = String, example = "0.005")]
    tolerance_ratio: String,
    /// Lines per status.
    #[schema(value_type = Object)]
    counts: Value,
}

impl From<ReconciliationEntry> for ReconciliationEntryResponse {
    fn from(entry: ReconciliationEntry) -> Self {
        ReconciliationEntryResponse {
            reconciliation_id: entry.id,
            report_id: entry.report_id,
            created_at: canonical::timestamp(entry.created_at),
            position: entry.ledger_position,
            tolerance_ms: entry.tolerance_ms,
            tolerance_ratio: entry.tolerance_ratio.to_string(),
            counts: entry.counts,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReconciliationsPage {
    /// Newest first.
    reconciliations: Vec<ReconciliationEntryResponse>,
    /// Pass as `after` for the next page; null when this page is the last.
    next_after: Option<Uuid>,
}

/// The stored reconciliations, newest first, a page at a time; only one report's with
/// `report_id`. Each names the ledger position its figures reflect; the list reads what
/// the runs stored and does not wait for the projection. Global: a token bound to an org
/// gets 403 `org_bound_token`.
#[utoipa::path(
    get,
    path = "/v1/reconciliations",
    tag = "finance",
    params(ReconciliationsParams),
    responses(
        (status = 200, body = ReconciliationsPage),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "`invalid_limit`, `invalid_after` (not a UUID, or no such reconciliation in this list), `invalid_report_id`, `unknown_parameter`"),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn list_reconciliations(
    State(state): State<AppState>,
    StrictQuery(params): StrictQuery<ReconciliationsParams>,
) -> Result<Json<ReconciliationsPage>, ApiError> {
    let limit = listing::limit(
        params.limit.as_deref(),
        RECONCILIATIONS_DEFAULT,
        RECONCILIATIONS_MAX,
    )?;
    let report_id = params
        .report_id
        .as_deref()
        .map(|id| {
            Uuid::try_parse(id).map_err(|_| {
                ApiError::invalid(ErrorCode::InvalidReportId, "report_id: must be a UUID")
            })
        })
        .transpose()?;
    let after = match listing::after_id(params.after.as_deref())? {
        None => None,
        Some(id) => Some(
            catalog::reconciliation_cursor(&state.pool, id, report_id)
                .await?
                .ok_or_else(|| listing::unknown_after(id))?,
        ),
    };
    // One row past the page tells whether another page follows.
    let mut rows =
        catalog::reconciliations(&state.pool, report_id, after, limit as i64 + 1).await?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let next_after = more.then(|| rows.last().map(|row| row.id)).flatten();
    Ok(Json(ReconciliationsPage {
        reconciliations: rows.into_iter().map(Into::into).collect(),
        next_after,
    }))
}

/// A stored reconciliation: what `POST /v1/reconciliations` answered, and how it was run.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReconciliationSummary {
    reconciliation_id: Uuid,
    /// `done`.
    status: &'static str,
    /// Lines per status.
    #[schema(value_type = Object)]
    counts: Value,
    /// As `POST /v1/reconciliations` answered them.
    #[schema(value_type = Object)]
    totals: Value,
    /// The ledger position its ledger figures reflect.
    position: i64,
    report_id: Uuid,
    created_at: String,
    tolerance_ms: i64,
    /// A decimal number as text.
    #[schema(value_type = String, example = "0.005")]
    tolerance_ratio: String,
    /// How many lines it has: the sum of `counts`.
    lines: i64,
}

/// The id of a reconciliation in a path: not a UUID is 422 `invalid_reconciliation_id`.
pub(super) fn reconciliation_id(value: &str) -> Result<Uuid, ApiError> {
    Uuid::try_parse(value).map_err(|_| {
        ApiError::invalid(
            ErrorCode::InvalidReconciliationId,
            "reconciliation_id: must be a UUID",
        )
    })
}

/// 404 for a reconciliation that was never stored.
pub(super) fn not_found(id: Uuid) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::ReconciliationNotFound,
        format!("no reconciliation {id}"),
    )
}

/// A reconciliation: when done, its counts and totals as its run answered them, its
/// report, tolerance and size (its `position` is the one it reflected); while running or
/// once failed, its job (`status`, how it was asked, `error` when failed). Reads what was
/// stored; it does not wait for the projection. Global: a token bound to an org gets 403
/// `org_bound_token`.
#[utoipa::path(
    get,
    path = "/v1/reconciliations/{reconciliation_id}",
    tag = "finance",
    params(("reconciliation_id" = String, Path, description = "the id a reconciliation returned")),
    responses(
        (status = 200, body = ReconciliationState),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "`reconciliation_not_found`"),
        (status = 422, body = ErrorBody, description = "`invalid_reconciliation_id`"),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_reconciliation(
    State(state): State<AppState>,
    Path(reconciliation_id): Path<String>,
) -> Result<Json<ReconciliationState>, ApiError> {
    let id = self::reconciliation_id(&reconciliation_id)?;
    let stored = match catalog::reconciliation(&state.pool, id).await? {
        Some(entry) => entry,
        None => match reconciliation::job(&state.pool, id).await? {
            None => return Err(not_found(id)),
            // Done since the read above: read again.
            Some(job) if job.status == JobStatus::Done => catalog::reconciliation(&state.pool, id)
                .await?
                .ok_or_else(|| not_found(id))?,
            Some(job) => return Ok(Json(ReconciliationState::Job(job.into()))),
        },
    };
    Ok(Json(ReconciliationState::Done(ReconciliationSummary {
        reconciliation_id: stored.id,
        status: JobStatus::Done.as_str(),
        lines: stored.lines(),
        report_id: stored.report_id,
        created_at: canonical::timestamp(stored.created_at),
        position: stored.ledger_position,
        tolerance_ms: stored.tolerance_ms,
        tolerance_ratio: stored.tolerance_ratio.to_string(),
        counts: stored.counts,
        totals: stored.totals,
    })))
}

/// A reconciliation as `GET /v1/reconciliations/{id}` reads it: done, or its job.
#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ReconciliationState {
    Done(ReconciliationSummary),
    Job(ReconciliationJobResponse),
}

/// What `read` finds of the stored reconciliation `id`; when none is stored, why: 409
/// `reconciliation_running` while its job runs, else 404 `reconciliation_not_found`
/// (saying why when its job failed). A job found done was stored after the first read,
/// which is then made again.
pub(super) async fn stored<T, Read, Found>(
    pool: &PgPool,
    id: Uuid,
    read: Read,
) -> Result<T, ApiError>
where
    Read: Fn() -> Found,
    Found: std::future::Future<Output = Result<Option<T>, ApiError>>,
{
    if let Some(found) = read().await? {
        return Ok(found);
    }
    let Some(job) = reconciliation::job(pool, id).await? else {
        return Err(not_found(id));
    };
    match (job.status, job.error) {
        (JobStatus::Done, _) => read().await?.ok_or_else(|| not_found(id)),
        (JobStatus::Running, _) => Err(ApiError {
            retry_after_seconds: Some(RUNNING_RETRY_AFTER_SECONDS),
            ..ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::ReconciliationRunning,
                format!(
                    "reconciliation {id} is still running; its lines are stored when it is done"
                ),
            )
        }),
        (JobStatus::Failed, Some(error)) => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ReconciliationNotFound,
            format!(
                "no reconciliation {id}: its run failed ({}): {}",
                error.code, error.message
            ),
        )),
        (JobStatus::Failed, None) => Err(not_found(id)),
    }
}

/// The request's tolerance: the defaults, with what the request gives checked against its
/// limits.
fn tolerance(body: &ReconciliationRequest) -> Result<Tolerance, ApiError> {
    let invalid = |message: String| ApiError::invalid(ErrorCode::InvalidTolerance, message);
    let min_ms = match &body.tolerance_ms {
        None => None,
        Some(value) => Some(value.as_u64().ok_or_else(|| {
            invalid(format!(
                "tolerance_ms: a whole number from 0 to {TOLERANCE_MS_MAX}"
            ))
        })?),
    };
    // A ratio, not money. A JSON number has been read as a double by the time it is here:
    // its shortest decimal text is what is read (`1e-7` included). A string is read
    // exactly, so that one just over 1 in more digits than a decimal holds is refused.
    let ratio = match &body.tolerance_ratio {
        None => None,
        Some(value) => Some(
            match value {
                Value::Number(number) => Decimal::from_scientific(&number.to_string())
                    .or_else(|_| number.to_string().parse())
                    .ok(),
                Value::String(text) => exact_decimal(text),
                _ => None,
            }
            .ok_or_else(|| {
                invalid(
                    "tolerance_ratio: a decimal from 0 to 1, in at most 28 significant digits"
                        .to_owned(),
                )
            })?,
        ),
    };
    Tolerance::asked(min_ms, ratio).map_err(invalid)
}

/// The query of a reconciliation's lines, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LinesParams {
    /// `csv` (the default) or `json`
    #[param(pattern = "^(csv|json)$")]
    format: Option<String>,
}

impl QueryParams for LinesParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this export"),
        )
    }
}

/// One line of a reconciliation: the columns of the CSV, and the object of its JSON (the
/// same object in `lines.csv?format=json` and in a page of `GET .../lines`). Money is a
/// decimal number as text in the line's currency, at the report's precision. `org_id` is
/// the ledger's org of the container the line was compared with (else the tag, 0048),
/// `provider_org_id` the org the report tagged; `container_id` is the
/// line's `ResourceId`; the runtime figures and expected cost are null on a `not_runtime`
/// line.
#[derive(FromRow, Serialize, ToSchema)]
#[schema(as = LineSchema)]
pub(super) struct LineRow {
    /// The line's place in the stored reconciliation: not on the wire.
    #[serde(skip)]
    pub(super) seq: i64,
    org_id: Option<String>,
    container_id: Option<String>,
    #[serde(serialize_with = "instant")]
    #[schema(value_type = String)]
    charge_period_start: DateTime<Utc>,
    #[serde(serialize_with = "instant")]
    #[schema(value_type = String)]
    charge_period_end: DateTime<Utc>,
    ledger_runtime_ms: Option<i64>,
    provider_runtime_ms: Option<i64>,
    delta_ms: Option<i64>,
    status: String,
    /// Money as Postgres writes the stored `NUMERIC`: with its scale, zeros included
    /// (`0.00000000000`), which a `Decimal` read from the row would drop.
    provider_cost: String,
    expected_cost: Option<String>,
    cost_delta: Option<String>,
    currency: String,
    provider_org_id: Option<String>,
    /// The line's number in the report (the header is line 1); null on a
    /// `missing_in_provider` line, which no report line names.
    report_line: Option<i64>,
    charge_category: Option<String>,
}

/// The columns of [`LineRow`], for a statement on `reconciliation_line`.
pub(super) const LINE_COLUMNS: &str = "seq, org_id, container_id, charge_period_start, \
     charge_period_end, ledger_runtime_ms, provider_runtime_ms, delta_ms, status, \
     provider_cost::TEXT, expected_cost::TEXT, cost_delta::TEXT, currency, provider_org_id, \
     report_line, charge_category";

/// An instant as every answer writes it: RFC 3339 UTC with milliseconds.
fn instant<S: serde::Serializer>(value: &DateTime<Utc>, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&canonical::timestamp(*value))
}

/// A text cell of `lines.csv`: quoted when it holds a comma, a quote or a line break
/// (resource ids and categories are the provider's text, kept as given), and written with
/// a leading `'` when a spreadsheet would read it as a formula ([`runs_as_formula`]).
fn csv_text(value: Option<&str>) -> String {
    let Some(value) = value else {
        return String::new();
    };
    let value = match runs_as_formula(value) {
        true => std::borrow::Cow::Owned(format!("'{value}")),
        false => std::borrow::Cow::Borrowed(value),
    };
    if value.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", value.replace('"', "\"\""))
    } else {
        value.into_owned()
    }
}

/// Whether a spreadsheet opening the CSV would read `value` as a formula: it begins with
/// `=`, `+`, `-`, `@`, a tab or a carriage return (`-1+cmd|' /C calc'!A0` runs a command;
/// even `-c1` shows the negated value of cell C1 instead of the id).
fn runs_as_formula(value: &str) -> bool {
    value.starts_with(['=', '+', '-', '@', '\t', '\r'])
}

impl LineRow {
    fn csv(&self) -> String {
        let number = |value: Option<i64>| value.map(|value| value.to_string()).unwrap_or_default();
        format!(
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}\n",
            csv_text(self.org_id.as_deref()),
            csv_text(self.container_id.as_deref()),
            canonical::timestamp(self.charge_period_start),
            canonical::timestamp(self.charge_period_end),
            number(self.ledger_runtime_ms),
            number(self.provider_runtime_ms),
            number(self.delta_ms),
            self.status,
            self.provider_cost,
            self.expected_cost.as_deref().unwrap_or_default(),
            self.cost_delta.as_deref().unwrap_or_default(),
            self.currency,
            csv_text(self.provider_org_id.as_deref()),
            number(self.report_line),
            csv_text(self.charge_category.as_deref()),
        )
    }
}

/// A reconciliation's lines as JSON (`format=json`): the CSV's lines as objects. The
/// answer is streamed a chunk at a time, never built as one value; this type is its
/// description.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct LinesSchema {
    /// The ledger position the reconciliation reflected, as the `Tally-Position` header.
    position: i64,
    lines: Vec<LineRow>,
}

/// A reconciliation's lines, streamed: CSV with the header of contract §6, or JSON. The
/// `Tally-Position` header (and `position` in JSON) is the ledger position the
/// reconciliation reflected. A token bound to an org gets that org's lines only.
/// With a read database (`TALLY_READ_DATABASE_URL`) the lines are read there, once it has
/// replayed the reconciliation (past `TALLY_READ_WAIT_MS`, 503 `replica_lagging`).
#[utoipa::path(
    get,
    path = "/v1/reconciliations/{reconciliation_id}/lines.csv",
    tag = "finance",
    params(
        ("reconciliation_id" = String, Path, description = "the id a reconciliation returned"),
        LinesParams,
    ),
    responses(
        (status = 200, description = "CSV, one line per reconciled line; with `format=json`, one JSON object",
         content((String = "text/csv"), (LinesSchema = "application/json")),
         headers(("Tally-Position" = i64, description = "the ledger position the reconciliation reflected"))),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "`reconciliation_running` (with Retry-After)"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_lines(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(reconciliation_id): Path<String>,
    StrictQuery(params): StrictQuery<LinesParams>,
) -> Result<Response, ApiError> {
    let json_format = wants_json(params.format.as_deref())?;
    let id = self::reconciliation_id(&reconciliation_id)?;
    // Found on the primary (an unknown id is 404 at once), then read where reads go.
    let position = reconciliation_position(&state.pool, id).await?;
    let reads = super::replica::holding_reconciliation(&state, id).await?;
    let pool = reads.pool.clone();
    // A token bound to one org reads only the lines of that org.
    let bound = principal.org_id.clone();
    // (next seq to read, lines written so far, done)
    let chunks = futures::stream::unfold((0i64, 0u64, false), move |(after, written, done)| {
        let pool = pool.clone();
        let bound = bound.clone();
        async move {
            if done {
                return None;
            }
            let rows = match read_lines(&pool, id, after, bound.as_deref()).await {
                Ok(rows) => rows,
                Err(error) => {
                    return Some((Err(std::io::Error::other(error)), (after, written, true)))
                }
            };
            let last = rows.last().map_or(after, |row| row.seq);
            let finished = (rows.len() as i64) < EXPORT_CHUNK_LINES;
            let text = lines_text(&rows, json_format, position, written, finished);
            Some((
                Ok(Bytes::from(text)),
                (last, written + rows.len() as u64, finished),
            ))
        }
    });
    let content_type = if json_format {
        "application/json"
    } else {
        "text/csv; charset=utf-8"
    };
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(POSITION_HEADER, position)
        .body(Body::from_stream(chunks))
        .map_err(|error| ApiError::internal(&error))
}

/// The ledger position a stored reconciliation reflected; when there is none, why
/// ([`stored`]).
pub(super) async fn reconciliation_position(pool: &PgPool, id: Uuid) -> Result<i64, ApiError> {
    stored(pool, id, || async {
        Ok(
            sqlx::query_scalar("SELECT ledger_position FROM reconciliation WHERE id = $1")
                .bind(id)
                .fetch_optional(pool)
                .await?,
        )
    })
    .await
}

/// One chunk of lines as text: the header (or the JSON opening) before the first chunk,
/// the JSON closing after the last; `written` lines came before this chunk.
fn lines_text(
    rows: &[LineRow],
    json_format: bool,
    position: i64,
    written: u64,
    finished: bool,
) -> String {
    let mut text = String::new();
    if written == 0 {
        if json_format {
            text.push_str(&format!("{{\"position\":{position},\"lines\":["));
        } else {
            text.push_str(LINES_CSV_HEADER);
            text.push('\n');
        }
    }
    for (index, row) in rows.iter().enumerate() {
        if json_format {
            if written + index as u64 > 0 {
                text.push(',');
            }
            text.push_str(&serde_json::to_string(row).expect("a line serializes"));
        } else {
            text.push_str(&row.csv());
        }
    }
    if finished && json_format {
        text.push_str("]}");
    }
    text
}

/// A chunk of lines after `after`; only `org_id`'s when given.
async fn read_lines(
    pool: &PgPool,
    id: Uuid,
    after: i64,
    org_id: Option<&str>,
) -> Result<Vec<LineRow>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {LINE_COLUMNS} FROM reconciliation_line WHERE reconciliation_id = $1 AND seq > $2 \
           AND ($4::text IS NULL OR org_id = $4) ORDER BY seq LIMIT $3"
    ))
    .bind(id)
    .bind(after)
    .bind(EXPORT_CHUNK_LINES)
    .bind(org_id)
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_text_cell_is_quoted_only_when_csv_needs_it() {
        assert_eq!(csv_text(None), "");
        assert_eq!(csv_text(Some("ctr_1")), "ctr_1");
        assert_eq!(
            csv_text(Some("arn:aws:s3:::bucket/a,b")),
            "\"arn:aws:s3:::bucket/a,b\""
        );
        assert_eq!(csv_text(Some("say \"hi\"")), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_text(Some("two\nlines")), "\"two\nlines\"");
    }

    #[test]
    fn a_provider_text_cell_a_spreadsheet_would_run_is_written_after_an_apostrophe() {
        for (cell, written) in [
            (
                "=HYPERLINK(\"http://x\")",
                "\"'=HYPERLINK(\"\"http://x\"\")\"",
            ),
            ("+1+1", "'+1+1"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\tx", "'\tx"),
            ("-1+cmd|' /C calc'!A0", "'-1+cmd|' /C calc'!A0"),
            ("-2,3", "\"'-2,3\""),
            ("-c1", "'-c1"),
            // Only the first character counts.
            ("c=1", "c=1"),
            ("c-1", "c-1"),
        ] {
            assert_eq!(csv_text(Some(cell)), written, "{cell}");
        }
    }

    #[test]
    fn a_not_runtime_line_has_empty_figures_and_its_cost_as_the_report_wrote_it() {
        let row = LineRow {
            seq: 1,
            org_id: None,
            container_id: None,
            charge_period_start: "2024-09-01T00:00:00Z".parse().unwrap(),
            charge_period_end: "2024-10-01T00:00:00Z".parse().unwrap(),
            ledger_runtime_ms: None,
            provider_runtime_ms: None,
            delta_ms: None,
            status: "not_runtime".into(),
            provider_cost: "-2.61370000000".into(),
            expected_cost: None,
            cost_delta: None,
            currency: "USD".into(),
            provider_org_id: Some("acme".into()),
            report_line: Some(7),
            charge_category: Some("Credit".into()),
        };
        assert_eq!(
            row.csv(),
            ",,2024-09-01T00:00:00.000Z,2024-10-01T00:00:00.000Z,,,,not_runtime,-2.61370000000,,,USD,acme,7,Credit\n"
        );
        let json = serde_json::to_value(&row).unwrap();
        assert_eq!(json["expected_cost"], Value::Null);
        assert_eq!(json["provider_cost"], "-2.61370000000");
        assert_eq!(json["charge_period_start"], "2024-09-01T00:00:00.000Z");
        assert_eq!(json.get("seq"), None, "the stored order is not on the wire");
    }
}
