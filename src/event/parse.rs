//! Request bodies → events: the native JSON envelope (one event or `{"events": [...]}`) and
//! CloudEvents 1.0 in structured mode (one event, or a batch array).
//!
//! Serde does the shape checks (unknown and duplicated fields are errors everywhere); the
//! rules of contract §2 live in [`Unchecked::check`]. A body that is not JSON at all is
//! *malformed* (HTTP 400); a JSON body that breaks a rule is *invalid* (HTTP 422) with one
//! detail per offending event, so that a producer can fix a batch in one round.

use serde::Deserialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use super::{
    storable, CloudEventOrigin, Event, EventError, EventId, FieldNames, TimeBounds, Unchecked,
};
use crate::error_code::ErrorCode;

/// The namespace under which a CloudEvent becomes its ledger id: UUIDv5 of
/// `orgid + "\n" + source + "\n" + id` (contract §2). Fixed forever: changing it would let
/// every retried CloudEvent in flight be stored twice. Not the legacy namespace, so that no
/// scoped name can land on an id a legacy name already took (a legacy `id` could hold a
/// line break, making `source + "\n" + id` spell a scoped name).
pub const CLOUDEVENTS_ORG_NAMESPACE: Uuid =
    Uuid::from_u128(0x2b8e_51c4_93a7_4f0d_8c62_e1f4_07a9_d35b);

/// The namespace of the ids CloudEvents were given before they were scoped by org
/// (UUIDv5 of `source + "\n" + id`). Only looked up, never written: see
/// [`legacy_cloudevent_ledger_id`].
pub const CLOUDEVENTS_NAMESPACE: Uuid = Uuid::from_u128(0x6f1c_2e0a_4b7d_4c59_9a3e_5d21_7c8b_0f42);

/// Longest CloudEvents `id` we keep, in characters: the spec sets none, the audit trail
/// needs one.
pub const CLOUDEVENT_ID_LENGTH_MAX: usize = 256;
/// Longest CloudEvents `source` we keep, in characters.
pub const CLOUDEVENT_SOURCE_LENGTH_MAX: usize = 1024;

const NATIVE_NAMES: FieldNames = FieldNames {
    org_id: "org_id",
    container_id: "container_id",
    occurred_at: "occurred_at",
};
const CLOUDEVENT_NAMES: FieldNames = FieldNames {
    org_id: "orgid",
    container_id: "subject",
    occurred_at: "time",
};

/// Which envelope a body uses, from its content type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `application/json`: one native event, or `{"events": [...]}`.
    Native,
    /// `application/cloudevents+json`: one CloudEvent.
    CloudEvent,
    /// `application/cloudevents-batch+json`: an array of CloudEvents.
    CloudEventBatch,
}

impl BodyKind {
    /// Maps a `Content-Type` value (parameters such as `charset` ignored) to a body kind.
    pub fn from_content_type(value: &str) -> Option<BodyKind> {
        let essence = value.split(';').next().unwrap_or("").trim();
        match essence.to_ascii_lowercase().as_str() {
            "application/json" => Some(BodyKind::Native),
            "application/cloudevents+json" => Some(BodyKind::CloudEvent),
            "application/cloudevents-batch+json" => Some(BodyKind::CloudEventBatch),
            _ => None,
        }
    }
}

/// One rejected event of a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexedError {
    pub index: usize,
    pub error: EventError,
}

/// Why a body was refused as a whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    #[error("malformed body: {0}")]
    Malformed(String),
    #[error("invalid body: {0}")]
    Shape(String),
    #[error("a batch must hold at least one event")]
    EmptyBatch,
    #[error("a batch holds at most {max} events, got {count}")]
    BatchTooLarge { count: usize, max: usize },
    #[error("{} invalid event(s)", .0.len())]
    Invalid(Vec<IndexedError>),
}

