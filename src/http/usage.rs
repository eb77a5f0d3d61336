//! The runtime read API (contract §6): `GET /v1/orgs/{org_id}/usage` and
//! `GET /v1/containers/{container_id}`, served from the projection.

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use chrono::{DateTime, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Principal;
use super::consistency::{Consistency, ConsistencyParams};
use super::error::{ApiError, ErrorBody};
use super::query::{QueryParams, StrictQuery};
use super::AppState;
use crate::billing::overage::{minor_unit_digits, round_amount};
use crate::error_code::ErrorCode;
use crate::event::{canonical, storable};
use crate::event::{ContainerId, OrgId, FUTURE_SKEW_MAX_SECONDS};
use crate::projection::model::ANOMALIES_KEPT_MAX;
use crate::projection::org::{self, DayUsage};
use crate::projection::query::{self, AtPosition, ContainerFound, PricedUsage};
use crate::projection::store::{AnomalyCursor, StoredContainer};
use crate::runtime::{Anomaly, Period, Window};
use axum::Extension;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_usage))
        .routes(routes!(get_container))
}

/// The query of an org's usage, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct UsageParams {
    /// The billing period, `YYYY-MM` (UTC calendar month).
    period: Option<String>,
    /// RFC 3339 with an offset; default now. Runtime is counted up to it.
    as_of: Option<String>,
    /// `day`: also split the figures by UTC day (`days`).
    #[param(pattern = "^day$")]
    window: Option<String>,
    /// As [`ConsistencyParams`], which the document lists.
    #[param(ignore)]
    min_position: Option<String>,
    #[param(ignore)]
    consistency: Option<String>,
}

impl QueryParams for UsageParams {
    fn unknown_parameter(name: &str) -> ApiError {
        unknown_parameter(name)
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UsageResponse {
    /// The ledger position the figures reflect: the projection's checkpoint.
    position: i64,
    org_id: String,
    period: String,
    as_of: String,
    runtime_ms: i64,
    commands: u64,
    command_ms: i64,
    ports_published: u64,
    running_containers: u64,
    /// Runtime past the allowance, consumed in time order across the org's containers.
    overage_ms: i64,
    /// The plan in effect at the end of the window.
    plan: String,
    /// The allowance of that plan, in milliseconds.
    included_ms: i64,
    /// The overage priced, rounded half-up once to the currency's minor unit, as the usage
    /// export computes it: a decimal string.
    #[schema(example = "1.25")]
    overage_amount: String,
    /// ISO 4217: the currency the overage was priced in (that of the plans in the window
    /// that price overage), else of that plan.
    #[schema(example = "USD")]
    currency: String,
    /// With `window=day`: one entry per UTC day of the period that starts before `as_of`,
    /// in date order, the figures cut to that day (and to `as_of`). They add up exactly to
    /// `runtime_ms`, `commands` and `command_ms`.
    #[serde(skip_serializing_if = "Option::is_none")]
    days: Option<Vec<DayResponse>>,
}

/// One UTC day of an org's usage.
#[derive(Debug, Serialize, ToSchema)]
pub struct DayResponse {
    #[schema(example = "2026-12-01")]
    date: String,
    runtime_ms: i64,
    commands: u64,
    command_ms: i64,
}

/// The org a `/v1/orgs/{org_id}` read names: a valid id (else 422 `invalid_org_id`) that
/// the token may read (else 403 `org_not_allowed`).
pub(super) fn path_org(principal: &Principal, org_id: &str) -> Result<OrgId, ApiError> {
    let org_id = OrgId::parse(org_id).map_err(|error| invalid(ErrorCode::InvalidOrgId, error))?;
    principal.check_org(org_id.as_str())?;
    Ok(org_id)
}

/// An org's usage in one period, as of an instant.
#[utoipa::path(
    get,
    path = "/v1/orgs/{org_id}/usage",
    tag = "usage",
    params(
        ("org_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]"),
        UsageParams,
        ConsistencyParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 200, body = UsageResponse),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "`projection_lagging` (with `Retry-After`): the projection did not reach the position within `TALLY_READ_WAIT_MS`"),
    ),
    security(("bearer" = []))
)]
pub async fn get_usage(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(org_id): Path<String>,
    headers: HeaderMap,
    StrictQuery(params): StrictQuery<UsageParams>,
) -> Result<Json<UsageResponse>, ApiError> {
    let org_id = path_org(&principal, &org_id)?;
    let consistency = Consistency::parse(
        params.min_position.as_deref(),
        params.consistency.as_deref(),
        &headers,
    )?;
    let period = params
        .period
        .as_deref()
        .ok_or_else(|| invalid(ErrorCode::InvalidPeriod, "period is required: YYYY-MM"))
        .and_then(|period| {
            Period::parse(period).map_err(|error| invalid(ErrorCode::InvalidPeriod, error))
        })?;
    let as_of = as_of(params.as_of.as_deref(), state.clock.now())?;
    let by_day = match params.window.as_deref() {
        None => false,
        Some("day") => true,
        Some(other) => {
            return Err(invalid(
                ErrorCode::InvalidWindow,
                format!("window: {other:?} is not day"),
            ))
        }
    };
    let (position, priced, days) = if by_day {
        // Each reads its org's commands of the period from the ledger (0.8 s for an org with
        // half a million of them): without a bound, one token's burst held every connection.
        let busy = "too many per-day usage reads are in progress on this instance; retry later";
        let _turn = super::take_turn(&state, &state.day_reads, busy).await?;
        let AtPosition {
            position,
            figures: (priced, days),
        } = consistency
            .read(&state, || {
                org::priced_usage_by_day(&state.pool, org_id.as_str(), period, as_of)
            })
            .await?;
        (position, priced, Some(days))
    } else {
        let AtPosition { position, figures } = consistency
            .read(&state, || {
                query::priced_usage(&state.pool, org_id.as_str(), period, as_of)
            })
            .await?;
        (position, figures, None)
    };
    Ok(Json(usage_response(
        position, &org_id, period, as_of, &priced, days,
    )))
}

