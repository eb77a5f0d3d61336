//! Provider reports in FOCUS 1.0–1.2 columns (contract §5): the header and each record,
//! checked and parsed into [`ReportLine`]s. Pure: the caller feeds records from any reader.
//!
//! Columns are found by name in any order; unknown columns are ignored; a required column
//! missing or any column named twice refuses the whole report. Every line is kept, runtime
//! or not (decision 0021). An empty cell and `NULL` are absent; an instant without an
//! offset is UTC. Every error names its line (the header is line 1) and column.

pub mod reader;

use std::collections::HashMap;
use std::str::FromStr;

use chrono::{DateTime, SubsecRound, Utc};
use rust_decimal::Decimal;
use serde_json::Value;

use super::reconcile::{ReportLine, PAST_RANGE_MS};
use crate::error_code::ErrorCode;
use crate::event::{storable, OrgId};
use crate::runtime::Window;

/// The columns every FOCUS 1.x export has and a line cannot be accounted for without.
pub const REQUIRED: [&str; 5] = [
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ChargeCategory",
    "BilledCost",
    "BillingCurrency",
];
/// Read when present; a report without them has no runtime lines (no resource, quantity or
/// unit) or no billing period (its window is its lines' span).
pub const OPTIONAL: [&str; 8] = [
    "ResourceId",
    "ConsumedQuantity",
    "ConsumedUnit",
    "BillingPeriodStart",
    "BillingPeriodEnd",
    "ChargeClass",
    "Tags",
    "ProviderName",
];
/// The longest free-text field kept (provider name, charge category and class, unit).
const TEXT_MAX: usize = 256;
/// The longest resource id kept: provider ids (ARNs, Azure resource paths) run to about a
/// thousand characters.
pub const RESOURCE_ID_MAX: usize = 2_048;
/// The largest magnitude a line's `BilledCost` may have: 10^15, past any one line of a real
/// bill in any currency. A line's expected cost is its cost times the ledger's runtime over
/// the provider's, so this keeps it inside a `Decimal` for any runtime under 2 500 years;
/// reconciling checks the rest ([`super::reconcile::OutOfRange`]).
pub const COST_MAX: i64 = 1_000_000_000_000_000;

/// Why a report is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}{}: {message}", column.as_ref().map(|c| format!(", column {c}")).unwrap_or_default())]
pub struct ReportError {
    pub line: u64,
    pub column: Option<String>,
    pub code: ErrorCode,
    pub message: String,
}

impl ReportError {
    pub fn new(
        line: u64,
        column: Option<&str>,
        code: ErrorCode,
        message: impl Into<String>,
    ) -> Self {
        ReportError {
            line,
            column: column.map(str::to_owned),
            code,
            message: message.into(),
        }
    }
}

/// A parsed line with what is kept beside the reconciliation fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedLine {
    pub line: u64,
    pub report: ReportLine,
    pub provider_name: Option<String>,
    /// `BillingPeriodStart`/`End`, when the line has them.
    pub billing_period: Option<Window>,
}

impl ParsedLine {
    /// The span this line gives the report's window: its billing period and its charge
    /// period together (a provider may date a charge outside its billing period).
    pub fn span(&self) -> (DateTime<Utc>, DateTime<Utc>) {
        let charge = self.report.charge_period;
        match self.billing_period {
            Some(billing) => (
                billing.start().min(charge.start()),
                billing.end().max(charge.end()),
            ),
            None => (charge.start(), charge.end()),
        }
    }
}

/// Where each known column is.
#[derive(Debug, Clone)]
pub struct Header {
    positions: HashMap<&'static str, usize>,
    /// Every column's name, known or not, to name the column of a bad cell.
    names: Vec<String>,
}

