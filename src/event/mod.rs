//! The event: what producers send, and the rules an event must meet before the ledger takes
//! it (contract §2). Pure: no I/O, the clock is passed in.
//!
//! Flow: bytes → [`parse`] (native JSON, or CloudEvents through [`cloudevent`]) → [`Event`]
//! → ledger appender.

pub mod canonical;
pub mod cloudevent;
pub mod ids;
pub mod parse;
pub mod storable;

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, SubsecRound, Utc};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

pub use ids::{
    is_reserved_org, ContainerId, EventId, IdError, OrgId, PlanId, CORRECTIONS_ORG_ID, PLANS_ORG_ID,
};

use crate::error_code::ErrorCode;

/// How far ahead of the server clock an `occurred_at` may be: producers' clocks drift,
/// but an event from the future would let a caller pre-book runtime.
pub const FUTURE_SKEW_MAX_SECONDS: i64 = 5 * 60;

/// Longest `container.created` name, in characters (contract §2).
pub const CONTAINER_NAME_LENGTH_MAX: usize = 128;
/// Longest `container.created` image reference, in characters (contract §2).
pub const IMAGE_LENGTH_MAX: usize = 256;
/// Longest `command_id`, in characters (contract §2).
pub const COMMAND_ID_LENGTH_MAX: usize = 128;
/// Longest published-port URL, in bytes (contract §2).
pub const URL_LENGTH_MAX: usize = 2048;
/// Longest command duration we accept: a year. No command outlives a billing year, and
/// the bound keeps every sum of durations far inside `i64` milliseconds.
pub const COMMAND_DURATION_MAX_MS: u64 = 366 * 24 * 60 * 60 * 1000;

/// The eight kinds of event of contract §2. Names are past tense: each records a fact.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    ContainerCreated,
    ContainerCommandRan,
    ContainerStopped,
    ContainerResumed,
    ContainerPortPublished,
    OrgPlanChanged,
    OrgVerificationChanged,
    OrgBillingEligibilityChanged,
    /// A plan version, appended by `PUT /v1/plans/{id}` only; producers cannot send it.
    PlanDefined,
    /// An admin's void of an earlier event (`POST /v1/corrections/voids`).
    LedgerEventVoided,
    /// An admin's record of events added outside the producers' path, beyond the backdate
    /// bound (`POST /v1/corrections/events`): who, why, which ids.
    LedgerEventsAdded,
}

impl EventType {
    pub const ALL: [EventType; 11] = [
        EventType::ContainerCreated,
        EventType::ContainerCommandRan,
        EventType::ContainerStopped,
        EventType::ContainerResumed,
        EventType::ContainerPortPublished,
        EventType::OrgPlanChanged,
        EventType::OrgVerificationChanged,
        EventType::OrgBillingEligibilityChanged,
        EventType::PlanDefined,
        EventType::LedgerEventVoided,
        EventType::LedgerEventsAdded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            EventType::ContainerCreated => "container.created",
            EventType::ContainerCommandRan => "container.command_ran",
            EventType::ContainerStopped => "container.stopped",
            EventType::ContainerResumed => "container.resumed",
            EventType::ContainerPortPublished => "container.port_published",
            EventType::OrgPlanChanged => "org.plan_changed",
            EventType::OrgVerificationChanged => "org.verification_changed",
            EventType::OrgBillingEligibilityChanged => "org.billing_eligibility_changed",
            EventType::PlanDefined => "plan.defined",
            EventType::LedgerEventVoided => "ledger.event_voided",
            EventType::LedgerEventsAdded => "ledger.events_added",
        }
    }

    pub fn parse(value: &str) -> Option<EventType> {
        EventType::ALL.into_iter().find(|t| t.as_str() == value)
    }

    /// Container events name their container; org events must not.
    pub fn is_container_event(self) -> bool {
        self.as_str().starts_with("container.")
    }
}

/// Why a producer stopped a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StopReason {
    User,
    Idle,
    Admin,
    Provider,
}

