//! Corrections, append-only: an admin voids an event — a `ledger.event_voided`
//! naming it, why, and who — or adds events the producers never sent, beyond the backdate
//! bound, recorded with a `ledger.events_added` naming them, why, and who. Nothing is ever
//! changed in place: the projections take a voided event back as if it had never been
//! stored, and both events stay in the ledger and its chain.
//!
//! Corrections are stored one at a time across every instance (in turn: [`super::turn`]),
//! each checked against the ledger under that turn: a void of an event already voided is
//! 409 however many are sent at once, and added events sent again store nothing, no second
//! record either, and answer with the record that added them.

use std::collections::HashSet;

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
use super::turn::{in_turn, Queue};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::parse::{parse_body, BodyKind};
use crate::event::{Event, EventData, EventId, EventType, OrgId, TimeBounds, CORRECTIONS_ORG_ID};
use crate::ledger::plans;

/// The longest reason a correction may give.
pub const REASON_MAX: usize = 1_024;
/// The advisory lock every instance's corrections take in turn.
pub const CORRECTIONS_LOCK_KEY: i64 = 0x636f_7272_6563;

/// Corrections wait for this instance's permit, then for the lock every instance's take.
const TURNS: Queue = Queue {
    lock_key: CORRECTIONS_LOCK_KEY,
    busy: "another correction is being stored; retry later",
    permit: |state| &state.corrections,
};

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
    let by = principal.id.clone();
    let void = in_turn(&state, TURNS, void(state.clone(), event_id, reason, by)).await?;
    tracing::info!(voided = %event_id, by = %principal.id, "event voided");
    Ok((StatusCode::CREATED, Json(void)))
}

/// Appends the void of `event_id`, in a correction's turn.
async fn void(
    state: AppState,
    event_id: EventId,
    reason: String,
    by: String,
) -> Result<VoidResponse, ApiError> {
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
            "by": by,
        })),
        origin: None,
    };
    let id = void.id.as_uuid();
    let appended = state.appender.append(vec![void]).await?;
    Ok(VoidResponse {
        id,
        position: appended[0].position,
        voided_event_id: event_id.as_uuid(),
    })
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
    if voided_among(pool, &[event_id.to_string()]).await?.is_some() {
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
    /// The `ledger.events_added` record of who added them and why: with `201`, this
    /// correction's, naming the events it stored; with `200` (every event was stored
    /// before), that of the correction this one repeats (the last record naming any of
    /// them), or null when none does.
    record_id: Option<Uuid>,
}

/// Add events the producers never sent (for example a `stopped` the provider confirms),
/// beyond the backdate bound; recorded with who and why. Sent again, it stores nothing
/// and answers `200` with the record of the correction it repeats; a voided event is not
/// added again
/// (409 `already_voided`). Past `TALLY_READ_WAIT_MS` waiting for another correction, 503
/// `overloaded`.
#[utoipa::path(
    post,
    path = "/v1/corrections/events",
    tag = "corrections",
    operation_id = "post_correction_events",
    request_body(content = AddedRequest),
    responses(
        (status = 200, body = AddedResponse, description = "every event was stored before: nothing stored"),
        (status = 201, body = AddedResponse),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "an id stored with other content, or a voided event"),
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
        backdate_max: chrono::Duration::days(crate::event::CORRECTION_BACKDATE_DAYS),
    };
    let events = parse_body(
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
    let by = principal.id.clone();
    let (status, added) = in_turn(&state, TURNS, add(state.clone(), events, reason, by)).await?;
    tracing::info!(count = added.results.len(), created = status == StatusCode::CREATED, by = %principal.id, "events added by correction");
    Ok((status, Json(added)))
}