impl Header {
    /// The header from the record of its `names`, on line `line` (1, unless blank lines
    /// come before it).
    pub fn parse(names: &csv::StringRecord, line: u64) -> Result<Header, ReportError> {
        let mut positions = HashMap::new();
        let mut seen = HashMap::new();
        let mut all = Vec::with_capacity(names.len());
        for (index, name) in names.iter().enumerate() {
            let name = name.trim().trim_start_matches('\u{feff}');
            all.push(name.to_owned());
            if seen.insert(name.to_owned(), index).is_some() {
                return Err(ReportError::new(
                    line,
                    Some(name),
                    ErrorCode::DuplicateColumn,
                    format!("column {name} appears twice"),
                ));
            }
            if let Some(known) = REQUIRED
                .iter()
                .chain(&OPTIONAL)
                .find(|known| **known == name)
            {
                positions.insert(*known, index);
            }
        }
        if let Some(missing) = REQUIRED.iter().find(|name| !positions.contains_key(*name)) {
            return Err(ReportError::new(
                line,
                Some(missing),
                ErrorCode::MissingColumn,
                format!("the header has no {missing} column (FOCUS 1.x names are required)"),
            ));
        }
        Ok(Header {
            positions,
            names: all,
        })
    }

    /// How many columns the header has: every record must have as many fields.
    pub fn columns(&self) -> usize {
        self.names.len()
    }

    /// The name of the column at `index`; `None` past the header's last column.
    fn name_of(&self, index: usize) -> Option<String> {
        self.names.get(index).cloned()
    }

    /// One record (at file line `line`) into a line of the report.
    pub fn line(&self, record: &csv::StringRecord, line: u64) -> Result<ParsedLine, ReportError> {
        let cells = Cells {
            header: self,
            record,
            line,
        };
        cells.storable()?;
        let charge_period = cells.period("ChargePeriodStart", "ChargePeriodEnd")?;
        let charge_period = charge_period.ok_or_else(|| {
            cells.error(
                "ChargePeriodStart",
                ErrorCode::MissingValue,
                "ChargePeriodStart is empty",
            )
        })?;
        let billing_period = cells.period("BillingPeriodStart", "BillingPeriodEnd")?;
        let charge_category = cells.text("ChargeCategory", TEXT_MAX)?.ok_or_else(|| {
            cells.error(
                "ChargeCategory",
                ErrorCode::MissingValue,
                "ChargeCategory is empty",
            )
        })?;
        let resource_id = cells.text("ResourceId", RESOURCE_ID_MAX)?;
        let quantity = cells.optional_decimal("ConsumedQuantity")?;
        let unit = cells.text("ConsumedUnit", TEXT_MAX)?;
        let billed_cost = cells.cost()?;
        let currency = cells.currency()?.to_owned();
        let org_id = cells.org_id()?;
        let provider_name = cells.text("ProviderName", TEXT_MAX)?;
        let parsed = ParsedLine {
            line,
            report: ReportLine {
                charge_period,
                charge_category,
                charge_class: cells.text("ChargeClass", TEXT_MAX)?,
                resource_id,
                org_id,
                quantity,
                unit,
                billed_cost,
                currency,
            },
            provider_name,
            billing_period,
        };
        // Refused here, not when the stored report is reconciled: one such line would make
        // every reconciliation of the report 422 `amounts_out_of_range`.
        if let Some((_, PAST_RANGE_MS)) = parsed.report.runtime() {
            return Err(cells.error(
                "ConsumedQuantity",
                ErrorCode::InvalidNumber,
                format!(
                    "{} {} of runtime is out of range: at most {} ms",
                    parsed.report.quantity.unwrap_or_default(),
                    parsed.report.unit.as_deref().unwrap_or_default(),
                    PAST_RANGE_MS - 1
                ),
            ));
        }
        Ok(parsed)
    }
}

/// Reads a report's instant: RFC 3339 with an offset, or a date and time without one
/// (`2024-09-18 22:00:00`, `2024-09-18T22:00:00.000`, `2024-09-18 22:00:00 UTC`), which
/// FOCUS defines as UTC. Leap seconds and years outside 0001–9999 are refused either way.
/// Kept to the microsecond, as stored: finer digits are dropped here, so that the checks
/// made on it (an end after its start) hold for what is stored.
pub fn parse_instant(value: &str) -> Result<DateTime<Utc>, storable::InstantError> {
    parse_instant_exactly(value).map(|instant| instant.trunc_subsecs(6))
}