/// The type-specific payload, already checked against its schema.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum EventData {
    ContainerCreated(ContainerCreated),
    ContainerCommandRan(ContainerCommandRan),
    ContainerStopped(ContainerStopped),
    ContainerResumed(ContainerResumed),
    ContainerPortPublished(ContainerPortPublished),
    OrgPlanChanged(OrgPlanChanged),
    OrgVerificationChanged(OrgVerificationChanged),
    OrgBillingEligibilityChanged(OrgBillingEligibilityChanged),
    /// The plan's definition, as [`crate::billing::Plan::to_data`] writes it.
    PlanDefined(serde_json::Value),
    /// A correction's record (`ledger.*` types), as the corrections API writes it.
    Correction(serde_json::Value),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerCreated {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerCommandRan {
    pub command_id: String,
    pub exit_code: i32,
    pub duration_ms: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timed_out: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerStopped {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<StopReason>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerResumed {}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerPortPublished {
    pub port: u16,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrgPlanChanged {
    pub plan: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrgVerificationChanged {
    pub verified: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrgBillingEligibilityChanged {
    pub eligible: bool,
}

/// Where a CloudEvent came from: kept for audit, since its ledger id is derived from them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloudEventOrigin {
    pub source: String,
    pub id: String,
    /// `datacontenttype`, `dataschema` and extension attributes (such as `traceparent`), as
    /// text: kept for audit and covered by the hash chain, but not part of the event's
    /// content, so that a retry through other middleware is still a duplicate (decision
    /// 0023). Empty when the event carried none.
    pub attributes: BTreeMap<String, String>,
}

impl CloudEventOrigin {
    /// The kept attributes as the ledger stores them: a JSON object of strings, or `None`
    /// when there are none (so that such a record's bytes are those of decision 0001).
    pub fn attributes_json(&self) -> Option<serde_json::Value> {
        (!self.attributes.is_empty()).then(|| {
            serde_json::Value::Object(
                self.attributes
                    .iter()
                    .map(|(name, value)| (name.clone(), serde_json::Value::String(value.clone())))
                    .collect(),
            )
        })
    }
}

/// A valid event, ready for the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: EventId,
    pub event_type: EventType,
    pub org_id: OrgId,
    pub container_id: Option<ContainerId>,
    /// Truncated to milliseconds.
    pub occurred_at: DateTime<Utc>,
    pub data: EventData,
    pub origin: Option<CloudEventOrigin>,
}

impl Event {
    /// The payload as the ledger stores it: only the fields that were given.
    pub fn data_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.data).expect("event data always serializes")
    }

    /// The fields the canonical encoding covers; `data` is [`Event::data_json`]. Without the
    /// kept attributes, which are not content: the writer of a record adds them
    /// (`ledger::rows`).
    pub fn record_fields<'a>(&'a self, data: &'a serde_json::Value) -> canonical::RecordFields<'a> {
        canonical::RecordFields {
            id: self.id.as_uuid(),
            event_type: self.event_type.as_str(),
            org_id: self.org_id.as_str(),
            container_id: self.container_id.as_ref().map(|c| c.as_str()),
            occurred_at: self.occurred_at,
            data,
            origin_source: self.origin.as_ref().map(|o| o.source.as_str()),
            origin_id: self.origin.as_ref().map(|o| o.id.as_str()),
            attributes: None,
        }
    }
}

/// A rejected event: a stable `code` for machines and a message for people.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct EventError {
    pub code: ErrorCode,
    pub message: String,
}

impl EventError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

/// How far back an event added by the admin correction flow may go: the ledger's useful
/// past, not the producers' bound.
pub const CORRECTION_BACKDATE_DAYS: i64 = 3_660;

/// Clock and bounds that decide whether a timestamp is acceptable.
#[derive(Debug, Clone, Copy)]
pub struct TimeBounds {
    pub now: DateTime<Utc>,
    /// Events older than this are refused (outside the admin correction flow).
    pub backdate_max: Duration,
}

/// The fields every event has, before they are checked (the native and CloudEvents
/// envelopes both reduce to this).
pub struct Unchecked<'a> {
    pub id: EventId,
    pub event_type: &'a str,
    pub org_id: &'a str,
    pub container_id: Option<&'a str>,
    pub occurred_at: &'a str,
    pub data: Option<&'a RawValue>,
    pub origin: Option<CloudEventOrigin>,
    /// Field names as this envelope spells them, so that errors point at what was sent.
    pub names: FieldNames,
}

#[derive(Debug, Clone, Copy)]
pub struct FieldNames {
    pub org_id: &'static str,
    pub container_id: &'static str,
    pub occurred_at: &'static str,
}

