//! Reconciliation (contract §5): the provider's runtime for a container over a charge period
//! against the ledger's, line by line, and the containers the provider did not report.
//! Pure; money is `Decimal` throughout.

use chrono::{DateTime, Utc};
use rust_decimal::{Decimal, RoundingStrategy};

use crate::runtime::{Lifecycle, Window};

/// How far the provider may be from the ledger and still match: at most the larger of
/// `min_ms` and `ratio` of the ledger's runtime. Exactly at the tolerance is a match.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tolerance {
    pub min_ms: i64,
    pub ratio: Decimal,
}

impl Default for Tolerance {
    /// max(2000 ms, 0.5 % of the ledger), contract §5.
    fn default() -> Self {
        Tolerance {
            min_ms: 2_000,
            ratio: Decimal::new(5, 3),
        }
    }
}

impl Tolerance {
    /// The allowed distance for a ledger runtime, in whole ms (the ratio's part rounded
    /// down, so the edge never widens by rounding).
    pub fn allowed_ms(&self, ledger_ms: i64) -> i64 {
        let relative = (Decimal::from(ledger_ms) * self.ratio).floor();
        let relative = i64::try_from(relative).unwrap_or(i64::MAX);
        self.min_ms.max(relative)
    }

    pub fn allows(&self, delta_ms: i64, ledger_ms: i64) -> bool {
        delta_ms.abs() <= self.allowed_ms(ledger_ms)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Status {
    Matched,
    ProviderOver,
    ProviderUnder,
    MissingInLedger,
    OrgMismatch,
    MissingInProvider,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Matched => "matched",
            Status::ProviderOver => "provider_over",
            Status::ProviderUnder => "provider_under",
            Status::MissingInLedger => "missing_in_ledger",
            Status::OrgMismatch => "org_mismatch",
            Status::MissingInProvider => "missing_in_provider",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Seconds,
    Hours,
}

/// One line of a provider report, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportLine {
    pub charge_period: Window,
    pub container_id: String,
    /// The org the provider attributes the line to (`Tags.org_id`), if any.
    pub org_id: Option<String>,
    pub quantity: Decimal,
    pub unit: Unit,
    pub billed_cost: Decimal,
    pub currency: String,
}

impl ReportLine {
    /// The provider's runtime in ms, rounded half-up to the millisecond.
    pub fn provider_runtime_ms(&self) -> i64 {
        let per_unit = match self.unit {
            Unit::Seconds => Decimal::from(1_000),
            Unit::Hours => Decimal::from(3_600_000),
        };
        let ms = (self.quantity * per_unit)
            .round_dp_with_strategy(0, RoundingStrategy::MidpointAwayFromZero);
        i64::try_from(ms).unwrap_or(i64::MAX)
    }
}

/// What the ledger knows about a container id: its org and lifecycle, for each org that
/// used the id (normally one).
#[derive(Debug, Clone, Copy)]
pub struct LedgerContainer<'a> {
    pub org_id: &'a str,
    pub lifecycle: &'a Lifecycle,
}

/// A reconciled line (or a `missing_in_provider` line, which has no provider figures).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// The ledger's org for the container; the report's for `missing_in_ledger`.
    pub org_id: Option<String>,
    pub container_id: String,
    pub charge_period: Window,
    pub ledger_runtime_ms: i64,
    pub provider_runtime_ms: i64,
    /// provider − ledger.
    pub delta_ms: i64,
    pub status: Status,
    pub provider_cost: Decimal,
    /// Ledger hours × the line's own unit price (BilledCost / provider hours).
    pub expected_cost: Decimal,
    /// provider − expected.
    pub cost_delta: Decimal,
    pub currency: String,
}