/// The answer for an org's usage, priced, and split by day when asked.
fn usage_response(
    position: i64,
    org_id: &OrgId,
    period: Period,
    as_of: DateTime<Utc>,
    priced: &PricedUsage,
    days: Option<Vec<DayUsage>>,
) -> UsageResponse {
    let usage = priced.usage;
    let currency = priced.currency.clone();
    let digits = minor_unit_digits(&currency) as usize;
    let overage_amount = format!(
        "{:.digits$}",
        round_amount(priced.overage.amount, &currency)
    );
    UsageResponse {
        position,
        org_id: org_id.as_str().to_owned(),
        period: period.to_string(),
        as_of: canonical::timestamp(as_of),
        runtime_ms: usage.runtime_ms,
        commands: usage.commands,
        command_ms: usage.command_ms,
        ports_published: usage.ports_published,
        running_containers: usage.running_containers,
        overage_ms: priced.overage.overage_ms,
        plan: priced.plan.id.as_str().to_owned(),
        included_ms: priced.plan.included_runtime_ms(),
        overage_amount,
        currency,
        days: days.map(|days| {
            days.iter()
                .map(|day| DayResponse {
                    date: day.day.date.to_string(),
                    runtime_ms: day.runtime_ms,
                    commands: day.commands,
                    command_ms: day.command_ms,
                })
                .collect()
        }),
    }
}

/// Anomalies in one answer when `anomalies_limit` is not given: every anomaly of a
/// container that has the usual few, and a small answer for one that has thousands.
const ANOMALIES_PAGE_DEFAULT: usize = 100;
/// The most `anomalies_limit` may ask for: a page stays around 100 KB of JSON.
const ANOMALIES_PAGE_MAX: usize = 1_000;

/// The query of a container's usage, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ContainerParams {
    /// Runtime is counted up to this instant (RFC 3339 with an offset); default now.
    as_of: Option<String>,
    /// Needed only when several orgs have used the same container id.
    org_id: Option<String>,
    /// Anomalies after this cursor: the `anomalies_next_after` of the previous answer,
    /// passed back as it is.
    anomalies_after: Option<String>,
    /// Anomalies in this answer, 1-1000; default 100.
    anomalies_limit: Option<String>,
    /// As [`ConsistencyParams`], which the document lists.
    #[param(ignore)]
    min_position: Option<String>,
    #[param(ignore)]
    consistency: Option<String>,
}

