//! Provider reports in FOCUS 1.x columns (contract §5): the header and each record, checked
//! and parsed into [`ReportLine`]s. Pure: the caller feeds records from any reader.
//!
//! Columns are found by name in any order; unknown columns are ignored; a required column
//! missing or any column named twice refuses the whole report. Every error names its line
//! (the header is line 1) and column.

pub mod reader;

use std::collections::HashMap;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::Value;

use super::reconcile::{ReportLine, Unit};
use crate::error_code::ErrorCode;
use crate::event::{storable, ContainerId, OrgId};
use crate::runtime::Window;

const REQUIRED: [&str; 7] = [
    "ChargePeriodStart",
    "ChargePeriodEnd",
    "ResourceId",
    "ConsumedQuantity",
    "ConsumedUnit",
    "BilledCost",
    "BillingCurrency",
];
const OPTIONAL: [&str; 3] = ["Tags", "ProviderName", "ChargeCategory"];
/// The longest free-text field kept (provider name, charge category).
const TEXT_MAX: usize = 256;

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
    pub charge_category: Option<String>,
}

/// Where each known column is.
#[derive(Debug, Clone)]
pub struct Header {
    positions: HashMap<&'static str, usize>,
    /// Every column's name, known or not, to name the column of a bad cell.
    names: Vec<String>,
}

