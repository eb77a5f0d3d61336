//! Reconciliation (contract §5): the provider's runtime for a container over a charge period
//! against the ledger's, line by line, and the containers the provider did not report.
//! Pure; money is `Decimal` throughout.

use std::collections::{BTreeMap, HashMap};
use std::ops::Bound::Excluded;

use chrono::{DateTime, Utc};
use rust_decimal::{Decimal, RoundingStrategy};

use crate::event::ContainerId;
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

/// The largest `min_ms` a reconciliation may ask for: a day.
pub const TOLERANCE_MS_MAX: u64 = 86_400_000;

impl Tolerance {
    /// The defaults with what a caller asks for instead, each within its limits: `min_ms`
    /// up to [`TOLERANCE_MS_MAX`], `ratio` from 0 to 1. The error names the field.
    pub fn asked(min_ms: Option<u64>, ratio: Option<Decimal>) -> Result<Tolerance, String> {
        let mut tolerance = Tolerance::default();
        if let Some(ms) = min_ms {
            tolerance.min_ms = Some(ms)
                .filter(|ms| *ms <= TOLERANCE_MS_MAX)
                .and_then(|ms| i64::try_from(ms).ok())
                .ok_or_else(|| {
                    format!("tolerance_ms: a whole number from 0 to {TOLERANCE_MS_MAX}")
                })?;
        }
        if let Some(ratio) = ratio {
            if ratio < Decimal::ZERO || ratio > Decimal::ONE {
                return Err("tolerance_ratio: a decimal from 0 to 1".to_owned());
            }
            tolerance.ratio = ratio;
        }
        Ok(tolerance)
    }

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
    /// A line that is not container runtime (tax, credit, purchase, adjustment, another
    /// unit, a resource that cannot be a container): counted with its money, not compared.
    NotRuntime,
}

impl Status {
    /// Every status, in the order counts are listed.
    pub const ALL: [Status; 7] = [
        Status::Matched,
        Status::ProviderOver,
        Status::ProviderUnder,
        Status::MissingInLedger,
        Status::OrgMismatch,
        Status::MissingInProvider,
        Status::NotRuntime,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Status::Matched => "matched",
            Status::ProviderOver => "provider_over",
            Status::ProviderUnder => "provider_under",
            Status::MissingInLedger => "missing_in_ledger",
            Status::OrgMismatch => "org_mismatch",
            Status::MissingInProvider => "missing_in_provider",
            Status::NotRuntime => "not_runtime",
        }
    }
}

/// A unit of time a runtime line may be counted in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Seconds,
    Minutes,
    Hours,
    Days,
}

impl Unit {
    /// The spellings read as a unit of time, compared without regard to case (decision
    /// 0021). A compound unit (`vCPU-Hours`, `GB Hours`, `Units/Hour`) or one with a count
    /// (`10 Hours`) is not a time unit; neither is `m` (minute, month or metre) nor a month
    /// or a year, whose lengths vary.
    pub const SPELLINGS: [(&'static str, Unit); 17] = [
        ("s", Unit::Seconds),
        ("sec", Unit::Seconds),
        ("secs", Unit::Seconds),
        ("second", Unit::Seconds),
        ("seconds", Unit::Seconds),
        ("min", Unit::Minutes),
        ("mins", Unit::Minutes),
        ("minute", Unit::Minutes),
        ("minutes", Unit::Minutes),
        ("h", Unit::Hours),
        ("hr", Unit::Hours),
        ("hrs", Unit::Hours),
        ("hour", Unit::Hours),
        ("hours", Unit::Hours),
        ("d", Unit::Days),
        ("day", Unit::Days),
        ("days", Unit::Days),
    ];

    /// The time unit `spelling` names (surrounding spaces ignored), if it names one.
    pub fn parse(spelling: &str) -> Option<Unit> {
        let spelling = spelling.trim();
        Unit::SPELLINGS
            .iter()
            .find(|(known, _)| known.eq_ignore_ascii_case(spelling))
            .map(|(_, unit)| *unit)
    }

    fn ms(self) -> i64 {
        match self {
            Unit::Seconds => 1_000,
            Unit::Minutes => 60_000,
            Unit::Hours => 3_600_000,
            Unit::Days => 86_400_000,
        }
    }
}

/// One line of a provider report, as the report gives it: every line, runtime or not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportLine {
    pub charge_period: Window,
    /// `ChargeCategory` as written (`Usage`, `Tax`, `Credit`, `Purchase`, `Adjustment`).
    pub charge_category: String,
    /// `ChargeClass` (`Correction` or absent).
    pub charge_class: Option<String>,
    /// `ResourceId`: the container id on a runtime line; any provider id otherwise.
    pub resource_id: Option<String>,
    /// The org the provider attributes the line to (`Tags.org_id`), if any.
    pub org_id: Option<String>,
    pub quantity: Option<Decimal>,
    /// `ConsumedUnit` as written.
    pub unit: Option<String>,
    pub billed_cost: Decimal,
    pub currency: String,
}

