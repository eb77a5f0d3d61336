//! Corrections, append-only: an admin voids an event — a `ledger.event_voided`
//! naming it, why, and who — or adds events the producers never sent, beyond the backdate
//! bound, recorded with a `ledger.events_added` naming them, why, and who. Nothing is ever
//! changed in place: the projections take a voided event back as if it had never been
//! stored, and both events stay in the ledger and its chain.

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::SubsecRound;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::body::{present, RequestBody, StrictJson};
use super::error::{ApiError, ErrorBody};
use super::events::{EventInput, EventResult};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::parse::{parse_body, BodyKind};
use crate::event::{Event, EventData, EventId, EventType, OrgId, TimeBounds, CORRECTIONS_ORG_ID};
use crate::ledger::plans;

/// The longest reason a correction may give.
pub const REASON_MAX: usize = 1_024;
/// How far back an added event may go: the ledger's useful past, not the producers' bound.
const ADDED_BACKDATE_DAYS: i64 = 3_660;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(post_void))
        .routes(routes!(post_events))
}

/// The body of a void. Each field is checked by the route, with its own code.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VoidRequest {
    /// The event to void.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, format = Uuid, required = true)]
    event_id: Option<Value>,
    /// Why, 1 to 1024 characters.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, required = true)]
    reason: Option<Value>,
}

impl RequestBody for VoidRequest {
    const WHAT: &'static str = "a void";
}

#[derive(Debug, Serialize, ToSchema)]
pub struct VoidResponse {
    /// The void's own event id and position.
    id: Uuid,
    position: i64,
    voided_event_id: Uuid,
}

/// Void an event: it stays in the ledger, and every figure is as if it had never been
/// stored.
#[utoipa::path(
    post,
    path = "/v1/corrections/voids",
    tag = "corrections",
    request_body(content = VoidRequest),
    responses(
        (status = 201, body = VoidResponse),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "already voided"),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn post_void(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    StrictJson(body): StrictJson<VoidRequest>,
) -> Result<(StatusCode, Json<VoidResponse>), ApiError> {
    let event_id = body
        .event_id
        .as_ref()
        .and_then(Value::as_str)
        .and_then(|id| EventId::parse(id).ok())
        .ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidEventId,
                "event_id: a hyphenated UUID is required",
            )
        })?;
    let reason = reason(&body.reason)?;
    let org_id = voidable_org(&state.pool, event_id).await?;
    let void = Event {
        id: EventId::from_uuid(Uuid::now_v7()).expect("a v7 UUID is not nil"),
        event_type: EventType::LedgerEventVoided,
        org_id: OrgId::parse(&org_id).map_err(|error| ApiError::internal(&error))?,
        container_id: None,
        occurred_at: state.clock.now().trunc_subsecs(3),
        data: EventData::Correction(json!({
            "event_id": event_id.to_string(),
            "reason": reason,
            "by": principal.id,
        })),
        origin: None,
    };
    let id = void.id.as_uuid();
    let appended = state.appender.append(vec![void]).await?;
    tracing::info!(voided = %event_id, by = %principal.id, "event voided");
    Ok((
        StatusCode::CREATED,
        Json(VoidResponse {
            id,
            position: appended[0].position,
            voided_event_id: event_id.as_uuid(),
        }),
    ))
}

