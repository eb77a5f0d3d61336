//! `POST /v1/events`: one event, `{"events": [...]}`, or CloudEvents (contract §2, §6).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::parse::{parse_body, BodyKind};
use crate::event::TimeBounds;
use crate::ledger::{legacy_ids, plans};
use axum::Extension;

pub(super) fn router() -> OpenApiRouter<AppState> {
    // The handler reads the body under its own limit, `TALLY_BODY_MAX_BYTES`.
    OpenApiRouter::new()
        .routes(routes!(post_events).layer(axum::extract::DefaultBodyLimit::disable()))
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventsResponse {
    /// One per input event, in input order.
    pub results: Vec<EventResult>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventResult {
    pub id: Uuid,
    /// The event's ledger position (the original one for a duplicate).
    pub position: i64,
    /// True when the event was already stored with the same content.
    pub duplicate: bool,
}

impl From<crate::ledger::AppendedEvent> for EventResult {
    fn from(appended: crate::ledger::AppendedEvent) -> Self {
        EventResult {
            id: appended.id.as_uuid(),
            position: appended.position,
            duplicate: appended.duplicate,
        }
    }
}

/// Append events to the ledger. Acknowledged only after they are committed; a batch is
/// atomic.
#[utoipa::path(
    post,
    path = "/v1/events",
    tag = "events",
    request_body(
        content = EventInput,
        description = "One event, `{\"events\": [...]}` (1–1000), or CloudEvents 1.0 (`application/cloudevents+json`, `application/cloudevents-batch+json`)",
        content_type = "application/json"
    ),
    responses(
        (status = 200, body = EventsResponse, description = "stored (or already stored)"),
        (status = 400, body = ErrorBody, description = "not JSON"),
        (status = 401, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "an id was stored before with other content"),
        (status = 413, body = ErrorBody, description = "body or batch too large"),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "invalid event(s), with per-index details; or `unstorable_event`, content the database refuses"),
        (status = 503, body = ErrorBody, description = "overloaded or database unavailable; retry"),
    ),
    security(("bearer" = []))
)]
pub async fn post_events(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<EventsResponse>, ApiError> {
    let kind = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(BodyKind::from_content_type)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                ErrorCode::UnsupportedMediaType,
                "Content-Type must be application/json, application/cloudevents+json or application/cloudevents-batch+json",
            )
        })?;
    let bytes = super::body::read_body(body, state.body_max_bytes).await?;
    let bounds = TimeBounds {
        now: state.clock.now(),
        backdate_max: state.backdate_max,
    };
    let mut events = parse_body(kind, &bytes, bounds, state.batch_events_max).inspect_err(|e| {
        metrics::counter!(crate::telemetry::INGEST_REQUESTS_REJECTED, "source" => "http", "code" => e.code().as_str())
            .increment(1);
    })?;
    for event in &events {
        principal.check_org(event.org_id.as_str())?;
    }
    if let Some((index, plan)) = plans::unknown_reference(&state.pool, &events).await? {
        metrics::counter!(crate::telemetry::INGEST_REQUESTS_REJECTED, "source" => "http", "code" => ErrorCode::UnknownPlan.as_str())
            .increment(1);
        return Err(ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::UnknownPlan,
            format!("event {index} moves its org to plan {plan:?}, which is not defined; nothing was stored"),
        )
        .with_details(vec![serde_json::json!({
            "index": index,
            "code": ErrorCode::UnknownPlan,
            "message": format!("data.plan: {plan:?} is not defined (PUT /v1/plans/{plan} first)"),
        })]));
    }
    legacy_ids::adopt(&state.pool, &mut events).await?;
    let appended = state.appender.append(events).await.inspect_err(|e| {
        let code = if e.is_retryable() {
            crate::telemetry::CODE_UNAVAILABLE
        } else {
            e.code().as_str()
        };
        metrics::counter!(crate::telemetry::INGEST_REQUESTS_REJECTED, "source" => "http", "code" => code)
            .increment(1);
    })?;
    let duplicates = appended.iter().filter(|a| a.duplicate).count() as u64;
    metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "http", "outcome" => "stored")
        .increment(appended.len() as u64 - duplicates);
    metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "http", "outcome" => "duplicate")
        .increment(duplicates);
    Ok(Json(EventsResponse {
        results: appended.into_iter().map(EventResult::from).collect(),
    }))
}

/// A native event, as the OpenAPI document shows it. `data` depends on `type`.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct EventInput {
    /// UUID, the idempotency key.
    id: uuid::Uuid,
    #[schema(example = "container.created")]
    r#type: String,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    org_id: String,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    container_id: Option<String>,
    /// RFC 3339 with offset.
    occurred_at: String,
    data: Option<serde_json::Value>,
}
