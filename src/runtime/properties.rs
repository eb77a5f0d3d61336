//! Properties of the runtime rules over random histories of a few containers and one org:
//! arrival order and redelivery never change a figure, periods add up to the whole, and
//! the folded intervals stay well formed.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use proptest::prelude::*;
use proptest::sample::{select, Index};

use super::container::tests::{entry, event_id, instant};
use super::*;
use crate::event::PlanId;

const CONTAINERS: usize = 3;

/// Histories span November 2026 to January 2027, crossing December → January.
fn base() -> DateTime<Utc> {
    instant("2026-11-01T00:00:00Z")
}

const SPAN_MS: i64 = 92 * 86_400_000;

/// October 2026 to February 2027: every period a history or `as_of` can touch.
fn periods() -> Vec<Period> {
    let mut period = Period::parse("2026-10").unwrap();
    let mut periods = Vec::new();
    for _ in 0..5 {
        periods.push(period);
        period = period.next();
    }
    periods
}

fn boundaries() -> Vec<DateTime<Utc>> {
    periods()[1..].iter().map(|period| period.start()).collect()
}

fn any_instant() -> impl Strategy<Value = DateTime<Utc>> {
    prop_oneof![
        (0..SPAN_MS).prop_map(|ms| base() + Duration::milliseconds(ms)),
        // On or next to a month boundary, where the half-open edges matter.
        (select(boundaries()), -2i64..=2).prop_map(|(at, ms)| at + Duration::milliseconds(ms)),
        // A handful of instants, so that many events share a millisecond.
        (0i64..4).prop_map(|hours| base() + Duration::days(20) + Duration::hours(hours)),
    ]
}

fn any_kind() -> impl Strategy<Value = EntryKind> {
    prop_oneof![
        3 => Just(EntryKind::Created),
        3 => Just(EntryKind::Resumed),
        3 => Just(EntryKind::Stopped),
        2 => (0i64..10_000).prop_map(|duration_ms| EntryKind::CommandRan { duration_ms }),
        1 => (1u16..=4).prop_map(|port| EntryKind::PortPublished { port }),
    ]
}

fn any_change() -> impl Strategy<Value = AccountChange> {
    prop_oneof![
        select(vec!["free", "pro", "team"])
            .prop_map(|plan| AccountChange::Plan(PlanId::parse(plan).unwrap())),
        any::<bool>().prop_map(AccountChange::Verified),
        any::<bool>().prop_map(AccountChange::BillingEligible),
    ]
}

/// Events in arrival order, which is also ledger order: positions are assigned as they are
/// generated, while `occurred_at` is random, so many events arrive late.
#[derive(Debug, Clone)]
struct History {
    /// (container index, entry)
    containers: Vec<(usize, ContainerEntry)>,
    account: Vec<AccountEntry>,
}

fn any_history() -> impl Strategy<Value = History> {
    let containers = prop::collection::vec((0..CONTAINERS, any_instant(), any_kind()), 0..40);
    let account = prop::collection::vec((any_instant(), any_change()), 0..8);
    (containers, account).prop_map(|(containers, account)| History {
        containers: containers
            .into_iter()
            .zip(1..)
            .map(|((container, at, kind), position)| (container, entry(position, at, kind)))
            .collect(),
        account: account
            .into_iter()
            .zip(1_000..)
            .map(|((at, change), position)| AccountEntry {
                occurred_at: at,
                position,
                event_id: event_id(position),
                change,
            })
            .collect(),
    })
}

fn any_as_of() -> impl Strategy<Value = DateTime<Utc>> {
    prop_oneof![
        any_instant(),
        (-2 * 86_400_000..SPAN_MS + 8 * 86_400_000)
            .prop_map(|ms| base() + Duration::milliseconds(ms)),
    ]
}

fn timelines(history: &History) -> Vec<ContainerTimeline> {
    (0..CONTAINERS)
        .map(|container| {
            let entries: Vec<ContainerEntry> = history
                .containers
                .iter()
                .filter(|(owner, _)| *owner == container)
                .map(|(_, entry)| *entry)
                .collect();
            ContainerTimeline::fold(&entries)
        })
        .collect()
}

