//! Overage (contract §6): within a period an org's allowance is consumed in time order across
//! its containers; runtime accrued while the period's cumulative runtime is at or above the
//! included seconds of the plan in effect at that instant is overage, priced at that plan's
//! rate. Pure.
//!
//! Time is cut into segments where both the plan and the number of running containers are
//! constant. In a segment cumulative runtime `C` grows linearly, so the overage in it is
//! `C(end) - max(C(start), included)` when positive: whole milliseconds, with no instant of
//! crossing to compute.

use chrono::{DateTime, Utc};
use rust_decimal::{Decimal, RoundingStrategy};

use super::plan::Plan;
use crate::runtime::{AccountTimeline, Interval, Window};

/// The plan version in effect from `from` (within a window) until the next segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanSegment {
    pub from: DateTime<Utc>,
    pub plan: Plan,
}

/// One plan version as stored: effective from its instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlanVersion {
    pub plan: Plan,
    /// 1 for a plan's first definition; 0 for the built-in `free`.
    pub version: i64,
    pub effective_from: DateTime<Utc>,
    /// The ledger position of its `plan.defined`; 0 for the built-in `free`.
    pub position: i64,
}

impl PlanVersion {
    pub fn builtin_free() -> PlanVersion {
        PlanVersion {
            plan: Plan::free(),
            version: 0,
            effective_from: DateTime::UNIX_EPOCH,
            position: 0,
        }
    }
}

/// The version of `versions` (oldest first) in effect at `instant`: the last one effective
/// at or before it; before the first, the first (a plan an org moved to before it was
/// defined is priced as first defined). `None` only for an undefined plan.
pub fn in_effect(versions: &[PlanVersion], instant: DateTime<Utc>) -> Option<&PlanVersion> {
    let after = versions.partition_point(|version| version.effective_from <= instant);
    versions.get(after.saturating_sub(1))
}

/// The plans in effect across `window`: the org's plan changes and the versions of each
/// plan it is on, cut where either changes. `versions_of` gives a plan's versions, oldest
/// first. Returns `None` if the org is on a plan with no version.
pub fn plan_segments<'a>(
    account: &AccountTimeline,
    versions_of: impl Fn(&str) -> Option<&'a [PlanVersion]>,
    window: Window,
) -> Option<Vec<PlanSegment>> {
    let mut cuts = vec![window.start()];
    for change in account.changes() {
        if window.contains(change.from) {
            cuts.push(change.from);
        }
    }
    let mut plans_seen: Vec<String> = Vec::new();
    for cut in cuts.clone() {
        let plan = account.state_at(cut).plan;
        if !plans_seen.iter().any(|seen| seen == plan.as_str()) {
            plans_seen.push(plan.as_str().to_owned());
        }
    }
    for plan in &plans_seen {
        for version in versions_of(plan)? {
            if window.contains(version.effective_from) {
                cuts.push(version.effective_from);
            }
        }
    }
    cuts.sort_unstable();
    cuts.dedup();
    let mut segments: Vec<PlanSegment> = Vec::with_capacity(cuts.len());
    for from in cuts {
        let plan_id = account.state_at(from).plan;
        let plan = in_effect(versions_of(plan_id.as_str())?, from)?
            .plan
            .clone();
        if segments.last().is_some_and(|last| last.plan == plan) {
            continue;
        }
        segments.push(PlanSegment { from, plan });
    }
    Some(segments)
}

/// Overage in a window: time and amount (unrounded; see [`round_amount`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Overage {
    pub overage_ms: i64,
    pub amount: Decimal,
}

/// Overage when one plan is in effect over the whole window: whatever the order of
/// running time, everything past the allowance is overage.
pub fn single_plan(runtime_ms: i64, plan: &Plan) -> Overage {
    let overage_ms = (runtime_ms - plan.included_runtime_ms()).max(0);
    Overage {
        overage_ms,
        amount: price(overage_ms, plan),
    }
}

