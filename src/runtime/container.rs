//! One container's history, folded: its running intervals, state, anomalies, commands and
//! published ports.
//!
//! A projector hands [`ContainerTimeline::fold`] every container event it has for one
//! container, in whatever order they arrived. The fold orders them by (`occurred_at`, ledger
//! position) and walks the state machine of contract §3. Because it always starts from the
//! whole history, a late event yields exactly the figures it would have yielded in order.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use super::ledger_order;
use super::period::{millis_between, Period, Window};
use crate::event::{Event, EventData, EventId};

/// A container event, reduced to what the runtime rules read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContainerEntry {
    /// Milliseconds only, as events are stored.
    pub occurred_at: DateTime<Utc>,
    /// Ledger position: breaks ties between events at the same millisecond.
    pub position: i64,
    pub event_id: EventId,
    pub kind: EntryKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    Created,
    Resumed,
    Stopped,
    CommandRan { duration_ms: i64 },
    PortPublished { port: u16 },
}

impl EntryKind {
    /// `created`, `resumed` or `stopped`: an entry that walks the state machine.
    pub fn is_lifecycle(self) -> bool {
        matches!(
            self,
            EntryKind::Created | EntryKind::Resumed | EntryKind::Stopped
        )
    }
}

impl ContainerEntry {
    /// The entry for a container event stored at `position`; `None` for org events.
    pub fn from_event(event: &Event, position: i64) -> Option<ContainerEntry> {
        let kind = match &event.data {
            EventData::ContainerCreated(_) => EntryKind::Created,
            EventData::ContainerResumed(_) => EntryKind::Resumed,
            EventData::ContainerStopped(_) => EntryKind::Stopped,
            EventData::ContainerCommandRan(command) => EntryKind::CommandRan {
                duration_ms: i64::try_from(command.duration_ms)
                    .expect("validation bounds duration_ms far below i64::MAX"),
            },
            EventData::ContainerPortPublished(port) => EntryKind::PortPublished { port: port.port },
            EventData::OrgPlanChanged(_)
            | EventData::OrgVerificationChanged(_)
            | EventData::OrgBillingEligibilityChanged(_)
            | EventData::PlanDefined(_)
            | EventData::Correction(_) => return None,
        };
        Some(ContainerEntry {
            occurred_at: event.occurred_at,
            position,
            event_id: event.id,
            kind,
        })
    }
}

/// A span during which the container was running: `[start, end)`, or from `start` on while
/// `end` is `None`. A stop at the very millisecond of the start leaves a zero-length
/// interval: it is kept, so the timeline shows that the container did start, and it counts
/// no runtime and contains no instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    start: DateTime<Utc>,
    end: Option<DateTime<Utc>>,
}

impl Interval {
    /// Panics if `end` is before `start`: intervals come from folds, or from a projection
    /// that stored a fold.
    pub fn new(start: DateTime<Utc>, end: Option<DateTime<Utc>>) -> Interval {
        assert!(
            end.is_none_or(|end| end >= start),
            "interval ends at {end:?} before it starts at {start}"
        );
        Interval { start, end }
    }

    pub fn start(&self) -> DateTime<Utc> {
        self.start
    }

    /// `None` while the container is still running.
    pub fn end(&self) -> Option<DateTime<Utc>> {
        self.end
    }

    /// Half-open: running at the start instant, no longer running at the stop instant.
    pub fn contains(&self, instant: DateTime<Utc>) -> bool {
        self.start <= instant && self.end.is_none_or(|end| instant < end)
    }

    /// The running time inside `window`; an open interval runs to the window's end, which
    /// [`Window::until`] has already cut at `as_of`.
    pub fn overlap_ms(&self, window: Window) -> i64 {
        let start = self.start.max(window.start());
        let end = self.end.map_or(window.end(), |end| end.min(window.end()));
        if end <= start {
            return 0;
        }
        millis_between(start, end)
    }
}

/// A span in which a container was not running: `[from, until)`, unbounded where `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleSpan {
    pub from: Option<DateTime<Utc>>,
    pub until: Option<DateTime<Utc>>,
}

impl IdleSpan {
    pub fn contains(&self, instant: DateTime<Utc>) -> bool {
        self.from.is_none_or(|from| from <= instant)
            && self.until.is_none_or(|until| instant < until)
    }
}

/// Where a container stands after its last lifecycle event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContainerState {
    /// No `created` or `resumed` yet (only commands, ports or stray stops).
    Unseen,
    Running,
    Stopped,
}

impl ContainerState {
    pub fn as_str(self) -> &'static str {
        match self {
            ContainerState::Unseen => "unseen",
            ContainerState::Running => "running",
            ContainerState::Stopped => "stopped",
        }
    }
}

/// The most running intervals a container has: a `resumed` that would start one more
/// starts nothing and is a [`AnomalyKind::ResumePastIntervalLimit`]. A container's
/// intervals are stored, read and rewritten whole by every projector round that moves
/// them, so without a limit one container's stops and resumes would make each of its
/// events cost more than the last, and past about six million intervals Postgres refuses
/// the `jsonb` value and no round could commit again (decision 0053). A constant, not a
/// setting: it is part of the fold, which every projection and replay must agree on.
pub const INTERVALS_MAX: usize = 100_000;

/// The most lifecycle events (`created`, `resumed`, `stopped`) of a container the fold
/// walks, in (`occurred_at`, position) order. A container running after the last of them
/// counts as stopped at its instant, and every later one starts and stops nothing and is a
/// [`AnomalyKind::LifecyclePastLimit`]. A late lifecycle event makes a projection read the
/// container's lifecycle events again, so without a limit one container's stray stops
/// would make each such event cost more than the last; with it, the read stops at this
/// many and the anomalies a container keeps (decision 0056). Room for the 2 ×
/// [`INTERVALS_MAX`] events of a container stopped and resumed up to its interval limit,
/// and 50 000 more. A constant, part of the fold, as [`INTERVALS_MAX`] is.
pub const LIFECYCLE_EVENTS_MAX: u64 = 250_000;

/// Whether a `resumed` after `lifecycle_total` lifecycle events of a container starts
/// nothing because of [`LIFECYCLE_EVENTS_MAX`]: it is past the limit, or the last event
/// within it, which stops the container at its own instant (a zero-length interval).
pub fn resume_past_lifecycle_limit(lifecycle_total: u64) -> bool {
    lifecycle_total + 1 >= LIFECYCLE_EVENTS_MAX
}

/// An event the state machine could not take at face value. Anomalies are recorded, not
/// rejected: the ledger keeps every fact, and billing follows the table of contract §3.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnomalyKind {
    DuplicateCreate,
    ResumeBeforeCreate,
    ResumeWhileRunning,
    ResumePastIntervalLimit,
    StopWhileNotRunning,
    CommandWhileNotRunning,
    LifecyclePastLimit,
}

