//! What Postgres stores exactly as tally hashed it (contract §2: text anywhere in an event
//! must be storable as it was hashed). Every text and instant that enters tally — event
//! fields, request bodies, query parameters, report cells — is checked here before it can
//! reach the ledger or any table. Pure.
//!
//! Two things Postgres does not store as they were sent:
//! - **NUL** (`\u0000`): neither `text` nor `jsonb` can hold it; the insert fails, and with
//!   it the whole group commit the request joined. Refused as `unstorable_text`. (Unpaired
//!   surrogates, the other thing `jsonb` refuses, cannot exist in a Rust string: serde
//!   refuses them while parsing.)
//! - **A leap second** (`:60`): chrono keeps it as a nanosecond count past one billion and
//!   prints `:60`, so the hash covers `:60`; Postgres stores the next second, `:00`, and the
//!   chain recomputed from the stored row differs for ever. Refused as `leap_second`.

use chrono::{DateTime, Datelike, Timelike, Utc};

use crate::error_code::ErrorCode;

/// The code of a text with a NUL in it.
pub const UNSTORABLE_TEXT: ErrorCode = ErrorCode::UnstorableText;
/// The code of an instant at second 60.
pub const LEAP_SECOND: ErrorCode = ErrorCode::LeapSecond;

/// The first and last UTC years an instant may fall in: Postgres has no year 0 (its text
/// form refuses `0000`) and RFC 3339 has no year past 9999.
const YEAR_MIN: i32 = 1;
const YEAR_MAX: i32 = 9999;

/// Whether Postgres `text` and `jsonb` can hold `value` as it is.
pub fn is_storable(value: &str) -> bool {
    // `contains` on bytes is memchr: one vectorized scan of a string already in cache.
    !value.as_bytes().contains(&0)
}

/// What is wrong with a text that holds a NUL, for messages that name the field apart.
pub const UNSTORABLE_WHY: &str = "contains a NUL character (\\u0000), which Postgres cannot store";

/// The message for a field whose text holds a NUL.
pub fn unstorable_message(field: &str) -> String {
    format!("{field}: {UNSTORABLE_WHY}")
}

/// Why an instant was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InstantError {
    #[error("{value:?} is not an RFC 3339 time with an offset ({reason})")]
    Malformed { value: String, reason: String },
    #[error(
        "{value:?} is a leap second (:60), which Postgres stores as the next second, so it \
         could not be stored as it was hashed; send :59.999 or the next second instead"
    )]
    LeapSecond { value: String },
    #[error("{value:?} falls outside the years {YEAR_MIN:04} to {YEAR_MAX} in UTC")]
    YearOutOfRange { value: String },
}

impl InstantError {
    /// `leap_second` for a leap second; `otherwise` (the caller's code for a bad instant)
    /// for the rest.
    pub fn code_or(&self, otherwise: ErrorCode) -> ErrorCode {
        match self {
            InstantError::LeapSecond { .. } => LEAP_SECOND,
            InstantError::Malformed { .. } | InstantError::YearOutOfRange { .. } => otherwise,
        }
    }
}

/// Whether `instant` falls in the years an event's instant may have (0001 to 9999, UTC),
/// which Postgres and every period can hold.
pub fn in_event_years(instant: DateTime<Utc>) -> bool {
    (YEAR_MIN..=YEAR_MAX).contains(&instant.year())
}

/// An RFC 3339 instant with an offset, in UTC, refusing what Postgres would not give back
/// as it was sent: a leap second, and a year outside 0001–9999.
pub fn parse_instant(value: &str) -> Result<DateTime<Utc>, InstantError> {
    let parsed = DateTime::parse_from_rfc3339(value).map_err(|error| InstantError::Malformed {
        value: value.to_owned(),
        reason: error.to_string(),
    })?;
    // chrono represents second 60 as a nanosecond count of a second or more.
    if parsed.nanosecond() >= 1_000_000_000 {
        return Err(InstantError::LeapSecond {
            value: value.to_owned(),
        });
    }
    let instant = parsed.with_timezone(&Utc);
    if !in_event_years(instant) {
        return Err(InstantError::YearOutOfRange {
            value: value.to_owned(),
        });
    }
    Ok(instant)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nul_is_the_one_character_that_cannot_be_stored() {
        assert!(is_storable(""));
        assert!(is_storable("é \u{1} \u{7f} \u{2028} \u{fffe} 😀 \\u0000"));
        assert!(!is_storable("a\u{0}b"));
        assert!(!is_storable("\u{0}"));
    }

    #[test]
    fn a_leap_second_is_refused_at_any_offset_and_fraction() {
        for value in [
            "2026-12-01T06:59:60Z",
            "2026-12-01T06:59:60.000Z",
            "2026-12-01T06:59:60.500Z",
            "2026-12-01T07:59:60.999999999+01:00",
            "2026-06-30T23:59:60-00:00",
        ] {
            assert_eq!(
                parse_instant(value),
                Err(InstantError::LeapSecond {
                    value: value.to_owned()
                }),
                "{value}"
            );
        }
        assert_eq!(
            parse_instant("2026-12-01T06:59:60Z")
                .unwrap_err()
                .code_or(ErrorCode::InvalidTimestamp),
            LEAP_SECOND
        );
    }

    #[test]
    fn ordinary_instants_are_read_in_utc_with_their_fraction() {
        assert_eq!(
            parse_instant("2026-12-01T07:59:59.999999+01:00").unwrap(),
            "2026-12-01T06:59:59.999999Z"
                .parse::<DateTime<Utc>>()
                .unwrap()
        );
        assert_eq!(
            parse_instant("0001-01-01T00:00:00Z").unwrap().year(),
            YEAR_MIN
        );
    }

    #[test]
    fn years_postgres_cannot_write_back_are_refused() {
        for value in [
            "0000-11-01T00:00:00Z",
            "0001-01-01T00:30:00+01:00",
            "9999-12-31T23:00:00-05:00",
        ] {
            assert!(
                matches!(
                    parse_instant(value),
                    Err(InstantError::YearOutOfRange { .. })
                ),
                "{value}"
            );
        }
    }

    #[test]
    fn text_that_is_not_an_instant_is_malformed() {
        for value in [
            "2026-12-01T06:59:61Z",
            "2026-12-01T06:59:59",
            "yesterday",
            "",
        ] {
            assert!(
                matches!(parse_instant(value), Err(InstantError::Malformed { .. })),
                "{value}"
            );
        }
    }
}
