//! Plans (contract §4): what an org may run and what its runtime costs. Pure.
//!
//! A plan is defined or changed by `PUT /v1/plans/{id}`, which appends a `plan.defined`
//! event; each one is a new version, in effect from its `occurred_at`. Money is a
//! [`Decimal`] parsed from a decimal string with at most six decimal places: a JSON number
//! for a price is refused, so no binary float ever holds an amount.

use std::str::FromStr;

use rust_decimal::Decimal;
use serde::Serialize;
use serde_json::{Map, Value};

use crate::error_code::ErrorCode;
use crate::event::{EventError, PlanId};
use crate::runtime::FREE_PLAN;

/// Decimal places a price may have.
pub const PRICE_SCALE_MAX: u32 = 6;
/// The largest count limit a plan may set: far above any real plan, small enough that
/// every sum over it fits.
pub const LIMIT_MAX: u64 = 1_000_000;
/// The largest allowance: a century of runtime per period.
pub const INCLUDED_SECONDS_MAX: u64 = 100 * 366 * 86_400;
/// The largest hourly price: keeps every amount far inside `Decimal`'s range.
pub const PRICE_MAX: Decimal = Decimal::from_parts(1_000_000_000, 0, 0, false, 0);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Overage {
    /// Past the allowance, runtime is refused.
    Deny,
    /// Past the allowance, runtime is billed at the overage price.
    Bill,
}

/// One version of a plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    #[serde(serialize_with = "plan_id_string")]
    pub id: PlanId,
    pub sandbox_runtime: bool,
    pub included_runtime_seconds: u64,
    pub overage: Overage,
    #[serde(serialize_with = "decimal_string")]
    pub overage_price_per_hour: Decimal,
    /// ISO 4217: three upper-case letters.
    pub currency: String,
    pub max_running_containers: u64,
    pub max_published_ports: u64,
}

fn plan_id_string<S: serde::Serializer>(value: &PlanId, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(value.as_str())
}

fn decimal_string<S: serde::Serializer>(value: &Decimal, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(&value.normalize().to_string())
}

impl Plan {
    /// The plan every org starts on (contract §3, §4): no sandboxes, nothing included. It
    /// exists before any `plan.defined` event; defining `free` makes a new version of it.
    pub fn free() -> Plan {
        Plan {
            id: PlanId::parse(FREE_PLAN).expect("a valid plan id"),
            sandbox_runtime: false,
            included_runtime_seconds: 0,
            overage: Overage::Deny,
            overage_price_per_hour: Decimal::ZERO,
            currency: "USD".to_owned(),
            max_running_containers: 0,
            max_published_ports: 0,
        }
    }

    pub fn included_runtime_ms(&self) -> i64 {
        i64::try_from(self.included_runtime_seconds * 1000)
            .expect("bounded by INCLUDED_SECONDS_MAX")
    }

    /// Parses a plan definition (the body of `PUT /v1/plans/{id}`, or the `data` of a stored
    /// `plan.defined`, which also names the id). Every problem is reported, each with its
    /// own code, so a caller can fix a definition in one round.
    pub fn parse(id: &PlanId, body: &Value) -> Result<Plan, Vec<EventError>> {
        let Some(fields) = body.as_object() else {
            return Err(vec![EventError::new(
                ErrorCode::InvalidPlan,
                "a plan is a JSON object",
            )]);
        };
        let mut errors = unknown_fields(id, fields);
        let plan = Plan {
            id: id.clone(),
            sandbox_runtime: boolean(fields, "sandbox_runtime", &mut errors),
            included_runtime_seconds: count(
                fields,
                "included_runtime_seconds",
                INCLUDED_SECONDS_MAX,
                ErrorCode::InvalidAllowance,
                &mut errors,
            ),
            overage: overage(fields, &mut errors),
            overage_price_per_hour: price(fields, "overage_price_per_hour", &mut errors),
            currency: currency(fields, &mut errors),
            max_running_containers: count(
                fields,
                "max_running_containers",
                LIMIT_MAX,
                ErrorCode::InvalidLimit,
                &mut errors,
            ),
            max_published_ports: count(
                fields,
                "max_published_ports",
                LIMIT_MAX,
                ErrorCode::InvalidLimit,
                &mut errors,
            ),
        };
        if errors.is_empty() {
            Ok(plan)
        } else {
            Err(errors)
        }
    }

    /// The `data` of the `plan.defined` event that records this version.
    pub fn to_data(&self) -> Value {
        serde_json::to_value(self).expect("a plan serializes")
    }
}

/// The problems with a definition's field names: fields a plan does not have, and an `id`
/// other than the plan's.
fn unknown_fields(id: &PlanId, fields: &Map<String, Value>) -> Vec<EventError> {
    let mut errors = Vec::new();
    let known = [
        "id",
        "sandbox_runtime",
        "included_runtime_seconds",
        "overage",
        "overage_price_per_hour",
        "currency",
        "max_running_containers",
        "max_published_ports",
    ];
    for name in fields.keys().filter(|name| !known.contains(&name.as_str())) {
        errors.push(EventError::new(
            ErrorCode::UnknownField,
            format!("{name}: is not a plan field"),
        ));
    }
    if let Some(given) = fields.get("id") {
        if given.as_str() != Some(id.as_str()) {
            errors.push(EventError::new(
                ErrorCode::PlanIdMismatch,
                format!("id: {given} differs from the plan id {id} in the path"),
            ));
        }
    }
    errors
}