impl AnomalyKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AnomalyKind::DuplicateCreate => "duplicate_create",
            AnomalyKind::ResumeBeforeCreate => "resume_before_create",
            AnomalyKind::ResumeWhileRunning => "resume_while_running",
            AnomalyKind::ResumePastIntervalLimit => "resume_past_interval_limit",
            AnomalyKind::StopWhileNotRunning => "stop_while_not_running",
            AnomalyKind::CommandWhileNotRunning => "command_while_not_running",
            AnomalyKind::LifecyclePastLimit => "lifecycle_past_limit",
        }
    }

    pub fn parse(value: &str) -> Option<AnomalyKind> {
        [
            AnomalyKind::DuplicateCreate,
            AnomalyKind::ResumeBeforeCreate,
            AnomalyKind::ResumeWhileRunning,
            AnomalyKind::ResumePastIntervalLimit,
            AnomalyKind::StopWhileNotRunning,
            AnomalyKind::CommandWhileNotRunning,
            AnomalyKind::LifecyclePastLimit,
        ]
        .into_iter()
        .find(|kind| kind.as_str() == value)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anomaly {
    pub kind: AnomalyKind,
    /// The event that caused it.
    pub event_id: EventId,
    pub occurred_at: DateTime<Utc>,
    pub position: i64,
}

impl Anomaly {
    /// The order the fold keeps anomalies in: (`occurred_at`, position). Positions are
    /// unique, so no two anomalies of a container share it.
    pub fn order(&self) -> (DateTime<Utc>, i64) {
        (self.occurred_at, self.position)
    }
}

/// A `command_ran`: counted in the period of its `occurred_at`, whether or not the
/// container was running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommandRun {
    pub occurred_at: DateTime<Utc>,
    pub duration_ms: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortPublication {
    pub occurred_at: DateTime<Utc>,
    pub port: u16,
}

/// A container's whole history, folded. Everything in it is in (`occurred_at`, position)
/// order; it does not depend on `as_of`, which only the runtime queries take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerTimeline {
    lifecycle: Lifecycle,
    /// Every anomaly, in (`occurred_at`, position) order.
    anomalies: Vec<Anomaly>,
    commands: Vec<CommandRun>,
    ports: Vec<PortPublication>,
}

/// What the state machine carries from one event to the next: the running intervals, how
/// many anomalies there were, and the latest `occurred_at` seen. A projection stores this
/// per container and counts commands and ports as they come, so that an event later than
/// everything before it, or a late command or port ([`Lifecycle::advance`]), needs no
/// history; only a late lifecycle event needs a refold (or a lifecycle stored before
/// [`LIFECYCLE_EVENTS_MAX`], see [`Lifecycle::runs_past_the_lifecycle_limit`]).
///
/// The anomalies themselves are not carried: [`Lifecycle::advance`] hands each new one to
/// its caller, which appends it to wherever it keeps them. Carrying the list made every
/// event of a container cost as much as the anomalies it already had.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Lifecycle {
    /// Sorted, non-overlapping; only the last may be open.
    intervals: Vec<Interval>,
    /// Every anomaly the entries folded so far caused.
    anomalies_total: u64,
    /// How many lifecycle entries were folded, walked or past [`LIFECYCLE_EVENTS_MAX`].
    lifecycle_total: u64,
    /// The latest `occurred_at` of any entry folded, lifecycle or not.
    last_at: Option<DateTime<Utc>>,
}

/// A lifecycle entry (created, resumed, stopped) that does not come strictly after every
/// entry already folded: it can move intervals, so the container's history has to be
/// folded again with it ([`ContainerTimeline::fold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("an entry at {occurred_at} is not later than {last_at}, the latest already folded")]
pub struct Late {
    pub occurred_at: DateTime<Utc>,
    pub last_at: DateTime<Utc>,
}

impl ContainerTimeline {
    /// Folds one container's entries, in any order. Repeats of an event id are ignored, so a
    /// redelivered event cannot count twice.
    ///
    /// Panics if an `occurred_at` has sub-millisecond digits or a command has a negative
    /// duration: entries come from validated events, which have neither.
    pub fn fold(entries: &[ContainerEntry]) -> ContainerTimeline {
        let ordered = ledger_order(entries, |entry| {
            (entry.occurred_at, entry.position, entry.event_id)
        });
        let mut timeline = ContainerTimeline {
            lifecycle: Lifecycle::default(),
            anomalies: Vec::new(),
            commands: Vec::new(),
            ports: Vec::new(),
        };
        let lifecycle = &mut timeline.lifecycle;
        for entry in &ordered {
            lifecycle.last_at = Some(entry.occurred_at);
            let anomaly = match entry.kind {
                EntryKind::Created | EntryKind::Resumed | EntryKind::Stopped => {
                    lifecycle.walk(entry.kind, entry.occurred_at)
                }
                EntryKind::CommandRan { duration_ms } => {
                    assert!(
                        duration_ms >= 0,
                        "command {} ran {duration_ms} ms",
                        entry.event_id
                    );
                    timeline.commands.push(CommandRun {
                        occurred_at: entry.occurred_at,
                        duration_ms,
                    });
                    None
                }
                EntryKind::PortPublished { port } => {
                    timeline.ports.push(PortPublication {
                        occurred_at: entry.occurred_at,
                        port,
                    });
                    None
                }
            };
            if let Some(kind) = anomaly {
                timeline.anomalies.push(anomaly_of(kind, entry));
            }
        }
        // Whether a command ran while the container was running is a question about the
        // whole timeline, not the walk so far: a stop at the command's millisecond but a
        // later position has already ended the half-open interval.
        for entry in &ordered {
            if matches!(entry.kind, EntryKind::CommandRan { .. })
                && !lifecycle.running_at(entry.occurred_at)
            {
                timeline
                    .anomalies
                    .push(anomaly_of(AnomalyKind::CommandWhileNotRunning, entry));
            }
        }
        timeline.anomalies.sort_by_key(Anomaly::order);
        lifecycle.anomalies_total =
            u64::try_from(timeline.anomalies.len()).expect("a history fits in memory");
        lifecycle.assert_intervals_are_ordered();
        timeline
    }

    pub fn lifecycle(&self) -> &Lifecycle {
        &self.lifecycle
    }

    pub fn into_lifecycle(self) -> Lifecycle {
        self.lifecycle
    }

    /// The lifecycle and every anomaly, in (`occurred_at`, position) order.
    pub fn into_parts(self) -> (Lifecycle, Vec<Anomaly>) {
        (self.lifecycle, self.anomalies)
    }

    pub fn intervals(&self) -> &[Interval] {
        self.lifecycle.intervals()
    }

