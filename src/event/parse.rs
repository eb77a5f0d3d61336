//! Request bodies → events: the native JSON envelope (one event or `{"events": [...]}`), and
//! CloudEvents 1.0 in structured mode (one event, or a batch array) or binary mode (`ce-`
//! headers, the body being `data`; see [`super::cloudevent`]).
//!
//! Serde does the shape checks (unknown and duplicated fields are errors everywhere); the
//! rules of contract §2 live in [`Unchecked::check`]. A body that is not JSON at all is
//! *malformed* (HTTP 400); a JSON body that breaks a rule is *invalid* (HTTP 422) with one
//! detail per offending event, so that a producer can fix a batch in one round.

use serde::Deserialize;
use serde_json::value::RawValue;

use super::cloudevent::{self, Mode};
use super::{Event, EventError, EventId, FieldNames, TimeBounds, Unchecked};
use crate::error_code::ErrorCode;

pub use super::cloudevent::{
    cloudevent_ledger_id, legacy_cloudevent_ledger_id, CLOUDEVENTS_NAMESPACE,
    CLOUDEVENTS_ORG_NAMESPACE, CLOUDEVENT_ID_LENGTH_MAX, CLOUDEVENT_SOURCE_LENGTH_MAX,
};

const NATIVE_NAMES: FieldNames = FieldNames {
    org_id: "org_id",
    container_id: "container_id",
    occurred_at: "occurred_at",
};

/// What an ingest path says when it cannot tell which envelope a request uses.
pub const CONTENT_TYPES_ACCEPTED: &str = "Content-Type must be application/json, \
     application/cloudevents+json or application/cloudevents-batch+json, or the request a \
     binary-mode CloudEvent (ce- headers) whose data is application/json";

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

/// How a request or message carries its events: a body of one of the [`BodyKind`]s, or a
/// binary-mode CloudEvent (attributes in `ce-` headers, the body its `data`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Envelope {
    Body(BodyKind),
    Binary,
}

impl Envelope {
    /// Picks the envelope from the `Content-Type` header and whether any `ce-` header came
    /// with it. A CloudEvents media type means structured mode, whatever other headers say
    /// (the HTTP binding's rule); otherwise a `ce-` header means binary mode. `absent` is
    /// the kind of a body without `Content-Type` (HTTP: none, NATS: native JSON).
    pub fn select(
        content_type: Option<&str>,
        has_ce_header: bool,
        absent: Option<BodyKind>,
    ) -> Result<Envelope, BodyError> {
        let kind = match content_type {
            Some(value) => BodyKind::from_content_type(value),
            None => absent,
        };
        match kind {
            Some(kind @ (BodyKind::CloudEvent | BodyKind::CloudEventBatch)) => {
                Ok(Envelope::Body(kind))
            }
            _ if has_ce_header => Ok(Envelope::Binary),
            Some(kind) => Ok(Envelope::Body(kind)),
            None => Err(BodyError::UnsupportedMediaType(
                CONTENT_TYPES_ACCEPTED.to_owned(),
            )),
        }
    }
}

/// Parses and checks whatever `envelope` says the request holds; `headers` are the
/// request's or message's headers (only `ce-` ones are read) and `content_type` its
/// `Content-Type`.
pub fn parse_envelope<'a>(
    envelope: Envelope,
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    content_type: Option<&str>,
    body: &[u8],
    bounds: TimeBounds,
    batch_events_max: usize,
) -> Result<Vec<Event>, BodyError> {
    match envelope {
        Envelope::Body(kind) => parse_body(kind, body, bounds, batch_events_max),
        Envelope::Binary => parse_binary(headers, content_type, body, bounds),
    }
}

/// A binary-mode CloudEvent: its attributes from the `ce-` headers, its `data` the body
/// (JSON; an empty body is no data). One event, so errors are those of event 0.
pub fn parse_binary<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    content_type: Option<&str>,
    body: &[u8],
    bounds: TimeBounds,
) -> Result<Vec<Event>, BodyError> {
    let text = std::str::from_utf8(body)
        .map_err(|e| BodyError::Malformed(format!("body is not valid UTF-8: {e}")))?;
    let empty = text.trim().is_empty();
    let json =
        content_type.map(|value| BodyKind::from_content_type(value) == Some(BodyKind::Native));
    if json == Some(false) || (json.is_none() && !empty) {
        return Err(BodyError::UnsupportedMediaType(
            "a binary-mode CloudEvent's data must be application/json (Content-Type)".to_owned(),
        ));
    }
    let data = if empty {
        None
    } else {
        Some(from_json::<&RawValue>(text)?)
    };
    let invalid = |error| BodyError::Invalid(vec![IndexedError { index: 0, error }]);
    let attributes = cloudevent::binary_attributes(headers, content_type).map_err(invalid)?;
    let event = cloudevent::check(attributes, data, Mode::Binary, bounds).map_err(invalid)?;
    Ok(vec![event])
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
    /// A member given twice where serde reads the body (the batch's `events`).
    #[error("invalid body: {0}")]
    Duplicate(String),
    #[error("a batch must hold at least one event")]
    EmptyBatch,
    #[error("a batch holds at most {max} events, got {count}")]
    BatchTooLarge { count: usize, max: usize },
    #[error("{} invalid event(s)", .0.len())]
    Invalid(Vec<IndexedError>),
    #[error("{0}")]
    UnsupportedMediaType(String),
}