/// Every figure the module produces for a history.
#[derive(Debug, PartialEq)]
struct Figures {
    timelines: Vec<ContainerTimeline>,
    runtime_by_period: Vec<BTreeMap<Period, i64>>,
    usage: Vec<Usage>,
    account: AccountTimeline,
}

fn figures(history: &History, as_of: DateTime<Utc>) -> Figures {
    let timelines = timelines(history);
    Figures {
        runtime_by_period: timelines
            .iter()
            .map(|timeline| timeline.runtime_by_period(as_of))
            .collect(),
        usage: periods()
            .into_iter()
            .map(|period| usage(&timelines, period, as_of))
            .collect(),
        account: AccountTimeline::fold(&history.account),
        timelines,
    }
}

/// A history and the same events in another arrival order.
fn shuffled() -> impl Strategy<Value = (History, History)> {
    any_history().prop_flat_map(|history| {
        let containers = Just(history.containers.clone()).prop_shuffle();
        let account = Just(history.account.clone()).prop_shuffle();
        (Just(history), containers, account).prop_map(|(history, containers, account)| {
            (
                history,
                History {
                    containers,
                    account,
                },
            )
        })
    })
}

/// A history and the same events with some delivered more than once, in another order.
fn redelivered() -> impl Strategy<Value = (History, History)> {
    let repeats = prop::collection::vec(any::<Index>(), 0..10);
    (any_history(), repeats.clone(), repeats).prop_flat_map(|(history, containers, account)| {
        let mut again = history.clone();
        if !history.containers.is_empty() {
            let picked = containers
                .iter()
                .map(|index| *index.get(&history.containers));
            again.containers.extend(picked);
        }
        if !history.account.is_empty() {
            let picked = account
                .iter()
                .map(|index| index.get(&history.account).clone());
            again.account.extend(picked);
        }
        let containers = Just(again.containers).prop_shuffle();
        let account = Just(again.account).prop_shuffle();
        (Just(history), containers, account).prop_map(|(history, containers, account)| {
            (
                history,
                History {
                    containers,
                    account,
                },
            )
        })
    })
}

