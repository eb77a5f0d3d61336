//! The runtime rules of contract §3: how a container's lifecycle events become running time,
//! how that time falls into billing periods, and what an org's account state is at each
//! instant. Pure: no I/O, and the clock is passed in as `as_of`.
//!
//! Flow: ledger → projector → [`ContainerEntry`] / [`AccountEntry`] per event →
//! [`ContainerTimeline::fold`] / [`AccountTimeline::fold`] over a container's or an org's
//! whole history → [`usage`] per period, runtime per [`Window`] (reconciliation), state at an
//! instant (admission, pricing).
//!
//! Results never depend on arrival order: each fold sorts by (`occurred_at`, ledger
//! position) and ignores a repeated event id, so refolding after a late event gives what
//! in-order arrival would have given.

mod account;
mod container;
mod day;
mod period;
#[cfg(test)]
mod properties;

use std::collections::{BTreeSet, HashSet};

use chrono::{DateTime, Utc};

use crate::event::EventId;

pub use account::{
    AccountChange, AccountEntry, AccountState, AccountStateChange, AccountTimeline, FREE_PLAN,
};
pub use container::{
    resume_past_lifecycle_limit, Anomaly, AnomalyKind, CommandRun, ContainerEntry, ContainerState,
    ContainerTimeline, EntryKind, IdleSpan, Interval, Late, Lifecycle, PortPublication,
    INTERVALS_MAX, LIFECYCLE_EVENTS_MAX,
};
pub use day::{days, runtime_by_day, Day, DAYS_MAX};
pub use period::{Period, PeriodError, Window};

/// What one org used in one period, as of an instant (contract §6 usage).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Running time in `[period start, min(period end, as_of))`.
    pub runtime_ms: i64,
    /// Commands whose `occurred_at` is in that window, running or not.
    pub commands: u64,
    /// The sum of their `duration_ms`.
    pub command_ms: i64,
    /// Distinct (container, port) pairs published in that window.
    pub ports_published: u64,
    /// Containers running at `as_of` itself, whatever the period: the gauge admission
    /// compares with `max_running_containers`.
    pub running_containers: u64,
}

/// The usage of an org's containers (each folded from its whole history) in `period`,
/// counting nothing that happened at or after `as_of`.
pub fn usage<'a>(
    containers: impl IntoIterator<Item = &'a ContainerTimeline>,
    period: Period,
    as_of: DateTime<Utc>,
) -> Usage {
    let window = period.window().until(as_of);
    let mut usage = Usage::default();
    for timeline in containers {
        usage.runtime_ms += timeline.runtime_ms(window);
        for command in timeline.commands() {
            if window.contains(command.occurred_at) {
                usage.commands += 1;
                usage.command_ms += command.duration_ms;
            }
        }
        // Each timeline is a different container, so distinct ports per container add up
        // to distinct (container, port) pairs.
        let ports: BTreeSet<u16> = timeline
            .ports()
            .iter()
            .filter(|published| window.contains(published.occurred_at))
            .map(|published| published.port)
            .collect();
        usage.ports_published += ports.len() as u64;
        if timeline.running_at(as_of) {
            usage.running_containers += 1;
        }
    }
    usage
}

/// An org's figures for one period as a projection keeps them, by adding each container's
/// share as its events come: everything of [`Usage`] except the part of runtime that still
/// grows (open intervals, see [`OpenRuns`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeriodTotals {
    /// Closed intervals' running time inside the whole period.
    pub closed_runtime_ms: i64,
    pub commands: u64,
    pub command_ms: i64,
    /// Distinct (container, port) pairs published in the period.
    pub ports_published: u64,
}

/// An org's open intervals that started in one period: how many, and the sum of their starts
/// counted in milliseconds from the period's start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenRuns {
    pub since_period: Period,
    pub running: u64,
    pub since_offset_ms: i64,
}

impl OpenRuns {
    /// The entry of one open interval starting at `since`.
    pub fn of(since: DateTime<Utc>) -> OpenRuns {
        let since_period = Period::containing(since);
        OpenRuns {
            since_period,
            running: 1,
            since_offset_ms: period::millis_between(since_period.start(), since),
        }
    }
}

/// The usage of an org from its projected totals, in time independent of how many
/// containers it has: `totals` for `period`, `open` for every period its open intervals
/// started in. Equal to [`usage`] over the org's timelines when `as_of` is at or after
/// `settled_at` (the instant after the org's latest event, see [`settled_at`]): then every
/// closed interval, command and port lies wholly before `as_of`, and every open interval
/// started before it. Returns `None` for an earlier `as_of`, which needs the timelines.
pub fn usage_from_totals(
    totals: PeriodTotals,
    open: &[OpenRuns],
    period: Period,
    as_of: DateTime<Utc>,
    settled_at: Option<DateTime<Utc>>,
) -> Option<Usage> {
    if settled_at.is_some_and(|settled_at| as_of < settled_at) {
        return None;
    }
    let window = period.window().until(as_of);
    let mut usage = Usage {
        runtime_ms: totals.closed_runtime_ms,
        commands: totals.commands,
        command_ms: totals.command_ms,
        ports_published: totals.ports_published,
        running_containers: 0,
    };
    for runs in open {
        usage.running_containers += runs.running;
        let running = i64::try_from(runs.running).expect("fewer than 2^63 containers");
        if runs.since_period < period {
            usage.runtime_ms += running * window.length_ms();
        } else if runs.since_period == period {
            usage.runtime_ms += running * window.length_ms() - runs.since_offset_ms;
        }
    }
    Some(usage)
}

