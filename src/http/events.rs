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
use crate::event::cloudevent;
use crate::event::parse::{parse_envelope, Envelope};
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
///
/// Four ways to send: a native event or `{"events": [...]}` (`application/json`); one
/// CloudEvent in structured mode (`application/cloudevents+json`); a batch of them
/// (`application/cloudevents-batch+json`); or one CloudEvent in binary mode, its attributes
/// in `ce-` headers (names in any case, values percent-encoded) and its `data` as the body
/// (`application/json`, or an empty body for no data). A CloudEvent has the same ledger id
/// in every mode. Extension attributes (`ce-traceparent`, `ce-tracestate`, any
/// `ce-<name>` of 1–20 lower-case letters or digits), `dataschema` and `datacontenttype`
/// are kept for audit (`GET /v1/events`, `attributes`), at most 16 of 4096 bytes per event,
/// and are not part of the event's identity.
#[utoipa::path(
    post,
    path = "/v1/events",
    tag = "events",
    params(
        ("ce-specversion" = Option<String>, Header, description = "Binary mode: `1.0`. Any `ce-` header makes an `application/json` request binary mode."),
        ("ce-id" = Option<String>, Header, description = "Binary mode, required: the event's id at its source (1–256 characters)."),
        ("ce-source" = Option<String>, Header, description = "Binary mode, required: the producer (1–1024 characters, no control characters)."),
        ("ce-type" = Option<String>, Header, description = "Binary mode, required: the event type, e.g. `container.created`."),
        ("ce-time" = Option<String>, Header, description = "Binary mode, required: when it happened, RFC 3339 with an offset."),
        ("ce-orgid" = Option<String>, Header, description = "Binary mode, required: the org."),
        ("ce-subject" = Option<String>, Header, description = "Binary mode: the container, for `container.*` types."),
        ("ce-dataschema" = Option<String>, Header, description = "Binary mode, optional: kept for audit."),
        ("ce-traceparent" = Option<String>, Header, description = "Binary mode, optional extension (W3C trace context): kept for audit, like any `ce-<name>` extension."),
        ("ce-tracestate" = Option<String>, Header, description = "Binary mode, optional extension: kept for audit."),
    ),
    request_body(
        description = "Events in one of four envelopes; see the operation's description",
        content(
            (JsonEventsBody = "application/json"),
            (CloudEventInput = "application/cloudevents+json"),
            (Vec<CloudEventInput> = "application/cloudevents-batch+json"),
        )
    ),
    responses(
        (status = 200, body = EventsResponse, description = "stored (or already stored)"),
        (status = 400, body = ErrorBody, description = "not JSON"),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody, description = "the token lacks `events:write`, or is bound to an org and an event is another org's or an account event (`org.*`)"),
        (status = 409, body = ErrorBody, description = "an id was stored before with other content"),
        (status = 413, body = ErrorBody, description = "body or batch too large"),
        (status = 415, body = ErrorBody, description = "no envelope recognised, or binary-mode data that is not JSON"),
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
    // Every refusal the handler makes is counted here, whichever step made it; a 503 as
    // `unavailable` (worth retrying).
    store_events(&state, &principal, &headers, body)
        .await
        .inspect_err(|error| {
            let code = if error.status == StatusCode::SERVICE_UNAVAILABLE {
                crate::telemetry::CODE_UNAVAILABLE
            } else {
                error.code.as_str()
            };
            metrics::counter!(crate::telemetry::INGEST_REQUESTS_REJECTED, "source" => "http", "code" => code)
                .increment(1);
        })
}

/// `POST /v1/events` itself: the events of the body, checked, stored.
async fn store_events(
    state: &AppState,
    principal: &Principal,
    headers: &HeaderMap,
    body: Body,
) -> Result<Json<EventsResponse>, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    let envelope = Envelope::select(
        content_type,
        cloudevent::has_ce_header(headers.keys().map(|name| name.as_str())),
        None,
    )?;
    super::body::identity_only(headers)?;
    let bytes = super::body::read_body(body, state.body_max_bytes).await?;
    let bounds = TimeBounds {
        now: state.clock.now(),
        backdate_max: state.backdate_max,
    };
    let mut events = parse_envelope(
        envelope,
        headers
            .iter()
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
        content_type,
        &bytes,
        bounds,
        state.batch_events_max,
    )?;
    principal.check_events(&events)?;
    if let Some((index, plan)) = plans::unknown_reference(&state.pool, &events).await? {
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
    let appended = state.appender.append(events).await?;
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

/// A batch of native events, as the OpenAPI document shows it.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct EventBatchInput {
    /// 1–1000 events, stored atomically.
    events: Vec<EventInput>,
}

/// A CloudEvent in structured mode, as the OpenAPI document shows it. Any other member is
/// an extension attribute (name of 1–20 lower-case letters or digits; a string, boolean or
/// 32-bit integer), kept for audit.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct CloudEventInput {
    #[schema(example = "1.0")]
    specversion: String,
    /// 1–256 characters; with `source` and `orgid`, it makes the ledger id.
    id: String,
    /// 1–1024 characters, no control characters.
    source: String,
    #[schema(example = "container.created")]
    r#type: String,
    /// RFC 3339 with offset.
    time: String,
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    orgid: String,
    /// The container, for `container.*` types.
    #[schema(pattern = "^[A-Za-z0-9_-]{1,64}$")]
    subject: Option<String>,
    /// Only `application/json`; kept for audit.
    datacontenttype: Option<String>,
    /// Kept for audit.
    dataschema: Option<String>,
    /// Shaped by `type`.
    data: Option<serde_json::Value>,
}

/// The `application/json` body of `POST /v1/events`: a native event, a native batch, or —
/// in CloudEvents binary mode, with `ce-` headers — the event's `data`, shaped by `ce-type`.
pub struct JsonEventsBody;

impl utoipa::PartialSchema for JsonEventsBody {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{AnyOfBuilder, ObjectBuilder, Schema};
        use utoipa::openapi::{Ref, RefOr};
        let data = ObjectBuilder::new().description(Some(
            "binary mode: the CloudEvent's data, shaped by its `ce-type`",
        ));
        RefOr::T(Schema::AnyOf(
            AnyOfBuilder::new()
                .item(Ref::from_schema_name("EventInput"))
                .item(Ref::from_schema_name("EventBatchInput"))
                .item(data)
                .description(Some(
                    "a native event, `{\"events\": [...]}`, or (with `ce-` headers) a CloudEvent's data",
                ))
                .build(),
        ))
    }
}

impl ToSchema for JsonEventsBody {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        use utoipa::PartialSchema as _;
        schemas.push((EventInput::name().into_owned(), EventInput::schema()));
        EventInput::schemas(schemas);
        schemas.push((
            EventBatchInput::name().into_owned(),
            EventBatchInput::schema(),
        ));
        EventBatchInput::schemas(schemas);
    }
}
