//! The projector: tails the ledger by position and keeps the projection tables current.
//!
//! Each round is one transaction: lock the checkpoint row (`FOR UPDATE SKIP LOCKED`, so
//! that of several instances one projects and the others skip the round), take the events
//! after it, apply them (a late lifecycle event refolds only its container, from its
//! lifecycle events and the commands that fall outside its intervals), write the changes
//! and move the checkpoint. The projection therefore always equals the ledger up to its
//! checkpoint, and a crash anywhere loses or repeats nothing. It wakes on this instance's
//! commits (the appender's head) and polls for other instances'.
//!
//! The events of this instance's own commits are handed over by the appender in memory
//! ([`Committed`]), so that a round does not read back what was just written: a round takes
//! them when they start exactly after the checkpoint it locked (up to its `batch_max`), and
//! reads everything else from the ledger (another instance's appends, a group too large to
//! hand over, rows dropped while the projector was slow, a round after one that another
//! instance made). Rows at or before the checkpoint are dropped unused, so rows that
//! another instance projected are never applied again. An event is made from a handed row
//! exactly as `store::read_events` makes it from the stored one (`EventRow::of_committed`;
//! a row for which that is not certain is left to the ledger). A round that finds the
//! checkpoint locked discards what it was handed. A round from memory that stopped at a gap
//! short of what this instance had committed when it began is followed by the next round
//! at once, not at the next commit or poll.
//!
//! Woken by a commit, it lingers (`ProjectorSettings::linger`) so that a round carries many
//! group commits: per round, every touched container, org and period row is written once
//! and the fixed statements are paid once. The linger counts from when the first commit
//! not yet projected began to wait, so a busy projector, whose rounds last as long, never
//! idles between them (a fixed pause after every round would add itself to every event's
//! lag under load). A reader that needs this instance's
//! appends projected now ([`Freshness::hurry`]) ends the linger at once.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sqlx::{PgConnection, PgPool};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::model::{Changes, ContainerKey, ProjectedEvent, ANOMALIES_KEPT_MAX};
use super::notice::Rounds;
use super::store::History;
use super::{notice, store};
use crate::clock::Clock;
use crate::config::Config;
use crate::ledger::{Acknowledged, Committed};
use crate::runtime::{ContainerTimeline, EntryKind, IdleSpan};

/// Pause after an error before trying the round again.
const RETRY_DELAY_MS: u64 = 500;
/// How often a reader waiting for the projection ([`Freshness::wait_projected`]) reads the
/// checkpoint row: this instance's rounds wake it at once, but another instance's projector
/// can only be seen there. One single-row read per waiting reader per interval; 20 ms adds
/// little to a wait that a round of another instance ends, and bounds the reads a waiting
/// reader makes to 50 a second.
pub const CHECKPOINT_POLL_MS: u64 = 20;

#[derive(Debug, Clone)]
pub struct ProjectorSettings {
    /// Events per round (one transaction).
    pub batch_max: usize,
    /// How often to look for events appended by other instances.
    pub poll: Duration,
    /// How long to wait for more commits after being woken by one.
    pub linger: Duration,
    /// Judges whether a reservation has expired when its container starts.
    pub clock: Clock,
}

/// What a reader needs to see this instance's own appends in the projection: the head the
/// appender last committed (which wakes the projector), the last position acknowledged for
/// each org, and a way to end the projector's linger. Cheap to clone.
#[derive(Clone)]
pub struct Freshness {
    head: watch::Receiver<i64>,
    acknowledged: Arc<Mutex<Acknowledged>>,
    hurry: Arc<Notify>,
    /// The checkpoint this instance's projector last committed or found: wakes readers
    /// waiting for the projection without a read of the checkpoint row.
    projected: Arc<watch::Sender<i64>>,
}

/// Why [`Freshness::wait_projected`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// The projection did not reach the position within the wait.
    #[error("the projection is at {checkpoint}, short of {wanted}")]
    Lagging { wanted: i64, checkpoint: i64 },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

impl Freshness {
    pub fn new(head: watch::Receiver<i64>, acknowledged: Arc<Mutex<Acknowledged>>) -> Freshness {
        Freshness {
            head,
            acknowledged,
            hurry: Arc::new(Notify::new()),
            projected: Arc::new(watch::Sender::new(0)),
        }
    }

