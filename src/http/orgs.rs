//! One org as the console shows it (contract §6, decision 0026): `GET /v1/orgs/{org_id}`,
//! its account state as of an instant with the history of its account events, and
//! `GET /v1/orgs/{org_id}/containers`, its containers a page at a time. Both are read from
//! the projection under the consistency rules, like the org's usage.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Principal;
use super::consistency::{Consistency, ConsistencyParams};
use super::error::{ApiError, ErrorBody};
use super::listing;
use super::plans::PlanResponse;
use super::query::{QueryParams, StrictQuery};
use super::usage::{as_of, invalid, path_org, unknown_parameter};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::{canonical, ContainerId};
use crate::projection::org::{self, ContainerSummary, StateFilter};
use crate::projection::query::AtPosition;
use crate::runtime::AccountChange;

/// The most account events one answer lists, newest first; `history_total` counts all.
pub const HISTORY_MAX: usize = 500;
/// Containers per page when `limit` is not given.
pub const CONTAINERS_PAGE_DEFAULT: usize = 100;
/// The largest page of containers: about 150 KB of JSON.
pub const CONTAINERS_PAGE_MAX: usize = 1_000;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_org))
        .routes(routes!(get_containers))
}

/// The query of an org's account, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct OrgParams {
    /// RFC 3339 with an offset; default now. The account state at this instant.
    as_of: Option<String>,
    /// As [`ConsistencyParams`], which the document lists.
    #[param(ignore)]
    min_position: Option<String>,
    #[param(ignore)]
    consistency: Option<String>,
}

impl QueryParams for OrgParams {
    fn unknown_parameter(name: &str) -> ApiError {
        unknown_parameter(name)
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct OrgResponse {
    /// The ledger position the answer reflects: the projection's checkpoint.
    position: i64,
    org_id: String,
    as_of: String,
    /// The version of the org's plan in effect at `as_of`, as `GET /v1/plans` shows one.
    plan: PlanResponse,
    verified: bool,
    billing_eligible: bool,
    /// The org's account events, newest first by (`occurred_at`, `position`): at most 500.
    history: Vec<HistoryEntry>,
    /// Every account event of the org, also those past the 500 listed.
    history_total: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct HistoryEntry {
    position: i64,
    event_id: String,
    occurred_at: String,
    /// What the event set.
    #[schema(example = "plan")]
    change: &'static str,
    /// The plan id for `plan`, a boolean otherwise.
    value: HistoryValue,
}

#[derive(Debug, Serialize, ToSchema)]
#[serde(untagged)]
pub enum HistoryValue {
    Plan(String),
    Flag(bool),
}

/// An org's account: plan, verification and billing eligibility as of an instant, and the
/// events that set them. An org with no events is on `free`, unverified, not eligible.
#[utoipa::path(
    get,
    path = "/v1/orgs/{org_id}",
    tag = "usage",
    params(
        ("org_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]"),
        OrgParams,
        ConsistencyParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 200, body = OrgResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "`projection_lagging` (with `Retry-After`): the projection did not reach the position within `TALLY_READ_WAIT_MS`"),
    ),
    security(("bearer" = []))
)]
pub async fn get_org(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(org_id): Path<String>,
    headers: HeaderMap,
    StrictQuery(params): StrictQuery<OrgParams>,
) -> Result<Json<OrgResponse>, ApiError> {
    let org_id = path_org(&principal, &org_id)?;
    let consistency = Consistency::parse(
        params.min_position.as_deref(),
        params.consistency.as_deref(),
        &headers,
    )?;
    let as_of = as_of(params.as_of.as_deref(), state.clock.now())?;
    let AtPosition {
        position,
        figures: account,
    } = consistency
        .read(&state, || {
            org::account(&state.pool, org_id.as_str(), as_of, HISTORY_MAX)
        })
        .await?;
    Ok(Json(OrgResponse {
        position,
        org_id: org_id.as_str().to_owned(),
        as_of: canonical::timestamp(as_of),
        plan: PlanResponse::from(&account.plan),
        verified: account.state.verified,
        billing_eligible: account.state.billing_eligible,
        history: account
            .history
            .iter()
            .map(|entry| {
                let (change, value) = match &entry.change {
                    AccountChange::Plan(plan) => {
                        ("plan", HistoryValue::Plan(plan.as_str().to_owned()))
                    }
                    AccountChange::Verified(value) => ("verified", HistoryValue::Flag(*value)),
                    AccountChange::BillingEligible(value) => {
                        ("billing_eligible", HistoryValue::Flag(*value))
                    }
                };
                HistoryEntry {
                    position: entry.position,
                    event_id: entry.event_id.to_string(),
                    occurred_at: canonical::timestamp(entry.occurred_at),
                    change,
                    value,
                }
            })
            .collect(),
        history_total: account.history_total,
    }))
}