impl BodyError {
    /// The stable error code of contract §7.
    pub fn code(&self) -> ErrorCode {
        match self {
            BodyError::Malformed(_) => ErrorCode::MalformedJson,
            BodyError::Shape(_) => ErrorCode::InvalidBody,
            BodyError::EmptyBatch => ErrorCode::EmptyBatch,
            BodyError::BatchTooLarge { .. } => ErrorCode::BatchTooLarge,
            BodyError::Invalid(_) => ErrorCode::InvalidEvents,
        }
    }

    /// One line for people (and for the dead-letter header).
    pub fn describe(&self) -> String {
        match self {
            BodyError::Invalid(errors) => errors
                .iter()
                .map(|e| format!("event {}: {}: {}", e.index, e.error.code, e.error.message))
                .collect::<Vec<_>>()
                .join("; "),
            other => other.to_string(),
        }
    }
}

/// Parses and checks a whole body. Either every event is valid, or nothing is returned.
pub fn parse_body(
    kind: BodyKind,
    body: &[u8],
    bounds: TimeBounds,
    batch_events_max: usize,
) -> Result<Vec<Event>, BodyError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| BodyError::Malformed(format!("body is not valid UTF-8: {e}")))?;
    let raws: Vec<&RawValue> = match kind {
        BodyKind::Native => {
            if !text.trim_start().starts_with('{') {
                // Serde would read an array into a struct field by field; say what is wrong.
                from_json::<serde::de::IgnoredAny>(text)?;
                return Err(BodyError::Shape("the body must be a JSON object".into()));
            }
            let probe: BatchProbe = from_json(text)?;
            if probe.events.is_some() {
                let batch: NativeBatch = from_json(text)?;
                batch.events
            } else {
                vec![from_json::<&RawValue>(text)?]
            }
        }
        BodyKind::CloudEvent => vec![from_json::<&RawValue>(text)?],
        BodyKind::CloudEventBatch => from_json::<Vec<&RawValue>>(text)?,
    };
    if raws.is_empty() {
        return Err(BodyError::EmptyBatch);
    }
    if raws.len() > batch_events_max {
        return Err(BodyError::BatchTooLarge {
            count: raws.len(),
            max: batch_events_max,
        });
    }
    let mut events = Vec::with_capacity(raws.len());
    let mut errors = Vec::new();
    for (index, raw) in raws.into_iter().enumerate() {
        let parsed = match kind {
            BodyKind::Native => parse_native(raw.get(), bounds),
            BodyKind::CloudEvent | BodyKind::CloudEventBatch => parse_cloudevent(raw.get(), bounds),
        };
        match parsed {
            Ok(event) => events.push(event),
            Err(error) => errors.push(IndexedError { index, error }),
        }
    }
    if errors.is_empty() {
        Ok(events)
    } else {
        Err(BodyError::Invalid(errors))
    }
}

fn from_json<'a, T: Deserialize<'a>>(text: &'a str) -> Result<T, BodyError> {
    serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => BodyError::Shape(e.to_string()),
        _ => BodyError::Malformed(e.to_string()),
    })
}

/// Detects a batch without caring about the other fields (those are checked after).
#[derive(Deserialize)]
struct BatchProbe<'a> {
    #[serde(borrow)]
    events: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NativeBatch<'a> {
    #[serde(borrow)]
    events: Vec<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NativeEvent<'a> {
    id: String,
    #[serde(rename = "type")]
    event_type: String,
    org_id: String,
    #[serde(default)]
    container_id: Option<String>,
    occurred_at: String,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CloudEvent<'a> {
    specversion: String,
    id: String,
    source: String,
    #[serde(rename = "type")]
    event_type: String,
    time: String,
    #[serde(default)]
    subject: Option<String>,
    orgid: String,
    #[serde(default)]
    datacontenttype: Option<String>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

/// Serde's messages name the field; the code says which kind of mistake it is.
fn envelope_error(error: serde_json::Error) -> EventError {
    let message = error.to_string();
    let code = if message.starts_with("unknown field") {
        ErrorCode::UnknownField
    } else if message.starts_with("missing field") {
        ErrorCode::MissingField
    } else if message.starts_with("duplicate field") {
        ErrorCode::DuplicateField
    } else {
        ErrorCode::InvalidEvent
    };
    EventError::new(code, message)
}