proptest! {
    #[test]
    fn arrival_order_never_changes_any_figure((history, reordered) in shuffled(), as_of in any_as_of()) {
        prop_assert_eq!(figures(&history, as_of), figures(&reordered, as_of));
    }

    #[test]
    fn a_redelivered_event_never_changes_any_figure((history, redelivered) in redelivered(), as_of in any_as_of()) {
        prop_assert_eq!(figures(&history, as_of), figures(&redelivered, as_of));
    }

    #[test]
    fn runtime_per_period_adds_up_to_runtime_over_the_whole_span(history in any_history(), as_of in any_as_of()) {
        let periods = periods();
        let whole = Window::new(periods[0].start(), periods[periods.len() - 1].end()).until(as_of);
        let timelines = timelines(&history);
        for timeline in &timelines {
            let split: i64 = timeline.runtime_by_period(as_of).values().sum();
            prop_assert_eq!(split, timeline.runtime_ms(whole));
        }
        let per_period: i64 = periods.iter().map(|period| usage(&timelines, *period, as_of).runtime_ms).sum();
        let over_whole: i64 = timelines.iter().map(|timeline| timeline.runtime_ms(whole)).sum();
        prop_assert_eq!(per_period, over_whole);
    }

    #[test]
    fn intervals_are_ordered_and_runtime_stays_inside_its_window(
        history in any_history(),
        start in any_instant(),
        length_ms in 0i64..SPAN_MS,
        as_of in any_as_of(),
    ) {
        let window = Window::new(start, start + Duration::milliseconds(length_ms)).until(as_of);
        for timeline in timelines(&history) {
            let intervals = timeline.intervals();
            for interval in intervals {
                prop_assert!(interval.end().is_none_or(|end| end >= interval.start()));
            }
            for pair in intervals.windows(2) {
                prop_assert!(pair[0].end().is_some_and(|end| end <= pair[1].start()));
            }
            let runtime_ms = timeline.runtime_ms(window);
            prop_assert!(runtime_ms >= 0 && runtime_ms <= window.length_ms());
            prop_assert!(timeline.runtime_by_period(as_of).values().all(|ms| *ms > 0));
        }
    }

    #[test]
    fn commands_and_ports_never_change_the_intervals(history in any_history()) {
        let mut lifecycle_only = history.clone();
        lifecycle_only.containers.retain(|(_, entry)| {
            matches!(entry.kind, EntryKind::Created | EntryKind::Resumed | EntryKind::Stopped)
        });
        let with: Vec<Vec<Interval>> =
            timelines(&history).iter().map(|t| t.intervals().to_vec()).collect();
        let without: Vec<Vec<Interval>> =
            timelines(&lifecycle_only).iter().map(|t| t.intervals().to_vec()).collect();
        prop_assert_eq!(with, without);
    }

    #[test]
    fn advancing_in_arrival_order_and_refolding_only_late_entries_gives_the_fold(history in any_history()) {
        for container in 0..CONTAINERS {
            let arrivals: Vec<ContainerEntry> = history
                .containers
                .iter()
                .filter(|(owner, _)| *owner == container)
                .map(|(_, entry)| *entry)
                .collect();
            // The anomalies each advance hands out are appended to a list, as the
            // projection appends them to its rows; a refold replaces the list.
            let mut lifecycle = Lifecycle::default();
            let mut anomalies: Vec<Anomaly> = Vec::new();
            for (seen, entry) in arrivals.iter().enumerate() {
                match lifecycle.advance(entry) {
                    Ok(anomaly) => anomalies.extend(anomaly),
                    Err(_) => {
                        (lifecycle, anomalies) = ContainerTimeline::fold(&arrivals[..=seen]).into_parts();
                    }
                }
            }
            anomalies.sort_by_key(Anomaly::order);
            let (folded, folded_anomalies) = ContainerTimeline::fold(&arrivals).into_parts();
            prop_assert_eq!(lifecycle, folded);
            prop_assert_eq!(anomalies, folded_anomalies);
        }
    }

    #[test]
    fn usage_from_totals_equals_usage_from_timelines_once_settled(
        history in any_history(),
        after_ms in prop_oneof![Just(0i64), 0i64..3, 0i64..40 * 86_400_000],
    ) {
        let timelines = timelines(&history);
        let Some(latest) = history.containers.iter().map(|(_, entry)| entry.occurred_at).max() else {
            return Ok(());
        };
        let settled = settled_at(latest);
        let (totals, open) = totals_and_open(&timelines);
        let as_of = settled + Duration::milliseconds(after_ms);
        for period in periods() {
            let period_totals = totals.get(&period).copied().unwrap_or_default();
            prop_assert_eq!(
                usage_from_totals(period_totals, &open, period, as_of, Some(settled)),
                Some(usage(&timelines, period, as_of))
            );
            let early = settled - Duration::milliseconds(1);
            prop_assert_eq!(usage_from_totals(period_totals, &open, period, early, Some(settled)), None);
        }
    }

    #[test]
    fn the_intervals_ending_after_an_instant_answer_for_it_and_every_later_one_as_all_of_them_do(
        history in any_history(),
        pick in any::<Index>(),
        nudge_ms in -1i64..=1,
        later_ms in prop_oneof![Just(0i64), 0i64..3, 0i64..2 * 86_400_000],
    ) {
        let Some(read_at) = near_an_event(&history, pick, nudge_ms) else {
            return Ok(());
        };
        let as_of = read_at + Duration::milliseconds(later_ms);
        for timeline in timelines(&history) {
            let all = timeline.lifecycle();
            let tail = Lifecycle::restore(all.intervals_ending_after(read_at).to_vec(), 0, 0, None);
            prop_assert_eq!(tail.running_at(as_of), all.running_at(as_of));
            prop_assert_eq!(tail.starts_after(as_of), all.starts_after(as_of));
            prop_assert_eq!(tail.running_since(), all.running_since());
            prop_assert!(all.intervals()[..all.intervals().len() - tail.intervals().len()]
                .iter()
                .all(|interval| interval.end().is_some_and(|end| end <= read_at)));
        }
    }

    #[test]
    fn an_instant_is_in_an_idle_span_exactly_when_the_container_is_not_running_at_it(
        history in any_history(),
        pick in any::<Index>(),
        nudge_ms in -1i64..=1,
    ) {
        let Some(instant) = near_an_event(&history, pick, nudge_ms) else {
            return Ok(());
        };
        for timeline in timelines(&history) {
            let spans = timeline.lifecycle().idle_spans();
            let idle = spans.iter().filter(|span| span.contains(instant)).count();
            prop_assert_eq!(idle, usize::from(!timeline.running_at(instant)), "{:?}", spans);
            // In order, not overlapping, none empty.
            for pair in spans.windows(2) {
                prop_assert!(pair[0].until.is_some_and(|until| pair[1].from.is_some_and(|from| until <= from)));
            }
            for span in &spans {
                prop_assert!(span.from.is_none_or(|from| span.until.is_none_or(|until| from < until)));
            }
        }
    }

    #[test]
    fn runtime_from_totals_and_the_containers_ahead_equals_runtime_from_timelines_at_any_instant(
        history in any_history(),
        pick in any::<Index>(),
        nudge_ms in -1i64..=1,
        read_before_ms in prop_oneof![Just(0i64), 0i64..3, 0i64..2 * 86_400_000],
    ) {
        let timelines = timelines(&history);
        // Some containers have events after it, others not.
        let Some(as_of) = near_an_event(&history, pick, nudge_ms) else {
            return Ok(());
        };
        let (totals, open) = totals_and_open(&timelines);
        // Facts read earlier hold every container with an event after their read: those
        // ahead of `as_of`, and some whose events are all before it, which change nothing.
        // Of each, they hold only the intervals that end after the read.
        let read_at = as_of - Duration::milliseconds(read_before_ms);
        let ahead: Vec<Lifecycle> = timelines
            .iter()
            .map(ContainerTimeline::lifecycle)
            .filter(|lifecycle| lifecycle.last_at().is_some_and(|at| at > read_at))
            .map(|lifecycle| {
                Lifecycle::restore(lifecycle.intervals_ending_after(read_at).to_vec(), 0, 0, None)
            })
            .collect();
        for period in periods() {
            let period_totals = totals.get(&period).copied().unwrap_or_default();
            prop_assert_eq!(
                runtime_from_totals_and_ahead(period_totals, &open, period, as_of, &ahead),
                usage(&timelines, period, as_of).runtime_ms
            );
        }
    }
}

