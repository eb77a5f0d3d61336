//! Billing periods and time windows: the calendar arithmetic under every runtime figure.
//!
//! Periods are UTC calendar months named `YYYY-MM` (contract §3). Every span of time is
//! half-open, `[start, end)`, so that an instant on a boundary belongs to exactly one period
//! and adjacent pieces add up without double counting.

use std::fmt;

use chrono::{DateTime, Datelike, SubsecRound, TimeZone, Utc};

/// The largest year a period may have: names have four-digit years, and a fifth digit
/// would not parse back.
const YEAR_MAX: i32 = 9999;
/// The smallest year a period may have, as for an event's instant.
const YEAR_MIN: i32 = 1;

/// Whole milliseconds from `start` to `end`; every runtime figure is counted this way.
pub(super) fn millis_between(start: DateTime<Utc>, end: DateTime<Utc>) -> i64 {
    (end - start).num_milliseconds()
}

/// A billing period: one UTC calendar month.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Period {
    year: i32,
    /// 1 to 12.
    month: u32,
}

/// A period name that is not `YYYY-MM`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a period: expected YYYY-MM, a year from 0001 and a month from 01 to 12")]
pub struct PeriodError(String);

impl Period {
    /// Accepts exactly `YYYY-MM` (four-digit year 0001–9999, two-digit month 01–12), so
    /// that one period has one spelling in URLs, exports and tables.
    pub fn parse(value: &str) -> Result<Period, PeriodError> {
        Period::parse_from_year(value, YEAR_MIN)
    }

    /// [`Period::parse`] of a period a close stored, year 0000 included: one could be closed
    /// before periods began at 0001, and its close is kept for ever.
    pub fn parse_stored(value: &str) -> Result<Period, PeriodError> {
        Period::parse_from_year(value, 0)
    }

    fn parse_from_year(value: &str, year_min: i32) -> Result<Period, PeriodError> {
        let error = || PeriodError(value.to_owned());
        let bytes = value.as_bytes();
        let well_formed = bytes.len() == 7
            && bytes[4] == b'-'
            && bytes[..4].iter().chain(&bytes[5..]).all(u8::is_ascii_digit);
        if !well_formed {
            return Err(error());
        }
        let year: i32 = value[..4].parse().map_err(|_| error())?;
        let month: u32 = value[5..].parse().map_err(|_| error())?;
        // Year 0000 holds no event (their instants are years 0001 to 9999): a period of it
        // would only be a typo, and one that a close would keep.
        if year < year_min || !(1..=12).contains(&month) {
            return Err(error());
        }
        Ok(Period { year, month })
    }

    /// The period an instant falls in.
    ///
    /// Panics for instants after year 9999, which ingest never admits (events are at most
    /// minutes in the future) and callers refuse in query parameters.
    pub fn containing(instant: DateTime<Utc>) -> Period {
        let year = instant.year();
        assert!(
            (0..=YEAR_MAX).contains(&year),
            "{instant} is outside the years a period can name"
        );
        Period {
            year,
            month: instant.month(),
        }
    }

    /// The first instant of the period.
    pub fn start(self) -> DateTime<Utc> {
        first_instant(self.year, self.month)
    }

    /// The first instant after the period (exclusive end): the start of the next month.
    pub fn end(self) -> DateTime<Utc> {
        match self.month {
            12 => first_instant(self.year + 1, 1),
            month => first_instant(self.year, month + 1),
        }
    }

    /// The following period; December is followed by January of the next year.
    pub fn next(self) -> Period {
        Period::containing(self.end())
    }

    /// `[start, end)` of the period.
    pub fn window(self) -> Window {
        Window::new(self.start(), self.end())
    }
}

fn first_instant(year: i32, month: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(year, month, 1, 0, 0, 0)
        .single()
        .expect("midnight UTC on the first of a month exists exactly once")
}

impl fmt::Display for Period {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}", self.year, self.month)
    }
}

impl std::str::FromStr for Period {
    type Err = PeriodError;

    fn from_str(value: &str) -> Result<Period, PeriodError> {
        Period::parse(value)
    }
}

/// A half-open span of time, `[start, end)`, over which runtime is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    start: DateTime<Utc>,
    end: DateTime<Utc>,
}

impl Window {
    /// Panics if `end` is before `start`: windows that come from outside (a query, a
    /// provider report line) are checked where they are parsed.
    pub fn new(start: DateTime<Utc>, end: DateTime<Utc>) -> Window {
        assert!(
            end >= start,
            "window ends at {end} before it starts at {start}"
        );
        Window { start, end }
    }

    pub fn start(self) -> DateTime<Utc> {
        self.start
    }

    pub fn end(self) -> DateTime<Utc> {
        self.end
    }

