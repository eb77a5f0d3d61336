//! Identifiers that appear in events: parsed once at the edge, valid from then on.
//!
//! Organization, container and plan ids travel into NATS subjects (`tally.ledger.<org_id>.…`)
//! and CSV exports, so the alphabet is kept to `[A-Za-z0-9_-]`: no dots, spaces, wildcards
//! or quotes can ever reach a subject or a cell.

use std::fmt;

use uuid::Uuid;

use crate::error_code::ErrorCode;

/// The longest org, container or plan id we accept, in characters.
/// Long enough for any provider's resource ids; short enough to keep NATS subjects small.
pub const NAME_LENGTH_MAX: usize = 64;

/// Why an identifier was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    #[error("must not be empty")]
    Empty,
    #[error("must be at most {NAME_LENGTH_MAX} characters, got {0}")]
    TooLong(usize),
    #[error("may only contain A-Z, a-z, 0-9, '_' and '-', found {0:?}")]
    BadCharacter(char),
    #[error("must be a hyphenated UUID such as 0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55")]
    NotUuid,
    #[error("must not be the nil UUID")]
    NilUuid,
    #[error("{0} is reserved: tally records its own plan versions and corrections under it")]
    Reserved(String),
}

impl IdError {
    /// The code of an org id refused for this: `reserved_org_id` or `invalid_org_id`.
    pub fn org_code(&self) -> ErrorCode {
        match self {
            IdError::Reserved(_) => ErrorCode::ReservedOrgId,
            _ => ErrorCode::InvalidOrgId,
        }
    }
}

fn check_name(value: &str) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty);
    }
    let length = value.chars().count();
    if length > NAME_LENGTH_MAX {
        return Err(IdError::TooLong(length));
    }
    match value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        Some(bad) => Err(IdError::BadCharacter(bad)),
        None => Ok(()),
    }
}

macro_rules! name_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            pub fn parse(value: &str) -> Result<Self, IdError> {
                check_name(value)?;
                Ok(Self(value.to_owned()))
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

name_id!(
    /// The organization an event belongs to; the unit of billing.
    OrgId
);

/// The org id `plan.defined` events are recorded under: plans belong to no org.
pub const PLANS_ORG_ID: &str = "_plans";
/// The org id `ledger.events_added` records go under: a correction may span orgs.
pub const CORRECTIONS_ORG_ID: &str = "_corrections";

/// Whether tally records its own events under `org_id` ([`PLANS_ORG_ID`],
/// [`CORRECTIONS_ORG_ID`]): no producer's event, token or report tag may name it.
pub fn is_reserved_org(org_id: &str) -> bool {
    [PLANS_ORG_ID, CORRECTIONS_ORG_ID].contains(&org_id)
}

impl OrgId {
    /// An org id a caller names: a valid one that is not reserved ([`is_reserved_org`]).
    pub fn parse_unreserved(value: &str) -> Result<OrgId, IdError> {
        let org = OrgId::parse(value)?;
        if is_reserved_org(org.as_str()) {
            return Err(IdError::Reserved(value.to_owned()));
        }
        Ok(org)
    }
}
name_id!(
    /// A sandbox container, as the container provider names it.
    ContainerId
);
name_id!(
    /// A plan, such as `free`.
    PlanId
);

/// The producer-chosen idempotency key of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(Uuid);

impl EventId {
    /// Accepts only the hyphenated form, so that one id has one spelling in the ledger,
    /// in `Nats-Msg-Id` headers and in audit queries.
    pub fn parse(value: &str) -> Result<Self, IdError> {
        if value.len() != 36 {
            return Err(IdError::NotUuid);
        }
        let uuid = Uuid::try_parse(value).map_err(|_| IdError::NotUuid)?;
        Self::from_uuid(uuid)
    }

    pub fn from_uuid(uuid: Uuid) -> Result<Self, IdError> {
        if uuid.is_nil() {
            return Err(IdError::NilUuid);
        }
        Ok(Self(uuid))
    }

    pub fn as_uuid(&self) -> Uuid {
        self.0
    }

    /// Whether the id is name-based (UUID version 5): what a CloudEvent's ledger id is
    /// (`cloudevent::ledger_id`), and what anyone who knows an org, a source and an id can
    /// compute.
    pub fn is_name_based(&self) -> bool {
        self.0.get_version_num() == 5
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_accept_the_safe_alphabet_up_to_sixty_four_characters() {
        assert!(OrgId::parse("org_8f2k").is_ok());
        assert!(ContainerId::parse("ctr-51x_A").is_ok());
        assert!(OrgId::parse(&"a".repeat(64)).is_ok());
    }

    #[test]
    fn a_callers_org_id_may_not_be_one_tally_records_its_own_events_under() {
        for reserved in [PLANS_ORG_ID, CORRECTIONS_ORG_ID] {
            let refused = OrgId::parse_unreserved(reserved).unwrap_err();
            assert_eq!(refused, IdError::Reserved(reserved.to_owned()));
            assert_eq!(refused.org_code(), ErrorCode::ReservedOrgId);
            assert!(
                OrgId::parse(reserved).is_ok(),
                "tally itself still names it"
            );
        }
        assert!(OrgId::parse_unreserved("_plans2").is_ok());
        assert_eq!(
            OrgId::parse_unreserved("a b").unwrap_err().org_code(),
            ErrorCode::InvalidOrgId
        );
    }

    #[test]
    fn names_reject_empty_long_and_unsafe_values() {
        let cases = [
            ("", IdError::Empty),
            (&"a".repeat(65)[..], IdError::TooLong(65)),
            ("org.1", IdError::BadCharacter('.')),
            ("org 1", IdError::BadCharacter(' ')),
            ("org*", IdError::BadCharacter('*')),
            ("org>", IdError::BadCharacter('>')),
            ("orgé", IdError::BadCharacter('é')),
            ("org,1", IdError::BadCharacter(',')),
        ];
        for (input, expected) in cases {
            assert_eq!(OrgId::parse(input), Err(expected), "input {input:?}");
        }
    }

    #[test]
    fn event_ids_must_be_hyphenated_non_nil_uuids() {
        assert!(EventId::parse("0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55").is_ok());
        assert_eq!(
            EventId::parse("0193a5f07c1e7d2a9b1e2f0c6a1d4e55"),
            Err(IdError::NotUuid)
        );
        assert_eq!(
            EventId::parse("{0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e5}"),
            Err(IdError::NotUuid)
        );
        assert_eq!(
            EventId::parse("00000000-0000-0000-0000-000000000000"),
            Err(IdError::NilUuid)
        );
        assert_eq!(EventId::parse("not-a-uuid"), Err(IdError::NotUuid));
    }

    #[test]
    fn event_ids_print_in_lowercase_hyphenated_form() {
        let id = EventId::parse("0193A5F0-7C1E-7D2A-9B1E-2F0C6A1D4E55").unwrap();
        assert_eq!(id.to_string(), "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55");
    }
}