impl BodyError {
    /// The stable error code of contract §7.
    pub fn code(&self) -> ErrorCode {
        match self {
            BodyError::Malformed(_) => ErrorCode::MalformedJson,
            BodyError::Shape(_) => ErrorCode::InvalidBody,
            BodyError::Duplicate(_) => ErrorCode::DuplicateField,
            BodyError::EmptyBatch => ErrorCode::EmptyBatch,
            BodyError::BatchTooLarge { .. } => ErrorCode::BatchTooLarge,
            BodyError::Invalid(_) => ErrorCode::InvalidEvents,
            BodyError::UnsupportedMediaType(_) => ErrorCode::UnsupportedMediaType,
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
            if let Some(events) = probe.events {
                if !events.get().starts_with('[') {
                    return Err(BodyError::Shape(format!(
                        "events: an array of events is required, not {}",
                        json_kind(events.get())
                    )));
                }
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
            BodyKind::CloudEvent | BodyKind::CloudEventBatch => {
                cloudevent::parse_structured(raw.get(), bounds)
            }
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
        serde_json::error::Category::Data if e.to_string().starts_with("duplicate field") => {
            BodyError::Duplicate(e.to_string())
        }
        serde_json::error::Category::Data => BodyError::Shape(e.to_string()),
        _ => BodyError::Malformed(e.to_string()),
    })
}

/// Detects a batch without caring about the other fields (those are checked after).
#[derive(Deserialize)]
struct BatchProbe<'a> {
    /// Whenever the key is there, `null` included: `{"events": null}` is a batch without
    /// its array, not one event with an unknown field.
    #[serde(borrow, default, deserialize_with = "present")]
    events: Option<&'a RawValue>,
}

/// What kind of JSON value `text` (a whole value, valid JSON) is, to name it in an error
/// without repeating it.
fn json_kind(text: &str) -> &'static str {
    match text.as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'"') => "a string",
        Some(b'n') => "null",
        Some(b't' | b'f') => "a boolean",
        _ => "a number",
    }
}

/// A value that is there, whatever it is (`Option` reads `null` as absent).
fn present<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<&'de RawValue>, D::Error> {
    <&RawValue>::deserialize(deserializer).map(Some)
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

#[cfg(test)]
mod tests {
    use chrono::{DateTime, Duration, Utc};
    use serde_json::json;
    use uuid::Uuid;

