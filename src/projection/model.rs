//! What a run of ledger events changes in the projection (pure).
//!
//! The projector reads events by position and hands them, with the stored lifecycles of
//! their containers, to [`Changes::apply`]: an event later than everything its container
//! has seen advances the lifecycle in place, and so does an earlier command or port
//! publication ([`Lifecycle::advance`]); an earlier lifecycle event marks the container
//! for a refold of its whole history ([`Changes::refold`]). Commands, ports and each org's latest
//! instant are counted per event, whatever the order, since none of them depends on
//! another event. [`Changes::finish`] then turns each container's old and new intervals
//! into runtime deltas per period, so that a late event corrects every period it touches
//! without rescanning the org. Replay builds the same [`Changes`] from complete histories.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::runtime::{
    AccountEntry, ContainerEntry, ContainerTimeline, Lifecycle, OpenRuns, Period,
};

/// A container is known by its org and its id: an id reused by another org is another
/// container there, so one tenant's events can never move another tenant's figures.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ContainerKey {
    pub org_id: String,
    pub container_id: String,
}

/// A ledger event, reduced to what the projection reads.
#[derive(Debug, Clone, PartialEq)]
pub struct ProjectedEvent {
    pub position: i64,
    pub recorded_at: DateTime<Utc>,
    pub org_id: String,
    /// `None` for org events and for types the projection does not read.
    pub container: Option<(String, ContainerEntry)>,
    /// For org events: the value it sets.
    pub account: Option<AccountEntry>,
    /// For `ledger.event_voided`: the event it voids.
    pub voids: Option<uuid::Uuid>,
}

/// Additions to an org's totals for one period; runtime may shrink when a late event
/// shortens an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PeriodDelta {
    pub closed_runtime_ms: i64,
    pub commands: i64,
    pub command_ms: i64,
    pub ports_published: i64,
}

/// Additions to an org's open intervals that started in one period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpenDelta {
    pub running: i64,
    pub since_offset_ms: i64,
}

/// A (container, port) publication in a period: the projection counts the pair the first
/// time it is stored and keeps the earliest instant.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortKey {
    pub org_id: String,
    pub period: Period,
    pub container_id: String,
    pub port: u16,
}

#[derive(Debug, Clone, PartialEq)]
struct ContainerChange {
    /// As stored before this run; `None` for a container new to the projection.
    old: Option<Lifecycle>,
    new: Lifecycle,
}

/// Everything one run of events changes; written in one transaction with the checkpoint.
#[derive(Debug, Default)]
pub struct Changes {
    containers: HashMap<ContainerKey, ContainerChange>,
    late: HashSet<ContainerKey>,
    /// Filled by [`Changes::finish`] (runtime) and by counting (commands).
    pub periods: HashMap<(String, Period), PeriodDelta>,
    pub open: HashMap<(String, Period), OpenDelta>,
    pub latest: HashMap<String, DateTime<Utc>>,
    /// The earliest publication of each pair seen in this run.
    pub ports: HashMap<PortKey, DateTime<Utc>>,
    /// Org events, stored as they are: the account state is folded from them when read.
    pub accounts: Vec<(String, AccountEntry)>,
    /// Events voided in this run, with the position of the void: stored, so that every
    /// later read of a history leaves them out.
    pub voided: Vec<(uuid::Uuid, i64)>,
    /// Voided org events: their account changes are removed.
    pub voided_accounts: Vec<uuid::Uuid>,
    /// Pairs a voided publication belonged to: their first instant (or existence) is
    /// recomputed from the publications left.
    pub voided_ports: HashSet<PortKey>,
    finished: bool,
}