impl ReportLine {
    /// The container and the provider's runtime in ms (rounded half-up to the millisecond)
    /// when the line is container runtime: a `Usage` line, not a correction, of a
    /// non-negative quantity in a time unit, whose resource id can be a container id.
    pub fn runtime(&self) -> Option<(&str, i64)> {
        if !self.charge_category.trim().eq_ignore_ascii_case("usage")
            || self
                .charge_class
                .as_deref()
                .is_some_and(|class| class.trim().eq_ignore_ascii_case("correction"))
        {
            return None;
        }
        let unit = Unit::parse(self.unit.as_deref()?)?;
        let quantity = self
            .quantity
            .filter(|quantity| !quantity.is_sign_negative())?;
        let container_id = self.resource_id.as_deref()?;
        ContainerId::parse(container_id).ok()?;
        // [`PAST_RANGE_MS`] when the milliseconds do not fit in an `i64`.
        let ms = quantity
            .checked_mul(Decimal::from(unit.ms()))
            .map(|ms| ms.round_dp_with_strategy(0, RoundingStrategy::MidpointAwayFromZero))
            .and_then(|ms| i64::try_from(ms).ok())
            .unwrap_or(PAST_RANGE_MS);
        Some((container_id, ms))
    }

    /// The precision money derived from this line is kept at: the line's own `BilledCost`
    /// scale, and never less than the currency's minor unit.
    fn money_scale(&self) -> u32 {
        self.billed_cost
            .scale()
            .max(crate::billing::overage::minor_unit_digits(&self.currency))
    }
}

/// What the ledger knows about a container id: its org and lifecycle, for each org that
/// used the id (normally one).
#[derive(Debug, Clone, Copy)]
pub struct LedgerContainer<'a> {
    pub org_id: &'a str,
    pub lifecycle: &'a Lifecycle,
}

/// The charge periods a report's earlier runtime lines claimed, per ledger container (org,
/// container id): runtime inside them is counted for the first line that claimed it only,
/// so that a provider billing the same runtime on two lines is over on the second
/// (decision 0047). Each container's claims are kept merged, as disjoint windows by start.
#[derive(Debug, Default)]
pub struct Claims {
    by_container: HashMap<(String, String), BTreeMap<DateTime<Utc>, DateTime<Utc>>>,
}

impl Claims {
    /// Whether a line claimed anything of the container: the report mentions it.
    pub fn mentions(&self, org_id: &str, container_id: &str) -> bool {
        self.by_container
            .contains_key(&(org_id.to_owned(), container_id.to_owned()))
    }

    /// Claims `window` for the container, merged with what it touches.
    pub fn claim(&mut self, org_id: &str, container_id: &str, window: Window) {
        let claimed = self
            .by_container
            .entry((org_id.to_owned(), container_id.to_owned()))
            .or_default();
        let (mut start, mut end) = (window.start(), window.end());
        // The claim that starts at or before `start` and reaches it, then every claim that
        // starts inside the window or at its end: all merge into one.
        let before = claimed
            .range(..=start)
            .next_back()
            .filter(|(_, claim_end)| **claim_end >= start)
            .map(|(claim_start, _)| *claim_start);
        let inside: Vec<DateTime<Utc>> = claimed
            .range(start..=end)
            .map(|(claim_start, _)| *claim_start)
            .collect();
        for claim_start in before.into_iter().chain(inside) {
            if let Some(claim_end) = claimed.remove(&claim_start) {
                start = start.min(claim_start);
                end = end.max(claim_end);
            }
        }
        claimed.insert(start, end);
    }

    /// How much of `window` no earlier line claimed for the container, in ms.
    fn unclaimed_ms(&self, known: &LedgerContainer<'_>, container_id: &str, window: Window) -> i64 {
        self.unclaimed(known, container_id, window)
            .iter()
            .map(|gap| gap.length_ms())
            .sum()
    }

    /// The container's runtime inside `window` that no earlier line claimed.
    fn unclaimed_runtime_ms(
        &self,
        known: &LedgerContainer<'_>,
        container_id: &str,
        window: Window,
    ) -> i64 {
        self.unclaimed(known, container_id, window)
            .iter()
            .map(|gap| known.lifecycle.runtime_ms(*gap))
            .sum()
    }