fn parse_instant_exactly(value: &str) -> Result<DateTime<Utc>, storable::InstantError> {
    let error = match storable::parse_instant(value) {
        Ok(instant) => return Ok(instant),
        Err(error) => error,
    };
    if !matches!(error, storable::InstantError::Malformed { .. }) {
        return Err(error);
    }
    let bare = value.strip_suffix(" UTC").unwrap_or(value);
    let (date, time) = match bare.split_at_checked(10) {
        Some((date, time)) if time.starts_with([' ', 'T']) => (date, &time[1..]),
        _ => return Err(error),
    };
    // Without an offset, the time ends in a digit; `Z` or `+01:00` were refused above.
    if !time.ends_with(|c: char| c.is_ascii_digit()) {
        return Err(error);
    }
    storable::parse_instant(&format!("{date}T{time}Z")).map_err(|utc| match utc {
        storable::InstantError::Malformed { .. } => error,
        other => other,
    })
}

/// One record's cells, read by column name; every error names the record's line and the
/// column. Checks are made in the order of the columns' meaning (the charge period, the
/// billing period, the category, the resource, the quantity, the unit, the cost, the
/// currency, the tags), so that a line with several faults is reported by its first.
struct Cells<'a> {
    header: &'a Header,
    record: &'a csv::StringRecord,
    line: u64,
}

/// A decimal's text read exactly, at its own scale (`"3.00"` stays `3.00`). More
/// significant digits than a decimal holds is `None`, where parsing would round; zeros at
/// the end of the fraction are no such digits (`123456789012.000000000000000000`, as a
/// `DECIMAL(38,18)` column writes it, is read at the largest scale a decimal holds).
pub fn exact_decimal(text: &str) -> Option<Decimal> {
    if let Ok(exact) = Decimal::from_str_exact(text) {
        return Some(exact);
    }
    let rounded = Decimal::from_str(text).ok()?;
    let significant = match text.split_once('.') {
        Some((whole, fraction)) => format!("{whole}.{}0", fraction.trim_end_matches('0')),
        None => text.to_owned(),
    };
    let value = Decimal::from_str_exact(&significant).ok()?;
    (rounded == value).then_some(rounded)
}

/// The `Tags` key tally reads, read by a struct so that serde refuses it given twice.
#[derive(serde::Deserialize)]
struct OrgTag {
    #[serde(rename = "org_id")]
    _org_id: Option<serde::de::IgnoredAny>,
}

impl<'a> Cells<'a> {
    fn error(&self, column: &str, code: ErrorCode, message: impl Into<String>) -> ReportError {
        ReportError::new(self.line, Some(column), code, message)
    }