/// Overage of the org whose running intervals (every container's) are `intervals`, in
/// `window` (already cut at `as_of`), under `segments` (from [`plan_segments`]; the first
/// starts at the window's start).
pub fn overage(intervals: &[Interval], segments: &[PlanSegment], window: Window) -> Overage {
    // +1 at each start, -1 at each end, inside the window.
    let mut steps: Vec<(DateTime<Utc>, i64)> = Vec::with_capacity(intervals.len() * 2);
    for interval in intervals {
        let start = interval.start().max(window.start());
        let end = interval
            .end()
            .map_or(window.end(), |end| end.min(window.end()));
        if start < end {
            steps.push((start, 1));
            steps.push((end, -1));
        }
    }
    for segment in segments {
        steps.push((segment.from, 0));
    }
    steps.push((window.end(), 0));
    steps.sort_unstable();

    let mut result = Overage::default();
    let mut running = 0i64;
    let mut cumulative = 0i64;
    let mut at = window.start();
    let mut segment = 0;
    for (instant, delta) in steps {
        if instant > at {
            while segment + 1 < segments.len() && segments[segment + 1].from <= at {
                segment += 1;
            }
            let plan = &segments[segment].plan;
            let accrued = running * (instant - at).num_milliseconds();
            let before = cumulative;
            cumulative += accrued;
            let over = (cumulative - before.max(plan.included_runtime_ms())).max(0);
            result.overage_ms += over;
            result.amount += price(over, plan);
            at = instant;
        }
        running += delta;
    }
    result
}

fn price(overage_ms: i64, plan: &Plan) -> Decimal {
    Decimal::from(overage_ms) * plan.overage_price_per_hour / Decimal::from(3_600_000)
}

/// The currencies a plan may be priced in and a provider report may bill in: the ISO 4217
/// codes of money in use, with the funds codes (`BOV`, `CHE`, `CLF`, …), and codes
/// withdrawn or being replaced since 2021 (`ANG`, `BGN`, `CUC`, `HRK`, `SLL`, `ZWL`) so
/// that reports of those months still import. Not precious metals, special drawing
/// rights, or the testing and "no currency" codes (`XAU`, `XDR`, `XTS`, `XXX`, …): nothing
/// is billed in them.
pub const CURRENCIES: [&str; 170] = [
    "AED", "AFN", "ALL", "AMD", "ANG", "AOA", "ARS", "AUD", "AWG", "AZN", "BAM", "BBD", "BDT",
    "BGN", "BHD", "BIF", "BMD", "BND", "BOB", "BOV", "BRL", "BSD", "BTN", "BWP", "BYN", "BZD",
    "CAD", "CDF", "CHE", "CHF", "CHW", "CLF", "CLP", "CNY", "COP", "COU", "CRC", "CUC", "CUP",
    "CVE", "CZK", "DJF", "DKK", "DOP", "DZD", "EGP", "ERN", "ETB", "EUR", "FJD", "FKP", "GBP",
    "GEL", "GHS", "GIP", "GMD", "GNF", "GTQ", "GYD", "HKD", "HNL", "HRK", "HTG", "HUF", "IDR",
    "ILS", "INR", "IQD", "IRR", "ISK", "JMD", "JOD", "JPY", "KES", "KGS", "KHR", "KMF", "KPW",
    "KRW", "KWD", "KYD", "KZT", "LAK", "LBP", "LKR", "LRD", "LSL", "LYD", "MAD", "MDL", "MGA",
    "MKD", "MMK", "MNT", "MOP", "MRU", "MUR", "MVR", "MWK", "MXN", "MXV", "MYR", "MZN", "NAD",
    "NGN", "NIO", "NOK", "NPR", "NZD", "OMR", "PAB", "PEN", "PGK", "PHP", "PKR", "PLN", "PYG",
    "QAR", "RON", "RSD", "RUB", "RWF", "SAR", "SBD", "SCR", "SDG", "SEK", "SGD", "SHP", "SLE",
    "SLL", "SOS", "SRD", "SSP", "STN", "SVC", "SYP", "SZL", "THB", "TJS", "TMT", "TND", "TOP",
    "TRY", "TTD", "TWD", "TZS", "UAH", "UGX", "USD", "USN", "UYI", "UYU", "UYW", "UZS", "VED",
    "VES", "VND", "VUV", "WST", "XAF", "XCD", "XCG", "XOF", "XPF", "YER", "ZAR", "ZMW", "ZWG",
    "ZWL",
];