    /// The parts of `window` no earlier line claimed for the container, in order.
    fn unclaimed(
        &self,
        known: &LedgerContainer<'_>,
        container_id: &str,
        window: Window,
    ) -> Vec<Window> {
        let key = (known.org_id.to_owned(), container_id.to_owned());
        // (An empty window would be an empty range of the claims, which `range` refuses.)
        let (Some(claimed), false) = (self.by_container.get(&key), window.length_ms() == 0) else {
            return vec![window];
        };
        // The claim that starts at or before the window's start, then those that start
        // inside it: the gaps between them are unclaimed.
        let first = claimed.range(..=window.start()).next_back();
        let inside = claimed.range((Excluded(window.start()), Excluded(window.end())));
        let mut gaps = Vec::new();
        let mut from = window.start();
        for (claim_start, claim_end) in first.into_iter().chain(inside) {
            if *claim_start > from {
                gaps.push(Window::new(from, (*claim_start).min(window.end())));
            }
            from = from.max(*claim_end);
            if from >= window.end() {
                return gaps;
            }
        }
        gaps.push(Window::new(from, window.end()));
        gaps
    }
}

/// The figures of a compared line (a runtime line or a `missing_in_provider` one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compared {
    pub ledger_runtime_ms: i64,
    pub provider_runtime_ms: i64,
    /// provider − ledger.
    pub delta_ms: i64,
    /// Ledger hours × the line's own unit price (BilledCost / provider hours), at the
    /// line's money precision.
    pub expected_cost: Decimal,
    /// provider − expected.
    pub cost_delta: Decimal,
}

/// A reconciled line (or a `missing_in_provider` line, which has no provider figures).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reconciled {
    /// The line of the report (header = 1); `None` for `missing_in_provider`.
    pub report_line: Option<i64>,
    /// The ledger's org of the container the line was compared with; the provider's tag
    /// when it was compared with none (no org when untagged).
    pub org_id: Option<String>,
    /// The org the provider tagged the line with (`Tags.org_id`).
    pub provider_org_id: Option<String>,
    /// The container id, or the provider's resource id on a `not_runtime` line.
    pub container_id: Option<String>,
    pub charge_period: Window,
    pub charge_category: Option<String>,
    /// `None` on a `not_runtime` line: nothing was compared.
    pub compared: Option<Compared>,
    pub status: Status,
    /// The line's `BilledCost`, exactly as the report gave it.
    pub provider_cost: Decimal,
    pub currency: String,
}

/// The provider runtime of a line whose quantity in milliseconds does not fit in an `i64`
/// (over 292 million years): such a line is [`OutOfRange`].
pub const PAST_RANGE_MS: i64 = i64::MAX;

/// A line whose figures cannot be computed exactly: its runtime is [`PAST_RANGE_MS`], or
/// its expected cost, or a sum of lines, is past what a `Decimal` holds at the line's
/// precision (a cost past `report::COST_MAX`, stored before costs were bounded, or a
/// runtime of thousands of years against a millisecond billed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the figures of report line {line} are out of range")]
pub struct OutOfRange {
    pub line: i64,
}