fn parse_native(text: &str, bounds: TimeBounds) -> Result<Event, EventError> {
    let raw: NativeEvent = serde_json::from_str(text).map_err(envelope_error)?;
    let id = EventId::parse(&raw.id)
        .map_err(|e| EventError::new(ErrorCode::InvalidId, format!("id: {e}")))?;
    Unchecked {
        id,
        event_type: &raw.event_type,
        org_id: &raw.org_id,
        container_id: raw.container_id.as_deref(),
        occurred_at: &raw.occurred_at,
        data: raw.data,
        origin: None,
        names: NATIVE_NAMES,
    }
    .check(bounds)
}

/// The ledger id of a CloudEvent: retries of the same (`orgid`, `source`, `id`) map to the
/// same id, and one org's ids never collide with another's. Neither an org id nor a
/// `source` can hold a line break, so the name is unambiguous.
pub fn cloudevent_ledger_id(org_id: &str, source: &str, id: &str) -> EventId {
    // Joined by hand: `format!` costs more than the hash on the ingest path.
    let mut name = Vec::with_capacity(org_id.len() + source.len() + id.len() + 2);
    for (i, part) in [org_id, source, id].into_iter().enumerate() {
        if i > 0 {
            name.push(b'\n');
        }
        name.extend_from_slice(part.as_bytes());
    }
    EventId::from_uuid(Uuid::new_v5(&CLOUDEVENTS_ORG_NAMESPACE, &name))
        .expect("a v5 UUID is never nil")
}

/// The id a CloudEvent was given before ids were scoped by org. A CloudEvent stored then
/// keeps it; the ingest path looks it up (`ledger::legacy_ids`) so that a retry of such an
/// event still deduplicates. No new row is ever written with it.
pub fn legacy_cloudevent_ledger_id(source: &str, id: &str) -> EventId {
    let name = format!("{source}\n{id}");
    EventId::from_uuid(Uuid::new_v5(&CLOUDEVENTS_NAMESPACE, name.as_bytes()))
        .expect("a v5 UUID is never nil")
}

fn check_attribute(name: &str, value: &str, max: usize) -> Result<(), EventError> {
    if !storable::is_storable(value) {
        return Err(EventError::new(
            storable::UNSTORABLE_TEXT,
            storable::unstorable_message(name),
        ));
    }
    let length = value.chars().count();
    if length == 0 || length > max {
        return Err(EventError::new(
            ErrorCode::InvalidCloudevent,
            format!("{name}: must be 1 to {max} characters, got {length}"),
        ));
    }
    Ok(())
}