    /// The trimmed cell of a known column; `None` when the column is absent or the cell
    /// empty or `NULL` (in any case), as exports write an absent value.
    fn field(&self, name: &'static str) -> Option<&'a str> {
        self.header
            .positions
            .get(name)
            .and_then(|index| self.record.get(*index))
            .map(str::trim)
            .filter(|value| !value.is_empty() && !value.eq_ignore_ascii_case("null"))
    }

    fn required(&self, name: &'static str) -> Result<&'a str, ReportError> {
        self.field(name)
            .ok_or_else(|| self.error(name, ErrorCode::MissingValue, format!("{name} is empty")))
    }

    /// Some cells are stored as text (provider name, charge category), the others are read
    /// into ids, numbers and instants: none may hold a NUL, whichever column it is in. One
    /// memchr over the record's bytes; the cells are searched only to name the one.
    fn storable(&self) -> Result<(), ReportError> {
        if storable::is_storable(self.record.as_slice()) {
            return Ok(());
        }
        let (index, _) = self
            .record
            .iter()
            .enumerate()
            .find(|(_, cell)| !storable::is_storable(cell))
            .expect("one of the cells holds the NUL");
        let column = self.header.name_of(index);
        Err(ReportError::new(
            self.line,
            column.as_deref(),
            storable::UNSTORABLE_TEXT,
            storable::UNSTORABLE_WHY,
        ))
    }

    /// A period from two columns: both absent is `None`; one without the other, or an end
    /// not after the start, is an error.
    fn period(
        &self,
        start: &'static str,
        end: &'static str,
    ) -> Result<Option<Window>, ReportError> {
        let (from, to) = match (self.field(start), self.field(end)) {
            (None, None) => return Ok(None),
            (Some(_), None) => return Err(self.required(end).unwrap_err()),
            (None, Some(_)) => return Err(self.required(start).unwrap_err()),
            (Some(_), Some(_)) => (self.instant(start)?, self.instant(end)?),
        };
        if to <= from {
            return Err(self.error(
                end,
                ErrorCode::EndBeforeStart,
                format!("{end} is {to}, not after {start} {from}"),
            ));
        }
        Ok(Some(Window::new(from, to)))
    }

    fn instant(&self, name: &'static str) -> Result<DateTime<Utc>, ReportError> {
        let value = self.required(name)?;
        parse_instant(value).map_err(|error| {
            let message = match error {
                storable::InstantError::Malformed { .. } => format!(
                    "{value:?} is not an ISO 8601 instant (with an offset, or without one for UTC)"
                ),
                _ => error.to_string(),
            };
            self.error(name, error.code_or(ErrorCode::InvalidTimestamp), message)
        })
    }

    fn decimal(&self, name: &'static str) -> Result<Decimal, ReportError> {
        let value = self.required(name)?;
        let plain = value
            .bytes()
            .all(|b| b.is_ascii_digit() || b == b'.' || b == b'-');
        plain
            .then(|| exact_decimal(value))
            .flatten()
            .ok_or_else(|| {
                self.error(
                    name,
                    ErrorCode::InvalidNumber,
                    format!("{value:?} is not a decimal number"),
                )
            })
    }

    /// `BilledCost`, at most [`COST_MAX`] either way.
    fn cost(&self) -> Result<Decimal, ReportError> {
        let cost = self.decimal("BilledCost")?;
        if cost.abs() <= Decimal::from(COST_MAX) {
            return Ok(cost);
        }
        Err(self.error(
            "BilledCost",
            ErrorCode::InvalidNumber,
            format!("{cost} is out of range: at most {COST_MAX} either way"),
        ))
    }

    fn optional_decimal(&self, name: &'static str) -> Result<Option<Decimal>, ReportError> {
        match self.field(name) {
            None => Ok(None),
            Some(_) => self.decimal(name).map(Some),
        }
    }

    fn currency(&self) -> Result<&'a str, ReportError> {
        let currency = self.required("BillingCurrency")?;
        if super::overage::is_currency(currency) {
            return Ok(currency);
        }
        Err(self.error(
            "BillingCurrency",
            ErrorCode::InvalidCurrency,
            format!("{currency:?} is not an ISO 4217 currency in use"),
        ))
    }

    /// The org of the `Tags` JSON object's `org_id`, when it has one.
    fn org_id(&self) -> Result<Option<String>, ReportError> {
        let Some(tags) = self.field("Tags") else {
            return Ok(None);
        };
        let object = match serde_json::from_str::<Value>(tags) {
            Ok(Value::Object(object)) => object,
            Ok(_) => {
                return Err(self.error(
                    "Tags",
                    ErrorCode::InvalidTags,
                    "Tags must be a JSON object",
                ))
            }
            // Not JSON, or nested past what is read (128 levels): say which.
            Err(error) => {
                return Err(self.error(
                    "Tags",
                    ErrorCode::InvalidTags,
                    format!("Tags must be a JSON object, and is not JSON: {error}"),
                ))
            }
        };
        // A map keeps the last of two `org_id`s; which org the line is of must not hang on
        // that.
        if let Err(error) = serde_json::from_str::<OrgTag>(tags) {
            return Err(self.error("Tags", ErrorCode::InvalidTags, error.to_string()));
        }
        match object.get("org_id") {
            None => Ok(None),
            Some(Value::String(org)) => OrgId::parse_unreserved(org)
                .map(|org| Some(org.as_str().to_owned()))
                .map_err(|error| {
                    self.error("Tags", ErrorCode::InvalidTags, format!("org_id: {error}"))
                }),
            Some(_) => Err(self.error("Tags", ErrorCode::InvalidTags, "org_id must be a string")),
        }
    }

    fn text(&self, name: &'static str, max: usize) -> Result<Option<String>, ReportError> {
        match self.field(name) {
            Some(value) if value.chars().count() > max => Err(self.error(
                name,
                ErrorCode::TooLong,
                format!("at most {max} characters"),
            )),
            value => Ok(value.map(str::to_owned)),
        }
    }
}

/// Parses a whole report from a reader, as an import reads it: its first error, or every
/// line (tests and small inputs; imports stream with [`reader::Records`] directly).
pub fn parse_all(input: impl std::io::Read) -> Result<Vec<ParsedLine>, ReportError> {
    let first = |error: reader::ReadError| match error {
        reader::ReadError::Refused(refusal) => refusal.first().clone(),
        reader::ReadError::Input(error) => {
            ReportError::new(1, None, ErrorCode::MalformedCsv, error.to_string())
        }
    };
    let mut records = reader::Records::new(input).map_err(first)?;
    let mut lines = Vec::new();
    while let Some(line) = records.next_line().map_err(first)? {
        lines.push(line);
    }
    records
        .finish()
        .map_err(|refusal| refusal.first().clone())?;
    Ok(lines)
}

/// A reader error as a report error at its line.
pub fn csv_error(error: &csv::Error) -> ReportError {
    let line = error.position().map_or(1, |position| position.line());
    let message = match error.kind() {
        csv::ErrorKind::Utf8 { .. } => "the report is not UTF-8 text".to_owned(),
        _ => format!("not CSV: {error}"),
    };
    ReportError::new(line, None, ErrorCode::MalformedCsv, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "ChargeCategory,ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,Extra";

    fn report(lines: &[&str]) -> String {
        std::iter::once(HEADER)
            .chain(lines.iter().copied())
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn error_of(text: &str) -> (u64, Option<String>, &'static str) {
        let error = parse_all(text.as_bytes()).unwrap_err();
        (error.line, error.column, error.code.as_str())
    }

    #[test]
    fn a_report_parses_in_any_column_order_with_unknown_columns_ignored() {
        let text = "BillingCurrency,ConsumedUnit,ResourceId,ChargePeriodEnd,ChargePeriodStart,BilledCost,ConsumedQuantity,Whatever,ChargeCategory\n\
                    EUR,Hours,c1,2026-11-02T00:00:00Z,2026-11-01T00:00:00Z,1.250000,24,x,Usage\n";
        let lines = parse_all(text.as_bytes()).unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].line, 2);
        assert_eq!(lines[0].report.quantity, Some(Decimal::from(24)));
        assert_eq!(lines[0].report.billed_cost, Decimal::new(125, 2));
        assert_eq!(lines[0].report.runtime(), Some(("c1", 86_400_000)));
    }

    #[test]
    fn runtime_whose_milliseconds_do_not_fit_is_refused_at_import_and_the_same_quantity_of_bytes_is_not(
    ) {
        let line = |quantity: &str, unit: &str| {
            report(&[&format!(
                "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,{quantity},{unit},0.5,USD,,"
            )])
        };
        // i64::MAX ms is about 2 562 047 788 015 hours.
        assert!(parse_all(line("2562047788015", "Hours").as_bytes()).is_ok());
        assert_eq!(
            error_of(&line("2562047788016", "Hours")),
            (2, Some("ConsumedQuantity".into()), "invalid_number")
        );
        assert_eq!(
            error_of(&line("99999999999999999999999999", "Hours")),
            (2, Some("ConsumedQuantity".into()), "invalid_number")
        );
        assert!(parse_all(line("99999999999999999999999999", "Bytes").as_bytes()).is_ok());
    }

    #[test]
    fn tags_carry_the_org() {
        let text = report(&[
            r#"Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,"{""org_id"":""acme""}",y"#,
        ]);
        let lines = parse_all(text.as_bytes()).unwrap();
        assert_eq!(lines[0].report.org_id.as_deref(), Some("acme"));
        let reserved = report(&[
            r#"Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,"{""org_id"":""_corrections""}",y"#,
        ]);
        assert_eq!(
            error_of(&reserved),
            (2, Some("Tags".into()), "invalid_tags")
        );
        let twice = report(&[
            r#"Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,"{""org_id"":""acme"",""team"":""x"",""org_id"":""beta""}",y"#,
        ]);
        assert_eq!(error_of(&twice), (2, Some("Tags".into()), "invalid_tags"));
    }

    #[test]
    fn tags_that_are_not_json_say_why_and_tags_that_are_another_value_say_what_is_wanted() {
        let with_tags = |tags: &str| {
            report(&[&format!(
                "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,{tags},y"
            )])
        };
        let message = |text: String| parse_all(text.as_bytes()).unwrap_err().message;
        let deep = format!("\"{}{}\"", "[".repeat(200), "]".repeat(200));
        let nested = message(with_tags(&deep));
        assert!(nested.contains("recursion limit"), "{nested}");
        assert!(message(with_tags("\"{oops\"")).contains("is not JSON"));
        assert_eq!(message(with_tags("\"[1]\"")), "Tags must be a JSON object");
    }

    #[test]
    fn broken_reports_name_the_line_and_column() {
        let good = "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,";
        assert!(parse_all(report(&[good]).as_bytes()).is_ok());
        let missing = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency\n";
        assert_eq!(
            error_of(missing),
            (1, Some("ChargeCategory".into()), "missing_column")
        );
        let twice = "ResourceId,ResourceId,ChargePeriodStart,ChargePeriodEnd,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency\n";
        assert_eq!(
            error_of(twice),
            (1, Some("ResourceId".into()), "duplicate_column")
        );
        let bad_number = report(&[
            good,
            "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,12abc,Seconds,0.5,USD,,",
        ]);
        assert_eq!(
            error_of(&bad_number),
            (3, Some("ConsumedQuantity".into()), "invalid_number")
        );
        for currency in ["ABC", "XTS", "usd"] {
            let line = format!(
                "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,0.5,{currency},,"
            );
            assert_eq!(
                error_of(&report(&[good, &line])),
                (3, Some("BillingCurrency".into()), "invalid_currency"),
                "{currency}"
            );
        }
        let float_cost =
            report(&["Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1e3,USD,,"]);
        assert_eq!(
            error_of(&float_cost),
            (2, Some("BilledCost".into()), "invalid_number")
        );
        // Thirty significant digits: rounded to fit a decimal, the cost would not be the
        // report's.
        let too_precise = report(&[
            "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,0.123456789012345678901234567891,USD,,",
        ]);
        assert_eq!(
            error_of(&too_precise),
            (2, Some("BilledCost".into()), "invalid_number")
        );
        // Trailing zeros are no precision: a DECIMAL(38,18) export's cost is read.
        let zeros = report(&[
            "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,123456789012.000000000000000000,USD,,",
        ]);
        let lines = parse_all(zeros.as_bytes()).unwrap();
        assert_eq!(lines[0].report.billed_cost, "123456789012".parse().unwrap());
        let huge_cost = report(&[
            "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,-1000000000000000.01,USD,,",
        ]);
        assert_eq!(
            error_of(&huge_cost),
            (2, Some("BilledCost".into()), "invalid_number")
        );
        // A quantity may be any decimal: bytes of a transfer run past any cost bound.
        let at_the_limit = report(&[
            "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,79228162514264337593543950335,Bytes,-1000000000000000,USD,,",
        ]);
        assert!(parse_all(at_the_limit.as_bytes()).is_ok());
        let backwards =
            report(&["Usage,2026-11-01T01:00:00Z,2026-11-01T00:00:00Z,c1,1,Seconds,1,USD,,"]);
        assert_eq!(
            error_of(&backwards),
            (2, Some("ChargePeriodEnd".into()), "end_before_start")
        );
        let no_category =
            report(&["NULL,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Hours,1,USD,,"]);
        assert_eq!(
            error_of(&no_category),
            (2, Some("ChargeCategory".into()), "missing_value")
        );
        assert_eq!(error_of(""), (1, None, "empty_report"));
        assert_eq!(error_of(HEADER), (2, None, "empty_report"));
        let (line, _, code) = error_of("\u{1}\u{2}PNG\u{0} binary");
        assert_eq!((line, code), (1, "missing_column"));
        let year_zero = report(&[
            good,
            good,
            "Usage,0000-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD,,",
        ]);
        assert_eq!(
            error_of(&year_zero),
            (4, Some("ChargePeriodStart".into()), "invalid_timestamp")
        );
        // Apart by less than the microsecond that is stored: no period.
        let instant = report(&[
            "Usage,2026-11-10T00:00:00.0000001Z,2026-11-10T00:00:00.0000004Z,c1,2,Hours,1,USD,,",
        ]);
        assert_eq!(
            error_of(&instant),
            (2, Some("ChargePeriodEnd".into()), "end_before_start")
        );
        let leap =
            report(&["Usage,2026-11-01T00:00:00Z,2026-11-01T00:59:60Z,c1,1,Seconds,1,USD,,"]);
        assert_eq!(
            error_of(&leap),
            (2, Some("ChargePeriodEnd".into()), "leap_second")
        );
        // Any cell, read or not: a NUL is named by its column.
        for (line, column) in [
            (
                "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD,,a\u{0}b",
                "Extra",
            ),
            (
                "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c\u{0}1,1,Seconds,1,USD,,",
                "ResourceId",
            ),
        ] {
            let (at, named, code) = error_of(&report(&[good, line]));
            assert_eq!((at, code), (3, "unstorable_text"), "{line:?}");
            assert_eq!(named.as_deref(), Some(column));
        }
        // A cell past the header's last column is refused for its count, NUL or not.
        let past = "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD,,,\u{0}";
        assert_eq!(
            error_of(&report(&[good, past])),
            (3, None, "wrong_field_count")
        );
        let not_utf8 = [0xff_u8, 0xfe, 0x00, 0x41];
        assert_eq!(
            parse_all(&not_utf8[..]).unwrap_err().code,
            ErrorCode::MalformedCsv
        );
    }

    /// The columns of the FOCUS 1.0 sample that matter, in its order and its spelling.
    const FOCUS: &str = "BilledCost,BillingCurrency,BillingPeriodEnd,BillingPeriodStart,ChargeCategory,ChargeClass,ChargePeriodEnd,ChargePeriodStart,ConsumedQuantity,ConsumedUnit,ProviderName,ResourceId,Tags";

    #[test]
    fn instants_without_an_offset_are_utc_and_keep_every_other_check() {
        let utc = |text: &str| parse_instant(text).map(|instant| instant.to_rfc3339());
        for text in [
            "2024-09-18 22:00:00",
            "2024-09-18T22:00:00",
            "2024-09-18 22:00:00 UTC",
            "2024-09-18T22:00:00Z",
            "2024-09-19T00:00:00+02:00",
        ] {
            assert_eq!(
                utc(text),
                Ok("2024-09-18T22:00:00+00:00".to_owned()),
                "{text}"
            );
        }
        assert_eq!(
            utc("2024-09-18 22:00:00.250"),
            Ok("2024-09-18T22:00:00.250+00:00".to_owned())
        );
        assert_eq!(
            utc("2024-09-18T22:00:00.1234567Z"),
            Ok("2024-09-18T22:00:00.123456+00:00".to_owned()),
            "kept to the microsecond, as stored"
        );
        for text in [
            "2024-09-18",
            "2024-09-18 22:00",
            "2024-09-18 22:00:00 CET",
            "2024-09-18  22:00:00",
            "18/09/2024 22:00:00",
            "2024-09-18 22:00:00Z UTC",
        ] {
            assert!(
                matches!(
                    parse_instant(text),
                    Err(storable::InstantError::Malformed { .. })
                ),
                "{text}"
            );
        }
        assert!(matches!(
            parse_instant("2024-12-31 23:59:60"),
            Err(storable::InstantError::LeapSecond { .. })
        ));
        assert!(matches!(
            parse_instant("0000-09-18 22:00:00"),
            Err(storable::InstantError::YearOutOfRange { .. })
        ));
    }

    #[test]
    fn null_and_empty_cells_are_absent_and_a_tax_row_needs_no_resource_or_quantity() {
        let text = [
            FOCUS,
            r#"0.0000008,USD,2024-10-01 00:00:00,2024-09-01 00:00:00,Usage,NULL,2024-09-18 23:00:00,2024-09-18 22:00:00,NULL,Requests,AWS,arn:aws:sqs:us-west-2:1:q,NULL"#,
            r#"1.20,USD,2024-10-01 00:00:00,2024-09-01 00:00:00,Tax,,2024-10-01 00:00:00,2024-09-01 00:00:00,,,AWS,,"#,
            r#"-2.6137,USD,null,NULL,Credit,NULL,2024-09-24 04:00:00,2024-09-24 03:00:00,NULL,NULL,NULL,NULL,"{""org_id"": ""acme""}""#,
        ]
        .join("\n");
        let lines = parse_all(text.as_bytes()).unwrap();
        let usage = &lines[0];
        assert_eq!(
            (
                usage.report.quantity,
                usage.report.charge_class.as_deref(),
                usage.report.org_id.as_deref()
            ),
            (None, None, None)
        );
        assert_eq!(
            usage.report.resource_id.as_deref(),
            Some("arn:aws:sqs:us-west-2:1:q")
        );
        assert_eq!(usage.provider_name.as_deref(), Some("AWS"));
        let september = Window::new(
            "2024-09-01T00:00:00Z".parse().unwrap(),
            "2024-10-01T00:00:00Z".parse().unwrap(),
        );
        assert_eq!(usage.billing_period, Some(september));
        assert_eq!(usage.span(), (september.start(), september.end()));
        let tax = &lines[1].report;
        assert_eq!(
            (
                tax.charge_category.as_str(),
                tax.resource_id.as_deref(),
                tax.unit.as_deref()
            ),
            ("Tax", None, None)
        );
        let credit = &lines[2];
        assert_eq!(credit.billing_period, None);
        assert_eq!(credit.report.billed_cost.to_string(), "-2.6137");
        assert_eq!(credit.report.org_id.as_deref(), Some("acme"));
        assert_eq!(credit.provider_name, None);
        assert!(lines.iter().all(|line| line.report.runtime().is_none()));
    }

    #[test]
    fn a_billing_period_needs_both_ends_in_order_and_the_charge_period_widens_the_span() {
        let line = |billing_end: &str, billing_start: &str| {
            format!("{FOCUS}\n1,USD,{billing_end},{billing_start},Usage,,2024-10-01 01:00:00,2024-09-30 22:00:00,3,Hours,OCI,vm1,")
        };
        let lines =
            parse_all(line("2024-11-01 00:00:00", "2024-10-01 00:00:00").as_bytes()).unwrap();
        assert_eq!(
            lines[0].span(),
            (
                "2024-09-30T22:00:00Z".parse().unwrap(),
                "2024-11-01T00:00:00Z".parse().unwrap()
            )
        );
        assert_eq!(lines[0].report.runtime(), Some(("vm1", 10_800_000)));
        assert_eq!(
            error_of(&line("NULL", "2024-10-01 00:00:00")),
            (2, Some("BillingPeriodEnd".into()), "missing_value")
        );
        assert_eq!(
            error_of(&line("2024-10-01 00:00:00", "")),
            (2, Some("BillingPeriodStart".into()), "missing_value")
        );
        assert_eq!(
            error_of(&line("2024-10-01 00:00:00", "2024-10-01 00:00:00")),
            (2, Some("BillingPeriodEnd".into()), "end_before_start")
        );
        assert_eq!(
            error_of(&line("2024-10-01", "2024-09-01 00:00:00")),
            (2, Some("BillingPeriodEnd".into()), "invalid_timestamp")
        );
    }

    #[test]
    fn a_resource_id_past_its_limit_is_too_long_and_one_at_it_is_kept() {
        let line = |id: &str| {
            format!(
                "{FOCUS}\n1,USD,,,Usage,,2024-09-18 23:00:00,2024-09-18 22:00:00,1,GB,Azure,{id},"
            )
        };
        let at_limit = format!("/subscriptions/{}", "a".repeat(RESOURCE_ID_MAX - 15));
        assert_eq!(at_limit.chars().count(), RESOURCE_ID_MAX);
        let lines = parse_all(line(&at_limit).as_bytes()).unwrap();
        assert_eq!(
            lines[0].report.resource_id.as_deref(),
            Some(at_limit.as_str())
        );
        assert_eq!(
            error_of(&line(&format!("{at_limit}b"))),
            (2, Some("ResourceId".into()), "too_long")
        );
        let negative = format!("{FOCUS}\n-0.1,USD,,,Usage,,2024-09-18 23:00:00,2024-09-18 22:00:00,-1.0,Hours,AWS,i-0ab,");
        let lines = parse_all(negative.as_bytes()).unwrap();
        assert_eq!(lines[0].report.quantity, Some(Decimal::new(-10, 1)));
        assert_eq!(lines[0].report.runtime(), None, "a reversal is not runtime");
    }
}