/// Reconciles one line (file line `report_line`) against the ledger's records of its
/// container id, counting the ledger's runtime over the line's charge period up to `as_of`,
/// outside what earlier lines `claims` for the same container. A line that is not runtime
/// is `not_runtime`, whatever the ledger holds. The caller claims the line's charge period
/// of the container it names ([`container_named`]) before the next line.
pub fn reconcile_line(
    report_line: i64,
    line: &ReportLine,
    ledger: &[LedgerContainer<'_>],
    (tolerance, as_of): (Tolerance, DateTime<Utc>),
    claims: &Claims,
) -> Result<Reconciled, OutOfRange> {
    let mut reconciled = Reconciled {
        report_line: Some(report_line),
        org_id: line.org_id.clone(),
        provider_org_id: line.org_id.clone(),
        container_id: line.resource_id.clone(),
        charge_period: line.charge_period,
        charge_category: Some(line.charge_category.clone()),
        compared: None,
        status: Status::NotRuntime,
        provider_cost: line.billed_cost,
        currency: line.currency.clone(),
    };
    let Some((container_id, provider_runtime_ms)) = line.runtime() else {
        return Ok(reconciled);
    };
    let out_of_range = OutOfRange { line: report_line };
    if provider_runtime_ms == PAST_RANGE_MS {
        return Err(out_of_range);
    }
    let window = line.charge_period.until(as_of);
    // Compared only with the container of the line's own org: the tagged org's, else
    // (untagged) the id's only one.
    let own = container_named(line, ledger)
        .filter(|known| line.org_id.as_deref().is_none_or(|tag| tag == known.org_id));
    let (ledger_runtime_ms, status) = match (own, ledger) {
        (Some(known), _) => {
            let ledger_ms = claims.unclaimed_runtime_ms(known, container_id, window);
            // The tolerance covers the part of the charge period no earlier line billed: a
            // line repeating an earlier one gets none, so runtime billed again in pieces
            // each inside the tolerance is over, not matched (decision 0047).
            // The share of the whole charge period, not of its part before `as_of`: a line
            // dated ahead of the clock has no part before it, and is no less a repeat.
            let allowed_ms = scaled(
                tolerance.allowed_ms(ledger_ms),
                claims.unclaimed_ms(known, container_id, line.charge_period),
                line.charge_period.length_ms(),
            );
            reconciled.org_id = Some(known.org_id.to_owned());
            (
                ledger_ms,
                compared_status(allowed_ms, provider_runtime_ms, ledger_ms),
            )
        }
        // Known to other orgs than the tag's, or to several with no tag to choose: the
        // provider bills another tenant than the ledger, or which tenant cannot be told.
        // The line stays with the provider's tag (no org when untagged) and is compared
        // with no org's runtime, so no tenant reads another's figures through it, nor
        // takes another's line as its own (decision 0048).
        (None, [_, ..]) => (0, Status::OrgMismatch),
        (None, []) => (0, Status::MissingInLedger),
    };
    let expected_cost =
        expected_cost(line, ledger_runtime_ms, provider_runtime_ms).ok_or(out_of_range)?;
    reconciled.status = status;
    reconciled.compared = Some(Compared {
        ledger_runtime_ms,
        provider_runtime_ms,
        delta_ms: provider_runtime_ms - ledger_runtime_ms,
        expected_cost,
        cost_delta: exact_sum(line.billed_cost, -expected_cost).ok_or(out_of_range)?,
    });
    Ok(reconciled)
}

/// The ledger container a runtime line names: its tagged org's container of the id, else
/// the id's only container (untagged, or tagged with another org); `None` when the id has
/// no container, or several and the tag names none of them. The line claims its charge
/// period of that container ([`Claims`]), so the container is not missing from the report
/// even when the line was not compared with it.
pub fn container_named<'l, 'a>(
    line: &ReportLine,
    ledger: &'l [LedgerContainer<'a>],
) -> Option<&'l LedgerContainer<'a>> {
    let tagged = line
        .org_id
        .as_deref()
        .and_then(|tag| ledger.iter().find(|known| known.org_id == tag));
    match ledger {
        [only] => Some(tagged.unwrap_or(only)),
        _ => tagged,
    }
}

/// `allowed_ms` × `part` / `whole`, rounded down; all of it for an empty whole.
fn scaled(allowed_ms: i64, part: i64, whole: i64) -> i64 {
    if whole <= 0 {
        return allowed_ms;
    }
    let scaled = i128::from(allowed_ms) * i128::from(part.clamp(0, whole)) / i128::from(whole);
    i64::try_from(scaled).expect("a part of an i64")
}

/// `matched` when the distance is at most `allowed_ms`, else which side is over.
fn compared_status(allowed_ms: i64, provider_ms: i64, ledger_ms: i64) -> Status {
    let delta = provider_ms - ledger_ms;
    if delta.abs() <= allowed_ms {
        Status::Matched
    } else if delta > 0 {
        Status::ProviderOver
    } else {
        Status::ProviderUnder
    }
}

/// Ledger hours × (BilledCost / provider hours), rounded half-up to the line's money
/// precision (so that lines and the exact totals of their figures agree); a line with no
/// provider quantity carries no unit price, so nothing is expected from it.
/// `None` when it cannot be held at that precision: `Decimal` keeps 28 digits and, past
/// them, rounds a product to fewer places or stops a rescale short, where a reconciliation
/// is exact or is not made.
fn expected_cost(line: &ReportLine, ledger_ms: i64, provider_ms: i64) -> Option<Decimal> {
    let scale = line.money_scale();
    if provider_ms == 0 {
        return Some(Decimal::new(0, scale));
    }
    let product = line.billed_cost.checked_mul(Decimal::from(ledger_ms))?;
    // (A zero product comes back at scale 0, and loses nothing.)
    if product.scale() < line.billed_cost.scale() && !product.is_zero() {
        return None;
    }
    let mut expected = product
        .checked_div(Decimal::from(provider_ms))?
        .round_dp_with_strategy(scale, RoundingStrategy::MidpointAwayFromZero);
    expected.rescale(scale);
    (expected.scale() == scale || expected.is_zero()).then_some(expected)
}