/// Appends the events of a correction not stored yet, with a record naming them, in a
/// correction's turn: `201`; or, when every one is stored already, nothing: `200`.
async fn add(
    state: AppState,
    mut events: Vec<Event>,
    reason: String,
    by: String,
) -> Result<(StatusCode, AddedResponse), ApiError> {
    let ids: Vec<String> = events.iter().map(|event| event.id.to_string()).collect();
    refuse_voided(&state.pool, &ids).await?;
    let stored = stored_ids(&state.pool, &events).await?;
    // Each once, as the ledger stores it once: an id given twice in the batch is the
    // same event (or a conflict the append refuses).
    let mut named = HashSet::new();
    let new: Vec<&String> = ids
        .iter()
        .zip(&events)
        .filter(|(_, event)| !stored.contains(&event.id.as_uuid()))
        .map(|(id, _)| id)
        .filter(|id| named.insert(*id))
        .collect();
    if new.is_empty() {
        // Sent again: each is a duplicate (or 409 for other content), and no record is
        // added; the answer names the record that added them, if one did.
        let appended = state.appender.append(events).await?;
        let record_id = adding_record(&state.pool, &ids).await?;
        let results = appended.into_iter().map(EventResult::from).collect();
        return Ok((StatusCode::OK, AddedResponse { results, record_id }));
    }
    // The record names the events this correction stores, not those stored before.
    let record = Event {
        id: EventId::from_uuid(Uuid::now_v7()).expect("a v7 UUID is not nil"),
        event_type: EventType::LedgerEventsAdded,
        org_id: OrgId::parse(CORRECTIONS_ORG_ID).expect("a valid org id"),
        container_id: None,
        occurred_at: state.clock.now().trunc_subsecs(3),
        data: EventData::Correction(json!({"event_ids": new, "reason": reason, "by": by})),
        origin: None,
    };
    let record_id = Some(record.id.as_uuid());
    events.push(record);
    let mut appended = state.appender.append(events).await?;
    appended.pop();
    let results = appended.into_iter().map(EventResult::from).collect();
    Ok((StatusCode::CREATED, AddedResponse { results, record_id }))
}

/// One of the events `ids` names that the ledger holds voided, if any.
async fn voided_among(pool: &PgPool, ids: &[String]) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar(
        "SELECT data->>'event_id' FROM ledger \
         WHERE type = 'ledger.event_voided' AND data->>'event_id' = ANY($1) LIMIT 1",
    )
    .bind(ids)
    .fetch_optional(pool)
    .await
}

/// 409 `already_voided` when an event to add (`ids`, in the batch's order) is one the
/// ledger holds voided: a void is final, and the event is added again under a new id.
async fn refuse_voided(pool: &PgPool, ids: &[String]) -> Result<(), ApiError> {
    let voided = voided_among(pool, ids).await?;
    let Some(index) = voided.and_then(|voided| ids.iter().position(|id| *id == voided)) else {
        return Ok(());
    };
    Err(ApiError::new(
        StatusCode::CONFLICT,
        ErrorCode::AlreadyVoided,
        format!(
            "event {index}: {} is voided, and stays voided; add it again under a new id",
            ids[index]
        ),
    ))
}

/// Which of `events` the ledger holds already, by id.
async fn stored_ids(pool: &PgPool, events: &[Event]) -> Result<HashSet<Uuid>, ApiError> {
    let ids: Vec<Uuid> = events.iter().map(|event| event.id.as_uuid()).collect();
    let stored: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM ledger_ids WHERE id = ANY($1)")
        .bind(&ids)
        .fetch_all(pool)
        .await?;
    Ok(stored.into_iter().collect())
}

/// The last correction record naming any of `ids`: that of the correction a retry
/// repeats. A record names only the events it stored, so each id is in one record at
/// most, and once that correction stored its events every one of `ids` was stored: no
/// later record names any. `None` when none does (producers sent them all).
async fn adding_record(pool: &PgPool, ids: &[String]) -> Result<Option<Uuid>, ApiError> {
    Ok(sqlx::query_scalar(
        "SELECT id FROM ledger WHERE org_id = $1 AND type = 'ledger.events_added' \
           AND data->'event_ids' ?| $2 ORDER BY position DESC LIMIT 1",
    )
    .bind(CORRECTIONS_ORG_ID)
    .bind(ids)
    .fetch_optional(pool)
    .await?)
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