impl QueryParams for ContainerParams {
    fn unknown_parameter(name: &str) -> ApiError {
        unknown_parameter(name)
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ContainerResponse {
    /// The ledger position the figures reflect: the projection's checkpoint.
    position: i64,
    container_id: String,
    org_id: String,
    /// At `as_of`, as its `runtime_ms` is counted: `running` when an interval holds that
    /// instant (an event dated ahead of it not yet in force); a container never created or
    /// resumed is `stopped`.
    #[schema(example = "running")]
    state: &'static str,
    runtime_ms: i64,
    intervals: Vec<IntervalResponse>,
    /// A page of the kept anomalies in (`occurred_at`, ledger position) order: the first
    /// `anomalies_limit`, or those after `anomalies_after`.
    anomalies: Vec<AnomalyResponse>,
    /// Every anomaly the container's history caused. Only the first 10 000 in order are
    /// kept and paged; the ledger holds the events of the rest.
    anomalies_total: u64,
    /// How many are kept: min(`anomalies_total`, 10 000).
    anomalies_kept: u64,
    /// Pass as `anomalies_after` for the next page; `null` on the last.
    anomalies_next_after: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct IntervalResponse {
    start: String,
    /// `null` while running.
    end: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AnomalyResponse {
    #[schema(example = "stop_while_not_running")]
    kind: &'static str,
    event_id: String,
    occurred_at: String,
}

/// A container's running intervals and anomalies.
#[utoipa::path(
    get,
    path = "/v1/containers/{container_id}",
    tag = "usage",
    params(
        ("container_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]"),
        ContainerParams,
        ConsistencyParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 200, body = ContainerResponse),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "several orgs used this id; pass org_id"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "`projection_lagging` (with `Retry-After`): the projection did not reach the position within `TALLY_READ_WAIT_MS`"),
    ),
    security(("bearer" = []))
)]
pub async fn get_container(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(container_id): Path<String>,
    headers: HeaderMap,
    StrictQuery(params): StrictQuery<ContainerParams>,
) -> Result<Json<ContainerResponse>, ApiError> {
    let container_id = ContainerId::parse(&container_id)
        .map_err(|error| invalid(ErrorCode::InvalidContainerId, error))?;
    let org_id = container_org(&principal, params.org_id.as_deref())?;
    let consistency = Consistency::parse(
        params.min_position.as_deref(),
        params.consistency.as_deref(),
        &headers,
    )?;
    let as_of = as_of(params.as_of.as_deref(), state.clock.now())?;
    let after = params
        .anomalies_after
        .as_deref()
        .map(parse_cursor)
        .transpose()?;
    let limit = anomalies_limit(params.anomalies_limit.as_deref())?;
    // One more than the page, to know whether another follows.
    let AtPosition {
        position,
        figures:
            ContainerFound {
                containers: found,
                mut anomalies,
            },
    } = consistency
        .read(&state, || {
            query::container(
                &state.pool,
                container_id.as_str(),
                org_id.as_ref().map(OrgId::as_str),
                after,
                limit + 1,
            )
        })
        .await?;
    let anomalies_next_after = (anomalies.len() > limit).then(|| {
        anomalies.truncate(limit);
        let last = anomalies.last().expect("a full page");
        format_cursor(AnomalyCursor::of(last))
    });
    let stored = only_container(found, &container_id)?;
    Ok(Json(container_response(
        position,
        &container_id,
        stored,
        as_of,
        &anomalies,
        anomalies_next_after,
    )))
}

/// The org whose container of that id is read: the `org_id` asked for, which the token
/// must be allowed to see, else an org-bound token's own org, else any.
fn container_org(principal: &Principal, asked: Option<&str>) -> Result<Option<OrgId>, ApiError> {
    let org_id = asked
        .map(OrgId::parse)
        .transpose()
        .map_err(|error| invalid(ErrorCode::InvalidOrgId, error))?;
    // An org-bound token sees only its org's container of that id.
    Ok(match (org_id, &principal.org_id) {
        (Some(org_id), _) => {
            principal.check_org(org_id.as_str())?;
            Some(org_id)
        }
        (None, Some(bound)) => {
            Some(OrgId::parse(bound).map_err(|error| invalid(ErrorCode::InvalidOrgId, error))?)
        }
        (None, None) => None,
    })
}

/// The one container found: 404 when no org used the id, 409 when several did.
fn only_container(
    mut found: Vec<StoredContainer>,
    container_id: &ContainerId,
) -> Result<StoredContainer, ApiError> {
    match found.len() {
        0 => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ContainerNotFound,
            format!("no events for container {container_id}"),
        )),
        1 => Ok(found.remove(0)),
        _ => {
            let orgs: Vec<&str> = found.iter().map(|stored| stored.org_id.as_str()).collect();
            Err(ApiError::new(
                StatusCode::CONFLICT,
                ErrorCode::AmbiguousContainer,
                format!(
                    "orgs {} have each used container id {container_id}; pass org_id",
                    orgs.join(", ")
                ),
            ))
        }
    }
}