/// `a + b` at the precision of the finer of them; `None` when it cannot be held at it.
/// (`Decimal` rounds a sum to fewer places rather than fail when its digits run out, and
/// gives back an operand unchanged when the other is zero.)
pub fn exact_sum(a: Decimal, b: Decimal) -> Option<Decimal> {
    let places = a.scale().max(b.scale());
    let mut sum = a.checked_add(b)?;
    sum.rescale(places);
    (sum.scale() == places).then_some(sum)
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
    let zero = Decimal::new(0, crate::billing::overage::minor_unit_digits(currency));
    Some(Reconciled {
        report_line: None,
        org_id: Some(org_id.to_owned()),
        provider_org_id: None,
        container_id: Some(container_id.to_owned()),
        charge_period: report_window,
        charge_category: None,
        compared: Some(Compared {
            ledger_runtime_ms,
            provider_runtime_ms: 0,
            delta_ms: -ledger_runtime_ms,
            expected_cost: zero,
            cost_delta: zero,
        }),
        status: Status::MissingInProvider,
        provider_cost: zero,
        currency: currency.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::{ContainerEntry, ContainerTimeline, EntryKind};
    use chrono::{Duration, TimeZone};

    /// The line reconciled, its figures in range.
    fn reconcile_line(
        report_line: i64,
        line: &ReportLine,
        ledger: &[LedgerContainer],
        tolerance: Tolerance,
        as_of: DateTime<Utc>,
    ) -> Reconciled {
        super::reconcile_line(
            report_line,
            line,
            ledger,
            (tolerance, as_of),
            &Claims::default(),
        )
        .expect("in range")
    }

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
            charge_category: "Usage".into(),
            charge_class: None,
            resource_id: Some("c1".into()),
            org_id: Some("acme".into()),
            quantity: Some(seconds.parse().unwrap()),
            unit: Some("Seconds".into()),
            billed_cost: cost.parse().unwrap(),
            currency: "USD".into(),
        }
    }

    fn reconcile(
        line: &ReportLine,
        ledger: &[LedgerContainer],
        as_of: DateTime<Utc>,
    ) -> Reconciled {
        reconcile_line(2, line, ledger, Tolerance::default(), as_of)
    }

    fn compared(reconciled: &Reconciled) -> Compared {
        reconciled.compared.expect("a compared line")
    }

    fn known(lifecycle: &Lifecycle) -> [LedgerContainer<'_>; 1] {
        [LedgerContainer {
            org_id: "acme",
            lifecycle,
        }]
    }

    #[test]
    fn runtime_an_earlier_line_claimed_is_not_counted_again_for_a_later_one() {
        // Ran from hour 1 to hour 3 and from 5 to 6.
        let ran = lifecycle(&[(1, Some(3)), (5, Some(6))]);
        let ledger = known(&ran);
        let as_of = at(100);
        let mut claims = Claims::default();
        let mut next = |start: i64, end: i64, seconds: &str| {
            let line = line(start, end, seconds, "1.00");
            let tolerance = (Tolerance::default(), as_of);
            let reconciled = super::reconcile_line(2, &line, &ledger, tolerance, &claims).unwrap();
            claims.claim("acme", "c1", line.charge_period);
            (reconciled.status, compared(&reconciled).ledger_runtime_ms)
        };
        let hour = 3_600_000;
        assert_eq!(next(0, 24, "10800"), (Status::Matched, 3 * hour));
        assert_eq!(
            next(0, 12, "7200"),
            (Status::ProviderOver, 0),
            "billed twice"
        );
        // Another container, or another org's, is not claimed.
        assert!(claims.mentions("acme", "c1"));
        assert!(!claims.mentions("beta", "c1") && !claims.mentions("acme", "c2"));
    }

    #[test]
    fn a_repeated_line_gets_no_tolerance_and_one_overlapping_by_a_sliver_keeps_nearly_all() {
        let ran = lifecycle(&[(0, Some(1))]);
        let ledger = known(&ran);
        let mut claims = Claims::default();
        let mut next = |line: ReportLine| {
            let tolerance = (Tolerance::default(), at(100));
            let reconciled = super::reconcile_line(2, &line, &ledger, tolerance, &claims).unwrap();
            claims.claim("acme", "c1", line.charge_period);
            reconciled.status
        };
        assert_eq!(next(line(0, 1, "3600", "1.00")), Status::Matched);
        // The hour again in pieces of a second each, inside the 2 s tolerance: over.
        for _ in 0..3 {
            assert_eq!(next(line(0, 1, "1", "0.01")), Status::ProviderOver);
        }
        // The next hour, which the container did not run, billed 1.5 s: its charge period
        // overlaps the claimed hour by 1 ms, so nearly all of the tolerance is left.
        let mut sliver = line(1, 2, "1.5", "0.01");
        sliver.charge_period = Window::new(at(1) - Duration::milliseconds(1), at(2));
        assert_eq!(next(sliver), Status::Matched);
        // Charge periods after the instant reconciled to: nothing of them has run, and a
        // repeat is still one.
        let as_of = at(100);
        let mut ahead = |seconds: &str| {
            let line = line(200, 201, seconds, "0.01");
            let reconciled =
                super::reconcile_line(2, &line, &ledger, (Tolerance::default(), as_of), &claims)
                    .unwrap();
            claims.claim("acme", "c1", line.charge_period);
            reconciled.status
        };
        assert_eq!(ahead("1"), Status::Matched);
        assert_eq!(ahead("1"), Status::ProviderOver);
        assert_eq!(scaled(2_000, 1, 3_600_001), 0);
        assert_eq!(scaled(2_000, 3_600_000, 3_600_001), 1_999);
        assert_eq!(scaled(2_000, 0, 0), 2_000);
    }

    #[test]
    fn claims_merge_and_leave_their_gaps_to_later_lines() {
        let ran = lifecycle(&[(0, Some(24))]);
        let ledger = known(&ran);
        let mut claims = Claims::default();
        for (start, end) in [(2, 4), (6, 8), (4, 5), (10, 11), (7, 10)] {
            claims.claim("acme", "c1", Window::new(at(start), at(end)));
        }
        // Claimed: [2, 5) and [6, 11).
        let unclaimed = |start: i64, end: i64| {
            claims.unclaimed_runtime_ms(&ledger[0], "c1", Window::new(at(start), at(end)))
                / 3_600_000
        };
        assert_eq!(unclaimed(0, 24), 24 - 3 - 5);
        assert_eq!(unclaimed(3, 7), 1, "only hour 5 is free");
        assert_eq!(unclaimed(2, 5), 0);
        assert_eq!(unclaimed(11, 12), 1);
        assert_eq!(unclaimed(4, 4), 0, "an empty window");
        assert_eq!(claims.by_container[&("acme".into(), "c1".into())].len(), 2);
    }

    #[test]
    fn every_status_of_a_line() {
        let ran = lifecycle(&[(0, Some(10))]);
        let as_of = at(100);
        let check = |line: ReportLine, ledger: &[LedgerContainer], expected: Status| {
            assert_eq!(reconcile(&line, ledger, as_of).status, expected);
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
        // Listed under the provider's tag and compared with no org's runtime.
        let mismatched = reconcile(&line(0, 10, "36000", "1"), &elsewhere, as_of);
        assert_eq!(
            (
                mismatched.org_id.as_deref(),
                compared(&mismatched).ledger_runtime_ms
            ),
            (Some("acme"), 0)
        );
        // The line still names that org's container, which it claims.
        assert_eq!(
            container_named(&line(0, 10, "36000", "1"), &elsewhere).map(|known| known.org_id),
            Some("other")
        );
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
            (missing.status, compared(&missing).delta_ms),
            (Status::MissingInProvider, -36_000_000)
        );
    }

    #[test]
    fn a_line_no_tag_ties_to_one_of_the_orgs_sharing_its_id_is_charged_to_none_of_them() {
        let ran = lifecycle(&[(0, Some(10))]);
        let shared = [
            LedgerContainer {
                org_id: "acme",
                lifecycle: &ran,
            },
            LedgerContainer {
                org_id: "beta",
                lifecycle: &ran,
            },
        ];
        for (tag, expected_org) in [(None, None), (Some("gamma"), Some("gamma"))] {
            let mut line = line(0, 10, "36000", "1.00");
            line.org_id = tag.map(str::to_owned);
            let reconciled = reconcile(&line, &shared, at(100));
            assert_eq!(
                (reconciled.status, reconciled.org_id.as_deref()),
                (Status::OrgMismatch, expected_org),
                "tag {tag:?}"
            );
            let compared = compared(&reconciled);
            assert_eq!(
                (compared.ledger_runtime_ms, compared.expected_cost),
                (0, Decimal::ZERO)
            );
            assert_eq!(compared.cost_delta, line.billed_cost);
        }
        // Several orgs, none of them the tag's: the line names no container.
        let mut third = line(0, 10, "36000", "1.00");
        third.org_id = Some("gamma".into());
        assert!(container_named(&third, &shared).is_none());
        // A tag names one of them: that org's container, as with no other org.
        let reconciled = reconcile(&line(0, 10, "36000", "1.00"), &shared, at(100));
        assert_eq!(
            (reconciled.status, reconciled.org_id.as_deref()),
            (Status::Matched, Some("acme"))
        );
    }

    #[test]
    fn exactly_at_the_tolerance_is_matched_and_one_ms_past_it_is_not() {
        let ran = lifecycle(&[(0, Some(10))]); // 36 000 000 ms: 0.5 % is 180 000 ms
        let tolerance = Tolerance::default();
        assert_eq!(tolerance.allowed_ms(36_000_000), 180_000);
        let as_of = at(100);
        let at_edge = reconcile_line(
            2,
            &line(0, 10, "36180", "1"),
            &known(&ran),
            tolerance,
            as_of,
        );
        assert_eq!(
            (at_edge.status, compared(&at_edge).delta_ms),
            (Status::Matched, 180_000)
        );
        let past = reconcile_line(
            2,
            &line(0, 10, "36180.001", "1"),
            &known(&ran),
            tolerance,
            as_of,
        );
        assert_eq!(
            (past.status, compared(&past).delta_ms),
            (Status::ProviderOver, 180_001)
        );
        // For short runtimes the 2 s floor applies.
        let short = lifecycle(&[(0, Some(0))]);
        assert_eq!(
            reconcile_line(2, &line(0, 1, "2", "0"), &known(&short), tolerance, as_of).status,
            Status::Matched
        );
        assert_eq!(
            reconcile_line(
                2,
                &line(0, 1, "2.001", "0"),
                &known(&short),
                tolerance,
                as_of
            )
            .status,
            Status::ProviderOver
        );
    }

    #[test]
    fn a_charge_period_cutting_through_running_intervals_counts_only_its_part() {
        let ran = lifecycle(&[(0, Some(10)), (12, None)]);
        let as_of = at(20);
        // 05:00–14:00: 5 h of the first interval and 2 h of the open one.
        let cut = reconcile(&line(5, 14, "25200", "7"), &known(&ran), as_of);
        assert_eq!(
            (cut.status, compared(&cut).ledger_runtime_ms),
            (Status::Matched, 7 * 3_600_000)
        );
        // An open interval counts up to as_of: 12:00–20:00 of a period ending at 30:00.
        let open = reconcile(&line(11, 30, "28800", "8"), &known(&ran), as_of);
        assert_eq!(compared(&open).ledger_runtime_ms, 8 * 3_600_000);
        assert_eq!(open.status, Status::Matched);
    }

    #[test]
    fn expected_cost_is_ledger_hours_at_the_lines_own_unit_price_in_decimal() {
        let ran = lifecycle(&[(0, Some(3))]);
        // The provider bills 4 h for 10.00: 2.50 an hour; the ledger has 3 h: 7.50 expected.
        let mut hours = line(0, 10, "4", "10.00");
        hours.unit = Some("Hours".into());
        let result = reconcile(&hours, &known(&ran), at(100));
        assert_eq!(result.status, Status::ProviderOver);
        assert_eq!(compared(&result).expected_cost, Decimal::new(750, 2));
        assert_eq!(compared(&result).cost_delta, Decimal::new(250, 2));
        // A third, at the line's precision (cents here) and never below the minor unit.
        let third = reconcile(&line(0, 10, "32400", "1.00"), &known(&ran), at(100));
        assert_eq!(compared(&third).expected_cost.to_string(), "0.33");
        let fine = reconcile(&line(0, 10, "32400", "1.0000000"), &known(&ran), at(100));
        assert_eq!(compared(&fine).expected_cost.to_string(), "0.3333333");
        let whole = reconcile(&line(0, 10, "32400", "1"), &known(&ran), at(100));
        assert_eq!(compared(&whole).expected_cost.to_string(), "0.33");
    }

    #[test]
    fn a_line_whose_expected_cost_would_not_fit_is_out_of_range_and_one_at_the_bound_fits() {
        // 10 h in the ledger against 1 ms billed: the cost is multiplied by 36 000 000.
        let ran = lifecycle(&[(0, Some(10))]);
        let as_of = at(100);
        let past = line(0, 10, "0.001", &Decimal::MAX.to_string());
        assert_eq!(
            super::reconcile_line(
                9,
                &past,
                &known(&ran),
                (Tolerance::default(), as_of),
                &Claims::default()
            ),
            Err(OutOfRange { line: 9 })
        );
        let bound = crate::billing::report::COST_MAX;
        let at_bound = line(0, 10, "0.001", &bound.to_string());
        let result = reconcile(&at_bound, &known(&ran), as_of);
        assert_eq!(
            compared(&result).expected_cost,
            Decimal::from(bound) * Decimal::from(36_000_000)
        );
        // Inside the bound, but 24 digits before the point and 10 after do not fit in 28.
        let fine = line(0, 10, "0.001", "999999999999999.9999999999");
        assert_eq!(
            super::reconcile_line(
                9,
                &fine,
                &known(&ran),
                (Tolerance::default(), as_of),
                &Claims::default()
            ),
            Err(OutOfRange { line: 9 })
        );
        // Days whose milliseconds pass an i64.
        let mut days = line(0, 10, "200000000000", "1");
        days.unit = Some("Days".into());
        assert_eq!(
            super::reconcile_line(
                9,
                &days,
                &known(&ran),
                (Tolerance::default(), as_of),
                &Claims::default()
            ),
            Err(OutOfRange { line: 9 })
        );
    }
}

