//! The projection's arithmetic against the pure rules: events arrive in any order, some
//! more than once, and are projected in rounds of any size; the stored figures must give
//! exactly the usage and timelines that folding the sorted history gives, and so must a
//! replay. The database adds storage to this, which the integration tests cover.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, Duration, TimeZone, Utc};
use proptest::prelude::*;

use super::model::{
    Changes, ContainerKey, IdleCommands, OpenDelta, PeriodDelta, PortKey, ProjectedEvent,
    ANOMALIES_KEPT_MAX, LIFECYCLE_READ_MAX,
};
use crate::event::EventId;
use crate::runtime::{
    self, Anomaly, AnomalyKind, ContainerEntry, ContainerTimeline, EntryKind, Lifecycle, OpenRuns,
    Period, PeriodTotals,
};

const ORGS: usize = 2;
const CONTAINERS: usize = 3;

fn base() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 20, 0, 0, 0).unwrap()
}

fn periods() -> Vec<Period> {
    ["2026-10", "2026-11", "2026-12", "2027-01"]
        .into_iter()
        .map(|name| Period::parse(name).unwrap())
        .collect()
}

/// A container's kept anomalies, by (`occurred_at`, position): the `container_anomaly` rows.
type AnomalyTable = BTreeMap<(DateTime<Utc>, i64), Anomaly>;

/// The projection's tables, in memory: what `store::write` does to them, row for row.
#[derive(Debug, Default, PartialEq)]
struct Tables {
    /// How many anomalies a container keeps ([`ANOMALIES_KEPT_MAX`] in the store).
    kept_max: u64,
    lifecycles: HashMap<ContainerKey, Lifecycle>,
    anomalies: HashMap<ContainerKey, AnomalyTable>,
    periods: HashMap<(String, Period), PeriodDelta>,
    open: HashMap<(String, Period), OpenDelta>,
    latest: HashMap<String, DateTime<Utc>>,
    ports: HashMap<PortKey, DateTime<Utc>>,
}

impl Tables {
    /// One projector round over `round`, with `ledger` holding every event up to its end.
    /// Late containers are refolded from their whole history when `whole` says so, else
    /// as the store does: from their lifecycle events and the commands it reads in their
    /// idle spans.
    fn project(&mut self, round: &[ProjectedEvent], ledger: &[ProjectedEvent], whole: bool) {
        let stored = round
            .iter()
            .filter_map(key_of)
            .filter_map(|key| Some((key.clone(), self.lifecycles.get(&key)?.clone())))
            .collect();
        let mut changes = Changes::apply(round, &[], stored);
        let late: Vec<ContainerKey> = changes.late().cloned().collect();
        for key in late {
            let history: Vec<ContainerEntry> = ledger
                .iter()
                .filter(|event| key_of(event).as_ref() == Some(&key))
                .map(|event| event.container.as_ref().unwrap().1)
                .collect();
            if whole {
                changes.refold(&key, &history);
            } else {
                let (lifecycle, idle) = self.lifecycle_and_idle_commands(&history);
                changes.refold_lifecycle(&key, lifecycle, idle);
            }
        }
        self.write(changes.finish());
    }

    /// What the store reads for a lifecycle refold: the fold of the first
    /// [`LIFECYCLE_READ_MAX`] lifecycle events in order, and the commands whose instant one
    /// of its idle spans holds, the first `kept_max` of them in order.
    fn lifecycle_and_idle_commands(
        &self,
        history: &[ContainerEntry],
    ) -> (ContainerTimeline, IdleCommands) {
        let mut lifecycle: Vec<ContainerEntry> = history
            .iter()
            .filter(|entry| entry.kind.is_lifecycle())
            .copied()
            .collect();
        lifecycle.sort_by_key(|entry| (entry.occurred_at, entry.position));
        lifecycle.truncate(usize::try_from(LIFECYCLE_READ_MAX).unwrap());
        let lifecycle = ContainerTimeline::fold(&lifecycle);
        let spans = lifecycle.lifecycle().idle_spans();
        let mut idle: Vec<Anomaly> = history
            .iter()
            .filter(|entry| matches!(entry.kind, EntryKind::CommandRan { .. }))
            .filter(|entry| spans.iter().any(|span| span.contains(entry.occurred_at)))
            .map(|entry| Anomaly {
                kind: AnomalyKind::CommandWhileNotRunning,
                event_id: entry.event_id,
                occurred_at: entry.occurred_at,
                position: entry.position,
            })
            .collect();
        idle.sort_by_key(Anomaly::order);
        let total = idle.len() as u64;
        idle.truncate(self.kept_max as usize);
        (lifecycle, IdleCommands { total, first: idle })
    }