impl Changes {
    /// Applies `events` (in position order) to the `stored` lifecycles of their containers.
    /// Containers that a late lifecycle event reached are listed by [`Changes::late`] and must be
    /// given their whole history with [`Changes::refold`] before [`Changes::finish`].
    /// `voided` are the events that voids among `events` take back (as stored, earlier or
    /// in this run): their containers are refolded without them.
    pub fn apply(
        events: &[ProjectedEvent],
        voided: &[ProjectedEvent],
        mut stored: HashMap<ContainerKey, Lifecycle>,
    ) -> Changes {
        let mut changes = Changes::default();
        for event in events {
            if let Some(entry) = &event.account {
                changes.accounts.push((event.org_id.clone(), entry.clone()));
            }
            let Some((container_id, entry)) = &event.container else {
                continue;
            };
            let key = ContainerKey {
                org_id: event.org_id.clone(),
                container_id: container_id.clone(),
            };
            changes.count(&key, entry);
            let change = changes.containers.entry(key.clone()).or_insert_with(|| {
                let old = stored.remove(&key);
                ContainerChange {
                    new: old.clone().unwrap_or_default(),
                    old,
                }
            });
            if changes.late.contains(&key) {
                continue;
            }
            if change.new.advance(entry).is_err() {
                changes.late.insert(key);
            }
        }
        for void in events
            .iter()
            .filter_map(|event| Some((event.voids?, event.position)))
        {
            changes.voided.push(void);
        }
        // A voided event is taken back as if it had never been stored: its counts are
        // subtracted and its container refolded without it.
        for target in voided {
            if let Some(entry) = &target.account {
                changes.voided_accounts.push(entry.event_id.as_uuid());
            }
            let Some((container_id, entry)) = &target.container else {
                continue;
            };
            let key = ContainerKey {
                org_id: target.org_id.clone(),
                container_id: container_id.clone(),
            };
            changes.uncount(&key, entry);
            changes.containers.entry(key.clone()).or_insert_with(|| {
                let old = stored.remove(&key);
                ContainerChange {
                    new: old.clone().unwrap_or_default(),
                    old,
                }
            });
            changes.late.insert(key);
        }
        changes
    }

    /// The changes of a replay: every container's whole history and every org event,
    /// nothing stored before.
    pub fn from_histories(
        histories: HashMap<ContainerKey, Vec<ContainerEntry>>,
        accounts: Vec<(String, AccountEntry)>,
    ) -> Changes {
        let mut changes = Changes {
            accounts,
            ..Changes::default()
        };
        for (key, entries) in histories {
            for entry in &entries {
                changes.count(&key, entry);
            }
            let new = ContainerTimeline::fold(&entries).into_lifecycle();
            changes
                .containers
                .insert(key, ContainerChange { old: None, new });
        }
        changes.finish()
    }

    /// Containers whose history must be read again: a late lifecycle event or a void
    /// reached them.
    pub fn late(&self) -> impl Iterator<Item = &ContainerKey> {
        self.late.iter()
    }

    /// Replaces a late container's lifecycle with the fold of its whole history, up to and
    /// including the last event of this run.
    pub fn refold(&mut self, key: &ContainerKey, history: &[ContainerEntry]) {
        assert!(self.late.contains(key), "{key:?} was not late");
        let change = self
            .containers
            .get_mut(key)
            .expect("a late container has a change");
        change.new = ContainerTimeline::fold(history).into_lifecycle();
    }

    /// Adds each container's runtime delta: closed runtime per period and open intervals,
    /// new minus old.
    pub fn finish(mut self) -> Changes {
        assert!(!self.finished, "finished twice");
        for (key, change) in &self.containers {
            let empty = Lifecycle::default();
            let old = change.old.as_ref().unwrap_or(&empty);
            let mut runtime: BTreeMap<Period, i64> = change.new.closed_runtime_by_period();
            for (period, runtime_ms) in old.closed_runtime_by_period() {
                *runtime.entry(period).or_insert(0) -= runtime_ms;
            }
            for (period, runtime_ms) in runtime {
                if runtime_ms != 0 {
                    self.periods
                        .entry((key.org_id.clone(), period))
                        .or_default()
                        .closed_runtime_ms += runtime_ms;
                }
            }
            let (old_since, new_since) = (old.running_since(), change.new.running_since());
            if old_since != new_since {
                for (since, sign) in [(old_since, -1), (new_since, 1)] {
                    let Some(since) = since else { continue };
                    let runs = OpenRuns::of(since);
                    let open = self
                        .open
                        .entry((key.org_id.clone(), runs.since_period))
                        .or_default();
                    open.running += sign;
                    open.since_offset_ms += sign * runs.since_offset_ms;
                }
            }
        }
        self.finished = true;
        self
    }