/// Whether `code` is one of [`CURRENCIES`].
pub fn is_currency(code: &str) -> bool {
    CURRENCIES.binary_search(&code).is_ok()
}

/// Digits after the decimal point of a currency's minor unit (ISO 4217); 2 unless listed.
pub fn minor_unit_digits(currency: &str) -> u32 {
    match currency {
        "BIF" | "CLP" | "DJF" | "GNF" | "ISK" | "JPY" | "KMF" | "KRW" | "PYG" | "RWF" | "UGX"
        | "UYI" | "VND" | "VUV" | "XAF" | "XOF" | "XPF" => 0,
        "BHD" | "IQD" | "JOD" | "KWD" | "LYD" | "OMR" | "TND" => 3,
        "CLF" | "UYW" => 4,
        _ => 2,
    }
}

/// An amount rounded once, half-up, to the currency's minor unit.
pub fn round_amount(amount: Decimal, currency: &str) -> Decimal {
    amount.round_dp_with_strategy(
        minor_unit_digits(currency),
        RoundingStrategy::MidpointAwayFromZero,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_currencies_are_sorted_once_each_and_hold_every_code_with_its_own_minor_unit() {
        assert!(CURRENCIES.windows(2).all(|pair| pair[0] < pair[1]));
        for code in [
            "BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI",
            "VND", "VUV", "XAF", "XOF", "XPF", "BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND",
            "CLF", "UYW", "USD", "EUR",
        ] {
            assert!(is_currency(code), "{code}");
        }
        for code in ["ABC", "XAU", "XDR", "XTS", "XXX", "usd", "US", "USDD", ""] {
            assert!(!is_currency(code), "{code}");
        }
    }
    use crate::billing::Overage as Mode;
    use crate::event::{EventId, PlanId};
    use crate::runtime::{AccountChange, AccountEntry, Period};
    use chrono::{Duration, TimeZone};

    fn at(day: u32, hour: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, day, hour, 0, 0).unwrap()
    }

    fn plan(id: &str, included_hours: u64, price: &str) -> Plan {
        Plan {
            id: PlanId::parse(id).unwrap(),
            sandbox_runtime: true,
            included_runtime_seconds: included_hours * 3600,
            overage: Mode::Bill,
            overage_price_per_hour: price.parse().unwrap(),
            currency: "USD".into(),
            max_running_containers: 10,
            max_published_ports: 10,
        }
    }

    fn version(plan: Plan, from: DateTime<Utc>) -> PlanVersion {
        PlanVersion {
            plan,
            version: 1,
            effective_from: from,
            position: 1,
        }
    }

    fn november() -> Window {
        Period::parse("2026-11").unwrap().window()
    }

    #[test]
    fn allowance_is_consumed_in_time_order_across_containers() {
        let pro = plan("pro", 3, "2");
        let segments = [PlanSegment {
            from: november().start(),
            plan: pro.clone(),
        }];
        // Two containers, 2 h each, overlapping for 1 h: 4 h in all, 1 h over.
        let intervals = [
            Interval::new(at(1, 0), Some(at(1, 2))),
            Interval::new(at(1, 1), Some(at(1, 3))),
        ];
        let result = overage(&intervals, &segments, november());
        assert_eq!(result.overage_ms, 3_600_000);
        assert_eq!(result.amount, Decimal::from(2));
        assert_eq!(result, single_plan(4 * 3_600_000, &pro));
    }

    #[test]
    fn crossing_the_allowance_while_several_run_counts_exactly_the_part_above_it() {
        let pro = plan("pro", 1, "1");
        let segments = [PlanSegment {
            from: november().start(),
            plan: pro,
        }];
        // Three running together from 00:00: 1 h of allowance is used after 20 min; the
        // remaining 3 × 40 min are overage.
        let intervals: Vec<Interval> = (0..3)
            .map(|_| Interval::new(at(1, 0), Some(at(1, 1))))
            .collect();
        let result = overage(&intervals, &segments, november());
        assert_eq!(result.overage_ms, 2 * 3_600_000);
    }

    #[test]
    fn a_plan_change_mid_period_switches_allowance_and_price_at_the_instant_of_change() {
        let small = plan("small", 1, "1.5");
        let big = plan("big", 10, "0.5");
        let mut entries = vec![AccountEntry {
            occurred_at: at(1, 0) - Duration::days(3),
            position: 1,
            event_id: EventId::from_uuid(uuid::Uuid::from_u128(1)).unwrap(),
            change: AccountChange::Plan(small.id.clone()),
        }];
        entries.push(AccountEntry {
            occurred_at: at(10, 0),
            position: 2,
            event_id: EventId::from_uuid(uuid::Uuid::from_u128(2)).unwrap(),
            change: AccountChange::Plan(big.id.clone()),
        });
        let account = AccountTimeline::fold(&entries);
        let versions = [
            version(small.clone(), at(1, 0) - Duration::days(30)),
            version(big.clone(), at(1, 0) - Duration::days(30)),
        ];
        let versions_of = |id: &str| -> Option<&[PlanVersion]> {
            versions
                .iter()
                .position(|v| v.plan.id.as_str() == id)
                .map(|i| &versions[i..=i])
        };
        let segments = plan_segments(&account, versions_of, november()).unwrap();
        assert_eq!(segments.len(), 2);
        assert_eq!(segments[1].from, at(10, 0));
        // 3 h before the change (1 h included on small: 2 h over at 1.5), 3 h after it
        // (6 h cumulative, under big's 10 h: nothing over).
        let intervals = [
            Interval::new(at(2, 0), Some(at(2, 3))),
            Interval::new(at(11, 0), Some(at(11, 3))),
        ];
        let result = overage(&intervals, &segments, november());
        assert_eq!(result.overage_ms, 2 * 3_600_000);
        assert_eq!(result.amount, Decimal::from(3));
        // Running past big's allowance later is priced at big's rate.
        let more = [
            Interval::new(at(2, 0), Some(at(2, 3))),
            Interval::new(at(11, 0), Some(at(11, 9))),
        ];
        let result = overage(&more, &segments, november());
        assert_eq!(result.overage_ms, 2 * 3_600_000 + 2 * 3_600_000);
        assert_eq!(result.amount, Decimal::from(3) + Decimal::from(1));
    }

    #[test]
    fn a_new_version_of_the_same_plan_switches_at_its_effective_instant() {
        let account = AccountTimeline::fold(&[AccountEntry {
            occurred_at: at(1, 0) - Duration::days(3),
            position: 1,
            event_id: EventId::from_uuid(uuid::Uuid::from_u128(1)).unwrap(),
            change: AccountChange::Plan(PlanId::parse("pro").unwrap()),
        }]);
        let versions = [
            version(plan("pro", 1, "1"), at(1, 0) - Duration::days(9)),
            version(plan("pro", 1, "4"), at(15, 0)),
        ];
        let segments = plan_segments(&account, |_| Some(&versions[..]), november()).unwrap();
        let intervals = [Interval::new(at(14, 0), Some(at(16, 0)))];
        let result = overage(&intervals, &segments, november());
        // 48 h, 1 h included: 23 h at 1 before the 15th, 24 h at 4 after.
        assert_eq!(result.overage_ms, 47 * 3_600_000);
        assert_eq!(result.amount, Decimal::from(23 + 24 * 4));
    }

    #[test]
    fn amounts_round_once_half_up_to_the_minor_unit() {
        assert_eq!(
            round_amount("0.125".parse().unwrap(), "USD"),
            "0.13".parse::<Decimal>().unwrap()
        );
        assert_eq!(
            round_amount("0.124999".parse().unwrap(), "USD"),
            "0.12".parse::<Decimal>().unwrap()
        );
        assert_eq!(
            round_amount("12.5".parse().unwrap(), "JPY"),
            Decimal::from(13)
        );
        assert_eq!(
            round_amount("1.0005".parse().unwrap(), "KWD"),
            "1.001".parse::<Decimal>().unwrap()
        );
    }
}