    fn write(&mut self, mut changes: Changes) {
        for (key, first_at) in std::mem::take(&mut changes.ports) {
            match self.ports.get_mut(&key) {
                Some(stored) => *stored = (*stored).min(first_at),
                None => {
                    changes
                        .periods
                        .entry((key.org_id.clone(), key.period))
                        .or_default()
                        .ports_published += 1;
                    self.ports.insert(key, first_at);
                }
            }
        }
        for (key, lifecycle) in changes.lifecycles() {
            if changes.intervals_unchanged(key) {
                // The store writes only the last instant and the anomaly count of these:
                // their rows must hold the intervals already.
                let stored = &self.lifecycles[key];
                assert_eq!(stored.intervals(), lifecycle.intervals(), "{key:?}");
            }
            self.lifecycles.insert(key.clone(), lifecycle.clone());
        }
        for (key, rows) in changes.anomaly_rows(self.kept_max) {
            let kept = self.anomalies.entry(key.clone()).or_default();
            if rows.replace {
                kept.clear();
            }
            for anomaly in rows.insert {
                // The store inserts without ON CONFLICT: a row already there fails.
                assert!(
                    kept.insert(anomaly.order(), anomaly).is_none(),
                    "{anomaly:?} twice"
                );
            }
            for _ in 0..rows.trim {
                kept.pop_last().expect("trims only what is kept");
            }
            assert!(
                kept.len() as u64 <= self.kept_max,
                "more anomalies kept than the limit"
            );
        }
        // As the store: a period's row is written for a delta, and goes when it holds
        // nothing.
        for (key, delta) in &changes.periods {
            if *delta == PeriodDelta::default() {
                continue;
            }
            let totals = self.periods.entry(key.clone()).or_default();
            totals.closed_runtime_ms += delta.closed_runtime_ms;
            totals.commands += delta.commands;
            totals.command_ms += delta.command_ms;
            totals.ports_published += delta.ports_published;
            if *totals == PeriodDelta::default() {
                self.periods.remove(key);
            }
        }
        // As the store: a run's row is written for a delta, and goes when a stop leaves
        // none running.
        for (key, delta) in &changes.open {
            if *delta == OpenDelta::default() {
                continue;
            }
            let open = self.open.entry(key.clone()).or_default();
            open.running += delta.running;
            open.since_offset_ms += delta.since_offset_ms;
            if delta.running < 0 && *open == OpenDelta::default() {
                self.open.remove(key);
            }
        }
        for (org, at) in &changes.latest {
            let latest = self.latest.entry(org.clone()).or_insert(*at);
            *latest = (*latest).max(*at);
        }
    }

    /// Usage as the fast path reads it; `None` where it would take the slow path.
    fn usage(&self, org: &str, period: Period, as_of: DateTime<Utc>) -> Option<runtime::Usage> {
        let delta = self
            .periods
            .get(&(org.to_owned(), period))
            .copied()
            .unwrap_or_default();
        assert!(delta.closed_runtime_ms >= 0 && delta.commands >= 0 && delta.ports_published >= 0);
        let totals = PeriodTotals {
            closed_runtime_ms: delta.closed_runtime_ms,
            commands: delta.commands as u64,
            command_ms: delta.command_ms,
            ports_published: delta.ports_published as u64,
        };
        let open: Vec<OpenRuns> = self
            .open
            .iter()
            .filter(|((owner, _), open)| owner == org && open.running > 0)
            .map(|((_, since_period), open)| OpenRuns {
                since_period: *since_period,
                running: open.running as u64,
                since_offset_ms: open.since_offset_ms,
            })
            .collect();
        let settled_at = self.latest.get(org).copied().map(runtime::settled_at);
        runtime::usage_from_totals(totals, &open, period, as_of, settled_at)
    }
}

fn key_of(event: &ProjectedEvent) -> Option<ContainerKey> {
    let (container_id, _) = event.container.as_ref()?;
    Some(ContainerKey {
        org_id: event.org_id.clone(),
        container_id: container_id.clone(),
    })
}

/// A generated event: (org, container, offset ms from `base`, kind), identified by its index.
type Spec = (usize, usize, i64, EntryKind);

fn any_kind() -> impl Strategy<Value = EntryKind> {
    prop_oneof![
        3 => Just(EntryKind::Created),
        3 => Just(EntryKind::Resumed),
        3 => Just(EntryKind::Stopped),
        2 => (0i64..10_000).prop_map(|duration_ms| EntryKind::CommandRan { duration_ms }),
        1 => (1u16..=3).prop_map(|port| EntryKind::PortPublished { port }),
    ]
}

fn any_offset() -> impl Strategy<Value = i64> {
    let day = 86_400_000i64;
    prop_oneof![
        (-25 * day..45 * day),
        // Around the December boundary, and a few shared instants.
        (11 * day - 3..11 * day + 3),
        (0i64..3).prop_map(move |hours| hours * 3_600_000),
    ]
}

