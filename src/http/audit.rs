//! Audit queries (contract §6): `GET /v1/events` and `GET /v1/containers/{id}/events`, pages
//! of the ledger in position order with a `next_after` cursor. With a read database
//! (`TALLY_READ_DATABASE_URL`) they are read there, once it holds the primary's head.

use axum::extract::{Path, State};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::listing;
use super::query::{QueryParams, StrictQuery};
use super::replica::{self, ReadPool};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::{ContainerId, EventType, OrgId};
use crate::ledger::read::{self, Filter};
use axum::Extension;

/// Events per page when `limit` is not given.
pub const PAGE_DEFAULT: usize = 100;
/// The largest page contract §6 allows; `TALLY_PAGE_EVENTS_MAX` may lower it.
pub const PAGE_MAX: usize = crate::config::PAGE_EVENTS_MAX;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_events))
        .routes(routes!(get_container_events))
}

/// The filters of a page, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct EventsParams {
    org_id: Option<String>,
    container_id: Option<String>,
    /// An event type, e.g. `container.stopped`.
    r#type: Option<String>,
    /// Return events after this position (the previous page's `next_after`); default 0.
    #[param(value_type = Option<i64>)]
    after: Option<String>,
    /// 1–1000, default 100.
    #[param(value_type = Option<usize>)]
    limit: Option<String>,
}

impl QueryParams for EventsParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a filter"),
        )
    }
}

/// The filters of one container's page: those of [`EventsParams`] but `container_id`,
/// which the path gives.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ContainerEventsParams {
    org_id: Option<String>,
    /// An event type, e.g. `container.stopped`.
    r#type: Option<String>,
    /// Return events after this position (the previous page's `next_after`); default 0.
    #[param(value_type = Option<i64>)]
    after: Option<String>,
    /// 1–1000, default 100.
    #[param(value_type = Option<usize>)]
    limit: Option<String>,
}

impl QueryParams for ContainerEventsParams {
    fn unknown_parameter(name: &str) -> ApiError {
        if name == "container_id" {
            return ApiError::invalid(
                ErrorCode::UnknownParameter,
                "container_id: is already in the path",
            );
        }
        EventsParams::unknown_parameter(name)
    }
}

impl From<ContainerEventsParams> for EventsParams {
    fn from(params: ContainerEventsParams) -> Self {
        EventsParams {
            org_id: params.org_id,
            container_id: None,
            r#type: params.r#type,
            after: params.after,
            limit: params.limit,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventsPage {
    /// In position order.
    #[schema(value_type = Vec<Object>)]
    events: Vec<Value>,
    /// Pass as `after` for the next page: the last position returned, or the `after` given
    /// when nothing (yet) follows it.
    next_after: i64,
}

/// Ledger events in position order, filtered.
#[utoipa::path(
    get,
    path = "/v1/events",
    tag = "audit",
    params(EventsParams),
    responses(
        (status = 200, body = EventsPage),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "database_unavailable; with a read database, replica_lagging (with Retry-After) or read_database_unavailable"),
    ),
    security(("bearer" = []))
)]
pub async fn get_events(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    StrictQuery(params): StrictQuery<EventsParams>,
) -> Result<Json<EventsPage>, ApiError> {
    page(&state, &principal, &params, None).await
}

/// One container's events in position order.
#[utoipa::path(
    get,
    path = "/v1/containers/{container_id}/events",
    tag = "audit",
    params(("container_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]"), ContainerEventsParams),
    responses(
        (status = 200, body = EventsPage),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "database_unavailable; with a read database, replica_lagging (with Retry-After) or read_database_unavailable"),
    ),
    security(("bearer" = []))
)]
pub async fn get_container_events(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(container_id): Path<String>,
    StrictQuery(params): StrictQuery<ContainerEventsParams>,
) -> Result<Json<EventsPage>, ApiError> {
    page(&state, &principal, &params.into(), Some(container_id)).await
}

async fn page(
    state: &AppState,
    principal: &Principal,
    params: &EventsParams,
    path_container: Option<String>,
) -> Result<Json<EventsPage>, ApiError> {
    let org_id = page_org(principal, params.org_id.as_deref())?;
    let container_id = path_container
        .as_ref()
        .or(params.container_id.as_ref())
        .map(|value| {
            ContainerId::parse(value).map_err(|error| {
                ApiError::invalid(
                    ErrorCode::InvalidContainerId,
                    format!("container_id: {error}"),
                )
            })
        })
        .transpose()?;
    let event_type = params
        .r#type
        .as_ref()
        .map(|value| {
            EventType::parse(value).ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidType,
                    format!("type: {value:?} is not an event type"),
                )
            })
        })
        .transpose()?;
    let after = page_after(params.after.as_deref())?;
    let limit = listing::limit(params.limit.as_deref(), PAGE_DEFAULT, state.page_events_max)?;
    let filter = Filter {
        org_id: org_id.as_ref().map(OrgId::as_str),
        container_id: container_id.as_ref().map(ContainerId::as_str),
        event_type: event_type.map(EventType::as_str),
    };
    let reads = page_pool(state).await?;
    let rows = read::read_filtered(&reads.pool, &filter, after, limit)
        .await
        .map_err(|error| reads.error(error))?;
    let next_after = rows.last().map_or(after, |row| row.position);
    let events = rows
        .iter()
        .map(|row| serde_json::to_value(row.to_message()).expect("a ledger row serializes"))
        .collect();
    Ok(Json(EventsPage { events, next_after }))
}

/// Where the page is read: the primary, or the read database once it holds the ledger head
/// taken on the primary now, so that the page holds every event acknowledged before the
/// request (as a page read on the primary does).
async fn page_pool(state: &AppState) -> Result<ReadPool, ApiError> {
    // Without a read database the page reads the primary itself: no head to wait for.
    let head = match state.read_pool {
        None => 0,
        Some(_) => read::head(&state.pool).await?.position,
    };
    replica::ledger_holding(state, head).await
}

/// The org whose events are read: the `org_id` asked for, which the token must be allowed
/// to see, else an org-bound token's own org, else every org.
fn page_org(principal: &Principal, asked: Option<&str>) -> Result<Option<OrgId>, ApiError> {
    let org_id = asked
        .map(|value| {
            OrgId::parse(value).map_err(|error| {
                ApiError::invalid(ErrorCode::InvalidOrgId, format!("org_id: {error}"))
            })
        })
        .transpose()?;
    // An org-bound token sees only its org.
    if let Some(org_id) = &org_id {
        principal.check_org(org_id.as_str())?;
    }
    Ok(match (org_id, &principal.org_id) {
        (None, Some(bound)) => Some(OrgId::parse(bound).map_err(|error| {
            ApiError::invalid(ErrorCode::InvalidOrgId, format!("org_id: {error}"))
        })?),
        (org_id, _) => org_id,
    })
}

/// The position the page starts after: 0 unless given.
fn page_after(after: Option<&str>) -> Result<i64, ApiError> {
    match after {
        None => Ok(0),
        Some(value) => super::listing::whole_number::<i64>(value).ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidAfter,
                "after: must be a position, a whole number from 0",
            )
        }),
    }
}