impl Header {
    pub fn parse(names: &csv::StringRecord) -> Result<Header, ReportError> {
        let mut positions = HashMap::new();
        let mut seen = HashMap::new();
        let mut all = Vec::with_capacity(names.len());
        for (index, name) in names.iter().enumerate() {
            let name = name.trim().trim_start_matches('\u{feff}');
            all.push(name.to_owned());
            if seen.insert(name.to_owned(), index).is_some() {
                return Err(ReportError::new(
                    1,
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
                1,
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
        let start = cells.instant("ChargePeriodStart")?;
        let end = cells.instant("ChargePeriodEnd")?;
        if end <= start {
            return Err(cells.error(
                "ChargePeriodEnd",
                ErrorCode::EndBeforeStart,
                format!("the charge period ends at {end}, not after its start {start}"),
            ));
        }
        let container_id = cells.required("ResourceId")?;
        ContainerId::parse(container_id).map_err(|error| {
            cells.error(
                "ResourceId",
                ErrorCode::InvalidResourceId,
                error.to_string(),
            )
        })?;
        let quantity = cells.decimal("ConsumedQuantity")?;
        if quantity.is_sign_negative() {
            return Err(cells.error(
                "ConsumedQuantity",
                ErrorCode::InvalidNumber,
                "a quantity cannot be negative",
            ));
        }
        let unit = cells.unit()?;
        let billed_cost = cells.decimal("BilledCost")?;
        let currency = cells.currency()?.to_owned();
        let org_id = cells.org_id()?;
        Ok(ParsedLine {
            line,
            report: ReportLine {
                charge_period: Window::new(start, end),
                container_id: container_id.to_owned(),
                org_id,
                quantity,
                unit,
                billed_cost,
                currency,
            },
            provider_name: cells.text("ProviderName")?,
            charge_category: cells.text("ChargeCategory")?,
        })
    }
}

/// One record's cells, read by column name; every error names the record's line and the
/// column. Checks are made in the order of the columns' meaning (the charge period, the
/// resource, the quantity, the unit, the cost, the currency, the tags), so that a line with
/// several faults is reported by its first.
struct Cells<'a> {
    header: &'a Header,
    record: &'a csv::StringRecord,
    line: u64,
}

impl<'a> Cells<'a> {
    fn error(&self, column: &str, code: ErrorCode, message: impl Into<String>) -> ReportError {
        ReportError::new(self.line, Some(column), code, message)
    }

    /// The trimmed cell of a known column; `None` when the column is absent or the cell
    /// empty.
    fn field(&self, name: &'static str) -> Option<&'a str> {
        self.header
            .positions
            .get(name)
            .and_then(|index| self.record.get(*index))
            .map(str::trim)
            .filter(|value| !value.is_empty())
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

    fn instant(&self, name: &'static str) -> Result<DateTime<Utc>, ReportError> {
        let value = self.required(name)?;
        storable::parse_instant(value).map_err(|error| {
            let message = match error {
                storable::InstantError::Malformed { .. } => {
                    format!("{value:?} is not an ISO 8601 instant with an offset")
                }
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
            .then(|| Decimal::from_str(value).ok())
            .flatten()
            .ok_or_else(|| {
                self.error(
                    name,
                    ErrorCode::InvalidNumber,
                    format!("{value:?} is not a decimal number"),
                )
            })
    }

    fn unit(&self) -> Result<Unit, ReportError> {
        match self.required("ConsumedUnit")? {
            "Seconds" => Ok(Unit::Seconds),
            "Hours" => Ok(Unit::Hours),
            other => Err(self.error(
                "ConsumedUnit",
                ErrorCode::UnknownUnit,
                format!("{other:?}: the unit must be Seconds or Hours"),
            )),
        }
    }

    fn currency(&self) -> Result<&'a str, ReportError> {
        let currency = self.required("BillingCurrency")?;
        if currency.len() == 3 && currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Ok(currency);
        }
        Err(self.error(
            "BillingCurrency",
            ErrorCode::InvalidCurrency,
            format!("{currency:?} is not an ISO 4217 code"),
        ))
    }

    /// The org of the `Tags` JSON object's `org_id`, when it has one.
    fn org_id(&self) -> Result<Option<String>, ReportError> {
        let Some(tags) = self.field("Tags") else {
            return Ok(None);
        };
        let Ok(Value::Object(tags)) = serde_json::from_str::<Value>(tags) else {
            return Err(self.error("Tags", ErrorCode::InvalidTags, "Tags must be a JSON object"));
        };
        match tags.get("org_id") {
            None => Ok(None),
            Some(Value::String(org)) => OrgId::parse(org)
                .map(|org| Some(org.as_str().to_owned()))
                .map_err(|error| {
                    self.error("Tags", ErrorCode::InvalidTags, format!("org_id: {error}"))
                }),
            Some(_) => Err(self.error("Tags", ErrorCode::InvalidTags, "org_id must be a string")),
        }
    }

    fn text(&self, name: &'static str) -> Result<Option<String>, ReportError> {
        match self.field(name) {
            Some(value) if value.chars().count() > TEXT_MAX => Err(self.error(
                name,
                ErrorCode::TooLong,
                format!("at most {TEXT_MAX} characters"),
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

    const HEADER: &str = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,Extra";

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
        let text = "BillingCurrency,ConsumedUnit,ResourceId,ChargePeriodEnd,ChargePeriodStart,BilledCost,ConsumedQuantity,Whatever\n\
                    EUR,Hours,c1,2026-11-02T00:00:00Z,2026-11-01T00:00:00Z,1.250000,24,x\n";
        let lines = parse_all(text.as_bytes()).unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].line, 2);
        assert_eq!(lines[0].report.quantity, Decimal::from(24));
        assert_eq!(lines[0].report.billed_cost, Decimal::new(125, 2));
        assert_eq!(lines[0].report.provider_runtime_ms(), 86_400_000);
    }

    #[test]
    fn tags_carry_the_org() {
        let text = report(&[
            r#"2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,"{""org_id"":""acme""}",y"#,
        ]);
        let lines = parse_all(text.as_bytes()).unwrap();
        assert_eq!(lines[0].report.org_id.as_deref(), Some("acme"));
    }

    #[test]
    fn broken_reports_name_the_line_and_column() {
        let good = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,";
        assert!(parse_all(report(&[good]).as_bytes()).is_ok());
        let missing = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,BilledCost,BillingCurrency\n";
        assert_eq!(
            error_of(missing),
            (1, Some("ConsumedUnit".into()), "missing_column")
        );
        let twice = "ResourceId,ResourceId,ChargePeriodStart,ChargePeriodEnd,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency\n";
        assert_eq!(
            error_of(twice),
            (1, Some("ResourceId".into()), "duplicate_column")
        );
        let bad_number = report(&[
            good,
            "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,12abc,Seconds,0.5,USD,,",
        ]);
        assert_eq!(
            error_of(&bad_number),
            (3, Some("ConsumedQuantity".into()), "invalid_number")
        );
        let float_cost =
            report(&["2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1e3,USD,,"]);
        assert_eq!(
            error_of(&float_cost),
            (2, Some("BilledCost".into()), "invalid_number")
        );
        let backwards = report(&["2026-11-01T01:00:00Z,2026-11-01T00:00:00Z,c1,1,Seconds,1,USD,,"]);
        assert_eq!(
            error_of(&backwards),
            (2, Some("ChargePeriodEnd".into()), "end_before_start")
        );
        let unit = report(&["2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Minutes,1,USD,,"]);
        assert_eq!(
            error_of(&unit),
            (2, Some("ConsumedUnit".into()), "unknown_unit")
        );
        assert_eq!(error_of(""), (1, None, "empty_report"));
        assert_eq!(error_of(HEADER), (2, None, "empty_report"));
        let (line, _, code) = error_of("\u{1}\u{2}PNG\u{0} binary");
        assert_eq!((line, code), (1, "missing_column"));
        let year_zero = report(&[
            good,
            good,
            "0000-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD,,",
        ]);
        assert_eq!(
            error_of(&year_zero),
            (4, Some("ChargePeriodStart".into()), "invalid_timestamp")
        );
        let leap = report(&["2026-11-01T00:00:00Z,2026-11-01T00:59:60Z,c1,1,Seconds,1,USD,,"]);
        assert_eq!(
            error_of(&leap),
            (2, Some("ChargePeriodEnd".into()), "leap_second")
        );
        // Any cell, read or not: a NUL is named by its column.
        for (line, column) in [
            (
                "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD,,a\u{0}b",
                "Extra",
            ),
            (
                "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c\u{0}1,1,Seconds,1,USD,,",
                "ResourceId",
            ),
        ] {
            let (at, named, code) = error_of(&report(&[good, line]));
            assert_eq!((at, code), (3, "unstorable_text"), "{line:?}");
            assert_eq!(named.as_deref(), Some(column));
        }
        // A cell past the header's last column is refused for its count, NUL or not.
        let past = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD,,,\u{0}";
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
}