/// The answer for one container, with its page of anomalies.
fn container_response(
    position: i64,
    container_id: &ContainerId,
    stored: StoredContainer,
    as_of: DateTime<Utc>,
    anomalies: &[Anomaly],
    anomalies_next_after: Option<String>,
) -> ContainerResponse {
    let lifecycle = &stored.lifecycle;
    let runtime_ms = lifecycle.intervals().first().map_or(0, |first| {
        lifecycle.runtime_ms(Window::new(first.start(), first.start().max(as_of)).until(as_of))
    });
    ContainerResponse {
        position,
        container_id: container_id.as_str().to_owned(),
        org_id: stored.org_id,
        state: if lifecycle.running_at(as_of) {
            "running"
        } else {
            "stopped"
        },
        runtime_ms,
        intervals: lifecycle
            .intervals()
            .iter()
            .map(|interval| IntervalResponse {
                start: canonical::timestamp(interval.start()),
                end: interval.end().map(canonical::timestamp),
            })
            .collect(),
        anomalies: anomalies
            .iter()
            .map(|anomaly| AnomalyResponse {
                kind: anomaly.kind.as_str(),
                event_id: anomaly.event_id.to_string(),
                occurred_at: canonical::timestamp(anomaly.occurred_at),
            })
            .collect(),
        anomalies_total: lifecycle.anomalies_total(),
        anomalies_kept: lifecycle.anomalies_total().min(ANOMALIES_KEPT_MAX),
        anomalies_next_after,
    }
}

/// A cursor is `<occurred_at in epoch ms>_<ledger position>` of the last anomaly of a page:
/// the order anomalies are kept in. Clients pass it back without reading it.
fn format_cursor(cursor: AnomalyCursor) -> String {
    format!(
        "{}_{}",
        cursor.occurred_at.timestamp_millis(),
        cursor.position
    )
}

fn parse_cursor(value: &str) -> Result<AnomalyCursor, ApiError> {
    let parsed = value.split_once('_').and_then(|(ms, position)| {
        Some(AnomalyCursor {
            // Only instants an anomaly can have: Postgres refuses some others.
            occurred_at: DateTime::from_timestamp_millis(ms.parse().ok()?)
                .filter(|at| storable::in_event_years(*at))?,
            position: position.parse().ok()?,
        })
    });
    parsed.ok_or_else(|| {
        invalid(
            ErrorCode::InvalidAnomaliesAfter,
            format!("anomalies_after {value:?} is not a cursor this api gave"),
        )
    })
}

fn anomalies_limit(value: Option<&str>) -> Result<usize, ApiError> {
    let Some(value) = value else {
        return Ok(ANOMALIES_PAGE_DEFAULT);
    };
    super::listing::whole_number::<usize>(value)
        .filter(|limit| (1..=ANOMALIES_PAGE_MAX).contains(limit))
        .ok_or_else(|| {
            invalid(
                ErrorCode::InvalidAnomaliesLimit,
                format!("anomalies_limit {value:?} is not a whole number from 1 to {ANOMALIES_PAGE_MAX}"),
            )
        })
}

/// `as_of` from a query parameter, truncated to the millisecond like event times; `now`
/// when absent. Figures cover what has happened: an instant ahead of `now` by no more
/// than a producer's clock may be (the events' future bound) is read as `now`, one further
/// ahead is 422 `invalid_as_of`.
pub(super) fn as_of(value: Option<&str>, now: DateTime<Utc>) -> Result<DateTime<Utc>, ApiError> {
    let now = now.trunc_subsecs(3);
    let Some(value) = value else {
        return Ok(now);
    };
    let instant = storable::parse_instant(value)
        .map(|instant| instant.trunc_subsecs(3))
        .map_err(|error| {
            invalid(
                error.code_or(ErrorCode::InvalidAsOf),
                format!("as_of: {error}"),
            )
        })?;
    if instant > now + chrono::Duration::seconds(FUTURE_SKEW_MAX_SECONDS) {
        return Err(invalid(
            ErrorCode::InvalidAsOf,
            format!(
                "as_of: {value} is more than {FUTURE_SKEW_MAX_SECONDS} s ahead of the server \
                 clock; figures cover only what has happened"
            ),
        ));
    }
    Ok(instant.min(now))
}

/// The refusal of a query parameter the route does not know.
pub(super) fn unknown_parameter(name: &str) -> ApiError {
    ApiError::invalid(
        ErrorCode::UnknownParameter,
        format!("{name}: is not a parameter of this route"),
    )
}

pub(super) fn invalid(code: ErrorCode, error: impl ToString) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, error.to_string())
}