    /// The state after the last lifecycle event; use [`Self::running_at`] for an instant.
    pub fn state(&self) -> ContainerState {
        self.lifecycle.state()
    }

    pub fn anomalies(&self) -> &[Anomaly] {
        &self.anomalies
    }

    pub fn commands(&self) -> &[CommandRun] {
        &self.commands
    }

    pub fn ports(&self) -> &[PortPublication] {
        &self.ports
    }

    /// Whether an interval holds `instant` (running at a start, not at a stop).
    pub fn running_at(&self, instant: DateTime<Utc>) -> bool {
        self.lifecycle.running_at(instant)
    }

    /// Running time inside `window`, in whole milliseconds. Pass `window.until(as_of)` to
    /// count an open interval up to `as_of`.
    pub fn runtime_ms(&self, window: Window) -> i64 {
        self.lifecycle.runtime_ms(window)
    }

    /// Running time up to `as_of`, split at month boundaries. Periods without running time
    /// are absent.
    pub fn runtime_by_period(&self, as_of: DateTime<Utc>) -> BTreeMap<Period, i64> {
        self.lifecycle.runtime_by_period(as_of)
    }
}

impl Lifecycle {
    /// A lifecycle as a projection stored it. Panics if the intervals are not ordered and
    /// disjoint with only the last open: stored lifecycles come from folds.
    pub fn restore(
        intervals: Vec<Interval>,
        anomalies_total: u64,
        lifecycle_total: u64,
        last_at: Option<DateTime<Utc>>,
    ) -> Lifecycle {
        let lifecycle = Lifecycle {
            intervals,
            anomalies_total,
            lifecycle_total,
            last_at,
        };
        lifecycle.assert_intervals_are_ordered();
        lifecycle
    }

    /// Takes one more entry with the result [`ContainerTimeline::fold`] would give for the
    /// whole history, where that needs no history:
    /// - an entry strictly after every entry folded so far: nothing before it can be
    ///   re-ordered, and no earlier command's running state can change, because every
    ///   earlier instant is before this one;
    /// - a command or port publication at or before `last_at` (see `place_late`).
    ///
    /// A lifecycle entry at or before `last_at` is [`Late`] and changes nothing: it can
    /// move intervals, and with them every later command's running state. Returns the
    /// anomaly the entry caused, if any, for the caller to keep: it is counted here, and
    /// sorts after every anomaly before it unless the entry was at or before `last_at`.
    ///
    /// Each entry is advanced once: the ledger holds an event once, at one position, and
    /// the projector reads each position once. (The fold ignores repeats because it is
    /// also given histories as producers sent them.)
    pub fn advance(&mut self, entry: &ContainerEntry) -> Result<Option<Anomaly>, Late> {
        if let Some(last_at) = self.last_at {
            if entry.occurred_at <= last_at {
                return self.place_late(entry).ok_or(Late {
                    occurred_at: entry.occurred_at,
                    last_at,
                });
            }
        }
        let kind = match entry.kind {
            EntryKind::Created | EntryKind::Resumed | EntryKind::Stopped => {
                self.walk(entry.kind, entry.occurred_at)
            }
            // Nothing after it yet, so the state after the walk so far is the state at it.
            EntryKind::CommandRan { .. } => (self.state() != ContainerState::Running)
                .then_some(AnomalyKind::CommandWhileNotRunning),
            EntryKind::PortPublished { .. } => None,
        };
        self.last_at = Some(entry.occurred_at);
        let anomaly = kind.map(|kind| anomaly_of(kind, entry));
        self.anomalies_total += u64::from(anomaly.is_some());
        Ok(anomaly)
    }

    /// A late command or port publication, as the fold would take it; `None` for a late
    /// lifecycle entry. Neither walks the state machine, so the intervals stay as they are
    /// (and `last_at`, which is later); the fold judges every command against the final
    /// intervals, which entries still to come cannot change at this instant, since they
    /// come after `last_at` or are late lifecycle entries, which refold. A command's
    /// anomaly is counted and returned; the caller keeps it where the fold sorts it.
    fn place_late(&mut self, entry: &ContainerEntry) -> Option<Option<Anomaly>> {
        match entry.kind {
            EntryKind::PortPublished { .. } => Some(None),
            EntryKind::CommandRan { .. } if self.running_at(entry.occurred_at) => Some(None),
            EntryKind::CommandRan { .. } => {
                self.anomalies_total += 1;
                Some(Some(anomaly_of(AnomalyKind::CommandWhileNotRunning, entry)))
            }
            EntryKind::Created | EntryKind::Resumed | EntryKind::Stopped => None,
        }
    }

    /// One step of the table in contract §3. "Seen" means a `created` or `resumed` came
    /// before, which is exactly "has an interval": so a `created` after a
    /// `resume_before_create` is a `duplicate_create`, while a `created` after a stray
    /// `stop_while_not_running` is the container's real start. A stopped container that
    /// has [`INTERVALS_MAX`] intervals is not resumed. A container still running after its
    /// [`LIFECYCLE_EVENTS_MAX`]th lifecycle entry stops at it, and every later one is
    /// [`AnomalyKind::LifecyclePastLimit`].
    fn walk(&mut self, kind: EntryKind, at: DateTime<Utc>) -> Option<AnomalyKind> {
        self.lifecycle_total += 1;
        if self.lifecycle_total > LIFECYCLE_EVENTS_MAX {
            return Some(AnomalyKind::LifecyclePastLimit);
        }
        let anomaly = self.step(kind, at);
        if self.lifecycle_total == LIFECYCLE_EVENTS_MAX {
            if let Some(open) = self.intervals.last_mut().filter(|last| last.end.is_none()) {
                open.end = Some(at);
            }
        }
        anomaly
    }

    fn step(&mut self, kind: EntryKind, at: DateTime<Utc>) -> Option<AnomalyKind> {
        let seen = !self.intervals.is_empty();
        let running = self.state() == ContainerState::Running;
        match kind {
            EntryKind::Created if seen => Some(AnomalyKind::DuplicateCreate),
            EntryKind::Created => {
                self.start(at);
                None
            }
            EntryKind::Resumed if running => Some(AnomalyKind::ResumeWhileRunning),
            EntryKind::Resumed if self.intervals.len() >= INTERVALS_MAX => {
                Some(AnomalyKind::ResumePastIntervalLimit)
            }
            EntryKind::Resumed => {
                self.start(at);
                (!seen).then_some(AnomalyKind::ResumeBeforeCreate)
            }
            EntryKind::Stopped if running => {
                let interval = self.intervals.last_mut().expect("running has an interval");
                assert!(at >= interval.start, "a stop sorted before its start");
                interval.end = Some(at);
                None
            }
            EntryKind::Stopped => Some(AnomalyKind::StopWhileNotRunning),
            EntryKind::CommandRan { .. } | EntryKind::PortPublished { .. } => {
                unreachable!("only lifecycle entries walk the state machine")
            }
        }
    }