/// The query of an org's containers, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ContainersParams {
    /// `running`, `stopped` or `all` (the default): the state after each container's last
    /// lifecycle event.
    #[param(pattern = "^(running|stopped|all)$")]
    state: Option<String>,
    /// Containers after this id: the `next_after` of the previous page.
    after: Option<String>,
    /// Containers in this page, 1-1000; default 100.
    #[param(value_type = Option<u32>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
    /// As [`ConsistencyParams`], which the document lists.
    #[param(ignore)]
    min_position: Option<String>,
    #[param(ignore)]
    consistency: Option<String>,
}

impl QueryParams for ContainersParams {
    fn unknown_parameter(name: &str) -> ApiError {
        unknown_parameter(name)
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ContainersResponse {
    /// The ledger position the list reflects: the projection's checkpoint.
    position: i64,
    org_id: String,
    /// In container id order (bytewise).
    containers: Vec<ContainerItem>,
    /// Pass as `after` for the next page: the last id of a full page; `null` when this
    /// page is the last.
    next_after: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ContainerItem {
    container_id: String,
    /// Its state now, events dated ahead of the clock not yet in force; a container never
    /// created or resumed is `stopped`.
    #[schema(example = "running")]
    state: &'static str,
    /// The start of the interval it runs in now; `null` while stopped.
    running_since: Option<String>,
    /// The latest `occurred_at` of its events.
    last_event_at: String,
}

/// An org's containers, a page at a time in container id order: all of them, or only the
/// running or the stopped ones.
#[utoipa::path(
    get,
    path = "/v1/orgs/{org_id}/containers",
    tag = "usage",
    params(
        ("org_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]"),
        ContainersParams,
        ConsistencyParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 200, body = ContainersResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "`projection_lagging` (with `Retry-After`): the projection did not reach the position within `TALLY_READ_WAIT_MS`"),
    ),
    security(("bearer" = []))
)]
pub async fn get_containers(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(org_id): Path<String>,
    headers: HeaderMap,
    StrictQuery(params): StrictQuery<ContainersParams>,
) -> Result<Json<ContainersResponse>, ApiError> {
    let org_id = path_org(&principal, &org_id)?;
    let consistency = Consistency::parse(
        params.min_position.as_deref(),
        params.consistency.as_deref(),
        &headers,
    )?;
    let filter = state_filter(params.state.as_deref())?;
    let after = params
        .after
        .as_deref()
        .map(ContainerId::parse)
        .transpose()
        .map_err(|error| invalid(ErrorCode::InvalidAfter, format!("after: {error}")))?;
    let limit = listing::limit(
        params.limit.as_deref(),
        CONTAINERS_PAGE_DEFAULT,
        CONTAINERS_PAGE_MAX,
    )?;
    // One more than the page, to know whether another follows.
    let AtPosition {
        position,
        figures: mut containers,
    } = consistency
        .read(&state, || {
            org::containers(
                &state.pool,
                org_id.as_str(),
                filter,
                after.as_ref().map(ContainerId::as_str),
                limit + 1,
                state.clock.now(),
            )
        })
        .await?;
    let next_after = (containers.len() > limit).then(|| {
        containers.truncate(limit);
        containers.last().expect("a full page").container_id.clone()
    });
    Ok(Json(ContainersResponse {
        position,
        org_id: org_id.as_str().to_owned(),
        containers: containers.into_iter().map(container_item).collect(),
        next_after,
    }))
}

fn container_item(summary: ContainerSummary) -> ContainerItem {
    ContainerItem {
        container_id: summary.container_id,
        state: if summary.running_since.is_some() {
            "running"
        } else {
            "stopped"
        },
        running_since: summary.running_since.map(canonical::timestamp),
        last_event_at: canonical::timestamp(summary.last_event_at),
    }
}

fn state_filter(value: Option<&str>) -> Result<StateFilter, ApiError> {
    match value {
        None | Some("all") => Ok(StateFilter::All),
        Some("running") => Ok(StateFilter::Running),
        Some("stopped") => Ok(StateFilter::Stopped),
        Some(other) => Err(invalid(
            ErrorCode::InvalidParameter,
            format!("state: {other:?} is not running, stopped or all"),
        )),
    }
}
