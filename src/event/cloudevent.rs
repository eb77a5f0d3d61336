//! CloudEvents 1.0 → events, in both ways a CloudEvent travels: *structured* (the event is a
//! JSON object, attributes and `data` as members) and *binary* (attributes in `ce-`
//! headers, the body is `data`). Both reduce to one set of attributes as text, which
//! [`check`] maps onto the ledger's fields (contract §2; decision 0023). Pure.
//!
//! Mapped: `specversion` (must be `1.0`), `id` and `source` (the event's origin and, with
//! `orgid`, its ledger id), `type`, `time` → `occurred_at`, `subject` → `container_id`,
//! `orgid` → `org_id`. Kept for audit, outside the event's identity: `datacontenttype`,
//! `dataschema` and every extension attribute, within the limits below.

use std::collections::BTreeMap;

use serde::de::{self, MapAccess, Visitor};
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

/// Longest extension attribute name, in characters: the spec recommends 20 so that every
/// protocol binding can carry the name; tally makes it the rule, since every name is
/// stored with its event for ever.
pub const EXTENSION_NAME_LENGTH_MAX: usize = 20;
/// Most attributes kept for audit per event (`datacontenttype`, `dataschema` and
/// extensions together). Tracing adds two; sixteen leaves room for any middleware chain
/// while bounding what a producer can make the ledger keep.
pub const KEPT_ATTRIBUTES_MAX: usize = 16;
/// Most bytes of the attributes kept for audit per event, names and values together. A
/// W3C `tracestate` is at most 512 characters in practice; 4 KiB bounds the ledger's
/// growth per event to a few times its usual size.
pub const KEPT_ATTRIBUTES_MAX_BYTES: usize = 4096;

/// The attributes tally maps onto ledger fields; all are strings.
const MAPPED: [&str; 7] = [
    "specversion",
    "id",
    "source",
    "type",
    "time",
    "subject",
    "orgid",
];
/// The optional attributes of the spec that tally keeps for audit; strings too.
const KEPT_STRINGS: [&str; 2] = ["datacontenttype", "dataschema"];

const NAMES: FieldNames = FieldNames {
    org_id: "orgid",
    container_id: "subject",
    occurred_at: "time",
};
const BINARY_NAMES: FieldNames = FieldNames {
    org_id: "ce-orgid",
    container_id: "ce-subject",
    occurred_at: "ce-time",
};

/// How a CloudEvent arrived; errors name attributes as the producer spelled them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Structured,
    Binary,
}

impl Mode {
    fn name(self, attribute: &str) -> String {
        match self {
            Mode::Structured => attribute.to_owned(),
            Mode::Binary => format!("ce-{attribute}"),
        }
    }
}

/// A CloudEvent's attributes as text, not yet checked: names lower case, values as the
/// spec's string form of their type.
#[derive(Debug, Default)]
pub struct Attributes {
    values: BTreeMap<String, String>,
}

impl Attributes {
    /// Adds one attribute; a name given twice is refused rather than one copy dropped.
    fn insert(&mut self, name: String, value: String, mode: Mode) -> Result<(), EventError> {
        if self.values.contains_key(&name) {
            return Err(EventError::new(
                ErrorCode::DuplicateField,
                format!("{}: given twice", mode.name(&name)),
            ));
        }
        self.values.insert(name, value);
        Ok(())
    }

    fn take_required(&mut self, name: &str, mode: Mode) -> Result<String, EventError> {
        self.values.remove(name).ok_or_else(|| {
            EventError::new(
                ErrorCode::MissingField,
                format!("{}: is required", mode.name(name)),
            )
        })
    }
}

/// The members of a structured CloudEvent, in order, each as raw JSON. Deserialized by
/// hand so that a member given twice is an error, as everywhere else in tally.
struct Members<'a>(Vec<(String, &'a RawValue)>);

impl<'de: 'a, 'a> Deserialize<'de> for Members<'a> {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MembersVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for MembersVisitor<'a> {
            type Value = Members<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a CloudEvent object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Members<'a>, M::Error> {
                let mut members: Vec<(String, &'a RawValue)> = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if members.iter().any(|(seen, _)| *seen == name) {
                        return Err(de::Error::custom(format!("duplicate field `{name}`")));
                    }
                    let value = map.next_value::<&'a RawValue>()?;
                    members.push((name, value));
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(MembersVisitor(std::marker::PhantomData))
    }
}

/// One structured CloudEvent (a JSON object) → its event.
pub fn parse_structured(text: &str, bounds: TimeBounds) -> Result<Event, EventError> {
    let members: Members = serde_json::from_str(text).map_err(|error| {
        let message = error.to_string();
        let code = if message.starts_with("duplicate field") {
            ErrorCode::DuplicateField
        } else {
            ErrorCode::InvalidEvent
        };
        EventError::new(code, message)
    })?;
    let mut attributes = Attributes::default();
    let mut data = None;
    for (name, raw) in members.0 {
        if name == "data" {
            data = Some(raw);
            continue;
        }
        if name == "data_base64" {
            return Err(EventError::new(
                ErrorCode::InvalidCloudevent,
                "data_base64: binary data is not supported; send data as JSON",
            ));
        }
        if let Some(value) = structured_value(&name, raw)? {
            attributes.insert(name, value, Mode::Structured)?;
        }
    }
    check(attributes, data, Mode::Structured, bounds)
}