    fn start(&mut self, at: DateTime<Utc>) {
        self.intervals.push(Interval {
            start: at,
            end: None,
        });
    }

    /// The invariants runtime arithmetic relies on; a failure is a bug in the fold.
    fn assert_intervals_are_ordered(&self) {
        for interval in &self.intervals {
            if let Some(end) = interval.end {
                assert!(end >= interval.start, "interval ends before it starts");
            }
        }
        for pair in self.intervals.windows(2) {
            let end = pair[0].end.expect("only the last interval may be open");
            assert!(end <= pair[1].start, "running intervals overlap");
        }
    }

    pub fn intervals(&self) -> &[Interval] {
        &self.intervals
    }

    /// How many anomalies the entries folded so far caused.
    pub fn anomalies_total(&self) -> u64 {
        self.anomalies_total
    }

    /// How many lifecycle entries were folded so far, past [`LIFECYCLE_EVENTS_MAX`] too.
    pub fn lifecycle_total(&self) -> u64 {
        self.lifecycle_total
    }

    /// Whether this lifecycle is one no fold gives: running with [`LIFECYCLE_EVENTS_MAX`]
    /// lifecycle entries or more. Only a projection made before the limit holds one (its
    /// migration counted the entries of a fold that had none), and every later stop of it
    /// would be past the limit, so a projector folds such a container again.
    pub fn runs_past_the_lifecycle_limit(&self) -> bool {
        self.lifecycle_total >= LIFECYCLE_EVENTS_MAX && self.state() == ContainerState::Running
    }

    /// The latest `occurred_at` folded; `None` before the first entry.
    pub fn last_at(&self) -> Option<DateTime<Utc>> {
        self.last_at
    }

    /// The state after the last lifecycle event; use [`Self::running_at`] for an instant.
    pub fn state(&self) -> ContainerState {
        match self.intervals.last() {
            None => ContainerState::Unseen,
            Some(interval) if interval.end.is_none() => ContainerState::Running,
            Some(_) => ContainerState::Stopped,
        }
    }

    /// The start of the open interval, while running.
    pub fn running_since(&self) -> Option<DateTime<Utc>> {
        self.intervals
            .last()
            .filter(|interval| interval.end.is_none())
            .map(|interval| interval.start)
    }

    /// The intervals that end after `instant` or are open: at `instant` and at every later
    /// instant, they alone can hold it, start after it or add running time after it. A
    /// suffix, since the intervals are ordered and disjoint.
    pub fn intervals_ending_after(&self, instant: DateTime<Utc>) -> &[Interval] {
        let ended = self
            .intervals
            .partition_point(|interval| interval.end.is_some_and(|end| end <= instant));
        &self.intervals[ended..]
    }

    /// The spans in which the container was not running, in order: before its first
    /// interval, between two, and after the last one when it is closed; the whole timeline
    /// when it never ran. A command whose instant falls in one of them ran while the
    /// container was not running, so with these a projection can ask the ledger for those
    /// commands alone rather than read every command of the container.
    pub fn idle_spans(&self) -> Vec<IdleSpan> {
        let mut spans = Vec::with_capacity(self.intervals.len() + 1);
        let mut from = None;
        for interval in &self.intervals {
            if from.is_none_or(|from| from < interval.start) {
                spans.push(IdleSpan {
                    from,
                    until: Some(interval.start),
                });
            }
            match interval.end {
                Some(end) => from = Some(end),
                None => return spans,
            }
        }
        spans.push(IdleSpan { from, until: None });
        spans
    }

    /// The first instant after `instant` at which an interval starts: a start dated ahead of
    /// the clock, when `instant` is now.
    pub fn starts_after(&self, instant: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let after = self
            .intervals
            .partition_point(|interval| interval.start <= instant);
        self.intervals.get(after).map(|interval| interval.start)
    }

    /// Whether an interval holds `instant` (running at a start, not at a stop).
    pub fn running_at(&self, instant: DateTime<Utc>) -> bool {
        // Intervals do not overlap, so only the last one starting at or before the
        // instant can hold it.
        let after = self
            .intervals
            .partition_point(|interval| interval.start <= instant);
        after > 0 && self.intervals[after - 1].contains(instant)
    }

    /// Running time inside `window`, in whole milliseconds. Pass `window.until(as_of)` to
    /// count an open interval up to `as_of`.
    pub fn runtime_ms(&self, window: Window) -> i64 {
        let runtime_ms: i64 = self
            .intervals
            .iter()
            .map(|interval| interval.overlap_ms(window))
            .sum();
        assert!(
            (0..=window.length_ms()).contains(&runtime_ms),
            "runtime {runtime_ms} ms outside its window"
        );
        runtime_ms
    }

    /// Running time up to `as_of`, split at month boundaries. Periods without running time
    /// are absent.
    pub fn runtime_by_period(&self, as_of: DateTime<Utc>) -> BTreeMap<Period, i64> {
        let mut runtime_by_period = BTreeMap::new();
        for interval in &self.intervals {
            let mut period = Period::containing(interval.start);
            let end = interval.end.unwrap_or(as_of).min(as_of);
            while period.start() < end {
                let runtime_ms = interval.overlap_ms(period.window().until(as_of));
                if runtime_ms > 0 {
                    *runtime_by_period.entry(period).or_insert(0) += runtime_ms;
                }
                period = period.next();
            }
        }
        runtime_by_period
    }

    /// The running time of the closed intervals, split at month boundaries: the part of a
    /// container's runtime that no `as_of` at or after its last event can change. Periods
    /// without running time are absent.
    pub fn closed_runtime_by_period(&self) -> BTreeMap<Period, i64> {
        let mut runtime_by_period = BTreeMap::new();
        for interval in &self.intervals {
            let Some(end) = interval.end else { continue };
            let mut period = Period::containing(interval.start);
            while period.start() < end {
                let runtime_ms = interval.overlap_ms(period.window());
                if runtime_ms > 0 {
                    *runtime_by_period.entry(period).or_insert(0) += runtime_ms;
                }
                period = period.next();
            }
        }
        runtime_by_period
    }
}

