//! Audit queries (contract §6): `GET /v1/events` and `GET /v1/containers/{id}/events`, pages
//! of the ledger in position order with a `next_after` cursor.

use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::event::{ContainerId, EventType, OrgId};
use crate::ledger::read::{self, Filter};
use axum::Extension;

/// Events per page when `limit` is not given.
pub const PAGE_DEFAULT: usize = 100;
/// The largest page contract §6 allows; `TALLY_PAGE_EVENTS_MAX` may lower it.
pub const PAGE_MAX: usize = crate::config::PAGE_EVENTS_MAX;

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/events", get(get_events)).route(
        "/v1/containers/{container_id}/events",
        get(get_container_events),
    )
}

#[derive(Debug, IntoParams)]
#[into_params(parameter_in = Query)]
#[allow(dead_code)]
pub struct EventsParams {
    org_id: Option<String>,
    container_id: Option<String>,
    /// An event type, e.g. `container.stopped`.
    r#type: Option<String>,
    /// Return events after this position (the previous page's `next_after`); default 0.
    after: Option<i64>,
    /// 1–1000, default 100.
    limit: Option<usize>,
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
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_events(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Query(params): Query<HashMap<String, String>>,
) -> Result<Json<EventsPage>, ApiError> {
    page(&state, &principal, &params, None).await
}

/// One container's events in position order.
#[utoipa::path(
    get,
    path = "/v1/containers/{container_id}/events",
    tag = "audit",
    params(("container_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]"), EventsParams),
    responses(
        (status = 200, body = EventsPage),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_container_events(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(container_id): Path<String>,
    Query(params): Query<HashMap<String, String>>,
) -> Result<Json<EventsPage>, ApiError> {
    if params.contains_key("container_id") {
        return Err(ApiError::invalid(
            "unknown_parameter",
            "container_id: is already in the path",
        ));
    }
    page(&state, &principal, &params, Some(container_id)).await
}

async fn page(
    state: &AppState,
    principal: &Principal,
    params: &HashMap<String, String>,
    path_container: Option<String>,
) -> Result<Json<EventsPage>, ApiError> {
    const KNOWN: [&str; 5] = ["org_id", "container_id", "type", "after", "limit"];
    if let Some(unknown) = params.keys().find(|name| !KNOWN.contains(&name.as_str())) {
        return Err(ApiError::invalid(
            "unknown_parameter",
            format!("{unknown}: is not a filter"),
        ));
    }
    let org_id = params
        .get("org_id")
        .map(|value| {
            OrgId::parse(value)
                .map_err(|error| ApiError::invalid("invalid_org_id", format!("org_id: {error}")))
        })
        .transpose()?;
    // An org-bound token sees only its org.
    if let Some(org_id) = &org_id {
        principal.check_org(org_id.as_str())?;
    }
    let org_id = match (org_id, &principal.org_id) {
        (None, Some(bound)) => Some(
            OrgId::parse(bound)
                .map_err(|error| ApiError::invalid("invalid_org_id", format!("org_id: {error}")))?,
        ),
        (org_id, _) => org_id,
    };
    let container_id = path_container
        .as_ref()
        .or(params.get("container_id"))
        .map(|value| {
            ContainerId::parse(value).map_err(|error| {
                ApiError::invalid("invalid_container_id", format!("container_id: {error}"))
            })
        })
        .transpose()?;
    let event_type = params
        .get("type")
        .map(|value| {
            EventType::parse(value).ok_or_else(|| {
                ApiError::invalid(
                    "invalid_type",
                    format!("type: {value:?} is not an event type"),
                )
            })
        })
        .transpose()?;
    let after = match params.get("after") {
        None => 0,
        Some(value) => value
            .parse::<i64>()
            .ok()
            .filter(|after| *after >= 0)
            .ok_or_else(|| {
                ApiError::invalid(
                    "invalid_after",
                    "after: must be a position, a whole number from 0",
                )
            })?,
    };
    let limit = match params.get("limit") {
        None => PAGE_DEFAULT.min(state.page_events_max),
        Some(value) => value
            .parse::<usize>()
            .ok()
            .filter(|limit| (1..=state.page_events_max).contains(limit))
            .ok_or_else(|| {
                ApiError::invalid(
                    "invalid_limit",
                    format!(
                        "limit: must be a whole number from 1 to {}",
                        state.page_events_max
                    ),
                )
            })?,
    };
    let filter = Filter {
        org_id: org_id.as_ref().map(OrgId::as_str),
        container_id: container_id.as_ref().map(ContainerId::as_str),
        event_type: event_type.map(EventType::as_str),
    };
    let rows = read::read_filtered(&state.pool, &filter, after, limit).await?;
    let next_after = rows.last().map_or(after, |row| row.position);
    let events = rows
        .iter()
        .map(|row| serde_json::to_value(row.to_message()).expect("a ledger row serializes"))
        .collect();
    Ok(Json(EventsPage { events, next_after }))
}