/// The org of the event to void: 404 when the ledger has no such event, 422 when its type
/// cannot be voided, 409 when it is voided already.
async fn voidable_org(pool: &PgPool, event_id: EventId) -> Result<String, ApiError> {
    let target: Option<(String, String)> = sqlx::query_as(
        "SELECT l.type, l.org_id FROM ledger_ids i \
             JOIN ledger l USING (position, recorded_at) WHERE i.id = $1",
    )
    .bind(event_id.as_uuid())
    .fetch_optional(pool)
    .await?;
    let Some((event_type, org_id)) = target else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::EventNotFound,
            format!("no event {event_id} in the ledger"),
        ));
    };
    let voidable = EventType::parse(&event_type)
        .is_some_and(|t| t.is_container_event() || event_type.starts_with("org."));
    if !voidable {
        return Err(ApiError::invalid(
            ErrorCode::NotVoidable,
            format!("{event_type} events cannot be voided (plans change by new versions; corrections stand)"),
        ));
    }
    let voided_before: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM ledger WHERE type = 'ledger.event_voided' \
                        AND data->>'event_id' = $1)",
    )
    .bind(event_id.to_string())
    .fetch_one(pool)
    .await?;
    if voided_before {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::AlreadyVoided,
            format!("event {event_id} is already voided"),
        ));
    }
    Ok(org_id)
}

/// The body of added events. Each field is checked by the route, with its own code; the
/// events as `POST /v1/events` checks native ones, beyond its backdate bound.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AddedRequest {
    /// Native events, 1 to the batch limit.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Vec<EventInput>, required = true)]
    events: Option<Value>,
    /// Why, 1 to 1024 characters.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, required = true)]
    reason: Option<Value>,
}

impl RequestBody for AddedRequest {
    const WHAT: &'static str = "a correction";
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AddedResponse {
    /// One per added event, in input order.
    results: Vec<EventResult>,
    /// The `ledger.events_added` record of who added them and why.
    record_id: Uuid,
}

/// Add events the producers never sent (for example a `stopped` the provider confirms),
/// beyond the backdate bound; recorded with who and why.
#[utoipa::path(
    post,
    path = "/v1/corrections/events",
    tag = "corrections",
    operation_id = "post_correction_events",
    request_body(content = AddedRequest),
    responses(
        (status = 201, body = AddedResponse),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 409, body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn post_events(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    StrictJson(body): StrictJson<AddedRequest>,
) -> Result<(StatusCode, Json<AddedResponse>), ApiError> {
    let reason = reason(&body.reason)?;
    let batch = json!({"events": body.events.unwrap_or(Value::Null)});
    let bounds = TimeBounds {
        now: state.clock.now(),
        backdate_max: chrono::Duration::days(ADDED_BACKDATE_DAYS),
    };
    let mut events = parse_body(
        BodyKind::Native,
        batch.to_string().as_bytes(),
        bounds,
        state.batch_events_max,
    )?;
    if let Some((index, plan)) = plans::unknown_reference(&state.pool, &events).await? {
        return Err(ApiError::invalid(
            ErrorCode::UnknownPlan,
            format!("event {index}: plan {plan:?} is not defined"),
        ));
    }
    let record = Event {
        id: EventId::from_uuid(Uuid::now_v7()).expect("a v7 UUID is not nil"),
        event_type: EventType::LedgerEventsAdded,
        org_id: OrgId::parse(CORRECTIONS_ORG_ID).expect("a valid org id"),
        container_id: None,
        occurred_at: state.clock.now().trunc_subsecs(3),
        data: EventData::Correction(json!({
            "event_ids": events.iter().map(|event| event.id.to_string()).collect::<Vec<_>>(),
            "reason": reason,
            "by": principal.id,
        })),
        origin: None,
    };
    let record_id = record.id.as_uuid();
    events.push(record);
    let mut appended = state.appender.append(events).await?;
    appended.pop();
    tracing::info!(count = appended.len(), by = %principal.id, "events added by correction");
    Ok((
        StatusCode::CREATED,
        Json(AddedResponse {
            results: appended.into_iter().map(EventResult::from).collect(),
            record_id,
        }),
    ))
}

fn reason(reason: &Option<Value>) -> Result<String, ApiError> {
    reason
        .as_ref()
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|reason| !reason.is_empty() && reason.chars().count() <= REASON_MAX)
        .map(str::to_owned)
        .ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidReason,
                format!("reason: 1 to {REASON_MAX} characters are required"),
            )
        })
}