fn anomaly_of(kind: AnomalyKind, entry: &ContainerEntry) -> Anomaly {
    Anomaly {
        kind,
        event_id: entry.event_id,
        occurred_at: entry.occurred_at,
        position: entry.position,
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use chrono::Duration;
    use uuid::Uuid;

    use EntryKind::{Created, Resumed, Stopped};

    /// The test base time; minutes in tests are counted from here.
    pub fn base() -> DateTime<Utc> {
        instant("2026-11-10T00:00:00Z")
    }

    pub fn instant(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    pub fn minute(minutes: i64) -> DateTime<Utc> {
        base() + Duration::minutes(minutes)
    }

    pub fn event_id(number: i64) -> EventId {
        EventId::from_uuid(Uuid::from_u128(number as u128 + 1)).unwrap()
    }

    /// An entry whose ledger position is `position` and whose id is derived from it.
    pub fn entry(position: i64, at: DateTime<Utc>, kind: EntryKind) -> ContainerEntry {
        ContainerEntry {
            occurred_at: at,
            position,
            event_id: event_id(position),
            kind,
        }
    }

    /// (minute, kind) of each event, in ledger order.
    type Events<'a> = &'a [(i64, EntryKind)];
    /// (anomaly kind, position of the event that caused it).
    type Expected<'a> = &'a [(&'a str, i64)];
    /// (period, runtime in ms).
    type Split<'a> = Vec<(&'a str, i64)>;

    /// Entries at the given minutes, with positions 1, 2, … in the order given.
    fn history(events: Events) -> Vec<ContainerEntry> {
        events
            .iter()
            .zip(1..)
            .map(|(&(at, kind), position)| entry(position, minute(at), kind))
            .collect()
    }

    fn open(start: i64) -> Interval {
        Interval {
            start: minute(start),
            end: None,
        }
    }

    fn closed(start: i64, end: i64) -> Interval {
        Interval {
            start: minute(start),
            end: Some(minute(end)),
        }
    }

    #[test]
    fn the_next_start_after_an_instant_is_the_first_interval_beginning_later() {
        let lifecycle =
            Lifecycle::restore(vec![closed(0, 10), closed(20, 30), open(40)], 0, 0, None);
        assert_eq!(lifecycle.starts_after(minute(-1)), Some(minute(0)));
        assert_eq!(
            lifecycle.starts_after(minute(0)),
            Some(minute(20)),
            "not at it"
        );
        assert_eq!(lifecycle.starts_after(minute(25)), Some(minute(40)));
        assert_eq!(lifecycle.starts_after(minute(40)), None);
        assert_eq!(Lifecycle::default().starts_after(minute(0)), None);
    }

    /// `(kind, position)` of each anomaly, for compact expectations.
    fn anomalies(timeline: &ContainerTimeline) -> Vec<(&'static str, i64)> {
        timeline
            .anomalies()
            .iter()
            .map(|anomaly| {
                assert_eq!(anomaly.event_id, event_id(anomaly.position));
                (anomaly.kind.as_str(), anomaly.position)
            })
            .collect()
    }

    #[test]
    fn every_row_of_the_lifecycle_table_has_its_effect_and_anomaly() {
        use ContainerState::{Running, Stopped as Off, Unseen};
        #[rustfmt::skip]
        let rows: [(&str, Events, &[Interval], ContainerState, Expected); 11] = [
            ("created, unseen: running from t",
                &[(0, Created)], &[open(0)], Running, &[]),
            ("created, seen and running: duplicate_create",
                &[(0, Created), (5, Created)], &[open(0)], Running, &[("duplicate_create", 2)]),
            ("created, seen and stopped: duplicate_create",
                &[(0, Created), (5, Stopped), (9, Created)], &[closed(0, 5)], Off,
                &[("duplicate_create", 3)]),
            ("created after resume_before_create: duplicate_create",
                &[(0, Resumed), (5, Created)], &[open(0)], Running,
                &[("resume_before_create", 1), ("duplicate_create", 2)]),
            ("resumed, stopped: running from t",
                &[(0, Created), (5, Stopped), (9, Resumed)], &[closed(0, 5), open(9)], Running, &[]),
            ("resumed, unseen: running from t with resume_before_create",
                &[(3, Resumed)], &[open(3)], Running, &[("resume_before_create", 1)]),
            ("resumed, running: no effect with resume_while_running",
                &[(0, Created), (5, Resumed)], &[open(0)], Running, &[("resume_while_running", 2)]),
            ("stopped, running: running ends at t",
                &[(0, Created), (5, Stopped)], &[closed(0, 5)], Off, &[]),
            ("stopped, stopped: stop_while_not_running",
                &[(0, Created), (5, Stopped), (7, Stopped)], &[closed(0, 5)], Off,
                &[("stop_while_not_running", 3)]),
            ("stopped, unseen: stop_while_not_running and still unseen",
                &[(0, Stopped)], &[], Unseen, &[("stop_while_not_running", 1)]),
            ("created after a stray stop: the real start, no duplicate",
                &[(0, Stopped), (5, Created)], &[open(5)], Running, &[("stop_while_not_running", 1)]),
        ];
        for (row, events, intervals, state, expected) in rows {
            let timeline = ContainerTimeline::fold(&history(events));
            assert_eq!(timeline.intervals(), intervals, "{row}");
            assert_eq!(timeline.state(), state, "{row}");
            assert_eq!(anomalies(&timeline), expected, "{row}");
        }
    }

    #[test]
    fn events_are_walked_by_occurred_at_never_by_arrival() {
        // The stop arrived first (position 1) but happened last.
        let timeline = ContainerTimeline::fold(&history(&[(10, Stopped), (0, Created)]));
        assert_eq!(timeline.intervals(), [closed(0, 10)]);
        assert_eq!(timeline.anomalies(), []);
    }

    #[test]
    fn events_at_the_same_millisecond_are_walked_by_ledger_position() {
        let stop_first = ContainerTimeline::fold(&history(&[(0, Stopped), (0, Created)]));
        assert_eq!(stop_first.intervals(), [open(0)]);
        assert_eq!(anomalies(&stop_first), [("stop_while_not_running", 1)]);

        let start_first = ContainerTimeline::fold(&history(&[(0, Created), (0, Stopped)]));
        assert_eq!(start_first.intervals(), [closed(0, 0)]);
        assert_eq!(start_first.state(), ContainerState::Stopped);
        assert_eq!(anomalies(&start_first), []);
    }

    #[test]
    fn a_zero_length_interval_is_kept_but_runs_for_no_time_and_holds_no_instant() {
        let timeline = ContainerTimeline::fold(&history(&[(0, Created), (0, Stopped)]));
        let window = Window::new(minute(-60), minute(60));
        assert_eq!(timeline.runtime_ms(window), 0);
        assert!(!timeline.running_at(minute(0)));
        assert_eq!(timeline.runtime_by_period(minute(60)), BTreeMap::new());
    }

    #[test]
    fn a_repeated_event_id_is_folded_once() {
        let mut entries = history(&[(0, Created), (5, Stopped)]);
        entries.extend(entries.clone());
        let timeline = ContainerTimeline::fold(&entries);
        assert_eq!(timeline.intervals(), [closed(0, 5)]);
        assert_eq!(timeline.anomalies(), []);
    }

    #[test]
    fn commands_never_change_runtime_and_are_flagged_when_not_running() {
        let command = |duration_ms| EntryKind::CommandRan { duration_ms };
        #[rustfmt::skip]
        let rows: [(&str, Events, bool); 7] = [
            ("before the create", &[(0, command(5)), (1, Created)], false),
            ("exactly at the start", &[(0, Created), (0, command(5))], true),
            ("exactly at the start that has a later position", &[(0, command(5)), (0, Created)], true),
            ("inside an open interval", &[(0, Created), (5, command(5))], true),
            ("exactly at the stop", &[(0, Created), (5, Stopped), (5, command(5))], false),
            ("exactly at the stop that has a later position",
                &[(0, Created), (5, command(5)), (5, Stopped)], false),
            ("between intervals", &[(0, Created), (5, Stopped), (7, command(5)), (9, Resumed)], false),
        ];
        for (row, events, running) in rows {
            let entries = history(events);
            let without_commands: Vec<ContainerEntry> = entries
                .iter()
                .filter(|entry| !matches!(entry.kind, EntryKind::CommandRan { .. }))
                .copied()
                .collect();
            let timeline = ContainerTimeline::fold(&entries);
            let command_position = entries
                .iter()
                .find(|entry| matches!(entry.kind, EntryKind::CommandRan { .. }))
                .unwrap()
                .position;
            let expected: &[(&str, i64)] = if running {
                &[]
            } else {
                &[("command_while_not_running", command_position)]
            };
            assert_eq!(anomalies(&timeline), expected, "{row}");
            assert_eq!(timeline.commands().len(), 1, "{row}");
            assert_eq!(
                timeline.intervals(),
                ContainerTimeline::fold(&without_commands).intervals(),
                "{row}"
            );
        }
    }

    #[test]
    fn runtime_is_the_overlap_with_the_window_cut_at_as_of() {
        let stopped = ContainerTimeline::fold(&history(&[(0, Created), (60, Stopped)]));
        let running = ContainerTimeline::fold(&history(&[(0, Created)]));
        let minute_ms = 60_000;
        #[rustfmt::skip]
        let rows = [
            ("closed, window covers it", &stopped, (-10, 100), 200, 60),
            ("closed, window starts inside", &stopped, (20, 100), 200, 40),
            ("closed, window ends inside", &stopped, (-10, 30), 200, 30),
            ("closed, window after it", &stopped, (60, 100), 200, 0),
            ("closed, as_of before the window", &stopped, (10, 50), 5, 0),
            ("closed, as_of inside the interval", &stopped, (-10, 100), 45, 45),
            ("open, as_of after the window", &running, (10, 50), 200, 40),
            ("open, as_of inside the window", &running, (10, 50), 30, 20),
            ("open, as_of before the window", &running, (10, 50), 5, 0),
            ("open, as_of at the start", &running, (-10, 50), 0, 0),
            ("open, window before the start", &running, (-50, -10), 200, 0),
        ];
        for (row, timeline, (start, end), as_of, runtime_minutes) in rows {
            let window = Window::new(minute(start), minute(end)).until(minute(as_of));
            assert_eq!(
                timeline.runtime_ms(window),
                runtime_minutes * minute_ms,
                "{row}"
            );
        }
    }

    #[test]
    fn runtime_is_split_at_month_boundaries() {
        let hour_ms = 3_600_000;
        let day_ms = 24 * hour_ms;
        let month = |name| Period::parse(name).unwrap();
        let at = |text, position, kind| entry(position, instant(text), kind);
        #[rustfmt::skip]
        let rows: [(&str, Vec<ContainerEntry>, &str, Split); 6] = [
            ("across December into January",
                vec![at("2026-12-31T23:00:00Z", 1, Created), at("2027-01-01T01:00:00Z", 2, Stopped)],
                "2027-02-01T00:00:00Z", vec![("2026-12", hour_ms), ("2027-01", hour_ms)]),
            ("all of a leap February",
                vec![at("2028-02-01T00:00:00Z", 1, Created), at("2028-03-01T00:00:00Z", 2, Stopped)],
                "2028-04-01T00:00:00Z", vec![("2028-02", 29 * day_ms)]),
            ("all of a common February",
                vec![at("2027-02-01T00:00:00Z", 1, Created), at("2027-03-01T00:00:00Z", 2, Stopped)],
                "2027-04-01T00:00:00Z", vec![("2027-02", 28 * day_ms)]),
            ("starting exactly on a boundary",
                vec![at("2027-01-01T00:00:00Z", 1, Created), at("2027-01-01T02:00:00Z", 2, Stopped)],
                "2027-02-01T00:00:00Z", vec![("2027-01", 2 * hour_ms)]),
            ("stopping exactly on a boundary",
                vec![at("2026-12-31T22:00:00Z", 1, Created), at("2027-01-01T00:00:00Z", 2, Stopped)],
                "2027-02-01T00:00:00Z", vec![("2026-12", 2 * hour_ms)]),
            ("open across several months up to as_of",
                vec![at("2026-11-30T12:00:00Z", 1, Created)],
                "2027-02-01T06:00:00Z",
                vec![("2026-11", 12 * hour_ms), ("2026-12", 31 * day_ms), ("2027-01", 31 * day_ms),
                     ("2027-02", 6 * hour_ms)]),
        ];
        for (row, entries, as_of, expected) in rows {
            let timeline = ContainerTimeline::fold(&entries);
            let expected: BTreeMap<Period, i64> = expected
                .into_iter()
                .map(|(name, ms)| (month(name), ms))
                .collect();
            assert_eq!(
                timeline.runtime_by_period(instant(as_of)),
                expected,
                "{row}"
            );
            for (period, runtime_ms) in expected {
                assert_eq!(
                    timeline.runtime_ms(period.window().until(instant(as_of))),
                    runtime_ms,
                    "{row} {period}"
                );
            }
        }
    }

    #[test]
    fn a_container_stopped_on_a_boundary_is_not_running_at_it() {
        let entries = [
            entry(1, instant("2026-12-31T22:00:00Z"), Created),
            entry(2, instant("2027-01-01T00:00:00Z"), Stopped),
        ];
        let timeline = ContainerTimeline::fold(&entries);
        assert!(timeline.running_at(instant("2026-12-31T23:59:59.999Z")));
        assert!(!timeline.running_at(instant("2027-01-01T00:00:00Z")));
        let january = Period::parse("2027-01").unwrap().window();
        assert_eq!(timeline.runtime_ms(january), 0);
    }

    #[test]
    fn container_events_become_entries_and_org_events_do_not() {
        use crate::event::{ContainerCommandRan, EventType, OrgId, OrgPlanChanged};
        let mut event = Event {
            id: event_id(7),
            event_type: EventType::ContainerCommandRan,
            org_id: OrgId::parse("org_1").unwrap(),
            container_id: Some(crate::event::ContainerId::parse("ctr_1").unwrap()),
            occurred_at: minute(3),
            data: EventData::ContainerCommandRan(ContainerCommandRan {
                command_id: "c".into(),
                exit_code: 0,
                duration_ms: 250,
                timed_out: None,
            }),
            origin: None,
        };
        assert_eq!(
            ContainerEntry::from_event(&event, 42),
            Some(entry(
                42,
                minute(3),
                EntryKind::CommandRan { duration_ms: 250 }
            ))
            .map(|entry| ContainerEntry {
                event_id: event_id(7),
                ..entry
            })
        );
        event.event_type = EventType::OrgPlanChanged;
        event.container_id = None;
        event.data = EventData::OrgPlanChanged(OrgPlanChanged { plan: "pro".into() });
        assert_eq!(ContainerEntry::from_event(&event, 42), None);
    }

    #[test]
    fn a_late_command_or_port_is_placed_without_its_history_as_the_fold_places_it() {
        // Running 0–10 and 20–30; commands at 5 (running) and 15 (stopped) arrive after
        // an entry at 30, then a port at 1.
        let earlier = history(&[(0, Created), (10, Stopped), (20, Resumed), (30, Stopped)]);
        let mut lifecycle = Lifecycle::default();
        for entry in &earlier {
            lifecycle.advance(entry).unwrap();
        }
        let late = [
            entry(5, minute(15), EntryKind::CommandRan { duration_ms: 1 }),
            entry(6, minute(5), EntryKind::CommandRan { duration_ms: 1 }),
            entry(7, minute(1), EntryKind::PortPublished { port: 8080 }),
            // At a stop's instant: no longer running.
            entry(8, minute(10), EntryKind::CommandRan { duration_ms: 1 }),
        ];
        let caused: Vec<Option<Anomaly>> = late
            .iter()
            .map(|entry| lifecycle.advance(entry).unwrap())
            .collect();
        assert_eq!(
            caused
                .iter()
                .map(|a| a.map(|a| a.position))
                .collect::<Vec<_>>(),
            vec![Some(5), None, None, Some(8)]
        );
        let all: Vec<ContainerEntry> = earlier.iter().chain(&late).copied().collect();
        let (folded, anomalies) = ContainerTimeline::fold(&all).into_parts();
        assert_eq!(lifecycle, folded);
        assert_eq!(lifecycle.anomalies_total(), 2);
        let mut kept: Vec<Anomaly> = caused.into_iter().flatten().collect();
        kept.sort_by_key(Anomaly::order);
        assert_eq!(kept, anomalies, "the anomalies caused are the fold's");
        assert_eq!(
            kept.iter().map(|a| a.position).collect::<Vec<_>>(),
            vec![8, 5],
            "sorted by occurred_at as the fold sorts them"
        );
    }

    #[test]
    fn advancing_counts_anomalies_without_keeping_them() {
        // Ten thousand commands of a container never created: the lifecycle stays the
        // same size whatever it has seen, and counts each one.
        let mut lifecycle = Lifecycle::default();
        for position in 1..=10_000 {
            let command = entry(
                position,
                minute(position),
                EntryKind::CommandRan { duration_ms: 1 },
            );
            let anomaly = lifecycle.advance(&command).unwrap().expect("never created");
            assert_eq!(anomaly.position, position);
        }
        assert_eq!(lifecycle.anomalies_total(), 10_000);
        assert_eq!(lifecycle.intervals(), []);
    }

    #[test]
    fn a_late_lifecycle_entry_is_late_and_changes_nothing() {
        let mut lifecycle = Lifecycle::default();
        for entry in history(&[(0, Created), (30, Stopped)]) {
            lifecycle.advance(&entry).unwrap();
        }
        let before = lifecycle.clone();
        for kind in [Created, Resumed, Stopped] {
            assert_eq!(
                lifecycle.advance(&entry(3, minute(10), kind)),
                Err(Late {
                    occurred_at: minute(10),
                    last_at: minute(30)
                })
            );
        }
        assert_eq!(lifecycle, before);
    }

    /// Advances a lifecycle over `entries`, in order, and checks that it ends as their
    /// fold `timeline` does, with the same anomalies.
    fn assert_advancing_gives_the_fold(entries: &[ContainerEntry], timeline: &ContainerTimeline) {
        let mut lifecycle = Lifecycle::default();
        let mut advanced = Vec::new();
        for entry in entries {
            advanced.extend(lifecycle.advance(entry).unwrap());
        }
        assert_eq!(&lifecycle, timeline.lifecycle());
        assert_eq!(advanced, timeline.anomalies());
    }

    /// A container created at the base time, then stopped one second after each start and
    /// resumed one second after each stop until it has `intervals` intervals, and stopped:
    /// positions 1, 2, … in that order.
    fn stopped_after_intervals(intervals: usize) -> Vec<ContainerEntry> {
        let second = |n: usize| base() + Duration::seconds(i64::try_from(n).unwrap());
        let mut entries = vec![entry(1, base(), Created)];
        for n in 1..intervals * 2 {
            let kind = if n % 2 == 1 { Stopped } else { Resumed };
            entries.push(entry(entries.len() as i64 + 1, second(n), kind));
        }
        entries
    }

    #[test]
    fn a_resume_past_the_interval_limit_starts_nothing_folded_or_advanced() {
        let mut entries = stopped_after_intervals(INTERVALS_MAX);
        let end = entries.last().unwrap().occurred_at;
        let next = entries.len() as i64 + 1;
        entries.extend([
            entry(next, end + Duration::seconds(1), Resumed),
            entry(
                next + 1,
                end + Duration::seconds(2),
                EntryKind::CommandRan { duration_ms: 5 },
            ),
            entry(next + 2, end + Duration::seconds(3), Stopped),
        ]);
        let timeline = ContainerTimeline::fold(&entries);
        assert_eq!(timeline.intervals().len(), INTERVALS_MAX);
        assert_eq!(timeline.intervals().last().unwrap().end(), Some(end));
        assert_eq!(timeline.state(), ContainerState::Stopped);
        assert_eq!(
            anomalies(&timeline),
            [
                ("resume_past_interval_limit", next),
                ("command_while_not_running", next + 1),
                ("stop_while_not_running", next + 2)
            ]
        );
        let window = Window::new(base(), end + Duration::hours(1));
        assert_eq!(
            timeline.runtime_ms(window),
            1_000 * INTERVALS_MAX as i64,
            "a second per interval, none after the limit"
        );

        assert_advancing_gives_the_fold(&entries, &timeline);
    }

    #[test]
    fn the_resume_past_the_interval_limit_is_the_latest_by_occurred_at_not_the_last_to_arrive() {
        // One interval short of the limit; then a resume and stop after every other event,
        // and, arriving after them, a stop and a resume inside the first interval: by
        // occurred_at they split it in two, and the resume that arrived first is the one
        // past the limit.
        let mut entries = stopped_after_intervals(INTERVALS_MAX - 1);
        let end = entries.last().unwrap().occurred_at;
        let next = entries.len() as i64 + 1;
        let half = Duration::milliseconds(500);
        entries.extend([
            entry(next, end + Duration::seconds(1), Resumed),
            entry(next + 1, end + Duration::seconds(2), Stopped),
            entry(next + 2, base() + half, Stopped),
            entry(
                next + 3,
                base() + half * 2 - Duration::milliseconds(100),
                Resumed,
            ),
        ]);
        let timeline = ContainerTimeline::fold(&entries);
        assert_eq!(timeline.intervals().len(), INTERVALS_MAX);
        assert_eq!(timeline.intervals()[0].end(), Some(base() + half));
        assert_eq!(
            anomalies(&timeline),
            [
                ("resume_past_interval_limit", next),
                ("stop_while_not_running", next + 1)
            ],
            "the stop at 1 s ends the interval the resume at 0.9 s began"
        );
    }

    /// A container created at the base time and then, one millisecond apart, `events` more
    /// lifecycle entries of `kind`: positions 1, 2, … in that order.
    fn created_then(kind: EntryKind, events: u64) -> Vec<ContainerEntry> {
        (0..=events)
            .map(|n| {
                let n = i64::try_from(n).unwrap();
                let kind = if n == 0 { Created } else { kind };
                entry(n + 1, base() + Duration::milliseconds(n), kind)
            })
            .collect()
    }

    #[test]
    fn a_container_running_at_its_last_lifecycle_event_stops_there_and_later_ones_are_past_the_limit(
    ) {
        // Created, then resumed while running until it has walked LIFECYCLE_EVENTS_MAX
        // lifecycle events; then a stop, a command, and a resume.
        let mut entries = created_then(Resumed, LIFECYCLE_EVENTS_MAX - 1);
        let last = entries.last().unwrap().occurred_at;
        let next = entries.len() as i64 + 1;
        entries.extend([
            entry(next, last + Duration::seconds(1), Stopped),
            entry(
                next + 1,
                last + Duration::seconds(2),
                EntryKind::CommandRan { duration_ms: 5 },
            ),
            entry(next + 2, last + Duration::seconds(3), Resumed),
        ]);
        let timeline = ContainerTimeline::fold(&entries);
        assert_eq!(timeline.intervals(), [Interval::new(base(), Some(last))]);
        assert_eq!(timeline.state(), ContainerState::Stopped);
        assert_eq!(
            timeline.lifecycle().lifecycle_total(),
            LIFECYCLE_EVENTS_MAX + 2
        );
        let kinds = anomalies(&timeline);
        assert_eq!(kinds.len() as u64, LIFECYCLE_EVENTS_MAX - 1 + 3);
        assert!(kinds[..kinds.len() - 3]
            .iter()
            .all(|(kind, _)| *kind == "resume_while_running"));
        assert_eq!(
            kinds[kinds.len() - 3..],
            [
                ("lifecycle_past_limit", next),
                ("command_while_not_running", next + 1),
                ("lifecycle_past_limit", next + 2)
            ]
        );

        assert_advancing_gives_the_fold(&entries, &timeline);
    }

    #[test]
    fn a_resume_starts_nothing_exactly_when_it_would_be_the_last_lifecycle_event_within_the_limit_or_later(
    ) {
        // Created at 0 and stopped at 1 ms, then stray stops, `before` lifecycle events in
        // all; then resumed an hour later.
        for before in [
            LIFECYCLE_EVENTS_MAX - 2,
            LIFECYCLE_EVENTS_MAX - 1,
            LIFECYCLE_EVENTS_MAX,
        ] {
            let mut entries = created_then(Stopped, before - 1);
            let resumed_at = base() + Duration::hours(1);
            entries.push(entry(before as i64 + 1, resumed_at, Resumed));
            let timeline = ContainerTimeline::fold(&entries);
            let window = Window::new(resumed_at, resumed_at + Duration::hours(1));
            assert_eq!(
                timeline.runtime_ms(window) == 0,
                resume_past_lifecycle_limit(before),
                "a resume after {before} lifecycle events"
            );
        }
    }

    #[test]
    fn a_late_lifecycle_event_moves_which_lifecycle_events_are_past_the_limit() {
        // Created at 0 and stopped at 1 ms, then stray stops one millisecond apart, as many
        // lifecycle events as the limit; a resume at 1 ms arrives last, so that by
        // (occurred_at, position) the stray stop at 2 ms ends a second interval and the
        // last stop is one past the limit.
        let mut entries = created_then(Stopped, LIFECYCLE_EVENTS_MAX - 1);
        let strays = ContainerTimeline::fold(&entries);
        assert_eq!(
            strays.intervals(),
            [Interval::new(
                base(),
                Some(base() + Duration::milliseconds(1))
            )]
        );
        assert!(anomalies(&strays)
            .iter()
            .all(|(kind, _)| *kind == "stop_while_not_running"));
        let last = entries.last().unwrap().position;
        let millisecond = |n| base() + Duration::milliseconds(n);
        entries.push(entry(last + 1, millisecond(1), Resumed));
        let timeline = ContainerTimeline::fold(&entries);
        assert_eq!(
            timeline.intervals(),
            [
                Interval::new(base(), Some(millisecond(1))),
                Interval::new(millisecond(1), Some(millisecond(2)))
            ]
        );
        let kinds = anomalies(&timeline);
        assert_eq!(kinds.last(), Some(&("lifecycle_past_limit", last)));
        assert_eq!(
            kinds.len() as u64,
            anomalies(&strays).len() as u64 - 1,
            "one stray is a real stop now, and one stop is past the limit"
        );
    }

    #[test]
    fn a_late_command_at_the_instant_of_a_zero_length_interval_did_not_run_while_running() {
        // Created and stopped at 0 (a zero-length interval, holding no instant), stopped
        // again at 5; then a command at 0 arrives.
        let earlier = history(&[(0, Created), (0, Stopped), (5, Stopped)]);
        let mut lifecycle = ContainerTimeline::fold(&earlier).into_lifecycle();
        let command = entry(4, minute(0), EntryKind::CommandRan { duration_ms: 1 });
        let anomaly = lifecycle
            .advance(&command)
            .unwrap()
            .expect("not running at 0");
        assert_eq!(anomaly.kind, AnomalyKind::CommandWhileNotRunning);
        let all: Vec<ContainerEntry> = earlier.iter().copied().chain([command]).collect();
        assert_eq!(lifecycle, ContainerTimeline::fold(&all).into_lifecycle());
    }
}