    /// Waits until the stored checkpoint (which every instance's projector moves) is at
    /// least `position`, for at most `wait`; returns the checkpoint read. Woken by this
    /// instance's rounds, and reads the checkpoint row every [`CHECKPOINT_POLL_MS`] to see
    /// another instance's. While it waits the projector is hurried, so that a reader does
    /// not wait out the linger.
    pub async fn wait_projected(
        &self,
        pool: &PgPool,
        position: i64,
        wait: Duration,
    ) -> Result<i64, WaitError> {
        self.wait_checkpoint(CheckpointReader::Pool(pool), position, wait)
            .await
    }

    /// [`Self::wait_projected`], reading the checkpoint on `connection`: for a waiter that
    /// holds a connection already and must not take another from the pool.
    pub async fn wait_projected_on(
        &self,
        connection: &mut PgConnection,
        position: i64,
        wait: Duration,
    ) -> Result<i64, WaitError> {
        self.wait_checkpoint(CheckpointReader::Connection(connection), position, wait)
            .await
    }

    async fn wait_checkpoint(
        &self,
        mut reader: CheckpointReader<'_>,
        position: i64,
        wait: Duration,
    ) -> Result<i64, WaitError> {
        let deadline = tokio::time::Instant::now() + wait;
        let mut projected = self.projected.subscribe();
        loop {
            let checkpoint = match &mut reader {
                CheckpointReader::Pool(pool) => {
                    let mut connection = pool.acquire().await?;
                    store::checkpoint(&mut connection, store::LIVE).await?
                }
                CheckpointReader::Connection(connection) => {
                    store::checkpoint(connection, store::LIVE).await?
                }
            };
            if checkpoint >= position {
                return Ok(checkpoint);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(WaitError::Lagging {
                    wanted: position,
                    checkpoint,
                });
            }
            self.hurry();
            let poll = tokio::time::sleep(Duration::from_millis(CHECKPOINT_POLL_MS));
            tokio::select! {
                _ = projected.changed() => {}
                _ = poll => {}
                _ = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    /// Records a checkpoint that a projector (this instance's, or another's as its round
    /// notice tells) has committed, waking waiting readers.
    pub fn reached(&self, position: i64) {
        self.projected.send_if_modified(|projected| {
            let moved = position > *projected;
            *projected = (*projected).max(position);
            moved
        });
    }

    /// Whether this instance's appender has committed `position` or past it.
    pub fn committed_at_least(&self, position: i64) -> bool {
        *self.head.borrow() >= position
    }

    /// Whether a projector is known to have committed `position` or past it (this
    /// instance's rounds and the notices it heard), without a read.
    pub fn projected_at_least(&self, position: i64) -> bool {
        *self.projected.borrow() >= position
    }

    /// The last position this instance acknowledged with an event of `org` (or a plan
    /// definition): what a read-your-writes reader of that org waits for.
    pub fn wanted_for(&self, org: &str) -> i64 {
        self.acknowledged
            .lock()
            .expect("never held across a panic")
            .wanted(org)
    }

    /// Asks the projector to project now rather than at the end of its linger.
    pub fn hurry(&self) {
        self.hurry.notify_one();
    }
}

/// Where a wait reads the stored checkpoint: a connection of the pool for each read, or one
/// the waiter holds.
enum CheckpointReader<'a> {
    Pool(&'a PgPool),
    Connection(&'a mut PgConnection),
}

/// What a round did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Round {
    /// Projected events up to this position; `handed` when they were this instance's
    /// commits taken from memory rather than read from the ledger; `reread`, the events of
    /// container histories read again to refold late containers.
    Projected {
        events: usize,
        position: i64,
        handed: bool,
        reread: usize,
    },
    /// Nothing after the checkpoint.
    CaughtUp { position: i64 },
    /// Another transaction holds the checkpoint.
    Busy,
}

/// How long to linger once a commit wakes the projector: `linger` from when the first
/// commit not yet projected began to wait. Commits that came during the round have waited
/// since it began at the latest, so after a round as long as the linger the next starts at
/// once; a commit after the round starts the whole linger.
fn linger_left(linger: Duration, committed_during_round: bool, round_took: Duration) -> Duration {
    if committed_during_round {
        linger.saturating_sub(round_took)
    } else {
        linger
    }
}

/// Runs until `shutdown`; errors are logged and the round retried, never fatal. `handoff`
/// holds this instance's commits in memory (see the module comment); without it, every
/// round reads the ledger. `rounds` is where this instance's admission listener finds
/// what each round changed.
pub async fn run(
    pool: PgPool,
    settings: ProjectorSettings,
    freshness: Freshness,
    mut handoff: Option<Committed<ProjectedEvent>>,
    rounds: Option<Rounds>,
    shutdown: CancellationToken,
) {
    let mut head = freshness.head.clone();
    // Whether the rounds follow this instance's commits: woken by one, or right after a
    // round from memory. Then a round whose handoff holds nothing after the checkpoint
    // reads the ledger only when this instance's head is past it; a round the poll wakes
    // (or the first) reads it on any miss, to find other instances' appends.
    let mut following = false;
    while !shutdown.is_cancelled() {
        // Commits from here on are the next round's.
        let committed_before = *head.borrow_and_update();
        let round_started = Instant::now();
        let round = project_once(
            &pool,
            (settings.batch_max, settings.clock),
            handoff.as_mut(),
            following.then_some(committed_before),
            rounds.as_ref(),
        )
        .await;
        let linger = linger_left(
            settings.linger,
            head.has_changed().unwrap_or(false),
            round_started.elapsed(),
        );
        match round {
            Ok(Round::Projected {
                events,
                position,
                handed,
                ..
            }) => {
                freshness.reached(position);
                let head_position = *head.borrow();
                metrics::gauge!(crate::telemetry::PROJECTION_LAG_POSITIONS)
                    .set((head_position - position).max(0) as f64);
                // A round from memory stops at a gap (another instance's commits, rows
                // dropped): what this instance committed before it began is due now.
                following = handed;
                if events == settings.batch_max || (handed && committed_before > position) {
                    continue;
                }
            }
            Ok(Round::CaughtUp { position }) => {
                freshness.reached(position);
                metrics::gauge!(crate::telemetry::PROJECTION_LAG_POSITIONS).set(0.0);
                metrics::gauge!(crate::telemetry::PROJECTION_LAG_SECONDS).set(0.0);
            }
            Ok(Round::Busy) => {}
            Err(error) => {
                // What the failed round took from memory is gone from it: the next reads
                // the ledger on a miss.
                following = false;
                pause_after_failure(&error, &shutdown).await;
                continue;
            }
        }
        let waiting = (linger, settings.poll);
        following =
            wait_for_commits(&mut head, waiting, &freshness, handoff.as_mut(), &shutdown).await;
    }
    tracing::info!("projector stopped");
}

/// Logs a failed round and waits [`RETRY_DELAY_MS`] (or until `shutdown`) before the next.
async fn pause_after_failure(error: &super::Error, shutdown: &CancellationToken) {
    tracing::warn!(
        error = format!("{error:#}"),
        "projection round failed; will retry"
    );
    metrics::counter!(crate::telemetry::PROJECTION_ERRORS).increment(1);
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(RETRY_DELAY_MS)) => {}
        _ = shutdown.cancelled() => {}
    }
}

/// Connections of the projector's own pool: a round is one transaction, and nothing else
/// the projector does holds a connection.
const PROJECTOR_CONNECTIONS: u32 = 1;

/// Runs [`run`] on a thread of its own ([`crate::own_thread`]), so that a check waiting for
/// a round (read-your-writes) does not also wait, at each of the round's statements, for
/// the ready HTTP tasks. Its pool, of one connection, is opened there from `config` (a
/// connection's socket is watched by the reactor of the runtime that opened it). The task
/// returned ends when the projector has stopped; dropped unfinished (its runtime shutting
/// down), it stops the projector, as it would a task of that runtime.
pub fn start(
    config: &Config,
    settings: ProjectorSettings,
    freshness: Freshness,
    handoff: Option<Committed<ProjectedEvent>>,
    rounds: Option<Rounds>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let config = Config {
        db_pool_max: PROJECTOR_CONNECTIONS,
        ..config.clone()
    };
    let stop = shutdown.child_token();
    let stop_when_dropped = stop.clone().drop_guard();
    let stopped = crate::own_thread::spawn("tally-projector", move || async move {
        // Lazy: this fails only on a URL that the service's own pool parsed already.
        match crate::ledger::db::connect(&config).await {
            Ok(pool) => {
                run(pool.clone(), settings, freshness, handoff, rounds, stop).await;
                pool.close().await;
            }
            Err(error) => tracing::error!(error = %error, "the projector cannot make its pool"),
        }
    });
    tokio::spawn(async move {
        let _stop_when_dropped = stop_when_dropped;
        let _ = stopped.await;
    })
}

/// Waits for the next round: a commit of this instance and then `linger` (unless a reader
/// hurries it), or `poll` for other instances' commits, or `shutdown`; true when a commit
/// of this instance woke it. The commit's rows are taken in from `handoff` before
/// lingering, so that the relay, which lingers less, finds them no longer shared and takes
/// them without a copy.
async fn wait_for_commits(
    head: &mut watch::Receiver<i64>,
    (linger, poll): (Duration, Duration),
    freshness: &Freshness,
    handoff: Option<&mut Committed<ProjectedEvent>>,
    shutdown: &CancellationToken,
) -> bool {
    tokio::select! {
        changed = head.changed() => {
            if changed.is_ok() {
                if let Some(handoff) = handoff {
                    handoff.receive();
                }
                tokio::select! {
                    _ = tokio::time::sleep(linger) => {}
                    _ = freshness.hurry.notified() => {}
                }
                true
            } else {
                // The appender stopped; only polling is left.
                tokio::time::sleep(poll).await;
                false
            }
        }
        _ = tokio::time::sleep(poll) => false,
        _ = shutdown.cancelled() => false,
    }
}

/// One round: projects up to `batch_max` events after the checkpoint, in one transaction;
/// a reservation is consumed when it has not expired by `clock`. The events come from
/// `handoff` when it holds those that follow the checkpoint, else from the ledger, unless
/// `own_head` (this instance's head, given for a round that follows its commits) says
/// there is nothing of this instance's to read ([`crate::ledger::committed_after`]): then
/// the round is caught up. What the round changed is kept in `rounds`, under the tag its
/// notice carries.
pub async fn project_once(
    pool: &PgPool,
    (batch_max, clock): (usize, Clock),
    mut handoff: Option<&mut Committed<ProjectedEvent>>,
    own_head: Option<i64>,
    rounds: Option<&Rounds>,
) -> Result<Round, super::Error> {
    let started = Instant::now();
    let mut transaction = pool.begin().await?;
    let Some(checkpoint) = store::lock_checkpoint(&mut transaction, store::LIVE).await? else {
        // Another instance projects what this one is handed; should this one lock the
        // checkpoint later, it reads the ledger from there.
        if let Some(handoff) = handoff.as_deref_mut() {
            handoff.discard();
        }
        return Ok(Round::Busy);
    };
    let (events, handed) =
        next_events(&mut transaction, handoff, (checkpoint, own_head), batch_max).await?;
    let Some(last) = events.last() else {
        // Ended here rather than dropped: a dropped transaction is rolled back only when
        // its connection is next used or back in the pool, and until then it holds the
        // checkpoint, so that the round a commit starts at once would find it Busy.
        transaction.rollback().await?;
        return Ok(Round::CaughtUp {
            position: checkpoint,
        });
    };
    let (position, recorded_at) = (last.position, last.recorded_at);
    // Voids first: the voided events are recorded (so that no history read from here on
    // includes them) and read back, to be taken out of the figures.
    let voids: Vec<(uuid::Uuid, i64)> = events
        .iter()
        .filter_map(|event| Some((event.voids?, event.position)))
        .collect();
    let voided = store::record_voids(&mut transaction, store::LIVE, &voids).await?;
    store::forget_voided_starts(&mut transaction, &voided).await?;
    let keys = containers_of(events.iter().chain(&voided));
    let stored = store::load_lifecycles(&mut transaction, store::LIVE, &keys).await?;
    let mut changes = Changes::apply(&events, &voided, stored);
    let reread = refold(&mut transaction, &mut changes, position).await?;
    let mut changes = changes.finish();
    store::write(&mut transaction, store::LIVE, &mut changes, position).await?;
    // A reservation is consumed in the transaction that makes its container count as
    // running, so that no snapshot counts the slot twice or not at all.
    let now = clock.now();
    let starts = starts(&events, &voided, &changes, now);
    let consumed = store::consume_reservations(&mut transaction, &starts, now).await?;
    metrics::counter!(crate::telemetry::RESERVATIONS_CONSUMED).increment(consumed.len() as u64);
    let notice = round_notice(position, &events, &voided, changes, consumed, rounds);
    notice::notify(&mut *transaction, &notice).await?;
    transaction.commit().await?;
    record_round(events.len(), started, position, recorded_at);
    Ok(Round::Projected {
        events: events.len(),
        position,
        handed,
        reread,
    })
}

/// Refolds the late containers ([`Changes::late`]), from the ledger up to
/// `position`: from their lifecycle events and the commands in their idle spans, or from
/// their whole history when a void reached them. Returns how many events it read.
async fn refold(
    connection: &mut PgConnection,
    changes: &mut Changes,
    position: i64,
) -> Result<usize, super::Error> {
    let (whole, lifecycle): (Vec<ContainerKey>, Vec<ContainerKey>) = changes
        .late()
        .cloned()
        .partition(|key| changes.reached_by_void(key));
    let mut read = 0;
    if !whole.is_empty() {
        let histories = store::read_histories(connection, &whole, position, History::Whole).await?;
        for (key, history) in &histories {
            changes.refold(key, history);
            read += history.len();
        }
    }
    if !lifecycle.is_empty() {
        let folded: Vec<(ContainerKey, ContainerTimeline)> =
            store::read_histories(connection, &lifecycle, position, History::Lifecycle)
                .await?
                .into_iter()
                .map(|(key, history)| {
                    read += history.len();
                    (key, ContainerTimeline::fold(&history))
                })
                .collect();
        let spans: Vec<(&ContainerKey, Vec<IdleSpan>)> = folded
            .iter()
            .map(|(key, timeline)| (key, timeline.lifecycle().idle_spans()))
            .collect();
        let mut idle =
            store::read_idle_commands(connection, &spans, position, ANOMALIES_KEPT_MAX).await?;
        for (key, timeline) in folded {
            let idle = idle.remove(&key).expect("read for every container");
            read += idle.first.len();
            changes.refold_lifecycle(&key, timeline, idle);
        }
    }
    let refolded = whole.len() + lifecycle.len();
    metrics::counter!(crate::telemetry::PROJECTION_REFOLDS).increment(refolded as u64);
    metrics::counter!(crate::telemetry::PROJECTION_REFOLD_EVENTS).increment(read as u64);
    Ok(read)
}

/// The notice of a round that projected `events` and `voided` up to `position`, with
/// `changes` and reservations of the `consumed` orgs. Admission facts kept in memory by every
/// instance drop what the round changed: its orgs, or everything for a plan definition (an
/// event of no container and no account). This instance's own listener advances them by
/// the round's changes instead, kept in `rounds` under the notice's tag, except for the
/// orgs of account events, voids and consumed reservations.
fn round_notice(
    position: i64,
    events: &[ProjectedEvent],
    voided: &[ProjectedEvent],
    changes: Changes,
    consumed: Vec<String>,
    rounds: Option<&Rounds>,
) -> String {
    let projected = || events.iter().chain(voided);
    let plans_changed = projected()
        .any(|event| event.container.is_none() && event.account.is_none() && event.voids.is_none());
    let tag = rounds.map(|rounds| {
        let tag = Uuid::new_v4().as_u64_pair().0;
        let reread = projected()
            .filter(|event| event.account.is_some() || event.voids.is_some())
            .map(|event| event.org_id.clone())
            .chain(voided.iter().map(|event| event.org_id.clone()))
            .chain(consumed)
            .collect();
        rounds.record(tag, notice::RoundChanges { changes, reread });
        tag
    });
    notice::Notice::of_round(
        position,
        projected().map(|event| event.org_id.as_str()),
        plans_changed,
        tag,
    )
}

/// The metrics of a round of `events` that began at `started` and reached `position`,
/// whose last event was recorded at `recorded_at`.
fn record_round(
    events: usize,
    started: Instant,
    position: i64,
    recorded_at: chrono::DateTime<chrono::Utc>,
) {
    metrics::histogram!(crate::telemetry::PROJECTION_ROUND_EVENTS).record(events as f64);
    metrics::histogram!(crate::telemetry::PROJECTION_ROUND_SECONDS)
        .record(started.elapsed().as_secs_f64());
    metrics::gauge!(crate::telemetry::PROJECTION_POSITION).set(position as f64);
    // A recorded_at ahead of this clock (another instance's) is no lag.
    let lag = (chrono::Utc::now() - recorded_at)
        .to_std()
        .unwrap_or_default();
    metrics::gauge!(crate::telemetry::PROJECTION_LAG_SECONDS).set(lag.as_secs_f64());
}

/// Up to `batch_max` events after `checkpoint`, in position order, and whether they were
/// taken from `handoff`: this instance's commits when they continue the checkpoint
/// exactly, otherwise (another instance's appends, a gap, nothing handed) the ledger's.
async fn next_events(
    connection: &mut PgConnection,
    handoff: Option<&mut Committed<ProjectedEvent>>,
    (checkpoint, own_head): (i64, Option<i64>),
    batch_max: usize,
) -> Result<(Vec<ProjectedEvent>, bool), super::Error> {
    if let Some(handoff) = handoff {
        if let Some(events) = handoff.take_after(checkpoint, batch_max) {
            metrics::counter!(crate::telemetry::PROJECTION_ROWS, "from" => "memory")
                .increment(events.len() as u64);
            return Ok((events, true));
        }
        if own_head.is_some_and(|head| !crate::ledger::committed_after(head, checkpoint)) {
            return Ok((Vec::new(), false));
        }
    }
    let events = store::read_events(connection, checkpoint, batch_max).await?;
    metrics::counter!(crate::telemetry::PROJECTION_ROWS, "from" => "ledger")
        .increment(events.len() as u64);
    Ok((events, false))
}

/// The containers `events` are about, each once.
fn containers_of<'a>(events: impl Iterator<Item = &'a ProjectedEvent>) -> Vec<ContainerKey> {
    events
        .filter_map(|event| {
            let (container_id, _) = event.container.as_ref()?;
            Some(ContainerKey {
                org_id: event.org_id.clone(),
                container_id: container_id.clone(),
            })
        })
        .collect::<HashSet<_>>()
        .into_iter()
        .collect()
}