    /// The part of the window before `as_of`: a figure "as of" an instant counts nothing
    /// after it (contract §6), and an `as_of` before the window leaves it empty. `as_of` is
    /// truncated to the millisecond, like event times, so that every count is exact.
    pub fn until(self, as_of: DateTime<Utc>) -> Window {
        let as_of = as_of.trunc_subsecs(3);
        Window {
            start: self.start,
            end: self.end.min(as_of).max(self.start),
        }
    }

    pub fn contains(self, instant: DateTime<Utc>) -> bool {
        self.start <= instant && instant < self.end
    }

    pub fn length_ms(self) -> i64 {
        millis_between(self.start, self.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn instant(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn a_period_is_four_digits_from_0001_a_hyphen_and_a_month_from_01_to_12() {
        for valid in ["2026-01", "2026-12", "0001-01", "9999-12"] {
            assert_eq!(Period::parse(valid).unwrap().to_string(), valid);
        }
        let invalid = [
            "",
            "2026-13",
            "2026-00",
            "2026-1",
            "26-01",
            "02026-01",
            "2026/01",
            "2026-01-01",
            " 2026-01",
            "2026-01 ",
            "+026-01",
            "2026-+1",
            "-026-01",
            "2026-1a",
            "２０26-01",
            "0000-01",
        ];
        assert_eq!(
            Period::parse_stored("0000-01").unwrap().to_string(),
            "0000-01"
        );
        for value in invalid {
            assert_eq!(
                Period::parse(value),
                Err(PeriodError(value.to_owned())),
                "input {value:?}"
            );
        }
    }

    #[test]
    fn a_period_starts_on_the_first_and_ends_where_the_next_begins() {
        let cases = [
            (
                "2026-11",
                "2026-11-01T00:00:00Z",
                "2026-12-01T00:00:00Z",
                "2026-12",
            ),
            (
                "2026-12",
                "2026-12-01T00:00:00Z",
                "2027-01-01T00:00:00Z",
                "2027-01",
            ),
            (
                "2028-02",
                "2028-02-01T00:00:00Z",
                "2028-03-01T00:00:00Z",
                "2028-03",
            ),
        ];
        for (name, start, end, next) in cases {
            let period = Period::parse(name).unwrap();
            assert_eq!(period.start(), instant(start), "{name}");
            assert_eq!(period.end(), instant(end), "{name}");
            assert_eq!(period.next().to_string(), next, "{name}");
            assert_eq!(period.next().start(), period.end(), "{name}");
        }
    }

    #[test]
    fn a_period_lasts_its_calendar_days_including_leap_february() {
        let day_ms = 24 * 60 * 60 * 1000;
        let cases = [
            ("2027-02", 28),
            ("2028-02", 29),
            ("2100-02", 28),
            ("2000-02", 29),
            ("2026-04", 30),
            ("2026-12", 31),
        ];
        for (name, days) in cases {
            let period = Period::parse(name).unwrap();
            assert_eq!(period.window().length_ms(), days * day_ms, "{name}");
        }
    }

    #[test]
    fn an_instant_on_a_boundary_belongs_to_the_period_it_starts() {
        let cases = [
            ("2027-01-01T00:00:00.000Z", "2027-01"),
            ("2026-12-31T23:59:59.999Z", "2026-12"),
            ("2028-02-29T12:00:00.000Z", "2028-02"),
            ("2028-03-01T00:00:00.000Z", "2028-03"),
        ];
        for (at, period) in cases {
            assert_eq!(Period::containing(instant(at)).to_string(), period, "{at}");
        }
    }

    #[test]
    fn as_of_cuts_a_window_short_or_empties_it() {
        let window = Period::parse("2026-12").unwrap().window();
        let cases = [
            ("before", "2026-11-15T00:00:00Z", "2026-12-01T00:00:00Z"),
            ("inside", "2026-12-10T00:00:00Z", "2026-12-10T00:00:00Z"),
            ("at the end", "2027-01-01T00:00:00Z", "2027-01-01T00:00:00Z"),
            ("after", "2027-02-01T00:00:00Z", "2027-01-01T00:00:00Z"),
            (
                "sub-millisecond",
                "2026-12-10T00:00:00.0019Z",
                "2026-12-10T00:00:00.001Z",
            ),
        ];
        for (case, as_of, end) in cases {
            let clipped = window.until(instant(as_of));
            assert_eq!(clipped.start(), window.start(), "{case}");
            assert_eq!(clipped.end(), instant(end), "{case}");
        }
    }

    #[test]
    fn a_window_holds_its_start_but_not_its_end() {
        let window = Period::parse("2026-12").unwrap().window();
        assert!(window.contains(instant("2026-12-01T00:00:00Z")));
        assert!(window.contains(instant("2026-12-31T23:59:59.999Z")));
        assert!(!window.contains(instant("2027-01-01T00:00:00Z")));
        assert!(!window.contains(instant("2026-11-30T23:59:59.999Z")));
    }
}
