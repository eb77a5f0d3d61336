//! What a run of ledger events changes in the projection (pure).
//!
//! The projector reads events by position and hands them, with the stored lifecycles of
//! their containers, to [`Changes::apply`]: an event later than everything its container
//! has seen advances the lifecycle in place, and so does an earlier command or port
//! publication ([`Lifecycle::advance`]); an earlier lifecycle event marks the container
//! for a refold ([`Changes::refold_lifecycle`]): of its lifecycle events, with the commands
//! that fall outside its new intervals, or of its whole history when a void reached it
//! ([`Changes::refold`]). Commands, ports and each org's latest
//! instant are counted per event, whatever the order, since none of them depends on
//! another event. [`Changes::finish`] then turns each container's old and new intervals
//! into runtime deltas per period, so that a late event corrects every period it touches
//! without rescanning the org. Replay builds the same [`Changes`] from complete histories.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, Utc};

use crate::runtime::{
    AccountEntry, Anomaly, ContainerEntry, ContainerTimeline, Lifecycle, OpenRuns, Period,
    LIFECYCLE_EVENTS_MAX,
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

/// How many anomalies the projection keeps of one container: the first ones in
/// (`occurred_at`, position) order; past it, `anomalies_total` still counts every one and
/// the ledger still holds the events. A producer that never sends `created` (or a hostile
/// one) would otherwise grow one container's rows without bound; ten thousand is far more
/// than an operator reads, and the first of them show when the trouble began.
pub const ANOMALIES_KEPT_MAX: u64 = 10_000;

/// How many of a late container's lifecycle events a lifecycle refold reads, the first in
/// (`occurred_at`, position) order: the [`LIFECYCLE_EVENTS_MAX`] the fold walks and as many
/// past them as a container keeps anomalies. Every later one is an anomaly that no kept
/// row can hold, since the ones read are earlier anomalies; it is counted, not read
/// ([`Changes::refold_lifecycle`]).
pub const LIFECYCLE_READ_MAX: u64 = LIFECYCLE_EVENTS_MAX + ANOMALIES_KEPT_MAX;

/// What a run does to one container's kept anomalies.
#[derive(Debug, Clone, PartialEq, Default)]
enum AnomalyChange {
    /// New anomalies, added to those stored (in the order they were caused).
    #[default]
    Added,
    /// The whole list (a refold or a replay): the stored ones are replaced.
    Replaced,
}

#[derive(Debug, Clone, PartialEq)]
struct ContainerChange {
    /// As stored before this run; `None` for a container new to the projection.
    old: Option<Lifecycle>,
    new: Lifecycle,
    anomalies_change: AnomalyChange,
    /// Added or replacing, as `anomalies_change` says.
    anomalies: Vec<Anomaly>,
    /// The latest `occurred_at` of this run's entries of the container.
    run_last_at: Option<DateTime<Utc>>,
    /// How many of this run's entries of the container are lifecycle entries.
    run_lifecycle: u64,
    /// A void in this run took back one of its events.
    voided: bool,
}

impl ContainerChange {
    fn of(old: Option<Lifecycle>) -> ContainerChange {
        ContainerChange {
            new: old.clone().unwrap_or_default(),
            old,
            anomalies_change: AnomalyChange::Added,
            anomalies: Vec::new(),
            run_last_at: None,
            run_lifecycle: 0,
            voided: false,
        }
    }

    /// Takes `new` and `anomalies`, the container's whole fold, in place of what it had.
    fn replace(&mut self, new: Lifecycle, anomalies: Vec<Anomaly>) {
        self.new = new;
        self.anomalies_change = AnomalyChange::Replaced;
        self.anomalies = anomalies;
    }
}

/// The commands a late container ran while it was not running, by its refolded intervals,
/// as read from the ledger ([`Lifecycle::idle_spans`]): how many, and the first of them in
/// (`occurred_at`, position) order, as `command_while_not_running` anomalies; at least as
/// many as a container keeps, or all of them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IdleCommands {
    pub total: u64,
    pub first: Vec<Anomaly>,
}

