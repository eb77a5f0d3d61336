//! An org's usage split by UTC day (contract §6, `window=day`): the days of a period's
//! window, and the running time of intervals in each. Days are half-open like every span,
//! so each millisecond of the window falls in exactly one day and the days of a window add
//! up to the window's figure exactly. Pure.

use chrono::{DateTime, Duration, NaiveDate, Utc};

use super::{Interval, Window};

/// The most days a window may be split into: a period is a calendar month.
pub const DAYS_MAX: usize = 31;

/// One UTC day's part of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Day {
    pub date: NaiveDate,
    /// The day `[midnight, next midnight)` cut to the window (`as_of` cuts the last day).
    pub window: Window,
}

/// The UTC days of `window` that start before its end, in order, each cut to the window.
/// An empty window has none. Panics for a window longer than [`DAYS_MAX`] days: callers
/// pass a period's window.
pub fn days(window: Window) -> Vec<Day> {
    let mut days = Vec::new();
    let mut date = window.start().date_naive();
    loop {
        let midnight = midnight(date);
        let start = midnight.max(window.start());
        if start >= window.end() {
            break;
        }
        let end = (midnight + Duration::days(1)).min(window.end());
        days.push(Day {
            date,
            window: Window::new(start, end),
        });
        date = date.succ_opt().expect("a date before year 9999 has a next");
    }
    assert!(
        days.len() <= DAYS_MAX,
        "a window of {} days is longer than a period",
        days.len()
    );
    days
}

fn midnight(date: NaiveDate) -> DateTime<Utc> {
    date.and_hms_opt(0, 0, 0)
        .expect("midnight exists")
        .and_utc()
}

/// The running time of `intervals` in each of `days` (consecutive, in order, as [`days`]
/// gives them), in whole milliseconds: each interval visits only the days it overlaps.
pub fn runtime_by_day<'a>(
    intervals: impl IntoIterator<Item = &'a Interval>,
    days: &[Day],
) -> Vec<i64> {
    let mut runtime_ms = vec![0; days.len()];
    for interval in intervals {
        let first = days.partition_point(|day| day.window.end() <= interval.start());
        for (index, day) in days.iter().enumerate().skip(first) {
            if interval.end().is_some_and(|end| end <= day.window.start()) {
                break;
            }
            runtime_ms[index] += interval.overlap_ms(day.window);
        }
    }
    runtime_ms
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::container::tests::instant;
    use crate::runtime::Period;
    use proptest::prelude::*;

    const DAY_MS: i64 = 86_400_000;

    #[test]
    fn a_period_cut_mid_day_has_its_whole_days_and_the_cut_one() {
        let window = Period::parse("2026-02")
            .unwrap()
            .window()
            .until(instant("2026-02-03T06:00:00Z"));
        let days = days(window);
        let dates: Vec<String> = days.iter().map(|day| day.date.to_string()).collect();
        assert_eq!(dates, ["2026-02-01", "2026-02-02", "2026-02-03"]);
        assert_eq!(days[1].window.length_ms(), DAY_MS);
        assert_eq!(days[2].window.length_ms(), 6 * 3_600_000);
    }

    #[test]
    fn a_whole_month_has_one_day_per_calendar_day_and_an_empty_window_none() {
        let december = Period::parse("2026-12").unwrap().window();
        assert_eq!(days(december).len(), 31);
        let february = Period::parse("2028-02").unwrap().window();
        assert_eq!(days(february).len(), 29);
        let before = december.until(instant("2026-11-01T00:00:00Z"));
        assert!(days(before).is_empty());
        // as_of at a midnight: the day that starts then is not in the window.
        let at_midnight = december.until(instant("2026-12-02T00:00:00Z"));
        assert_eq!(days(at_midnight).len(), 1);
    }

    #[test]
    fn an_interval_over_midnight_is_split_between_its_days() {
        let window = Period::parse("2026-12")
            .unwrap()
            .window()
            .until(instant("2026-12-03T12:00:00Z"));
        let days = days(window);
        let intervals = [
            Interval::new(
                instant("2026-11-30T22:00:00Z"),
                Some(instant("2026-12-01T01:00:00Z")),
            ),
            Interval::new(
                instant("2026-12-01T23:00:00Z"),
                Some(instant("2026-12-02T00:30:00Z")),
            ),
            Interval::new(instant("2026-12-02T23:59:59.999Z"), None),
        ];
        assert_eq!(
            runtime_by_day(&intervals, &days),
            [3_600_000 + 3_600_000, 1_800_000 + 1, 12 * 3_600_000]
        );
    }

    fn any_interval() -> impl Strategy<Value = Interval> {
        // From mid-November to mid-January: before, inside and after December.
        let base = instant("2026-11-15T00:00:00Z");
        (0..60 * DAY_MS, prop::option::of(0..20 * DAY_MS)).prop_map(move |(start, length)| {
            let start = base + Duration::milliseconds(start);
            Interval::new(start, length.map(|ms| start + Duration::milliseconds(ms)))
        })
    }

    proptest! {
        #[test]
        fn the_days_add_up_to_the_windows_runtime(
            intervals in prop::collection::vec(any_interval(), 0..8),
            as_of_ms in 0..40 * DAY_MS,
        ) {
            let as_of = instant("2026-11-28T00:00:00Z") + Duration::milliseconds(as_of_ms);
            let window = Period::parse("2026-12").unwrap().window().until(as_of);
            let days = days(window);
            let by_day = runtime_by_day(&intervals, &days);
            let whole: i64 = intervals.iter().map(|interval| interval.overlap_ms(window)).sum();
            prop_assert_eq!(by_day.iter().sum::<i64>(), whole);
            for (day, runtime_ms) in days.iter().zip(&by_day) {
                let expected: i64 =
                    intervals.iter().map(|interval| interval.overlap_ms(day.window)).sum();
                prop_assert_eq!(*runtime_ms, expected);
            }
        }
    }
}