/// An org's runtime in `period` up to `as_of` from its totals (as [`usage_from_totals`]
/// takes them) when events of the org lie after `as_of`: `ahead` are the lifecycles of
/// every container of the org with an event after `as_of` (every other container's
/// intervals lie wholly before it, so the totals count them as of `as_of`). What the totals
/// count of each container ahead is taken out and its runtime up to `as_of` put in, so the
/// figure costs the containers ahead, not all of the org's. Of each lifecycle, the intervals
/// that end after some instant at or before `as_of` ([`Lifecycle::intervals_ending_after`])
/// suffice: what the others count is taken out and put back alike.
pub fn runtime_from_totals_and_ahead<'a>(
    totals: PeriodTotals,
    open: &[OpenRuns],
    period: Period,
    as_of: DateTime<Utc>,
    ahead: impl IntoIterator<Item = &'a Lifecycle>,
) -> i64 {
    let window = period.window().until(as_of);
    let mut runtime_ms = usage_from_totals(totals, open, period, as_of, None)
        .expect("totals answer when not told when they settle")
        .runtime_ms;
    for lifecycle in ahead {
        runtime_ms -= lifecycle
            .intervals()
            .iter()
            .filter(|interval| interval.end().is_some())
            .map(|interval| interval.overlap_ms(period.window()))
            .sum::<i64>();
        if let Some(since) = lifecycle.running_since() {
            let runs = OpenRuns::of(since);
            if runs.since_period < period {
                runtime_ms -= window.length_ms();
            } else if runs.since_period == period {
                runtime_ms -= window.length_ms() - runs.since_offset_ms;
            }
        }
        runtime_ms += lifecycle.runtime_ms(window);
    }
    runtime_ms
}

/// The first instant at which every event at or before `latest` is wholly in the past: one
/// millisecond after it, since windows are half-open and events are whole milliseconds.
pub fn settled_at(latest: DateTime<Utc>) -> DateTime<Utc> {
    latest + chrono::Duration::milliseconds(1)
}

/// Entries in ledger order (`occurred_at`, then position), each event id once. The event id
/// closes the key only so that the order is total even for inconsistent input.
///
/// Panics on a sub-millisecond `occurred_at`: events are truncated on ingest, and runtime
/// arithmetic in whole milliseconds relies on it.
fn ledger_order<T>(entries: &[T], key: impl Fn(&T) -> (DateTime<Utc>, i64, EventId)) -> Vec<&T> {
    let mut ordered: Vec<&T> = entries.iter().collect();
    ordered.sort_by_key(|entry| key(entry));
    let mut seen = HashSet::new();
    ordered.retain(|entry| {
        let (occurred_at, _, event_id) = key(entry);
        assert_eq!(
            occurred_at.timestamp_subsec_nanos() % 1_000_000,
            0,
            "event {event_id} occurred_at {occurred_at} is not truncated to milliseconds"
        );
        seen.insert(event_id)
    });
    ordered
}

#[cfg(test)]
mod tests {
    use super::container::tests::{entry, instant};
    use super::*;
    use EntryKind::{CommandRan, Created, PortPublished, Resumed, Stopped};

    #[test]
    fn usage_counts_runtime_commands_and_distinct_ports_in_the_period_up_to_as_of() {
        let at = |text: &str| instant(text);
        let a = ContainerTimeline::fold(&[
            entry(1, at("2026-11-30T23:00:00Z"), Created),
            entry(
                2,
                at("2026-12-01T00:00:00Z"),
                CommandRan { duration_ms: 100 },
            ),
            entry(3, at("2026-12-01T00:00:00Z"), PortPublished { port: 443 }),
            entry(4, at("2026-12-02T00:00:00Z"), PortPublished { port: 443 }),
            entry(5, at("2026-12-02T00:00:00Z"), PortPublished { port: 8080 }),
            entry(6, at("2026-12-03T00:00:00Z"), Stopped),
            // Not running: counted all the same.
            entry(
                7,
                at("2026-12-04T00:00:00Z"),
                CommandRan { duration_ms: 50 },
            ),
            // After as_of: not counted yet.
            entry(8, at("2026-12-20T00:00:00Z"), CommandRan { duration_ms: 1 }),
        ]);
        let b = ContainerTimeline::fold(&[
            entry(11, at("2026-12-09T00:00:00Z"), Resumed),
            entry(12, at("2026-12-09T00:00:00Z"), PortPublished { port: 443 }),
            // The last millisecond of November: counted there, not in December.
            entry(
                13,
                at("2026-11-30T23:59:59.999Z"),
                PortPublished { port: 22 },
            ),
        ]);
        let as_of = at("2026-12-10T00:00:00Z");
        let day_ms = 86_400_000;
        let december = usage([&a, &b], Period::parse("2026-12").unwrap(), as_of);
        assert_eq!(
            december,
            Usage {
                runtime_ms: 2 * day_ms + day_ms,
                commands: 2,
                command_ms: 150,
                ports_published: 3,
                running_containers: 1,
            }
        );
        let november = usage([&a, &b], Period::parse("2026-11").unwrap(), as_of);
        assert_eq!(
            november,
            Usage {
                runtime_ms: 3_600_000,
                commands: 0,
                command_ms: 0,
                ports_published: 1,
                running_containers: 1,
            }
        );
    }

    #[test]
    fn a_period_after_as_of_has_no_usage_but_still_reports_running_containers() {
        let timeline =
            ContainerTimeline::fold(&[entry(1, instant("2026-12-01T00:00:00Z"), Created)]);
        let january = usage(
            [&timeline],
            Period::parse("2027-01").unwrap(),
            instant("2026-12-15T00:00:00Z"),
        );
        assert_eq!(
            january,
            Usage {
                running_containers: 1,
                ..Usage::default()
            }
        );
    }
}