fn parse_cloudevent(text: &str, bounds: TimeBounds) -> Result<Event, EventError> {
    let raw: CloudEvent = serde_json::from_str(text).map_err(envelope_error)?;
    if raw.specversion != "1.0" {
        return Err(EventError::new(
            ErrorCode::InvalidCloudevent,
            format!(
                "specversion: only \"1.0\" is supported, got {:?}",
                raw.specversion
            ),
        ));
    }
    check_attribute("id", &raw.id, CLOUDEVENT_ID_LENGTH_MAX)?;
    check_attribute("source", &raw.source, CLOUDEVENT_SOURCE_LENGTH_MAX)?;
    // A URI reference never holds control characters; refusing them keeps
    // `source + "\n" + id` unambiguous.
    if raw.source.chars().any(char::is_control) {
        return Err(EventError::new(
            ErrorCode::InvalidCloudevent,
            "source: must not contain control characters",
        ));
    }
    if let Some(content_type) = &raw.datacontenttype {
        if BodyKind::from_content_type(content_type) != Some(BodyKind::Native) {
            return Err(EventError::new(
                ErrorCode::InvalidCloudevent,
                format!(
                    "datacontenttype: only application/json is supported, got {content_type:?}"
                ),
            ));
        }
    }
    Unchecked {
        id: cloudevent_ledger_id(&raw.orgid, &raw.source, &raw.id),
        event_type: &raw.event_type,
        org_id: &raw.orgid,
        container_id: raw.subject.as_deref(),
        occurred_at: &raw.time,
        data: raw.data,
        origin: Some(CloudEventOrigin {
            source: raw.source,
            id: raw.id,
        }),
        names: CLOUDEVENT_NAMES,
    }
    .check(bounds)
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Duration, Utc};
    use serde_json::json;

    use super::*;
    use crate::event::{ContainerCommandRan, EventData, EventType};

    fn bounds() -> TimeBounds {
        TimeBounds {
            now: "2026-11-29T12:00:00Z".parse::<DateTime<Utc>>().unwrap(),
            backdate_max: Duration::days(35),
        }
    }

    /// `base` with each member of `overrides` set, or removed where it is `null`.
    fn overridden(mut base: serde_json::Value, overrides: serde_json::Value) -> serde_json::Value {
        for (key, value) in overrides.as_object().unwrap() {
            if value.is_null() {
                base.as_object_mut().unwrap().remove(key);
            } else {
                base[key] = value.clone();
            }
        }
        base
    }

    fn event(overrides: serde_json::Value) -> serde_json::Value {
        let base = json!({
            "id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55",
            "type": "container.command_ran",
            "org_id": "org_8f2k",
            "container_id": "ctr_51x",
            "occurred_at": "2026-11-29T10:00:00.123456+01:00",
            "data": {"command_id": "c1", "exit_code": 0, "duration_ms": 12}
        });
        overridden(base, overrides)
    }

    fn native(value: &serde_json::Value) -> Result<Vec<Event>, BodyError> {
        parse_body(
            BodyKind::Native,
            value.to_string().as_bytes(),
            bounds(),
            1000,
        )
    }

    fn single_code(value: serde_json::Value) -> &'static str {
        match native(&value) {
            Err(BodyError::Invalid(errors)) => {
                assert_eq!(errors.len(), 1);
                errors[0].error.code.as_str()
            }
            other => panic!("expected one invalid event, got {other:?}"),
        }
    }

    #[test]
    fn a_valid_event_is_parsed_with_its_time_in_utc_truncated_to_milliseconds() {
        let events = native(&event(json!({}))).unwrap();
        assert_eq!(events.len(), 1);
        let e = &events[0];
        assert_eq!(e.event_type, EventType::ContainerCommandRan);
        assert_eq!(e.org_id.as_str(), "org_8f2k");
        assert_eq!(e.container_id.as_ref().unwrap().as_str(), "ctr_51x");
        assert_eq!(
            crate::event::canonical::timestamp(e.occurred_at),
            "2026-11-29T09:00:00.123Z"
        );
        assert_eq!(
            e.data,
            EventData::ContainerCommandRan(ContainerCommandRan {
                command_id: "c1".into(),
                exit_code: 0,
                duration_ms: 12,
                timed_out: None
            })
        );
    }

    #[test]
    fn each_broken_rule_gets_its_own_code() {
        let cases: Vec<(serde_json::Value, &str)> = vec![
            (json!({"type": "container.deleted"}), "unknown_type"),
            (json!({"id": "abc"}), "invalid_id"),
            (json!({"id": 5}), "invalid_event"),
            (json!({"org_id": "org.x"}), "invalid_org_id"),
            (json!({"org_id": "org x"}), "invalid_org_id"),
            (json!({"org_id": "a".repeat(65)}), "invalid_org_id"),
            (json!({"container_id": ""}), "invalid_container_id"),
            (json!({"container_id": null}), "missing_container_id"),
            (
                json!({"occurred_at": "2026-11-29T10:00:00"}),
                "invalid_timestamp",
            ),
            (json!({"occurred_at": "yesterday"}), "invalid_timestamp"),
            (
                json!({"occurred_at": "2026-11-29T12:05:01Z"}),
                "occurred_at_in_future",
            ),
            (
                json!({"occurred_at": "2026-10-25T11:59:59Z"}),
                "occurred_at_too_old",
            ),
            (json!({"extra": 1}), "unknown_field"),
            (json!({"id": null}), "missing_field"),
            (
                json!({"data": {"command_id": "c", "exit_code": 0, "duration_ms": 1, "x": 1}}),
                "unknown_field",
            ),
            (
                json!({"data": {"command_id": "c", "exit_code": 0}}),
                "missing_field",
            ),
            (
                json!({"data": {"command_id": "c", "exit_code": 0, "duration_ms": -1}}),
                "invalid_data",
            ),
            (
                json!({"data": {"command_id": "c", "exit_code": 0.5, "duration_ms": 1}}),
                "invalid_data",
            ),
            (
                json!({"data": {"command_id": "", "exit_code": 0, "duration_ms": 1}}),
                "invalid_data",
            ),
            (json!({"data": [1, 2]}), "invalid_data"),
        ];
        for (overrides, code) in cases {
            assert_eq!(single_code(event(overrides.clone())), code, "{overrides}");
        }
    }

    #[test]
    fn the_time_bounds_are_inclusive_at_their_edges() {
        assert!(native(&event(json!({"occurred_at": "2026-11-29T12:05:00Z"}))).is_ok());
        assert!(native(&event(json!({"occurred_at": "2026-10-25T12:00:00Z"}))).is_ok());
    }

    #[test]
    fn type_specific_data_rules_are_enforced() {
        let port = |data: serde_json::Value| {
            event(json!({"type": "container.port_published", "data": data}))
        };
        assert!(native(&port(json!({"port": 443, "url": "https://x.example/a"}))).is_ok());
        assert_eq!(single_code(port(json!({"port": 0}))), "invalid_data");
        assert_eq!(single_code(port(json!({"port": 65536}))), "invalid_data");
        assert_eq!(
            single_code(port(json!({"port": 80, "url": "http://x.example"}))),
            "invalid_data"
        );
        let long_url = format!("https://x.example/{}", "a".repeat(2048));
        assert_eq!(
            single_code(port(json!({"port": 80, "url": long_url}))),
            "invalid_data"
        );

        let created =
            |data: serde_json::Value| event(json!({"type": "container.created", "data": data}));
        assert!(native(&created(json!({}))).is_ok());
        assert!(native(&event(json!({"type": "container.created", "data": null}))).is_ok());
        assert_eq!(
            single_code(created(json!({"name": "n".repeat(129)}))),
            "invalid_data"
        );
        assert_eq!(
            single_code(created(json!({"image": "i".repeat(257)}))),
            "invalid_data"
        );

        let stopped =
            |data: serde_json::Value| event(json!({"type": "container.stopped", "data": data}));
        assert!(native(&stopped(json!({"reason": "idle"}))).is_ok());
        assert_eq!(
            single_code(stopped(json!({"reason": "bored"}))),
            "invalid_data"
        );
        assert_eq!(
            single_code(event(
                json!({"type": "container.resumed", "data": {"x": 1}})
            )),
            "unknown_field"
        );

        let org = |event_type: &str, data: serde_json::Value| {
            event(json!({"type": event_type, "container_id": null, "data": data}))
        };
        assert!(native(&org("org.plan_changed", json!({"plan": "pro"}))).is_ok());
        assert_eq!(
            single_code(org("org.plan_changed", json!({"plan": "p.1"}))),
            "invalid_data"
        );
        assert!(native(&org("org.verification_changed", json!({"verified": true}))).is_ok());
        assert_eq!(
            single_code(org("org.verification_changed", json!({"verified": "yes"}))),
            "invalid_data"
        );
        assert!(native(&org(
            "org.billing_eligibility_changed",
            json!({"eligible": false})
        ))
        .is_ok());
        assert_eq!(
            single_code(event(
                json!({"type": "org.plan_changed", "data": {"plan": "pro"}})
            )),
            "unexpected_container_id"
        );
    }

    #[test]
    fn a_batch_reports_every_invalid_event_by_index() {
        let body = json!({"events": [
            event(json!({})),
            event(json!({"type": "nope"})),
            event(json!({})),
            event(json!({"org_id": ""})),
        ]});
        match native(&body) {
            Err(BodyError::Invalid(errors)) => {
                let found: Vec<_> = errors
                    .iter()
                    .map(|e| (e.index, e.error.code.as_str()))
                    .collect();
                assert_eq!(found, vec![(1, "unknown_type"), (3, "invalid_org_id")]);
            }
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    #[test]
    fn batch_bounds_and_body_shapes_are_enforced() {
        assert_eq!(native(&json!({"events": []})), Err(BodyError::EmptyBatch));
        let many: Vec<_> = (0..3).map(|_| event(json!({}))).collect();
        assert_eq!(
            parse_body(
                BodyKind::Native,
                json!({"events": many}).to_string().as_bytes(),
                bounds(),
                2
            ),
            Err(BodyError::BatchTooLarge { count: 3, max: 2 })
        );
        assert!(matches!(
            native(&json!({"events": [], "x": 1})),
            Err(BodyError::Shape(_))
        ));
        assert!(matches!(native(&json!([1])), Err(BodyError::Shape(_))));
        let truncated = br#"{"events": [{"id": "#;
        assert!(matches!(
            parse_body(BodyKind::Native, truncated, bounds(), 10),
            Err(BodyError::Malformed(_))
        ));
        assert!(matches!(
            parse_body(BodyKind::Native, b"{\"id\": \"\xff\"}", bounds(), 10),
            Err(BodyError::Malformed(_))
        ));
    }

    #[test]
    fn a_field_given_twice_is_refused_rather_than_silently_merged() {
        let text = r#"{"id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55", "id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e56",
            "type": "container.resumed", "org_id": "o", "container_id": "c", "occurred_at": "2026-11-29T10:00:00Z"}"#;
        match parse_body(BodyKind::Native, text.as_bytes(), bounds(), 10) {
            Err(BodyError::Invalid(errors)) => {
                assert_eq!(errors[0].error.code.as_str(), "duplicate_field")
            }
            other => panic!("expected invalid, got {other:?}"),
        }
        // In `data` too, with the same code.
        let text = r#"{"id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55", "type": "container.command_ran",
            "org_id": "o", "container_id": "c", "occurred_at": "2026-11-29T10:00:00Z",
            "data": {"command_id": "a", "exit_code": 0, "duration_ms": 1, "command_id": "b"}}"#;
        match parse_body(BodyKind::Native, text.as_bytes(), bounds(), 10) {
            Err(BodyError::Invalid(errors)) => {
                assert_eq!(errors[0].error.code.as_str(), "duplicate_field")
            }
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    fn cloudevent(overrides: serde_json::Value) -> serde_json::Value {
        let base = json!({
            "specversion": "1.0",
            "id": "evt-1",
            "source": "/providers/acme",
            "type": "container.stopped",
            "time": "2026-11-29T10:00:00Z",
            "subject": "ctr_51x",
            "orgid": "org_8f2k",
            "datacontenttype": "application/json",
            "data": {"reason": "user"}
        });
        overridden(base, overrides)
    }

    #[test]
    fn a_cloudevent_maps_to_a_ledger_event_with_a_stable_derived_id() {
        let body = cloudevent(json!({}));
        let events = parse_body(
            BodyKind::CloudEvent,
            body.to_string().as_bytes(),
            bounds(),
            10,
        )
        .unwrap();
        let e = &events[0];
        assert_eq!(
            e.id,
            cloudevent_ledger_id("org_8f2k", "/providers/acme", "evt-1")
        );
        assert_eq!(e.container_id.as_ref().unwrap().as_str(), "ctr_51x");
        assert_eq!(e.org_id.as_str(), "org_8f2k");
        assert_eq!(
            e.origin,
            Some(CloudEventOrigin {
                source: "/providers/acme".into(),
                id: "evt-1".into()
            })
        );
        // The derivation is part of the contract: pin one value so it never drifts.
        assert_eq!(
            cloudevent_ledger_id("org_8f2k", "/providers/acme", "evt-1").as_uuid(),
            Uuid::new_v5(
                &CLOUDEVENTS_ORG_NAMESPACE,
                b"org_8f2k\n/providers/acme\nevt-1"
            )
        );
        assert_eq!(
            cloudevent_ledger_id("org_8f2k", "/providers/acme", "evt-1").to_string(),
            "acb6c77f-637b-5065-869b-cebb0fe40e4b"
        );
        // And the ids stored before the change, which retries must still find.
        assert_eq!(
            legacy_cloudevent_ledger_id("/providers/acme", "evt-1").as_uuid(),
            Uuid::new_v5(&CLOUDEVENTS_NAMESPACE, b"/providers/acme\nevt-1")
        );
    }

    #[test]
    fn the_same_source_and_id_from_two_orgs_are_two_ledger_ids() {
        let id_of = |org: &str| {
            let body = cloudevent(json!({"orgid": org}));
            parse_body(
                BodyKind::CloudEvent,
                body.to_string().as_bytes(),
                bounds(),
                10,
            )
            .unwrap()[0]
                .id
        };
        assert_ne!(id_of("org_a"), id_of("org_b"));
        assert_eq!(id_of("org_a"), id_of("org_a"));
        // No scoped name can spell a legacy one: the namespaces differ.
        assert_ne!(
            cloudevent_ledger_id("org_a", "/s", "x").as_uuid(),
            legacy_cloudevent_ledger_id("org_a", "/s\nx").as_uuid()
        );
    }

    #[test]
    fn a_leap_second_is_refused_in_occurred_at_and_in_time() {
        for at in ["2026-11-29T09:59:60.000Z", "2026-11-29T10:59:60.5+01:00"] {
            assert_eq!(
                single_code(event(json!({"occurred_at": at}))),
                "leap_second",
                "{at}"
            );
            let body = cloudevent(json!({"time": at}));
            match parse_body(
                BodyKind::CloudEvent,
                body.to_string().as_bytes(),
                bounds(),
                10,
            ) {
                Err(BodyError::Invalid(errors)) => {
                    assert_eq!(errors[0].error.code.as_str(), "leap_second");
                    assert!(errors[0].error.message.starts_with("time: "));
                }
                other => panic!("expected invalid, got {other:?}"),
            }
        }
        // The second before and the second after are ordinary.
        assert!(native(&event(json!({"occurred_at": "2026-11-29T09:59:59.999Z"}))).is_ok());
        assert!(native(&event(json!({"occurred_at": "2026-11-29T10:00:00Z"}))).is_ok());
    }

    #[test]
    fn a_nul_in_any_text_of_an_event_is_refused_naming_the_field() {
        let nul = "a\u{0}b";
        let cases = [
            (
                event(json!({"type": "container.created", "data": {"name": nul}})),
                "data.name",
            ),
            (
                event(json!({"type": "container.created", "data": {"image": nul}})),
                "data.image",
            ),
            (
                event(json!({"data": {"command_id": nul, "exit_code": 0, "duration_ms": 1}})),
                "data.command_id",
            ),
            (
                event(json!({"type": "container.port_published",
                    "data": {"port": 80, "url": format!("https://x.example/{nul}")}})),
                "data.url",
            ),
            (
                event(json!({"type": "org.plan_changed", "container_id": null,
                    "data": {"plan": nul}})),
                "data.plan",
            ),
        ];
        for (body, field) in cases {
            match native(&body) {
                Err(BodyError::Invalid(errors)) => {
                    assert_eq!(errors[0].error.code.as_str(), "unstorable_text", "{field}");
                    assert!(errors[0].error.message.starts_with(field), "{field}");
                }
                other => panic!("{field}: expected invalid, got {other:?}"),
            }
        }
        for (attribute, field) in [("id", "id"), ("source", "source")] {
            let body = cloudevent(json!({ attribute: nul }));
            match parse_body(
                BodyKind::CloudEvent,
                body.to_string().as_bytes(),
                bounds(),
                10,
            ) {
                Err(BodyError::Invalid(errors)) => {
                    assert_eq!(errors[0].error.code.as_str(), "unstorable_text", "{field}");
                    assert!(errors[0].error.message.starts_with(field), "{field}");
                }
                other => panic!("{field}: expected invalid, got {other:?}"),
            }
        }
    }

    #[test]
    fn data_must_be_an_object_and_null_means_absent() {
        // Read by position, this array would have been a valid command.
        assert_eq!(
            single_code(event(json!({"data": ["c1", 0, 12]}))),
            "invalid_data"
        );
        assert_eq!(
            single_code(event(json!({"type": "container.resumed", "data": []}))),
            "invalid_data"
        );
        assert_eq!(
            single_code(event(json!({"type": "container.resumed", "data": "x"}))),
            "invalid_data"
        );
        assert_eq!(
            single_code(event(json!({"type": "container.resumed", "data": 1}))),
            "invalid_data"
        );
        // `null` is absent: fine where every data field is optional, missing where not.
        let mut resumed = event(json!({"type": "container.resumed"}));
        resumed["data"] = serde_json::Value::Null;
        let resumed = native(&resumed).unwrap();
        assert_eq!(
            resumed[0].data,
            crate::event::EventData::ContainerResumed(crate::event::ContainerResumed {})
        );
        let mut command = event(json!({}));
        command["data"] = serde_json::Value::Null;
        assert_eq!(single_code(command), "missing_field");
    }

    #[test]
    fn a_source_with_a_line_break_is_refused_so_the_id_derivation_stays_unambiguous() {
        // ("a", "b\nc") and ("a\nb", "c") would otherwise share one ledger id.
        let body = cloudevent(json!({"source": "a\nb"}));
        match parse_body(
            BodyKind::CloudEvent,
            body.to_string().as_bytes(),
            bounds(),
            10,
        ) {
            Err(BodyError::Invalid(errors)) => {
                assert_eq!(errors[0].error.code.as_str(), "invalid_cloudevent")
            }
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    #[test]
    fn a_cloudevent_without_orgid_or_with_unknown_attributes_is_refused() {
        let code = |body: serde_json::Value, kind| match parse_body(
            kind,
            body.to_string().as_bytes(),
            bounds(),
            10,
        ) {
            Err(BodyError::Invalid(errors)) => errors[0].error.code.as_str(),
            other => panic!("expected invalid, got {other:?}"),
        };
        assert_eq!(
            code(cloudevent(json!({"orgid": null})), BodyKind::CloudEvent),
            "missing_field"
        );
        assert_eq!(
            code(cloudevent(json!({"color": "red"})), BodyKind::CloudEvent),
            "unknown_field"
        );
        assert_eq!(
            code(
                cloudevent(json!({"specversion": "0.3"})),
                BodyKind::CloudEvent
            ),
            "invalid_cloudevent"
        );
        assert_eq!(
            code(cloudevent(json!({"id": ""})), BodyKind::CloudEvent),
            "invalid_cloudevent"
        );
        assert_eq!(
            code(
                cloudevent(json!({"datacontenttype": "text/xml"})),
                BodyKind::CloudEvent
            ),
            "invalid_cloudevent"
        );
        assert_eq!(
            code(
                json!([cloudevent(json!({})), cloudevent(json!({"subject": null}))]),
                BodyKind::CloudEventBatch
            ),
            "missing_container_id"
        );
    }

    #[test]
    fn content_types_select_the_envelope() {
        assert_eq!(
            BodyKind::from_content_type("application/json; charset=utf-8"),
            Some(BodyKind::Native)
        );
        assert_eq!(
            BodyKind::from_content_type("Application/CloudEvents+JSON"),
            Some(BodyKind::CloudEvent)
        );
        assert_eq!(
            BodyKind::from_content_type("application/cloudevents-batch+json"),
            Some(BodyKind::CloudEventBatch)
        );
        assert_eq!(BodyKind::from_content_type("text/plain"), None);
    }
}