impl Unchecked<'_> {
    /// Applies every rule of contract §2 and returns the event as the ledger will store it.
    pub fn check(self, bounds: TimeBounds) -> Result<Event, EventError> {
        let names = self.names;
        let event_type = EventType::parse(self.event_type).ok_or_else(|| {
            EventError::new(
                ErrorCode::UnknownType,
                format!("unknown event type {:?}", self.event_type),
            )
        })?;
        let org_id = OrgId::parse_unreserved(self.org_id)
            .map_err(|e| EventError::new(e.org_code(), format!("{}: {e}", names.org_id)))?;
        let container_id = match (event_type.is_container_event(), self.container_id) {
            (true, None) => {
                return Err(EventError::new(
                    ErrorCode::MissingContainerId,
                    format!(
                        "{}: is required for {}",
                        names.container_id,
                        event_type.as_str()
                    ),
                ))
            }
            (true, Some(raw)) => Some(ContainerId::parse(raw).map_err(|e| {
                EventError::new(
                    ErrorCode::InvalidContainerId,
                    format!("{}: {e}", names.container_id),
                )
            })?),
            (false, Some(_)) => {
                return Err(EventError::new(
                    ErrorCode::UnexpectedContainerId,
                    format!(
                        "{}: must be absent for {}",
                        names.container_id,
                        event_type.as_str()
                    ),
                ))
            }
            (false, None) => None,
        };
        let occurred_at = check_occurred_at(self.occurred_at, names.occurred_at, bounds)?;
        let data = check_data(event_type, self.data)?;
        Ok(Event {
            id: self.id,
            event_type,
            org_id,
            container_id,
            occurred_at,
            data,
            origin: self.origin,
        })
    }
}

fn check_occurred_at(
    value: &str,
    field: &str,
    bounds: TimeBounds,
) -> Result<DateTime<Utc>, EventError> {
    let parsed = storable::parse_instant(value).map_err(|error| {
        EventError::new(
            error.code_or(ErrorCode::InvalidTimestamp),
            format!("{field}: {error}"),
        )
    })?;
    let occurred_at = parsed.trunc_subsecs(3);
    if occurred_at > bounds.now + Duration::seconds(FUTURE_SKEW_MAX_SECONDS) {
        return Err(EventError::new(
            ErrorCode::OccurredAtInFuture,
            format!(
                "{field}: {value} is more than {FUTURE_SKEW_MAX_SECONDS} s ahead of the server clock"
            ),
        ));
    }
    if occurred_at < bounds.now - bounds.backdate_max {
        // The way past the producers' bound, unless this is it.
        let past = if bounds.backdate_max < Duration::days(CORRECTION_BACKDATE_DAYS) {
            "; use the admin correction flow"
        } else {
            ""
        };
        return Err(EventError::new(
            ErrorCode::OccurredAtTooOld,
            format!(
                "{field}: {value} is older than the backdate bound of {} days{past}",
                bounds.backdate_max.num_days()
            ),
        ));
    }
    Ok(occurred_at)
}

/// Serde's messages already name the field and the problem; the code says which kind.
fn data_error(error: serde_json::Error) -> EventError {
    let message = error.to_string();
    let code = if message.starts_with("unknown field") {
        ErrorCode::UnknownField
    } else if message.starts_with("missing field") {
        ErrorCode::MissingField
    } else if message.starts_with("duplicate field") {
        ErrorCode::DuplicateField
    } else {
        ErrorCode::InvalidData
    };
    EventError::new(code, format!("data: {message}"))
}

fn parse_data<T: for<'de> Deserialize<'de>>(raw: Option<&RawValue>) -> Result<T, EventError> {
    // Absent and `null` both mean "no data" (a `null` member equals an absent one, as
    // everywhere in tally's bodies and in the CloudEvents JSON format). Anything else must
    // be an object: serde would read an array into the struct by position.
    let text = match raw.map(|raw| raw.get().trim_start()) {
        None | Some("null") => "{}",
        Some(text) if text.starts_with('{') => text,
        Some(_) => {
            return Err(EventError::new(
                ErrorCode::InvalidData,
                "data: must be a JSON object (or absent)",
            ))
        }
    };
    serde_json::from_str(text).map_err(data_error)
}

/// A text field of `data` that Postgres must store as it was hashed.
fn check_storable(field: &str, value: &str) -> Result<(), EventError> {
    if storable::is_storable(value) {
        return Ok(());
    }
    Err(EventError::new(
        storable::UNSTORABLE_TEXT,
        storable::unstorable_message(&format!("data.{field}")),
    ))
}

/// A text field of `data`: storable, and at most `max` characters.
fn check_text(field: &str, value: &str, max: usize) -> Result<(), EventError> {
    check_storable(field, value)?;
    let length = value.chars().count();
    if length > max {
        return Err(EventError::new(
            ErrorCode::InvalidData,
            format!("data.{field}: must be at most {max} characters, got {length}"),
        ));
    }
    Ok(())
}