#[cfg(test)]
mod runtime_tests {
    use super::*;
    use chrono::TimeZone;

    fn usage(category: &str, unit: Option<&str>, resource: Option<&str>) -> ReportLine {
        let start = Utc.with_ymd_and_hms(2024, 9, 18, 22, 0, 0).unwrap();
        ReportLine {
            charge_period: Window::new(start, start + chrono::Duration::hours(1)),
            charge_category: category.into(),
            charge_class: None,
            resource_id: resource.map(str::to_owned),
            org_id: None,
            quantity: Some(Decimal::new(15, 1)),
            unit: unit.map(str::to_owned),
            billed_cost: Decimal::new(-261_370, 5),
            currency: "USD".into(),
        }
    }

    #[test]
    fn every_listed_time_unit_spelling_is_read_in_any_case_and_nothing_else_is() {
        for (spelling, unit) in Unit::SPELLINGS {
            for written in [
                spelling.to_owned(),
                spelling.to_uppercase(),
                format!(" {spelling} "),
            ] {
                assert_eq!(Unit::parse(&written), Some(unit), "{written:?}");
            }
        }
        for other in [
            "GB",
            "Requests",
            "vCPU-Hours",
            "GB Hours",
            "Units/Hour",
            "1 Hour",
            "10 Hours",
            "m",
            "Months",
            "Month",
            "Years",
            "ms",
            "",
            "Hourss",
        ] {
            assert_eq!(Unit::parse(other), None, "{other:?}");
        }
    }