/// A structured member's value as attribute text; `None` for `null`, which the JSON format
/// reads as absent. The mapped and kept attributes of the spec are strings; an extension
/// may also be a boolean or an integer, kept in the spec's string form of those types.
fn structured_value(name: &str, raw: &RawValue) -> Result<Option<String>, EventError> {
    let value: serde_json::Value = serde_json::from_str(raw.get())
        .map_err(|e| EventError::new(ErrorCode::InvalidEvent, format!("{name}: {e}")))?;
    let string_only = MAPPED.contains(&name) || KEPT_STRINGS.contains(&name);
    match value {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(text) => Ok(Some(text)),
        serde_json::Value::Bool(flag) if !string_only => Ok(Some(flag.to_string())),
        // The spec's Integer is 32-bit; a float is no CloudEvents type.
        serde_json::Value::Number(number) if !string_only => number
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .map(|n| Some(n.to_string()))
            .ok_or_else(|| {
                EventError::new(
                    ErrorCode::InvalidExtension,
                    format!("{name}: an extension number must be a 32-bit integer"),
                )
            }),
        _ if string_only => Err(EventError::new(
            ErrorCode::InvalidCloudevent,
            format!("{name}: must be a string"),
        )),
        _ => Err(EventError::new(
            ErrorCode::InvalidExtension,
            format!("{name}: an extension must be a string, a boolean or an integer"),
        )),
    }
}

/// The `ce-` headers of a binary-mode CloudEvent → its attributes. `headers` holds every
/// header of the request or message, names in any case (HTTP and NATS header names are
/// case-insensitive); values are percent-decoded as the HTTP binding says. `content_type`
/// (the data's media type) becomes `datacontenttype`.
pub fn binary_attributes<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    content_type: Option<&str>,
) -> Result<Attributes, EventError> {
    let mut attributes = Attributes::default();
    for (header, value) in headers {
        let Some(name) = ce_attribute_name(header) else {
            continue;
        };
        let shown = format!("ce-{name}");
        if name == "datacontenttype" {
            return Err(EventError::new(
                ErrorCode::InvalidCloudevent,
                "ce-datacontenttype: binary mode carries the data's type as Content-Type",
            ));
        }
        // `data` names the event's data in every format, never an attribute: kept as one, it
        // would sit in the audit beside the body it contradicts.
        if name == "data" {
            return Err(EventError::new(
                ErrorCode::InvalidCloudevent,
                "ce-data: binary mode carries the data as the body",
            ));
        }
        let decoded = percent_decode(value).map_err(|why| {
            EventError::new(ErrorCode::InvalidCloudevent, format!("{shown}: {why}"))
        })?;
        attributes.insert(name, decoded, Mode::Binary)?;
    }
    if let Some(content_type) = content_type {
        attributes.insert(
            "datacontenttype".to_owned(),
            content_type.to_owned(),
            Mode::Binary,
        )?;
    }
    Ok(attributes)
}

/// The attribute a header carries, lower-cased, when the header is a `ce-` one.
pub fn ce_attribute_name(header: &str) -> Option<String> {
    let prefix = header.get(..3)?;
    prefix
        .eq_ignore_ascii_case("ce-")
        .then(|| header[3..].to_ascii_lowercase())
}

/// Whether any header is a `ce-` one: such a request or message is a binary-mode CloudEvent.
pub fn has_ce_header<'a>(mut names: impl Iterator<Item = &'a str>) -> bool {
    names.any(|name| ce_attribute_name(name).is_some())
}