/// The statements' worth of one container's kept anomalies: what the store (and the
/// in-memory tables of the property tests) does with them, so that both keep exactly the
/// first `kept_max` in (`occurred_at`, position) order of all the container's anomalies.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AnomalyRows {
    /// Delete every stored anomaly first.
    pub replace: bool,
    /// Rows to insert, in (`occurred_at`, position) order.
    pub insert: Vec<Anomaly>,
    /// Then delete this many of the stored ones, from the last in order back.
    pub trim: u64,
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
    /// Containers that a late lifecycle event or a void reached, or stored as no fold gives
    /// ([`Lifecycle::runs_past_the_lifecycle_limit`]), are listed by
    /// [`Changes::late`] and must be refolded before [`Changes::finish`]: with
    /// [`Changes::refold_lifecycle`], or with their whole history by [`Changes::refold`]
    /// where [`Changes::reached_by_void`] says so (either where no void reached them).
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
            let change = changes
                .containers
                .entry(key.clone())
                .or_insert_with(|| ContainerChange::of(stored.remove(&key)));
            change.run_last_at = change.run_last_at.max(Some(entry.occurred_at));
            change.run_lifecycle += u64::from(entry.kind.is_lifecycle());
            if change.new.runs_past_the_lifecycle_limit() {
                changes.late.insert(key.clone());
            }
            if changes.late.contains(&key) {
                continue;
            }
            match change.new.advance(entry) {
                Ok(anomaly) => change.anomalies.extend(anomaly),
                Err(_) => {
                    changes.late.insert(key);
                }
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
            changes
                .containers
                .entry(key.clone())
                .or_insert_with(|| ContainerChange::of(stored.remove(&key)))
                .voided = true;
            changes.late.insert(key);
        }
        changes.drop_voided_accounts();
        changes
    }

    /// An account event voided in the run that stores it is not stored: the store takes
    /// the voided ones back before it writes the run's.
    fn drop_voided_accounts(&mut self) {
        if !self.voided_accounts.is_empty() {
            let voided: HashSet<uuid::Uuid> = self.voided_accounts.iter().copied().collect();
            self.accounts
                .retain(|(_, entry)| !voided.contains(&entry.event_id.as_uuid()));
        }
    }

    /// The changes of a replay: every container's whole history and every org event,
    /// nothing stored before.
    pub fn from_histories(
        histories: impl IntoIterator<Item = (ContainerKey, Vec<ContainerEntry>)>,
        accounts: Vec<(String, AccountEntry)>,
    ) -> Changes {
        let mut changes = Changes {
            accounts,
            ..Changes::default()
        };
        for (key, entries) in histories {
            changes.count_history(&key, &entries);
            let (new, anomalies) = ContainerTimeline::fold(&entries).into_parts();
            let mut change = ContainerChange::of(None);
            change.replace(new, anomalies);
            changes.containers.insert(key, change);
        }
        changes.finish()
    }

    /// [`Self::from_histories`], with the histories dealt into `parts` shares folded at
    /// once, each on a thread of its own, and the shares' changes merged: a replay folds
    /// every container of the ledger, and each container's fold needs only its own
    /// history. Blocks the calling thread until every share is folded.
    pub fn from_histories_in_parts(
        histories: impl IntoIterator<Item = (ContainerKey, Vec<ContainerEntry>)>,
        accounts: Vec<(String, AccountEntry)>,
        parts: usize,
    ) -> Changes {
        let parts = parts.max(1);
        let mut shares: Vec<Vec<(ContainerKey, Vec<ContainerEntry>)>> =
            (0..parts).map(|_| Vec::new()).collect();
        for (index, history) in histories.into_iter().enumerate() {
            shares[index % parts].push(history);
        }
        let first = shares.remove(0);
        std::thread::scope(|scope| {
            let others: Vec<_> = shares
                .into_iter()
                .map(|share| scope.spawn(|| Changes::from_histories(share, Vec::new())))
                .collect();
            let mut changes = Changes::from_histories(first, accounts);
            for other in others {
                changes.merge(other.join().expect("a fold does not panic"));
            }
            changes
        })
    }

    /// Adds the finished changes of other containers (none of them in `self`) to these:
    /// totals and open intervals add up, the latest instant and the earliest publication
    /// are kept.
    fn merge(&mut self, other: Changes) {
        assert!(self.finished && other.finished, "merged before finish");
        let Changes {
            containers,
            late,
            periods,
            open,
            latest,
            ports,
            accounts,
            voided,
            voided_accounts,
            voided_ports,
            finished: _,
        } = other;
        for (key, change) in containers {
            let previous = self.containers.insert(key, change);
            assert!(previous.is_none(), "merged changes share a container");
        }
        self.late.extend(late);
        for (key, delta) in periods {
            let totals = self.periods.entry(key).or_default();
            totals.closed_runtime_ms += delta.closed_runtime_ms;
            totals.commands += delta.commands;
            totals.command_ms += delta.command_ms;
            totals.ports_published += delta.ports_published;
        }
        for (key, delta) in open {
            let totals = self.open.entry(key).or_default();
            totals.running += delta.running;
            totals.since_offset_ms += delta.since_offset_ms;
        }
        for (org_id, at) in latest {
            let kept = self.latest.entry(org_id).or_insert(at);
            *kept = (*kept).max(at);
        }
        for (key, at) in ports {
            let first = self.ports.entry(key).or_insert(at);
            *first = (*first).min(at);
        }
        self.accounts.extend(accounts);
        self.voided.extend(voided);
        self.voided_accounts.extend(voided_accounts);
        self.voided_ports.extend(voided_ports);
    }

    /// Containers whose history must be read again: a late lifecycle event or a void
    /// reached them, or they were stored running past the lifecycle limit.
    pub fn late(&self) -> impl Iterator<Item = &ContainerKey> {
        self.late.iter()
    }

    /// Whether a void in this run reached the late container `key`: it is refolded from
    /// its whole history ([`Self::refold`]), since the void may have taken back its latest
    /// instant; any other late container from its lifecycle events
    /// ([`Self::refold_lifecycle`]).
    pub fn reached_by_void(&self, key: &ContainerKey) -> bool {
        self.containers.get(key).is_some_and(|change| change.voided)
    }

    /// Replaces a late container's lifecycle with the fold of its whole history, up to and
    /// including the last event of this run.
    pub fn refold(&mut self, key: &ContainerKey, history: &[ContainerEntry]) {
        let (new, anomalies) = ContainerTimeline::fold(history).into_parts();
        self.late_change(key).replace(new, anomalies);
    }

    /// Replaces a late container's lifecycle, as [`Self::refold`] would, from the fold of
    /// its lifecycle events alone (`lifecycle`, every created, resumed and stopped up to
    /// and including the last event of this run) and the commands that ran outside the
    /// intervals of that fold (`idle`): commands and ports never move an interval, and a
    /// command is an anomaly exactly when no interval holds its instant. The latest
    /// instant is the stored one or this run's, since no void reached the container. So
    /// a late stop costs the container's lifecycle and its idle commands, however many
    /// commands it ran while running.
    ///
    /// `lifecycle` may be the fold of the first [`LIFECYCLE_READ_MAX`] lifecycle events
    /// only: the later ones, past [`LIFECYCLE_EVENTS_MAX`], change no interval and are
    /// anomalies, counted from the stored number of lifecycle events and this run's.
    pub fn refold_lifecycle(
        &mut self,
        key: &ContainerKey,
        lifecycle: ContainerTimeline,
        idle: IdleCommands,
    ) {
        assert!(
            lifecycle.commands().is_empty() && lifecycle.ports().is_empty(),
            "{key:?}: a lifecycle refold is given lifecycle events only"
        );
        let change = self.late_change(key);
        assert!(!change.voided, "{key:?}: a void needs the whole history");
        let last_at = change
            .old
            .as_ref()
            .and_then(Lifecycle::last_at)
            .max(change.run_last_at);
        let (folded, mut anomalies) = lifecycle.into_parts();
        let read = folded.lifecycle_total();
        assert!(
            read <= LIFECYCLE_READ_MAX,
            "{key:?}: {read} lifecycle events read"
        );
        let lifecycle_total = if read < LIFECYCLE_READ_MAX {
            read
        } else {
            let known = change.old.as_ref().map_or(0, Lifecycle::lifecycle_total);
            (known + change.run_lifecycle).max(read)
        };
        let total = anomalies.len() as u64 + (lifecycle_total - read) + idle.total;
        anomalies.extend(idle.first);
        anomalies.sort_by_key(Anomaly::order);
        change.replace(
            Lifecycle::restore(folded.intervals().to_vec(), total, lifecycle_total, last_at),
            anomalies,
        );
    }

    fn late_change(&mut self, key: &ContainerKey) -> &mut ContainerChange {
        assert!(self.late.contains(key), "{key:?} was not late");
        self.containers
            .get_mut(key)
            .expect("a late container has a change")
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

    /// Whether this run left `key`'s intervals as they were stored before it, so that only
    /// its last instant and anomaly count move (a command or a port of a running container,
    /// the usual event); false for a container new to the projection.
    pub fn intervals_unchanged(&self, key: &ContainerKey) -> bool {
        self.containers.get(key).is_some_and(|change| {
            change
                .old
                .as_ref()
                .is_some_and(|old| old.intervals() == change.new.intervals())
        })
    }

    /// What to do to the kept anomalies of each container this run touched (none for a
    /// container whose rows go, see [`Self::removed`]), keeping the first `kept_max`.
    ///
    /// Stored, a container keeps the first min(`anomalies_total`, `kept_max`) anomalies in
    /// order. New ones are inserted and the excess trimmed from the end of the order,
    /// except those that certainly fall past `kept_max`: one after everything stored (an
    /// in-order event) with `kept_max` or more anomalies before it. So a container at the
    /// limit writes no anomaly row for an in-order event, and every other event writes
    /// and trims a bounded number: the cost never grows with what is stored.
    pub fn anomaly_rows(
        &self,
        kept_max: u64,
    ) -> impl Iterator<Item = (&ContainerKey, AnomalyRows)> {
        assert!(self.finished, "anomaly rows before finish");
        assert!(kept_max > 0, "a container keeps at least one anomaly");
        self.containers
            .iter()
            .filter(|(_, change)| change.new.last_at().is_some())
            .filter_map(move |(key, change)| {
                let rows = match change.anomalies_change {
                    AnomalyChange::Replaced => AnomalyRows {
                        replace: true,
                        insert: change
                            .anomalies
                            .iter()
                            .take(usize::try_from(kept_max).unwrap_or(usize::MAX))
                            .copied()
                            .collect(),
                        trim: 0,
                    },
                    AnomalyChange::Added if change.anomalies.is_empty() => return None,
                    AnomalyChange::Added => {
                        let old_total = change.old.as_ref().map_or(0, Lifecycle::anomalies_total);
                        let old_last_at = change.old.as_ref().and_then(Lifecycle::last_at);
                        let mut added = change.anomalies.clone();
                        added.sort_by_key(Anomaly::order);
                        let insert: Vec<Anomaly> = added
                            .into_iter()
                            .enumerate()
                            .filter(|(before, anomaly)| {
                                let after_stored =
                                    old_last_at.is_none_or(|last_at| anomaly.occurred_at > last_at);
                                !(after_stored && old_total + *before as u64 >= kept_max)
                            })
                            .map(|(_, anomaly)| anomaly)
                            .collect();
                        let kept_before = old_total.min(kept_max);
                        let trim = (kept_before + insert.len() as u64).saturating_sub(kept_max);
                        AnomalyRows {
                            replace: false,
                            insert,
                            trim,
                        }
                    }
                };
                Some((key, rows))
            })
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

    /// What [`Self::count`] adds for every entry of `entries`, added once per org, period
    /// and pair rather than once per entry (each of which copies the org's id into a map
    /// key): a replay counts every event of the ledger this way.
    fn count_history(&mut self, key: &ContainerKey, entries: &[ContainerEntry]) {
        let Some(latest) = entries.iter().map(|entry| entry.occurred_at).max() else {
            return;
        };
        match self.latest.get_mut(&key.org_id) {
            Some(at) => *at = (*at).max(latest),
            None => {
                self.latest.insert(key.org_id.clone(), latest);
            }
        }
        // A container's events fall in a few periods and publish a few ports: a short
        // list searched in place beats a map.
        let mut commands: Vec<(Period, i64, i64)> = Vec::new();
        let mut ports: Vec<(Period, u16, DateTime<Utc>)> = Vec::new();
        for entry in entries {
            let period = Period::containing(entry.occurred_at);
            match entry.kind {
                crate::runtime::EntryKind::CommandRan { duration_ms } => {
                    match commands.iter_mut().find(|(seen, _, _)| *seen == period) {
                        Some((_, count, ms)) => {
                            *count += 1;
                            *ms += duration_ms;
                        }
                        None => commands.push((period, 1, duration_ms)),
                    }
                }
                crate::runtime::EntryKind::PortPublished { port } => {
                    match ports
                        .iter_mut()
                        .find(|(seen, number, _)| *seen == period && *number == port)
                    {
                        Some((_, _, first)) => *first = (*first).min(entry.occurred_at),
                        None => ports.push((period, port, entry.occurred_at)),
                    }
                }
                _ => {}
            }
        }
        for (period, count, ms) in commands {
            self.add_commands(key, period, count, ms);
        }
        for (period, port, at) in ports {
            self.publish_port(key, period, port, at);
        }
    }

    /// Adds `count` commands of `ms` in all to the period's totals of `key`'s org.
    fn add_commands(&mut self, key: &ContainerKey, period: Period, count: i64, ms: i64) {
        let totals = self
            .periods
            .entry((key.org_id.clone(), period))
            .or_default();
        totals.commands += count;
        totals.command_ms += ms;
    }

    /// Keeps the earliest publication of `port` by `key`'s container in the period.
    fn publish_port(&mut self, key: &ContainerKey, period: Period, port: u16, at: DateTime<Utc>) {
        let first = self
            .ports
            .entry(PortKey {
                org_id: key.org_id.clone(),
                period,
                container_id: key.container_id.clone(),
                port,
            })
            .or_insert(at);
        *first = (*first).min(at);
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
                self.add_commands(key, period, 1, duration_ms);
            }
            crate::runtime::EntryKind::PortPublished { port } => {
                self.publish_port(key, period, port, entry.occurred_at);
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

    #[test]
    fn a_stored_container_running_past_the_lifecycle_limit_is_refolded_at_its_next_event() {
        // As a projection made before the limit may hold it: running, with more lifecycle
        // events than the fold walks. Its stop would be past the limit and leave it
        // running; it is refolded instead, and one within the limit is not.
        for (lifecycle_total, late) in [(LIFECYCLE_EVENTS_MAX + 5, true), (10, false)] {
            let stored = Lifecycle::restore(
                vec![crate::runtime::Interval::new(at(1, 0), None)],
                0,
                lifecycle_total,
                Some(at(1, 0)),
            );
            let changes = Changes::apply(
                &[event(7, "c1", at(2, 0), Stopped)],
                &[],
                HashMap::from([(key("c1"), stored)]),
            );
            let refolded: Vec<&ContainerKey> = changes.late().collect();
            assert_eq!(
                refolded.len(),
                usize::from(late),
                "{lifecycle_total} events"
            );
        }
    }

    fn period(name: &str) -> (String, Period) {
        ("org".into(), Period::parse(name).unwrap())
    }

    #[test]
    fn an_account_event_voided_in_the_run_that_stores_it_is_not_stored_and_one_before_is_kept() {
        let account = |position: i64, verified: bool| ProjectedEvent {
            position,
            recorded_at: at(1, 0),
            org_id: "org".into(),
            container: None,
            voids: None,
            account: Some(AccountEntry {
                occurred_at: at(1, 0),
                position,
                event_id: crate::event::EventId::from_uuid(uuid::Uuid::from_u128(position as u128))
                    .unwrap(),
                change: crate::runtime::AccountChange::Verified(verified),
            }),
        };
        let voided = account(1, true);
        let void = ProjectedEvent {
            position: 3,
            account: None,
            voids: Some(uuid::Uuid::from_u128(1)),
            ..account(3, false)
        };
        let kept = account(2, false);
        let changes = Changes::apply(
            &[voided.clone(), kept.clone(), void],
            &[voided],
            HashMap::new(),
        );
        assert_eq!(
            changes.accounts,
            [("org".to_owned(), kept.account.unwrap())]
        );
        assert_eq!(changes.voided_accounts, [uuid::Uuid::from_u128(1)]);
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
    fn only_containers_stored_before_whose_intervals_the_run_left_alone_keep_their_intervals() {
        // Stored: a, b and c created on Nov 1 and still running; d is new.
        let running =
            ContainerTimeline::fold(&[event(1, "a", at(1, 0), Created).container.unwrap().1])
                .into_lifecycle();
        let stored = ["a", "b", "c"].map(|container| (key(container), running.clone()));
        let changes = Changes::apply(
            &[
                event(2, "a", at(2, 0), CommandRan { duration_ms: 1 }),
                event(3, "b", at(2, 0), PortPublished { port: 443 }),
                event(4, "c", at(2, 0), Stopped),
                event(5, "d", at(2, 0), Created),
                // A late command moves no interval either.
                event(6, "a", at(1, 12), CommandRan { duration_ms: 1 }),
            ],
            &[],
            HashMap::from(stored),
        );
        assert_eq!(changes.late().count(), 0);
        let changes = changes.finish();
        let unchanged: Vec<bool> = ["a", "b", "c", "d", "never touched"]
            .map(|container| changes.intervals_unchanged(&key(container)))
            .into();
        assert_eq!(unchanged, [true, true, false, false, false]);
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
            lifecycle.anomalies_total(),
            1,
            "the command now ran while stopped"
        );
        let (_, rows) = changes.anomaly_rows(ANOMALIES_KEPT_MAX).next().unwrap();
        assert!(rows.replace, "a refold replaces the stored anomalies");
        assert_eq!(
            rows.insert.iter().map(|a| a.position).collect::<Vec<_>>(),
            [2]
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
        assert_eq!(lifecycle.anomalies_total(), 2);
        let (_, rows) = changes.anomaly_rows(ANOMALIES_KEPT_MAX).next().unwrap();
        assert_eq!(
            rows,
            AnomalyRows {
                replace: false,
                insert: rows.insert.clone(),
                trim: 0
            }
        );
        assert_eq!(
            rows.insert.iter().map(|a| a.position).collect::<Vec<_>>(),
            vec![6, 4],
            "the commands after the stop ran while not running, added in occurred_at order"
        );
    }

    /// Stored: a container never created, with `total` commands at hours 1..=total.
    fn stray(total: i64) -> HashMap<ContainerKey, Lifecycle> {
        let history: Vec<ContainerEntry> = (1..=total)
            .map(|hour| {
                event(
                    hour,
                    "a",
                    at(1, 0) + chrono::Duration::hours(hour),
                    CommandRan { duration_ms: 1 },
                )
                .container
                .unwrap()
                .1
            })
            .collect();
        HashMap::from([(key("a"), ContainerTimeline::fold(&history).into_lifecycle())])
    }

    #[test]
    fn a_container_at_the_anomaly_limit_writes_no_row_for_an_event_in_order() {
        let later = at(1, 0) + chrono::Duration::hours(10);
        let changes = Changes::apply(
            &[event(11, "a", later, CommandRan { duration_ms: 1 })],
            &[],
            stray(3),
        )
        .finish();
        let (_, lifecycle) = changes.lifecycles().next().unwrap();
        assert_eq!(lifecycle.anomalies_total(), 4, "counted past the limit");
        let (_, rows) = changes.anomaly_rows(3).next().unwrap();
        assert_eq!(rows, AnomalyRows::default(), "nothing to insert or trim");
    }

    #[test]
    fn a_late_anomaly_before_the_last_kept_one_takes_its_place() {
        // Kept: hours 1, 2, 3 (the limit); a command at hour 1½ arrives late.
        let late = at(1, 0) + chrono::Duration::minutes(90);
        let changes = Changes::apply(
            &[event(11, "a", late, CommandRan { duration_ms: 1 })],
            &[],
            stray(3),
        )
        .finish();
        let (_, rows) = changes.anomaly_rows(3).next().unwrap();
        assert!(!rows.replace);
        assert_eq!(
            rows.insert.iter().map(|a| a.position).collect::<Vec<_>>(),
            [11]
        );
        assert_eq!(rows.trim, 1, "hour 3's anomaly goes");
    }

    #[test]
    fn a_new_container_keeps_only_the_first_anomalies_up_to_the_limit() {
        let events: Vec<ProjectedEvent> = (1..=5)
            .map(|hour| event(hour, "a", at(1, hour as u32), CommandRan { duration_ms: 1 }))
            .collect();
        let changes = Changes::apply(&events, &[], HashMap::new()).finish();
        let (_, rows) = changes.anomaly_rows(2).next().unwrap();
        assert_eq!(
            rows.insert.iter().map(|a| a.position).collect::<Vec<_>>(),
            [1, 2]
        );
        assert_eq!(rows.trim, 0);
        let (_, lifecycle) = changes.lifecycles().next().unwrap();
        assert_eq!(lifecycle.anomalies_total(), 5);
    }
}