    use super::*;
    use crate::event::{CloudEventOrigin, ContainerCommandRan, EventData, EventType};

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
    fn an_event_past_the_backdate_bound_is_sent_to_the_correction_flow_unless_it_is_one() {
        let old = event(json!({"occurred_at": "2016-10-25T11:59:59Z"})).to_string();
        let message = |backdate_days: i64| {
            let bounds = TimeBounds {
                backdate_max: Duration::days(backdate_days),
                ..bounds()
            };
            parse_native(&old, bounds).unwrap_err().message
        };
        assert!(
            message(35).ends_with("use the admin correction flow"),
            "{}",
            message(35)
        );
        let correcting = message(crate::event::CORRECTION_BACKDATE_DAYS);
        assert!(correcting.ends_with("of 3660 days"), "{correcting}");
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
        for hidden in [
            "https://x.example/\nSet-Cookie: a=b",
            "https://x.example/a b",
            "https://x.example/\t",
            "https://x.example/\u{202E}gpj.exe",
            "https://x\u{200B}.example/",
            "https://x.example/\u{061C}",
            "https://x.example/\u{E0041}",
            "https://bücher.example/",
            "https://user:secret@x.example/",
            "https://user@x.example/",
        ] {
            assert_eq!(
                single_code(port(json!({"port": 80, "url": hidden}))),
                "invalid_data",
                "{hidden:?}"
            );
        }
        assert!(native(&port(
            json!({"port": 443, "url": "https://x.example/a%20b?q=%0A"})
        ))
        .is_ok());
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
    fn a_batch_naming_its_events_twice_is_a_duplicate_field() {
        let text = r#"{"events": [], "events": []}"#;
        let refused = parse_body(BodyKind::Native, text.as_bytes(), bounds(), 10);
        assert!(
            matches!(&refused, Err(error @ BodyError::Duplicate(_)) if error.code() == ErrorCode::DuplicateField),
            "{refused:?}"
        );
    }

    #[test]
    fn batch_bounds_and_body_shapes_are_enforced() {
        assert_eq!(native(&json!({"events": []})), Err(BodyError::EmptyBatch));
        for (not_an_array, kind) in [
            (json!(null), "null"),
            (json!({"a": 1}), "an object"),
            (json!("x".repeat(100)), "a string"),
            (json!(true), "a boolean"),
            (json!(-1.5), "a number"),
        ] {
            let refused = native(&json!({ "events": not_an_array }));
            let expected = format!("events: an array of events is required, not {kind}");
            assert!(
                matches!(&refused, Err(BodyError::Shape(why)) if *why == expected),
                "{not_an_array}: {refused:?}"
            );
        }
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
                id: "evt-1".into(),
                attributes: [("datacontenttype".to_owned(), "application/json".to_owned())].into(),
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
    fn a_cloudevent_without_orgid_or_with_malformed_attributes_is_refused() {
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
        // Extension names are lower-case letters and digits, at most 20 of them.
        for name in ["Color", "trace_parent", "abcdefghijklmnopqrstu"] {
            assert_eq!(
                code(cloudevent(json!({ name: "x" })), BodyKind::CloudEvent),
                "invalid_extension",
                "{name}"
            );
        }
        assert_eq!(
            code(
                cloudevent(json!({"sampled": {"a": 1}})),
                BodyKind::CloudEvent
            ),
            "invalid_extension"
        );
        assert_eq!(
            code(cloudevent(json!({"weight": 1.5})), BodyKind::CloudEvent),
            "invalid_extension"
        );
        assert_eq!(
            code(cloudevent(json!({"subject": 7})), BodyKind::CloudEvent),
            "invalid_cloudevent"
        );
        assert_eq!(
            code(
                cloudevent(json!({"data_base64": "AAAA"})),
                BodyKind::CloudEvent
            ),
            "invalid_cloudevent"
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
        let twice = cloudevent(json!({})).to_string().replacen(
            "\"orgid\"",
            "\"traceparent\":\"a\",\"traceparent\":\"b\",\"orgid\"",
            1,
        );
        match parse_body(BodyKind::CloudEvent, twice.as_bytes(), bounds(), 10) {
            Err(BodyError::Invalid(errors)) => {
                assert_eq!(errors[0].error.code.as_str(), "duplicate_field")
            }
            other => panic!("expected invalid, got {other:?}"),
        }
    }

    fn structured(body: &serde_json::Value) -> Result<Vec<Event>, BodyError> {
        parse_body(
            BodyKind::CloudEvent,
            body.to_string().as_bytes(),
            bounds(),
            10,
        )
    }

    #[test]
    fn optional_and_extension_attributes_are_kept_beside_the_identity() {
        let plain = structured(&cloudevent(json!({"datacontenttype": null}))).unwrap();
        let traced = structured(&cloudevent(json!({
            "dataschema": "https://schemas.example/stopped.json",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "congo=t61rcWkgMzE",
            "sampled": true,
            "hops": 3,
            "color": null,
        })))
        .unwrap();
        assert_eq!(plain[0].id, traced[0].id);
        assert_eq!(plain[0].data, traced[0].data);
        assert!(plain[0].origin.as_ref().unwrap().attributes.is_empty());
        assert_eq!(plain[0].origin.as_ref().unwrap().attributes_json(), None);
        let kept = &traced[0].origin.as_ref().unwrap().attributes;
        let names: Vec<&str> = kept.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "datacontenttype",
                "dataschema",
                "hops",
                "sampled",
                "traceparent",
                "tracestate"
            ]
        );
        assert_eq!(kept["sampled"], "true");
        assert_eq!(kept["hops"], "3");
    }

    #[test]
    fn kept_attributes_past_the_limits_are_refused() {
        let code = |overrides: serde_json::Value| match structured(&cloudevent(overrides)) {
            Err(BodyError::Invalid(errors)) => errors[0].error.code.as_str(),
            other => panic!("expected invalid, got {other:?}"),
        };
        // `datacontenttype` is one of the kept attributes: 15 extensions reach the limit.
        let mut at_limit = serde_json::Map::new();
        for i in 0..cloudevent::KEPT_ATTRIBUTES_MAX - 1 {
            at_limit.insert(format!("ext{i}"), json!("v"));
        }
        assert!(structured(&cloudevent(json!(at_limit.clone()))).is_ok());
        at_limit.insert("onemore".into(), json!("v"));
        assert_eq!(code(json!(at_limit)), "extensions_too_large");
        let long = "x".repeat(cloudevent::KEPT_ATTRIBUTES_MAX_BYTES);
        assert_eq!(code(json!({ "tracestate": long })), "extensions_too_large");
        assert_eq!(code(json!({ "tracestate": "a\u{0}b" })), "unstorable_text");
    }

    fn binary_headers() -> Vec<(&'static str, &'static [u8])> {
        vec![
            ("ce-specversion", b"1.0".as_slice()),
            ("Ce-Id", b"evt-1"),
            ("CE-SOURCE", b"/providers/acme"),
            ("ce-type", b"container.stopped"),
            ("ce-time", b"2026-11-29T10:00:00Z"),
            ("ce-subject", b"ctr_51x"),
            ("ce-orgid", b"org_8f2k"),
            ("accept", b"*/*"),
        ]
    }

    fn binary(
        headers: Vec<(&'static str, &'static [u8])>,
        content_type: Option<&str>,
        body: &[u8],
    ) -> Result<Vec<Event>, BodyError> {
        parse_binary(headers, content_type, body, bounds())
    }

    #[test]
    fn a_binary_mode_cloudevent_is_the_same_event_as_its_structured_form() {
        let from_headers = binary(
            binary_headers(),
            Some("application/json"),
            br#"{"reason": "user"}"#,
        )
        .unwrap();
        let from_body = structured(&cloudevent(json!({}))).unwrap();
        assert_eq!(from_headers[0].id, from_body[0].id);
        assert_eq!(from_headers[0].data, from_body[0].data);
        assert_eq!(from_headers[0].occurred_at, from_body[0].occurred_at);
        assert_eq!(from_headers[0].origin, from_body[0].origin);
        // Percent-encoded values are decoded; an empty body is no data.
        let mut headers = binary_headers();
        headers[2] = ("ce-source", b"/providers/acme%20eu");
        headers.push(("ce-traceparent", b"00-ab-cd-01"));
        let events = binary(headers, None, b"").unwrap();
        let origin = events[0].origin.as_ref().unwrap();
        assert_eq!(origin.source, "/providers/acme eu");
        assert_eq!(origin.attributes["traceparent"], "00-ab-cd-01");
    }

    #[test]
    fn a_binary_mode_cloudevent_missing_an_attribute_is_refused_naming_its_header() {
        for missing in ["ce-specversion", "ce-id", "ce-source", "ce-type", "ce-time"] {
            let headers: Vec<_> = binary_headers()
                .into_iter()
                .filter(|(name, _)| !name.eq_ignore_ascii_case(missing))
                .collect();
            match binary(headers, Some("application/json"), b"{}") {
                Err(BodyError::Invalid(errors)) => {
                    assert_eq!(errors[0].error.code.as_str(), "missing_field", "{missing}");
                    assert!(errors[0].error.message.starts_with(missing), "{missing}");
                }
                other => panic!("{missing}: expected invalid, got {other:?}"),
            }
        }
        let mut twice = binary_headers();
        twice.push(("ce-ID", b"evt-2"));
        match binary(twice, None, b"") {
            Err(BodyError::Invalid(errors)) => {
                assert_eq!(errors[0].error.code.as_str(), "duplicate_field")
            }
            other => panic!("expected invalid, got {other:?}"),
        }
        assert!(matches!(
            binary(binary_headers(), Some("text/plain"), b"x"),
            Err(BodyError::UnsupportedMediaType(_))
        ));
        assert!(matches!(
            binary(binary_headers(), None, b"{}"),
            Err(BodyError::UnsupportedMediaType(_))
        ));
        assert!(matches!(
            binary(binary_headers(), Some("application/json"), b"{"),
            Err(BodyError::Malformed(_))
        ));
    }

    #[test]
    fn the_envelope_follows_the_content_type_then_the_ce_headers() {
        let select = Envelope::select;
        assert_eq!(
            select(Some("application/cloudevents+json"), true, None),
            Ok(Envelope::Body(BodyKind::CloudEvent))
        );
        assert_eq!(
            select(Some("application/json"), true, None),
            Ok(Envelope::Binary)
        );
        assert_eq!(select(None, true, None), Ok(Envelope::Binary));
        assert_eq!(
            select(Some("application/json"), false, None),
            Ok(Envelope::Body(BodyKind::Native))
        );
        assert_eq!(
            select(None, false, Some(BodyKind::Native)),
            Ok(Envelope::Body(BodyKind::Native))
        );
        assert!(select(None, false, None).is_err());
        assert!(select(Some("text/plain"), false, None).is_err());
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