    #[test]
    fn runtime_is_usage_of_a_time_unit_on_a_container_id_and_in_milliseconds() {
        let runtime = |line: &ReportLine| line.runtime().map(|(id, ms)| (id.to_owned(), ms));
        for (unit, ms) in [
            ("Seconds", 1_500),
            ("secs", 1_500),
            ("MIN", 90_000),
            ("Hrs", 5_400_000),
            ("h", 5_400_000),
            ("days", 129_600_000),
        ] {
            assert_eq!(
                runtime(&usage("Usage", Some(unit), Some("ctr_1"))),
                Some(("ctr_1".into(), ms)),
                "{unit}"
            );
        }
        assert!(usage("usage", Some("Hours"), Some("ctr_1"))
            .runtime()
            .is_some());
        for category in ["Tax", "Credit", "Purchase", "Adjustment", "Usages"] {
            assert_eq!(
                usage(category, Some("Hours"), Some("ctr_1")).runtime(),
                None,
                "{category}"
            );
        }
        assert_eq!(usage("Usage", Some("GB"), Some("ctr_1")).runtime(), None);
        assert_eq!(usage("Usage", None, Some("ctr_1")).runtime(), None);
        assert_eq!(usage("Usage", Some("Hours"), None).runtime(), None);
        for provider_id in [
            "arn:aws:ec2:us-east-1:123:instance/i-1",
            "/subscriptions/x/vm",
            "ocid1.instance.oc1",
        ] {
            assert_eq!(
                usage("Usage", Some("Hours"), Some(provider_id)).runtime(),
                None,
                "{provider_id}"
            );
        }
        let mut correction = usage("Usage", Some("Hours"), Some("ctr_1"));
        correction.charge_class = Some("Correction".into());
        assert_eq!(correction.runtime(), None);
        let mut reversal = usage("Usage", Some("Hours"), Some("ctr_1"));
        reversal.quantity = Some(Decimal::new(-1, 0));
        assert_eq!(reversal.runtime(), None);
        reversal.quantity = None;
        assert_eq!(reversal.runtime(), None);
    }

    #[test]
    fn a_credit_is_not_runtime_whatever_the_ledger_holds_and_keeps_its_cost() {
        let lifecycle = crate::runtime::ContainerTimeline::fold(&[]).into_lifecycle();
        let ledger = [LedgerContainer {
            org_id: "acme",
            lifecycle: &lifecycle,
        }];
        let credit = usage("Credit", Some("Hours"), Some("ctr_1"));
        let result = reconcile_line(
            7,
            &credit,
            &ledger,
            (Tolerance::default(), Utc::now()),
            &Claims::default(),
        )
        .unwrap();
        assert_eq!(result.status, Status::NotRuntime);
        assert_eq!(result.compared, None);
        assert_eq!(
            (result.report_line, result.provider_cost.to_string()),
            (Some(7), "-2.61370".to_owned())
        );
    }
}