    /// The lifecycles to store, for the containers this run touched.
    pub fn lifecycles(&self) -> impl Iterator<Item = (&ContainerKey, &Lifecycle)> {
        assert!(self.finished, "lifecycles before finish");
        self.containers
            .iter()
            .filter(|(_, change)| change.new.last_at().is_some())
            .map(|(key, change)| (key, &change.new))
    }

    /// Containers left with no event at all (every one voided): their rows go.
    pub fn removed(&self) -> impl Iterator<Item = &ContainerKey> {
        self.containers
            .iter()
            .filter(|(_, change)| change.new.last_at().is_none())
            .map(|(key, _)| key)
    }

    /// Takes back what [`Self::count`] added for a voided event.
    fn uncount(&mut self, key: &ContainerKey, entry: &ContainerEntry) {
        let period = Period::containing(entry.occurred_at);
        match entry.kind {
            crate::runtime::EntryKind::CommandRan { duration_ms } => {
                let totals = self
                    .periods
                    .entry((key.org_id.clone(), period))
                    .or_default();
                totals.commands -= 1;
                totals.command_ms -= duration_ms;
            }
            crate::runtime::EntryKind::PortPublished { port } => {
                self.voided_ports.insert(PortKey {
                    org_id: key.org_id.clone(),
                    period,
                    container_id: key.container_id.clone(),
                    port,
                });
            }
            _ => {}
        }
    }