/// Reconciles one line against the ledger's records of its container id, counting the
/// ledger's runtime over the line's charge period up to `as_of`.
pub fn reconcile_line(
    line: &ReportLine,
    ledger: &[LedgerContainer<'_>],
    tolerance: Tolerance,
    as_of: DateTime<Utc>,
) -> Reconciled {
    let provider_runtime_ms = line.provider_runtime_ms();
    let window = line.charge_period.until(as_of);
    // The container the line is about: the tagged org's, else the only one.
    let own = match &line.org_id {
        Some(org) => ledger.iter().find(|known| known.org_id == org),
        None if ledger.len() == 1 => ledger.first(),
        None => None,
    };
    let (org_id, ledger_runtime_ms, status) = match own {
        Some(known) => {
            let ledger_ms = known.lifecycle.runtime_ms(window);
            let delta = provider_runtime_ms - ledger_ms;
            let status = if tolerance.allows(delta, ledger_ms) {
                Status::Matched
            } else if delta > 0 {
                Status::ProviderOver
            } else {
                Status::ProviderUnder
            };
            (Some(known.org_id.to_owned()), ledger_ms, status)
        }
        // Known, but to another org (or to several, with no tag to choose): the provider
        // bills the wrong tenant, or the ledger does.
        None if !ledger.is_empty() => {
            let first = ledger[0];
            (
                Some(first.org_id.to_owned()),
                first.lifecycle.runtime_ms(window),
                Status::OrgMismatch,
            )
        }
        None => (line.org_id.clone(), 0, Status::MissingInLedger),
    };
    let expected_cost = expected_cost(line, ledger_runtime_ms, provider_runtime_ms);
    Reconciled {
        org_id,
        container_id: line.container_id.clone(),
        charge_period: line.charge_period,
        ledger_runtime_ms,
        provider_runtime_ms,
        delta_ms: provider_runtime_ms - ledger_runtime_ms,
        status,
        provider_cost: line.billed_cost,
        expected_cost,
        cost_delta: line.billed_cost - expected_cost,
        currency: line.currency.clone(),
    }
}

/// Ledger hours × (BilledCost / provider hours); a line with no provider quantity carries
/// no unit price, so nothing is expected from it.
fn expected_cost(line: &ReportLine, ledger_ms: i64, provider_ms: i64) -> Decimal {
    if provider_ms == 0 {
        return Decimal::ZERO;
    }
    line.billed_cost * Decimal::from(ledger_ms) / Decimal::from(provider_ms)
}

/// The line for a container the report does not mention although the ledger has it
/// running for more than the tolerance inside the report's window.
pub fn missing_in_provider(
    org_id: &str,
    container_id: &str,
    lifecycle: &Lifecycle,
    report_window: Window,
    tolerance: Tolerance,
    as_of: DateTime<Utc>,
    currency: &str,
) -> Option<Reconciled> {
    let ledger_runtime_ms = lifecycle.runtime_ms(report_window.until(as_of));
    if tolerance.allows(ledger_runtime_ms, ledger_runtime_ms) {
        return None;
    }
    Some(Reconciled {
        org_id: Some(org_id.to_owned()),
        container_id: container_id.to_owned(),
        charge_period: report_window,
        ledger_runtime_ms,
        provider_runtime_ms: 0,
        delta_ms: -ledger_runtime_ms,
        status: Status::MissingInProvider,
        provider_cost: Decimal::ZERO,
        expected_cost: Decimal::ZERO,
        cost_delta: Decimal::ZERO,
        currency: currency.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{ContainerEntry, ContainerTimeline, EntryKind};
    use chrono::{Duration, TimeZone};

    fn at(hour: i64) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 10, 0, 0, 0).unwrap() + Duration::hours(hour)
    }

    fn lifecycle(spans: &[(i64, Option<i64>)]) -> Lifecycle {
        let mut entries = Vec::new();
        for (start, end) in spans {
            let n = entries.len() as i64 + 1;
            entries.push(entry(n, at(*start), EntryKind::Resumed));
            if let Some(end) = end {
                entries.push(entry(n + 1, at(*end), EntryKind::Stopped));
            }
        }
        ContainerTimeline::fold(&entries).into_lifecycle()
    }

    fn entry(position: i64, occurred_at: DateTime<Utc>, kind: EntryKind) -> ContainerEntry {
        ContainerEntry {
            occurred_at,
            position,
            event_id: crate::event::EventId::from_uuid(uuid::Uuid::from_u128(position as u128))
                .unwrap(),
            kind,
        }
    }

    fn line(start: i64, end: i64, seconds: &str, cost: &str) -> ReportLine {
        ReportLine {
            charge_period: Window::new(at(start), at(end)),
            container_id: "c1".into(),
            org_id: Some("acme".into()),
            quantity: seconds.parse().unwrap(),
            unit: Unit::Seconds,
            billed_cost: cost.parse().unwrap(),
            currency: "USD".into(),
        }
    }

    fn known(lifecycle: &Lifecycle) -> [LedgerContainer<'_>; 1] {
        [LedgerContainer {
            org_id: "acme",
            lifecycle,
        }]
    }

    #[test]
    fn every_status_of_a_line() {
        let ran = lifecycle(&[(0, Some(10))]);
        let as_of = at(100);
        let check = |line: ReportLine, ledger: &[LedgerContainer], expected: Status| {
            assert_eq!(
                reconcile_line(&line, ledger, Tolerance::default(), as_of).status,
                expected
            );
        };
        check(line(0, 10, "36000", "1"), &known(&ran), Status::Matched);
        check(
            line(0, 10, "36600", "1"),
            &known(&ran),
            Status::ProviderOver,
        );
        check(
            line(0, 10, "30000", "1"),
            &known(&ran),
            Status::ProviderUnder,
        );
        check(line(0, 10, "36000", "1"), &[], Status::MissingInLedger);
        let elsewhere = [LedgerContainer {
            org_id: "other",
            lifecycle: &ran,
        }];
        check(line(0, 10, "36000", "1"), &elsewhere, Status::OrgMismatch);
        let report = Window::new(at(0), at(24));
        let missing = missing_in_provider(
            "acme",
            "c1",
            &ran,
            report,
            Tolerance::default(),
            as_of,
            "USD",
        )
        .unwrap();
        assert_eq!(
            (missing.status, missing.delta_ms),
            (Status::MissingInProvider, -36_000_000)
        );
    }

    #[test]
    fn exactly_at_the_tolerance_is_matched_and_one_ms_past_it_is_not() {
        let ran = lifecycle(&[(0, Some(10))]); // 36 000 000 ms: 0.5 % is 180 000 ms
        let tolerance = Tolerance::default();
        assert_eq!(tolerance.allowed_ms(36_000_000), 180_000);
        let as_of = at(100);
        let at_edge = reconcile_line(&line(0, 10, "36180", "1"), &known(&ran), tolerance, as_of);
        assert_eq!(
            (at_edge.status, at_edge.delta_ms),
            (Status::Matched, 180_000)
        );
        let past = reconcile_line(
            &line(0, 10, "36180.001", "1"),
            &known(&ran),
            tolerance,
            as_of,
        );
        assert_eq!(
            (past.status, past.delta_ms),
            (Status::ProviderOver, 180_001)
        );
        // For short runtimes the 2 s floor applies.
        let short = lifecycle(&[(0, Some(0))]);
        assert_eq!(
            reconcile_line(&line(0, 1, "2", "0"), &known(&short), tolerance, as_of).status,
            Status::Matched
        );
        assert_eq!(
            reconcile_line(&line(0, 1, "2.001", "0"), &known(&short), tolerance, as_of).status,
            Status::ProviderOver
        );
    }

    #[test]
    fn a_charge_period_cutting_through_running_intervals_counts_only_its_part() {
        let ran = lifecycle(&[(0, Some(10)), (12, None)]);
        let as_of = at(20);
        // 05:00–14:00: 5 h of the first interval and 2 h of the open one.
        let cut = reconcile_line(
            &line(5, 14, "25200", "7"),
            &known(&ran),
            Tolerance::default(),
            as_of,
        );
        assert_eq!(
            (cut.status, cut.ledger_runtime_ms),
            (Status::Matched, 7 * 3_600_000)
        );
        // An open interval counts up to as_of: 12:00–20:00 of a period ending at 30:00.
        let open = reconcile_line(
            &line(11, 30, "28800", "8"),
            &known(&ran),
            Tolerance::default(),
            as_of,
        );
        assert_eq!(open.ledger_runtime_ms, 8 * 3_600_000);
        assert_eq!(open.status, Status::Matched);
    }

    #[test]
    fn expected_cost_is_ledger_hours_at_the_lines_own_unit_price_in_decimal() {
        let ran = lifecycle(&[(0, Some(3))]);
        // The provider bills 4 h for 10.00: 2.50 an hour; the ledger has 3 h: 7.50 expected.
        let mut hours = line(0, 10, "4", "10.00");
        hours.unit = Unit::Hours;
        let result = reconcile_line(&hours, &known(&ran), Tolerance::default(), at(100));
        assert_eq!(result.status, Status::ProviderOver);
        assert_eq!(result.expected_cost, Decimal::new(750, 2));
        assert_eq!(result.cost_delta, Decimal::new(250, 2));
        // Thirds stay exact enough to round to the cent correctly.
        let third = reconcile_line(
            &line(0, 10, "32400", "1.00"),
            &known(&ran),
            Tolerance::default(),
            at(100),
        );
        assert_eq!(
            third
                .expected_cost
                .round_dp_with_strategy(2, RoundingStrategy::MidpointAwayFromZero),
            Decimal::new(33, 2)
        );
    }
}