/// Events, and the order they arrive in (indexes into the events, some repeated).
fn any_arrivals() -> impl Strategy<Value = (Vec<Spec>, Vec<usize>, Vec<usize>)> {
    let specs = prop::collection::vec((0..ORGS, 0..CONTAINERS, any_offset(), any_kind()), 1..40);
    specs.prop_flat_map(|specs| {
        let count = specs.len();
        let repeats = prop::collection::vec(0..count, 0..8);
        let rounds = prop::collection::vec(1usize..8, 1..60);
        (Just(specs), repeats, rounds).prop_flat_map(move |(specs, repeats, rounds)| {
            let mut order: Vec<usize> = (0..count).chain(repeats).collect();
            order.sort_unstable();
            (Just(specs), Just(order).prop_shuffle(), Just(rounds))
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn projected_rounds_and_replay_in_any_number_of_parts_equal_the_pure_rules_whatever_the_arrival_order_and_redelivery(
        (specs, arrivals, rounds) in any_arrivals(),
        after_ms in prop_oneof![Just(0i64), 0i64..40 * 86_400_000],
        kept_max in prop_oneof![1u64..4, Just(ANOMALIES_KEPT_MAX)],
        parts in 1usize..5,
        whole_refolds in any::<bool>(),
    ) {
        // The ledger stores each event once, at the position of its first arrival.
        let mut ledger: Vec<ProjectedEvent> = Vec::new();
        let mut stored = BTreeSet::new();
        for index in arrivals {
            if !stored.insert(index) {
                continue;
            }
            let (org, container, offset, kind) = specs[index];
            let position = ledger.len() as i64 + 1;
            let occurred_at = base() + Duration::milliseconds(offset);
            ledger.push(ProjectedEvent {
                position,
                recorded_at: occurred_at,
                org_id: format!("org{org}"),
                account: None,
                voids: None,
                container: Some((
                    format!("ctr{container}"),
                    ContainerEntry {
                        occurred_at,
                        position,
                        event_id: EventId::from_uuid(uuid::Uuid::from_u128(index as u128 + 1)).unwrap(),
                        kind,
                    },
                )),
            });
        }

        // The projector, in rounds of the generated sizes.
        let mut projected = Tables { kept_max, ..Tables::default() };
        let mut start = 0;
        for size in rounds.iter().cycle() {
            if start >= ledger.len() {
                break;
            }
            let end = (start + size).min(ledger.len());
            projected.project(&ledger[start..end], &ledger[..end], whole_refolds);
            start = end;
        }

        // Replay: every history at once.
        let mut histories: HashMap<ContainerKey, Vec<ContainerEntry>> = HashMap::new();
        for event in &ledger {
            histories.entry(key_of(event).unwrap()).or_default().push(event.container.as_ref().unwrap().1);
        }
        let mut replayed = Tables { kept_max, ..Tables::default() };
        replayed.write(Changes::from_histories(histories.clone(), Vec::new()));
        // Replay folds its histories in parts at once: dealt any way, the same tables.
        let mut in_parts = Tables { kept_max, ..Tables::default() };
        in_parts.write(Changes::from_histories_in_parts(histories.clone(), Vec::new(), parts));
        prop_assert_eq!(&in_parts, &replayed);

        let timelines: HashMap<ContainerKey, ContainerTimeline> = histories
            .iter()
            .map(|(key, entries)| (key.clone(), ContainerTimeline::fold(entries)))
            .collect();
        for (key, timeline) in &timelines {
            prop_assert_eq!(&projected.lifecycles[key], timeline.lifecycle());
            prop_assert_eq!(&replayed.lifecycles[key], timeline.lifecycle());
            // Kept: the first `kept_max` of the fold's anomalies, in its order.
            let first: Vec<Anomaly> =
                timeline.anomalies().iter().take(kept_max as usize).copied().collect();
            let kept = |tables: &Tables| -> Vec<Anomaly> {
                tables.anomalies.get(key).map(|kept| kept.values().copied().collect()).unwrap_or_default()
            };
            prop_assert_eq!(kept(&projected), first.clone());
            prop_assert_eq!(kept(&replayed), first);
        }
        // The same org periods have rows, which the usage export and a close list orgs by.
        let rows = |tables: &Tables| tables.periods.keys().cloned().collect::<BTreeSet<_>>();
        prop_assert_eq!(rows(&projected), rows(&replayed));
        // And the same open runs, row for row.
        prop_assert_eq!(&projected.open, &replayed.open);
        for org in 0..ORGS {
            let org = format!("org{org}");
            let Some(latest) = projected.latest.get(&org).copied() else { continue };
            let as_of = runtime::settled_at(latest) + Duration::milliseconds(after_ms);
            let mine: Vec<&ContainerTimeline> = timelines
                .iter()
                .filter(|(key, _)| key.org_id == org)
                .map(|(_, timeline)| timeline)
                .collect();
            for period in periods() {
                let expected = runtime::usage(mine.iter().copied(), period, as_of);
                prop_assert_eq!(projected.usage(&org, period, as_of), Some(expected));
                prop_assert_eq!(replayed.usage(&org, period, as_of), Some(expected));
            }
        }
    }
}