fn overage(fields: &Map<String, Value>, errors: &mut Vec<EventError>) -> Overage {
    match fields.get("overage").and_then(Value::as_str) {
        Some("deny") => Overage::Deny,
        Some("bill") => Overage::Bill,
        _ => {
            errors.push(EventError::new(
                ErrorCode::InvalidOverage,
                "overage: must be \"deny\" or \"bill\"",
            ));
            Overage::Deny
        }
    }
}

fn currency(fields: &Map<String, Value>, errors: &mut Vec<EventError>) -> String {
    match fields.get("currency").and_then(Value::as_str) {
        Some(code) if code.len() == 3 && code.bytes().all(|b| b.is_ascii_uppercase()) => {
            code.to_owned()
        }
        _ => {
            errors.push(EventError::new(
                ErrorCode::InvalidCurrency,
                "currency: must be an ISO 4217 code such as \"USD\"",
            ));
            String::new()
        }
    }
}

fn boolean(fields: &Map<String, Value>, name: &str, errors: &mut Vec<EventError>) -> bool {
    match fields.get(name) {
        Some(Value::Bool(value)) => *value,
        _ => {
            errors.push(EventError::new(
                ErrorCode::InvalidPlan,
                format!("{name}: must be true or false"),
            ));
            false
        }
    }
}

fn count(
    fields: &Map<String, Value>,
    name: &str,
    max: u64,
    code: ErrorCode,
    errors: &mut Vec<EventError>,
) -> u64 {
    match fields.get(name).and_then(Value::as_u64) {
        Some(value) if value <= max => value,
        _ => {
            errors.push(EventError::new(
                code,
                format!("{name}: must be a whole number from 0 to {max}"),
            ));
            0
        }
    }
}

fn price(fields: &Map<String, Value>, name: &str, errors: &mut Vec<EventError>) -> Decimal {
    match fields.get(name) {
        Some(Value::String(text)) => match parse_price(text) {
            Some(value) => value,
            None => {
                errors.push(EventError::new(
                    ErrorCode::InvalidPrice,
                    format!(
                        "{name}: {text:?} is not a non-negative decimal with at most \
                         {PRICE_SCALE_MAX} decimal places, at most {PRICE_MAX}"
                    ),
                ));
                Decimal::ZERO
            }
        },
        Some(Value::Number(_)) => {
            errors.push(EventError::new(
                ErrorCode::PriceNotAString,
                format!(
                    "{name}: give money as a decimal string such as \"0.12\", not a JSON number"
                ),
            ));
            Decimal::ZERO
        }
        _ => {
            errors.push(EventError::new(
                ErrorCode::InvalidPrice,
                format!("{name}: is required, as a decimal string"),
            ));
            Decimal::ZERO
        }
    }
}

/// `digits[.digits]`, at most [`PRICE_SCALE_MAX`] decimal places, no sign or exponent.
pub fn parse_price(text: &str) -> Option<Decimal> {
    let (whole, fraction) = text.split_once('.').unwrap_or((text, ""));
    let digits = |part: &str| part.bytes().all(|b| b.is_ascii_digit());
    let well_formed = !whole.is_empty()
        && whole.len() <= 10
        && digits(whole)
        && digits(fraction)
        && fraction.len() <= PRICE_SCALE_MAX as usize
        && text.contains('.') != fraction.is_empty();
    if !well_formed {
        return None;
    }
    Decimal::from_str(text)
        .ok()
        .filter(|value| *value <= PRICE_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pro() -> PlanId {
        PlanId::parse("pro").unwrap()
    }

    fn valid() -> Value {
        json!({
            "sandbox_runtime": true, "included_runtime_seconds": 36_000, "overage": "bill",
            "overage_price_per_hour": "0.120000", "currency": "EUR",
            "max_running_containers": 5, "max_published_ports": 10,
        })
    }

    fn codes(body: Value) -> Vec<&'static str> {
        Plan::parse(&pro(), &body)
            .unwrap_err()
            .into_iter()
            .map(|error| error.code.as_str())
            .collect()
    }

    #[test]
    fn a_valid_definition_parses_with_an_exact_decimal_price() {
        let plan = Plan::parse(&pro(), &valid()).unwrap();
        assert_eq!(plan.overage_price_per_hour, Decimal::new(12, 2));
        assert_eq!(plan.included_runtime_ms(), 36_000_000);
        assert_eq!(plan.to_data()["overage_price_per_hour"], "0.12");
        assert_eq!(Plan::parse(&pro(), &plan.to_data()).unwrap(), plan);
    }

    #[test]
    fn a_price_given_as_a_json_number_is_refused() {
        let mut body = valid();
        body["overage_price_per_hour"] = json!(0.12);
        assert_eq!(codes(body), ["price_not_a_string"]);
    }

    #[test]
    fn bad_fields_are_each_reported_with_their_own_code() {
        let mut body = valid();
        body["included_runtime_seconds"] = json!(-1);
        body["currency"] = json!("eur");
        body["overage"] = json!("maybe");
        body["max_running_containers"] = json!(1.5);
        body["color"] = json!("red");
        let mut found = codes(body);
        found.sort_unstable();
        assert_eq!(
            found,
            [
                "invalid_allowance",
                "invalid_currency",
                "invalid_limit",
                "invalid_overage",
                "unknown_field"
            ]
        );
    }

    #[test]
    fn prices_are_plain_decimals_with_at_most_six_places() {
        for good in ["0", "0.5", "12.000001", "1000000000"] {
            assert!(parse_price(good).is_some(), "{good}");
        }
        for bad in [
            "",
            "-1",
            "+1",
            "1.",
            ".5",
            "1.0000001",
            "1e3",
            "0x10",
            " 1",
            "1,5",
            "NaN",
            "1000000000.01",
        ] {
            assert!(parse_price(bad).is_none(), "{bad}");
        }
    }
}