fn check_data(event_type: EventType, raw: Option<&RawValue>) -> Result<EventData, EventError> {
    Ok(match event_type {
        EventType::ContainerCreated => {
            let data: ContainerCreated = parse_data(raw)?;
            if let Some(name) = &data.name {
                check_text("name", name, CONTAINER_NAME_LENGTH_MAX)?;
            }
            if let Some(image) = &data.image {
                check_text("image", image, IMAGE_LENGTH_MAX)?;
            }
            EventData::ContainerCreated(data)
        }
        EventType::ContainerCommandRan => {
            let data: ContainerCommandRan = parse_data(raw)?;
            check_text("command_id", &data.command_id, COMMAND_ID_LENGTH_MAX)?;
            if data.command_id.is_empty() {
                return Err(EventError::new(
                    ErrorCode::InvalidData,
                    "data.command_id: must not be empty",
                ));
            }
            if data.duration_ms > COMMAND_DURATION_MAX_MS {
                return Err(EventError::new(
                    ErrorCode::InvalidData,
                    format!("data.duration_ms: must be at most {COMMAND_DURATION_MAX_MS}"),
                ));
            }
            EventData::ContainerCommandRan(data)
        }
        EventType::ContainerStopped => EventData::ContainerStopped(parse_data(raw)?),
        EventType::ContainerResumed => EventData::ContainerResumed(parse_data(raw)?),
        EventType::ContainerPortPublished => {
            let data: ContainerPortPublished = parse_data(raw)?;
            if data.port == 0 {
                return Err(EventError::new(
                    ErrorCode::InvalidData,
                    "data.port: must be between 1 and 65535",
                ));
            }
            if let Some(url) = &data.url {
                check_url(url)?;
            }
            EventData::ContainerPortPublished(data)
        }
        EventType::OrgPlanChanged => {
            let data: OrgPlanChanged = parse_data(raw)?;
            check_storable("plan", &data.plan)?;
            PlanId::parse(&data.plan)
                .map_err(|e| EventError::new(ErrorCode::InvalidData, format!("data.plan: {e}")))?;
            EventData::OrgPlanChanged(data)
        }
        EventType::OrgVerificationChanged => EventData::OrgVerificationChanged(parse_data(raw)?),
        EventType::OrgBillingEligibilityChanged => {
            EventData::OrgBillingEligibilityChanged(parse_data(raw)?)
        }
        EventType::PlanDefined => {
            return Err(EventError::new(
                ErrorCode::ReservedType,
                "plan.defined is recorded by PUT /v1/plans/{plan_id}, not sent as an event",
            ))
        }
        EventType::LedgerEventVoided | EventType::LedgerEventsAdded => {
            return Err(EventError::new(
                ErrorCode::ReservedType,
                "ledger.* events are recorded by the corrections API, not sent as events",
            ))
        }
    })
}

fn check_url(value: &str) -> Result<(), EventError> {
    check_storable("url", value)?;
    if value.len() > URL_LENGTH_MAX {
        return Err(EventError::new(
            ErrorCode::InvalidData,
            format!("data.url: must be at most {URL_LENGTH_MAX} bytes"),
        ));
    }
    // The parser drops tabs and line breaks and keeps the rest, while the ledger keeps the
    // text as sent: what is stored must be what was checked, and what a console shows. So
    // printable ASCII only, which no whitespace, control or invisible character is; a host
    // of other letters goes in punycode and anything else percent-encoded.
    if !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(EventError::new(
            ErrorCode::InvalidData,
            "data.url: must be printable ASCII (no whitespace or control characters; a host in \
             punycode, other characters percent-encoded)",
        ));
    }
    let url = url::Url::parse(value)
        .map_err(|e| EventError::new(ErrorCode::InvalidData, format!("data.url: {e}")))?;
    if url.scheme() != "https" || url.host().is_none() {
        return Err(EventError::new(
            ErrorCode::InvalidData,
            "data.url: must be an https URL with a host",
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(EventError::new(
            ErrorCode::InvalidData,
            "data.url: must not carry a user name or password",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_name_round_trips() {
        for event_type in EventType::ALL {
            assert_eq!(EventType::parse(event_type.as_str()), Some(event_type));
        }
        assert_eq!(EventType::parse("container.deleted"), None);
    }

    #[test]
    fn data_serializes_only_the_given_fields() {
        let data = EventData::ContainerCommandRan(ContainerCommandRan {
            command_id: "c1".into(),
            exit_code: -1,
            duration_ms: 5,
            timed_out: None,
        });
        assert_eq!(
            serde_json::to_string(&data).unwrap(),
            r#"{"command_id":"c1","exit_code":-1,"duration_ms":5}"#
        );
        let resumed = EventData::ContainerResumed(ContainerResumed {});
        assert_eq!(serde_json::to_string(&resumed).unwrap(), "{}");
    }
}