/// The containers that a `created` or `resumed` of `events` starts, unless the round also
/// `voided` it: (org, container) to the start, the earliest by (`occurred_at`, position)
/// should a container have several: the start its reservations were for. Only containers
/// that, as `changes` leave them, run at `now` or start after it: a late start that history
/// has stopped since (or a duplicate `created`, a resume while running) starts nothing, and
/// consuming the reservation of the container's next start would leave its slot held by
/// nothing. The start's instant is then when the container counts: at `now` at the latest
/// when it runs, else the first instant it starts after `now`.
fn starts(
    events: &[ProjectedEvent],
    voided: &[ProjectedEvent],
    changes: &Changes,
    now: chrono::DateTime<chrono::Utc>,
) -> HashMap<(String, String), store::Start> {
    let voided: HashSet<Uuid> = voided
        .iter()
        .filter_map(|event| Some(event.container.as_ref()?.1.event_id.as_uuid()))
        .collect();
    let mut starts: HashMap<(String, String), store::Start> = HashMap::new();
    for event in events {
        let Some((container_id, entry)) = event.container.as_ref() else {
            continue;
        };
        if !matches!(entry.kind, EntryKind::Created | EntryKind::Resumed)
            || voided.contains(&entry.event_id.as_uuid())
        {
            continue;
        }
        let start = store::Start {
            event_id: entry.event_id.as_uuid(),
            position: entry.position,
            at: entry.occurred_at,
        };
        starts
            .entry((event.org_id.clone(), container_id.clone()))
            .and_modify(|kept| {
                if (start.at, start.position) < (kept.at, kept.position) {
                    *kept = start;
                }
            })
            .or_insert(start);
    }
    if starts.is_empty() {
        return starts;
    }
    let lifecycles: HashMap<&ContainerKey, &crate::runtime::Lifecycle> =
        changes.lifecycles().collect();
    starts.retain(|(org_id, container_id), start| {
        let key = ContainerKey {
            org_id: org_id.clone(),
            container_id: container_id.clone(),
        };
        let Some(lifecycle) = lifecycles.get(&key) else {
            return false;
        };
        if lifecycle.running_at(now) {
            start.at = start.at.min(now);
            return true;
        }
        let next = lifecycle.starts_after(now);
        next.inspect(|begins| start.at = *begins).is_some()
    });
    starts
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINGER: Duration = Duration::from_millis(25);

    #[test]
    fn commits_during_a_round_as_long_as_the_linger_start_the_next_round_at_once() {
        let left = linger_left(LINGER, true, Duration::from_millis(40));
        assert_eq!(left, Duration::ZERO);
    }

    #[test]
    fn commits_during_a_short_round_wait_only_the_rest_of_the_linger() {
        let left = linger_left(LINGER, true, Duration::from_millis(10));
        assert_eq!(left, Duration::from_millis(15));
    }

    #[test]
    fn a_commit_after_the_round_waits_the_whole_linger() {
        let left = linger_left(LINGER, false, Duration::from_millis(40));
        assert_eq!(left, LINGER);
    }
}