/// Decodes `%XX` sequences; the result must be UTF-8. A `%` not followed by two hex digits
/// is refused rather than guessed at.
fn percent_decode(value: &[u8]) -> Result<String, String> {
    let mut out = Vec::with_capacity(value.len());
    let mut rest = value;
    while let Some((&byte, tail)) = rest.split_first() {
        if byte != b'%' {
            out.push(byte);
            rest = tail;
            continue;
        }
        let hex = tail
            .get(..2)
            .and_then(|pair| std::str::from_utf8(pair).ok())
            .and_then(|pair| u8::from_str_radix(pair, 16).ok())
            .ok_or("a % must be followed by two hex digits")?;
        out.push(hex);
        rest = &tail[2..];
    }
    String::from_utf8(out).map_err(|_| "is not UTF-8 once percent-decoded".to_owned())
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

/// Whether a media type is JSON (`application/json`, parameters such as `charset` ignored).
fn is_json_media_type(value: &str) -> bool {
    let essence = value.split(';').next().unwrap_or("").trim();
    essence.eq_ignore_ascii_case("application/json")
}

/// The attributes left once the mapped ones are taken: the ones kept for audit, checked
/// against the spec's naming rule and tally's limits.
fn check_kept(
    kept: BTreeMap<String, String>,
    mode: Mode,
) -> Result<BTreeMap<String, String>, EventError> {
    let mut bytes = 0;
    for (name, value) in &kept {
        let shown = mode.name(name);
        let well_formed = !name.is_empty()
            && name.len() <= EXTENSION_NAME_LENGTH_MAX
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        if !well_formed {
            return Err(EventError::new(
                ErrorCode::InvalidExtension,
                format!(
                    "{shown}: an extension attribute's name is 1 to {EXTENSION_NAME_LENGTH_MAX} lower-case letters or digits"
                ),
            ));
        }
        if !storable::is_storable(value) {
            return Err(EventError::new(
                storable::UNSTORABLE_TEXT,
                storable::unstorable_message(&shown),
            ));
        }
        bytes += name.len() + value.len();
    }
    if kept.len() > KEPT_ATTRIBUTES_MAX || bytes > KEPT_ATTRIBUTES_MAX_BYTES {
        return Err(EventError::new(
            ErrorCode::ExtensionsTooLarge,
            format!(
                "{} optional and extension attributes of {bytes} bytes; at most {KEPT_ATTRIBUTES_MAX} of {KEPT_ATTRIBUTES_MAX_BYTES} bytes (names and values) are kept",
                kept.len()
            ),
        ));
    }
    if let Some(content_type) = kept.get("datacontenttype") {
        if !is_json_media_type(content_type) {
            return Err(EventError::new(
                ErrorCode::InvalidCloudevent,
                format!(
                    "{}: only application/json is supported, got {content_type:?}",
                    mode.name("datacontenttype")
                ),
            ));
        }
    }
    Ok(kept)
}

/// Applies the CloudEvents rules, then those of every event (contract §2).
pub fn check(
    mut attributes: Attributes,
    data: Option<&RawValue>,
    mode: Mode,
    bounds: TimeBounds,
) -> Result<Event, EventError> {
    let specversion = attributes.take_required("specversion", mode)?;
    if specversion != "1.0" {
        return Err(EventError::new(
            ErrorCode::InvalidCloudevent,
            format!(
                "{}: only \"1.0\" is supported, got {specversion:?}",
                mode.name("specversion")
            ),
        ));
    }
    let id = attributes.take_required("id", mode)?;
    let source = attributes.take_required("source", mode)?;
    let event_type = attributes.take_required("type", mode)?;
    let time = attributes.take_required("time", mode)?;
    let org_id = attributes.take_required("orgid", mode)?;
    let subject = attributes.values.remove("subject");
    check_attribute(&mode.name("id"), &id, CLOUDEVENT_ID_LENGTH_MAX)?;
    check_attribute(&mode.name("source"), &source, CLOUDEVENT_SOURCE_LENGTH_MAX)?;
    // A URI reference never holds control characters; refusing them keeps
    // `source + "\n" + id` unambiguous.
    if source.chars().any(char::is_control) {
        return Err(EventError::new(
            ErrorCode::InvalidCloudevent,
            format!(
                "{}: must not contain control characters",
                mode.name("source")
            ),
        ));
    }
    let kept = check_kept(attributes.values, mode)?;
    Unchecked {
        id: cloudevent_ledger_id(&org_id, &source, &id),
        event_type: &event_type,
        org_id: &org_id,
        container_id: subject.as_deref(),
        occurred_at: &time,
        data,
        origin: Some(CloudEventOrigin {
            source,
            id,
            attributes: kept,
        }),
        names: match mode {
            Mode::Structured => NAMES,
            Mode::Binary => BINARY_NAMES,
        },
    }
    .check(bounds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding_follows_the_http_binding_and_refuses_broken_escapes() {
        assert_eq!(percent_decode(b"a%20b%25c").unwrap(), "a b%c");
        assert_eq!(percent_decode(b"caf%C3%A9").unwrap(), "café");
        assert_eq!(percent_decode(b"/plain/value").unwrap(), "/plain/value");
        assert!(percent_decode(b"50%").is_err());
        assert!(percent_decode(b"%zz").is_err());
        assert!(percent_decode(b"%C3").is_err());
    }

    #[test]
    fn ce_headers_are_recognised_in_any_case() {
        assert_eq!(ce_attribute_name("ce-id").as_deref(), Some("id"));
        assert_eq!(
            ce_attribute_name("Ce-TraceParent").as_deref(),
            Some("traceparent")
        );
        assert_eq!(ce_attribute_name("CE-SOURCE").as_deref(), Some("source"));
        assert_eq!(ce_attribute_name("content-type"), None);
        assert_eq!(ce_attribute_name("ce"), None);
        assert!(has_ce_header(["Accept", "CE-ID"].into_iter()));
        assert!(!has_ce_header(["Accept", "cert"].into_iter()));
    }
}