    fn count(&mut self, key: &ContainerKey, entry: &ContainerEntry) {
        let latest = self
            .latest
            .entry(key.org_id.clone())
            .or_insert(entry.occurred_at);
        *latest = (*latest).max(entry.occurred_at);
        let period = Period::containing(entry.occurred_at);
        match entry.kind {
            crate::runtime::EntryKind::CommandRan { duration_ms } => {
                let totals = self
                    .periods
                    .entry((key.org_id.clone(), period))
                    .or_default();
                totals.commands += 1;
                totals.command_ms += duration_ms;
            }
            crate::runtime::EntryKind::PortPublished { port } => {
                let first = self
                    .ports
                    .entry(PortKey {
                        org_id: key.org_id.clone(),
                        period,
                        container_id: key.container_id.clone(),
                        port,
                    })
                    .or_insert(entry.occurred_at);
                *first = (*first).min(entry.occurred_at);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::EntryKind::{self, CommandRan, Created, PortPublished, Stopped};
    use chrono::TimeZone;

    fn at(day: u32, hour: u32) -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, day, hour, 0, 0).unwrap()
    }

    fn event(
        position: i64,
        container: &str,
        occurred_at: DateTime<Utc>,
        kind: EntryKind,
    ) -> ProjectedEvent {
        ProjectedEvent {
            position,
            recorded_at: occurred_at,
            org_id: "org".into(),
            account: None,
            voids: None,
            container: Some((
                container.into(),
                ContainerEntry {
                    occurred_at,
                    position,
                    event_id: crate::event::EventId::from_uuid(uuid::Uuid::from_u128(
                        position as u128,
                    ))
                    .unwrap(),
                    kind,
                },
            )),
        }
    }

    fn key(container: &str) -> ContainerKey {
        ContainerKey {
            org_id: "org".into(),
            container_id: container.into(),
        }
    }

    fn period(name: &str) -> (String, Period) {
        ("org".into(), Period::parse(name).unwrap())
    }

    #[test]
    fn events_in_order_advance_without_a_refold_and_count_commands_and_ports() {
        let events = [
            event(1, "a", at(1, 0), Created),
            event(2, "a", at(1, 1), CommandRan { duration_ms: 70 }),
            event(3, "a", at(1, 2), PortPublished { port: 443 }),
            event(4, "a", at(1, 3), PortPublished { port: 443 }),
            event(5, "a", at(1, 4), Stopped),
        ];
        let changes = Changes::apply(&events, &[], HashMap::new());
        assert_eq!(changes.late().count(), 0);
        let changes = changes.finish();
        let november = changes.periods[&period("2026-11")];
        assert_eq!(
            november,
            PeriodDelta {
                closed_runtime_ms: 4 * 3_600_000,
                commands: 1,
                command_ms: 70,
                ports_published: 0,
            }
        );
        assert_eq!(changes.ports.len(), 1, "one pair, counted when stored");
        assert!(changes.open.values().all(|open| open.running == 0));
        assert_eq!(changes.latest["org"], at(1, 4));
    }

    #[test]
    fn a_late_stop_marks_its_container_for_a_refold_and_moves_runtime_by_delta() {
        // Stored: created on Nov 1 and still running.
        let stored =
            ContainerTimeline::fold(&[event(1, "a", at(1, 0), Created).container.unwrap().1])
                .into_lifecycle();
        let late_stop = event(3, "a", at(1, 2), Stopped);
        let mut changes = Changes::apply(
            &[
                event(2, "a", at(2, 0), CommandRan { duration_ms: 1 }),
                late_stop.clone(),
            ],
            &[],
            HashMap::from([(key("a"), stored)]),
        );
        assert_eq!(changes.late().cloned().collect::<Vec<_>>(), vec![key("a")]);
        let history: Vec<ContainerEntry> = [
            event(1, "a", at(1, 0), Created),
            event(2, "a", at(2, 0), CommandRan { duration_ms: 1 }),
            late_stop,
        ]
        .into_iter()
        .map(|event| event.container.unwrap().1)
        .collect();
        changes.refold(&key("a"), &history);
        let changes = changes.finish();
        assert_eq!(
            changes.periods[&period("2026-11")].closed_runtime_ms,
            2 * 3_600_000
        );
        let open = changes.open[&period("2026-11")];
        assert_eq!(
            open,
            OpenDelta {
                running: -1,
                since_offset_ms: 0
            }
        );
        let (_, lifecycle) = changes.lifecycles().next().unwrap();
        assert_eq!(
            lifecycle.anomalies().len(),
            1,
            "the command now ran while stopped"
        );
    }

    #[test]
    fn a_late_command_or_port_changes_its_container_in_place_and_marks_no_refold() {
        // Stored: created on Nov 1, stopped on Nov 3.
        let stored = ContainerTimeline::fold(
            &[
                event(1, "a", at(1, 0), Created),
                event(2, "a", at(3, 0), Stopped),
            ]
            .map(|event| event.container.unwrap().1),
        )
        .into_lifecycle();
        let changes = Changes::apply(
            &[
                event(3, "a", at(2, 0), CommandRan { duration_ms: 5 }),
                event(4, "a", at(4, 0), CommandRan { duration_ms: 7 }),
                event(5, "a", at(1, 1), PortPublished { port: 8080 }),
                // Late, and after the stop: placed before event 4's anomaly.
                event(6, "a", at(3, 1), CommandRan { duration_ms: 1 }),
            ],
            &[],
            HashMap::from([(key("a"), stored)]),
        );
        assert_eq!(changes.late().count(), 0, "no history to read");
        let changes = changes.finish();
        let november = changes.periods[&period("2026-11")];
        assert_eq!((november.commands, november.command_ms), (3, 13));
        assert_eq!(november.closed_runtime_ms, 0, "the intervals did not move");
        let (_, lifecycle) = changes.lifecycles().next().unwrap();
        assert_eq!(
            lifecycle
                .anomalies()
                .iter()
                .map(|a| a.position)
                .collect::<Vec<_>>(),
            vec![6, 4],
            "the commands after the stop ran while not running, in occurred_at order"
        );
    }
}