/// An instant at (`nudge_ms` 0), just before or just after one of the container events of
/// `history`, the one `pick` picks; `None` when it has none.
fn near_an_event(history: &History, pick: Index, nudge_ms: i64) -> Option<DateTime<Utc>> {
    let containers = &history.containers;
    (!containers.is_empty()).then(|| {
        containers[pick.index(containers.len())].1.occurred_at + Duration::milliseconds(nudge_ms)
    })
}

/// Each period's totals and the open runs of `timelines`, as the projection keeps them.
fn totals_and_open(
    timelines: &[ContainerTimeline],
) -> (BTreeMap<Period, PeriodTotals>, Vec<OpenRuns>) {
    let mut totals: BTreeMap<Period, PeriodTotals> = BTreeMap::new();
    let mut open: Vec<OpenRuns> = Vec::new();
    for timeline in timelines {
        for (period, runtime_ms) in timeline.lifecycle().closed_runtime_by_period() {
            totals.entry(period).or_default().closed_runtime_ms += runtime_ms;
        }
        for command in timeline.commands() {
            let period = totals
                .entry(Period::containing(command.occurred_at))
                .or_default();
            period.commands += 1;
            period.command_ms += command.duration_ms;
        }
        let pairs: std::collections::BTreeSet<(Period, u16)> = timeline
            .ports()
            .iter()
            .map(|published| (Period::containing(published.occurred_at), published.port))
            .collect();
        for (period, _) in pairs {
            totals.entry(period).or_default().ports_published += 1;
        }
        if let Some(since) = timeline.lifecycle().running_since() {
            let runs = OpenRuns::of(since);
            match open
                .iter_mut()
                .find(|group| group.since_period == runs.since_period)
            {
                Some(group) => {
                    group.running += 1;
                    group.since_offset_ms += runs.since_offset_ms;
                }
                None => open.push(runs),
            }
        }
    }
    (totals, open)
}
