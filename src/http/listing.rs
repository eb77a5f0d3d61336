//! The query values every list reads the same way: a page size within its bounds
//! and a cursor naming the last row of the page before (`after`), each refused with its
//! own code.

use uuid::Uuid;

use super::error::ApiError;
use crate::error_code::ErrorCode;

/// A whole number written as digits only: `+5`, ` 5` or `5.0` are not one, though Rust's
/// parsers take the first.
pub(super) fn whole_number<T: std::str::FromStr>(text: &str) -> Option<T> {
    let digits = !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit());
    digits.then(|| text.parse().ok()).flatten()
}

/// How many rows a page holds: from 1 to `max`, `default` unless given; past its bounds
/// 422 `invalid_limit`.
pub(super) fn limit(value: Option<&str>, default: usize, max: usize) -> Result<usize, ApiError> {
    match value {
        None => Ok(default.min(max)),
        Some(value) => whole_number::<usize>(value)
            .filter(|limit| (1..=max).contains(limit))
            .ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidLimit,
                    format!("limit: must be a whole number from 1 to {max}"),
                )
            }),
    }
}

/// The id a keyset page starts after (the page before's `next_after`); not a UUID is 422
/// `invalid_after`.
pub(super) fn after_id(value: Option<&str>) -> Result<Option<Uuid>, ApiError> {
    value
        .map(|value| {
            Uuid::try_parse(value).map_err(|_| {
                ApiError::invalid(
                    ErrorCode::InvalidAfter,
                    "after: must be the id the page before gave as next_after",
                )
            })
        })
        .transpose()
}

/// 422 `invalid_after` for a cursor naming no row: a page cannot start after it.
pub(super) fn unknown_after(id: Uuid) -> ApiError {
    ApiError::invalid(
        ErrorCode::InvalidAfter,
        format!("after: {id} names nothing in this list"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_limit_outside_its_bounds_is_refused_and_absent_is_the_default() {
        assert_eq!(limit(None, 24, 120).unwrap(), 24);
        assert_eq!(limit(Some("120"), 24, 120).unwrap(), 120);
        assert_eq!(limit(Some("1"), 24, 120).unwrap(), 1);
        for bad in ["0", "121", "-1", "ten", ""] {
            assert_eq!(
                limit(Some(bad), 24, 120).unwrap_err().code.as_str(),
                "invalid_limit",
                "{bad:?}"
            );
        }
    }
}
