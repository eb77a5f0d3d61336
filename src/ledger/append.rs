//! The appender: the one writer that orders the ledger.
//!
//! Producers (HTTP handlers, the NATS ingest consumer) send append requests over a bounded
//! queue, one request a submission or, from the NATS ingest, a fetched batch's requests in
//! one ([`Appender::append_each`]). One task takes every request waiting, up to a group
//! limit, and appends them all in one transaction (group commit) under
//! `pg_advisory_xact_lock(LEDGER_LOCK_KEY)`. Under that lock the head is read, the next
//! positions follow it and the lock is released by the commit. So positions are assigned
//! in commit order with no gaps, across any number of instances: a reader tailing by
//! position can never see position n+1 before n is visible.
//! A request is answered only after its commit.
//!
//! The fast path is one round trip: the appender remembers the head it last committed,
//! prepares the rows (positions, content digests, chained hashes) before taking the lock,
//! and calls `ledger_append(...)` (see its migration), which takes the lock, checks that the
//! head and the ids are still as assumed, and inserts. When they are not (another instance
//! appended, or an id is already stored) nothing is inserted, the appender prepares again
//! with what it learned, and after `FAST_PATH_ATTEMPTS_MAX` tries falls back to an explicit
//! transaction that holds the lock while it reads, prepares and inserts.
//!
//! Each request is all-or-nothing on its own: a request whose event reuses an id with
//! different content is refused whole and the rest of the group is unaffected.
//!
//! The same holds for content Postgres refuses (a NUL in a `jsonb` string, a value past a
//! limit): when a group commit fails with an error about the data (see
//! [`is_content_error`]), nothing of it was stored, and the appender commits the group again
//! in halves, and halves of the halves that fail, until each refused request stands alone
//! and is answered [`AppendError::Unstorable`]; every other request is committed, in queue
//! order, with positions and hashes prepared again for what was actually committed. This
//! costs nothing until such an error happens. Other errors (the database is down, a
//! timeout) fail the whole group: they are not the requests' fault, and retrying
//! is the producers' call.
//!
//! Rows are dated (`recorded_at`) by the appender's clock, to the millisecond, once per
//! group commit. The ledger is partitioned by month of that date, so before a group is
//! prepared the appender makes sure its month exists when it is not the month it last made
//! sure of (`partitions::Dating`): an append never fails for a missing month.
//!
//! The appender runs on a thread of its own, with a single-threaded runtime and its own
//! connection, whose socket that runtime's reactor watches. On the service's runtime the
//! appender's wake-ups (the answer to `ledger_append`, a new request) would queue behind
//! every ready HTTP task, and the socket would be polled only when a worker got round to
//! the reactor: with 64 single-event clients on two cores that adds more to each group
//! commit than Postgres spends executing it. A thread of its own is woken by the kernel directly, and
//! a group commit is that much shorter for every request waiting on it.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use chrono::{DateTime, Utc};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, FromRow, PgConnection, PgPool, Postgres, Transaction};
use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

use super::partitions::Dating;
use super::read::{self, Head, LedgerRow};
use super::rows::Rows;
use crate::clock::Clock;
use crate::error_code::ErrorCode;
use crate::event::canonical;
use crate::event::{Event, EventId, EventType, OrgId};

/// The advisory lock that serializes appends across every tally instance on a database.
/// Arbitrary but fixed: `'tally'` as ASCII bytes.
/// The same number is written in the `ledger_append` migration.
pub const LEDGER_LOCK_KEY: i64 = 0x0074_616c_6c79;

/// Optimistic attempts before falling back to the locked transaction: one to learn what
/// changed, one to use it. More would only spin while other instances keep appending.
const FAST_PATH_ATTEMPTS_MAX: usize = 2;

/// The outcome for one event of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppendedEvent {
    pub id: EventId,
    pub position: i64,
    /// The event was already in the ledger (same id, same content): stored once.
    pub duplicate: bool,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum AppendError {
    #[error("event {index} reuses id {id} with different content")]
    IdempotencyConflict { index: usize, id: EventId },
    #[error("the append queue is full")]
    Overloaded,
    #[error("the appender has stopped")]
    Stopped,
    /// Postgres refused the request's own content (it was committed alone and failed):
    /// retrying it can never succeed, and no other request was failed by it.
    #[error("the ledger cannot store this request's content ({sqlstate}: {reason})")]
    Unstorable { sqlstate: String, reason: String },
    #[error("the ledger could not be written")]
    Store(#[source] Arc<sqlx::Error>),
}

impl AppendError {
    /// Whether the same request may succeed later (queue full, database down, stopping);
    /// otherwise it never will, and a producer that retries it only loops.
    pub fn is_retryable(&self) -> bool {
        match self {
            AppendError::Overloaded | AppendError::Stopped | AppendError::Store(_) => true,
            AppendError::IdempotencyConflict { .. } | AppendError::Unstorable { .. } => false,
        }
    }

    /// The code HTTP answers and dead letters carry.
    pub fn code(&self) -> ErrorCode {
        match self {
            AppendError::IdempotencyConflict { .. } => ErrorCode::IdempotencyConflict,
            AppendError::Overloaded => ErrorCode::Overloaded,
            AppendError::Stopped => ErrorCode::ShuttingDown,
            AppendError::Unstorable { .. } => ErrorCode::UnstorableEvent,
            AppendError::Store(_) => ErrorCode::DatabaseUnavailable,
        }
    }
}

/// SQLSTATE classes whose errors are about the statement's data: given the same rows,
/// Postgres refuses them again whatever the state of the server, so retrying the group can
/// never help, and the refused rows are found by committing parts of it.
/// - `22` data exception: a NUL in `jsonb` (22P05) or `text` (22021), a value out of range
///   or badly formed for its type;
/// - `54` program limit exceeded: a `jsonb` value or index row past Postgres's size limits
///   (a whole group past a limit that its parts are not is committed in parts too).
///
/// Class `23` (integrity) only partly: the ledger has no foreign keys, and its NOT NULL
/// columns, unique ids and positions are filled and checked by the appender itself under
/// the lock, so a `23502`, `23503` or `23505` would be the appender's bug, which must fail
/// loudly and not be blamed on a caller. A check constraint judges a row's content, so
/// [`CONTENT_ERROR_CODES`] names `23514`.
/// Everything else (class 08 connection, 40 serialization, 53 resources, 57 operator
/// intervention such as a statement timeout, XX internal, P0 raised by `ledger_append`'s own
/// guard) is about the server or the appender, not the rows.
const CONTENT_ERROR_CLASSES: [&str; 2] = ["22", "54"];
/// Single SQLSTATEs outside [`CONTENT_ERROR_CLASSES`] that are about the data: a check
/// constraint (or a trigger raising `check_violation`) refusing a row.
const CONTENT_ERROR_CODES: [&str; 1] = ["23514"];

/// Whether Postgres refused the statement for the data in it (see
/// [`CONTENT_ERROR_CLASSES`]), rather than for the state of the server or a bug.
pub fn is_content_error(error: &sqlx::Error) -> bool {
    let sqlx::Error::Database(error) = error else {
        return false;
    };
    let Some(code) = error.code() else {
        return false;
    };
    CONTENT_ERROR_CLASSES
        .iter()
        .any(|class| code.starts_with(class))
        || CONTENT_ERROR_CODES.contains(&code.as_ref())
}

#[derive(Debug, Clone, Copy)]
pub struct AppendLimits {
    /// Submissions waiting in the queue: one request each from [`Appender::append`], or
    /// all the requests of one [`Appender::append_each`].
    pub queue_max: usize,
    /// Events per group commit (a single larger request still goes alone).
    pub group_events_max: usize,
}

struct Request {
    events: Vec<Event>,
    reply: oneshot::Sender<Result<Vec<AppendedEvent>, AppendError>>,
}

impl Request {
    /// A request for `events`, and what its caller waits on for the answer.
    fn new(events: Vec<Event>) -> (Request, Waiting) {
        let orgs = events
            .iter()
            .map(|event| {
                let every_org = event.event_type == EventType::PlanDefined;
                (event.org_id.clone(), every_org)
            })
            .collect();
        let (reply, response) = oneshot::channel();
        (Request { events, reply }, Waiting { orgs, response })
    }
}

/// A queued request, seen from its caller: the orgs of its events (and whether each is a
/// plan definition, which counts for every org), and where its answer arrives.
struct Waiting {
    orgs: Vec<(OrgId, bool)>,
    response: oneshot::Receiver<Result<Vec<AppendedEvent>, AppendError>>,
}

impl Waiting {
    /// The request's answer, once each of its events' orgs has its position recorded in
    /// `acknowledged`.
    async fn answered(
        self,
        acknowledged: &Mutex<Acknowledged>,
    ) -> Result<Vec<AppendedEvent>, AppendError> {
        let appended = self.response.await.map_err(|_| AppendError::Stopped)??;
        let mut acknowledged = acknowledged.lock().expect("never held across a panic");
        for ((org, every_org), event) in self.orgs.iter().zip(&appended) {
            acknowledged.record(org.as_str(), event.position, *every_org);
        }
        Ok(appended)
    }
}

/// Orgs whose last acknowledged position [`Acknowledged`] holds at most; past it they are
/// forgotten into its floor.
pub const ACKNOWLEDGED_ORGS_MAX: usize = 100_000;

/// The last position this instance acknowledged for each org: what a read of that org
/// waits for the projection to reach (read-your-writes, per org, so that a check of one org
/// does not wait for another's appends). A plan definition counts for every org.
#[derive(Debug, Default)]
pub struct Acknowledged {
    positions: HashMap<String, i64>,
    /// Counts for every org: plan definitions, and orgs forgotten past the limit.
    floor: i64,
}

impl Acknowledged {
    /// `position` holds an event of `org`; of every org when `every_org`.
    pub fn record(&mut self, org: &str, position: i64, every_org: bool) {
        if every_org {
            self.floor = self.floor.max(position);
            return;
        }
        if let Some(known) = self.positions.get_mut(org) {
            *known = (*known).max(position);
            return;
        }
        if self.positions.len() >= ACKNOWLEDGED_ORGS_MAX {
            // The forgotten wait for the highest position forgotten: longer than they need
            // to, never less.
            let highest = self.positions.values().copied().max().unwrap_or(0);
            self.floor = self.floor.max(highest);
            self.positions.clear();
        }
        self.positions.insert(org.to_owned(), position);
    }

    /// The position a read of `org` waits for.
    pub fn wanted(&self, org: &str) -> i64 {
        self.positions
            .get(org)
            .copied()
            .unwrap_or(0)
            .max(self.floor)
    }
}

/// A handle to the appender task; cheap to clone. The task ends once every handle is
/// dropped and the queue is drained, so stopping never loses an accepted request.
#[derive(Clone)]
pub struct Appender {
    sender: mpsc::Sender<Vec<Request>>,
    head: watch::Receiver<i64>,
    acknowledged: Arc<Mutex<Acknowledged>>,
    handoffs: Handoffs,
}

impl Appender {
    /// Starts the appender on a thread of its own (see the module comment). It connects
    /// with the pool's options but outside the pool. Also returns the rows it commits, for
    /// the relay to tail in memory (dropped, nothing is kept; another reader, the
    /// projector, asks for its own with [`Appender::handoff`]), and a task that ends when
    /// the appender has drained its queue and stopped. Rows are dated by the system clock.
    pub fn start(
        pool: PgPool,
        limits: AppendLimits,
    ) -> (Appender, Committed, tokio::task::JoinHandle<()>) {
        Appender::start_dated(pool, limits, Clock::system())
    }

    /// As [`Appender::start`], with rows dated (`recorded_at`) by `clock`: the system
    /// clock in production (`Config::ledger_clock`), another instant in tests of the
    /// ledger's months.
    pub fn start_dated(
        pool: PgPool,
        limits: AppendLimits,
        clock: Clock,
    ) -> (Appender, Committed, tokio::task::JoinHandle<()>) {
        assert!(limits.queue_max > 0 && limits.group_events_max > 0);
        let (sender, receiver) = mpsc::channel(limits.queue_max);
        let (head_sender, head) = watch::channel(0);
        let acknowledged = Arc::new(Mutex::new(Acknowledged::default()));
        let handoffs = Handoffs::default();
        let committed = handoffs.add();
        let outlets = Outlets {
            head: head_sender,
            handoffs: handoffs.clone(),
        };
        let options = pool.connect_options();
        let stopped = crate::own_thread::spawn("tally-appender", move || async move {
            run(&options, limits, Dating::new(clock), receiver, outlets).await
        });
        // Ends when the appender has stopped, or panicked.
        let task = tokio::spawn(async move {
            let _ = stopped.await;
        });
        (
            Appender {
                sender,
                head,
                acknowledged,
                handoffs,
            },
            committed,
            task,
        )
    }

    /// Appends the events atomically; resolves after the commit, once each event's org has
    /// its position recorded in [`Appender::acknowledged`] (here, on the caller's task, not
    /// on the appender's thread, which every commit waits for).
    pub async fn append(&self, events: Vec<Event>) -> Result<Vec<AppendedEvent>, AppendError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let (request, waiting) = Request::new(events);
        self.submit(vec![request])?;
        waiting.answered(&self.acknowledged).await
    }

    /// Appends each list of events atomically on its own, as [`Appender::append`] would,
    /// with every list queued in one submission, here and now: the returned future only
    /// waits for the answers, so a caller can prepare its next lists while these commit.
    /// The appender takes a submission's lists into the same group commit (past the events
    /// of one group, into consecutive groups), instead of starting a group with the first
    /// few while the rest are still being queued. One list's failure is its own: a list
    /// that reuses an id with other content, or that Postgres refuses, fails alone. The
    /// results are in the order of `lists`.
    pub fn append_each(
        &self,
        lists: Vec<Vec<Event>>,
    ) -> impl Future<Output = Vec<Result<Vec<AppendedEvent>, AppendError>>> + Send + 'static {
        let mut requests = Vec::with_capacity(lists.len());
        let waiting: Vec<Option<Waiting>> = lists
            .into_iter()
            .map(|events| {
                (!events.is_empty()).then(|| {
                    let (request, waiting) = Request::new(events);
                    requests.push(request);
                    waiting
                })
            })
            .collect();
        let refused = if requests.is_empty() {
            None
        } else {
            self.submit(requests).err()
        };
        let acknowledged = Arc::clone(&self.acknowledged);
        async move {
            let mut results = Vec::with_capacity(waiting.len());
            for waiting in waiting {
                results.push(match (waiting, &refused) {
                    (None, _) => Ok(Vec::new()),
                    (Some(_), Some(error)) => Err(error.clone()),
                    (Some(waiting), None) => waiting.answered(&acknowledged).await,
                });
            }
            results
        }
    }

    /// Queues `requests` as one submission, or refuses them all when the queue is full or
    /// the appender has stopped.
    fn submit(&self, requests: Vec<Request>) -> Result<(), AppendError> {
        self.sender.try_send(requests).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => AppendError::Overloaded,
            mpsc::error::TrySendError::Closed(_) => AppendError::Stopped,
        })
    }

    /// The last position this appender committed; wakes whoever tails the ledger.
    pub fn head(&self) -> watch::Receiver<i64> {
        self.head.clone()
    }

    /// The last position acknowledged for each org, updated before the appends are.
    pub fn acknowledged(&self) -> Arc<Mutex<Acknowledged>> {
        Arc::clone(&self.acknowledged)
    }

    /// The rows of this appender's commits from now on, for one more reader to tail in
    /// memory as `R` (the projector's events); dropped, nothing is kept for it.
    pub fn handoff<R: Handed>(&self) -> Committed<R> {
        self.handoffs.add()
    }
}

/// Groups of committed rows waiting for each reader at most; past it the appender drops
/// them for that reader, which reads the ledger instead. The groups are shared by the
/// readers, not copied for each.
const HANDOFF_GROUPS_MAX: usize = 32;
/// Rows a reader keeps from what it was handed, at most (the newest).
const HANDOFF_ROWS_MAX: usize = 16_000;
/// Larger groups are not handed over: a reader keeps no more than [`HANDOFF_ROWS_MAX`]
/// rows, so it would read part of one from the ledger anyway. Groups are at most the
/// appender's group limit (10 000 events by default) unless one request is larger, so by
/// default every group is handed over, batches too: read back, a batch group cost the relay
/// and the projector, and their backends, some 5 to 10 % of the HTTP batch rate
/// (docs/benchmarks.md).
pub const HANDOFF_GROUP_EVENTS_MAX: usize = HANDOFF_ROWS_MAX;
/// Rows waiting in one reader's queue at most, over its groups: a group that would take
/// the reader past it is not handed to that reader, which reads the ledger instead. With
/// the rows it keeps, a reader's handoff holds at most 48 000 rows (about 25 MB at the
/// bench's 500 bytes a row; a row is at most a few kB; the projector keeps only the few
/// hundred bytes it reads of one).
const HANDOFF_QUEUED_ROWS_MAX: usize = 2 * HANDOFF_ROWS_MAX;

/// Whether this instance may have committed rows after `after` that a reader's handoff
/// does not hold ([`Committed::take_after`] missed): only when `own_head`, the appender's
/// head ([`Appender::head`]) as the reader last saw it, is past `after`. A group is handed
/// over before the head moves, so every group up to that head was offered to the reader,
/// and a later one moves the head again, which wakes the reader. With the head at or
/// before `after` there is nothing of this instance's to read from the ledger: other
/// instances' appends are for the reader's poll to find, as is a group whose commit failed
/// without telling whether it committed (it moves neither the handoff nor the head).
pub fn committed_after(own_head: i64, after: i64) -> bool {
    own_head > after
}

/// What a reader tailing the ledger in memory keeps of each committed row: the row itself
/// (the relay), or what it reads of it (the projector's events).
pub trait Handed: Sized {
    /// The ledger position of the row it was made from.
    fn position(&self) -> i64;

    /// The rows of one commit as this reader keeps them, in position order. Each reader
    /// gets the same rows: the last to take them may take them whole. A row that the
    /// reader cannot make exactly as it would from the ledger is left out, and the gap
    /// sends the reader to the ledger for it.
    fn from_committed(rows: Arc<Rows>) -> Vec<Self>;
}

impl Handed for LedgerRow {
    fn position(&self) -> i64 {
        self.position
    }

    fn from_committed(rows: Arc<Rows>) -> Vec<LedgerRow> {
        Arc::unwrap_or_clone(rows).into_ledger_rows()
    }
}

/// Where the appender hands its commits over: one bounded queue per reader, shared with
/// every handle so that a reader can join after the start.
#[derive(Clone, Default)]
struct Handoffs(Arc<Mutex<Vec<Queue>>>);

/// One reader's queue of groups, and how many rows its groups hold: bounded in both
/// ([`HANDOFF_GROUPS_MAX`], [`HANDOFF_QUEUED_ROWS_MAX`]).
struct Queue {
    sender: mpsc::Sender<Arc<Rows>>,
    rows: Arc<AtomicUsize>,
}

impl Handoffs {
    fn add<R: Handed>(&self) -> Committed<R> {
        let (sender, receiver) = mpsc::channel(HANDOFF_GROUPS_MAX);
        let rows = Arc::new(AtomicUsize::new(0));
        self.0
            .lock()
            .expect("never held across a panic")
            .push(Queue {
                sender,
                rows: Arc::clone(&rows),
            });
        Committed::new(receiver, rows)
    }

    /// Hands `rows` to every reader whose queue has room for them; a reader that is gone is
    /// forgotten, one that is full (slow, or not reading) reads the ledger instead. Never
    /// waits.
    fn hand_over(&self, rows: Rows) {
        let count = rows.len();
        let rows = Arc::new(rows);
        self.0
            .lock()
            .expect("never held across a panic")
            .retain(|queue| {
                // Only the readers take rows out, so the room seen here can only grow.
                if queue.rows.load(Ordering::Acquire) + count > HANDOFF_QUEUED_ROWS_MAX {
                    return !queue.sender.is_closed();
                }
                // Counted before it is sent, so that the reader never takes out more than
                // was counted in.
                queue.rows.fetch_add(count, Ordering::AcqRel);
                match queue.sender.try_send(Arc::clone(&rows)) {
                    Ok(()) => true,
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        queue.rows.fetch_sub(count, Ordering::AcqRel);
                        true
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => false,
                }
            });
    }
}

/// The rows of this instance's commits, handed over in memory as they commit, so that a
/// reader tailing the ledger (the relay, the projector) need not read back what was just
/// written. It is only a shortcut: when the rows it holds do not continue exactly where
/// the reader is (another instance appended, a group was too large, the queue was full,
/// the reader started late or skipped rounds), it answers `None` and the reader reads the
/// ledger, so what the reader sees is the ledger either way.
pub struct Committed<R: Handed = LedgerRow> {
    receiver: mpsc::Receiver<Arc<Rows>>,
    /// The rows of the groups in `receiver`, counted by the appender as it sends them.
    queued: Arc<AtomicUsize>,
    pending: std::collections::VecDeque<R>,
}

impl<R: Handed> Committed<R> {
    fn new(receiver: mpsc::Receiver<Arc<Rows>>, queued: Arc<AtomicUsize>) -> Committed<R> {
        Committed {
            receiver,
            queued,
            pending: std::collections::VecDeque::new(),
        }
    }

    /// The next group in the queue, no longer counted against it.
    fn next_group(&mut self) -> Option<Arc<Rows>> {
        let rows = self.receiver.try_recv().ok()?;
        self.queued.fetch_sub(rows.len(), Ordering::AcqRel);
        Some(rows)
    }

    /// Up to `limit` rows following position `after`, in position order, when the rows
    /// handed over hold them; `None` when the reader has to read the ledger.
    pub fn take_after(&mut self, after: i64, limit: usize) -> Option<Vec<R>> {
        self.receive();
        while self
            .pending
            .front()
            .is_some_and(|row| row.position() <= after)
        {
            self.pending.pop_front();
        }
        let mut taken = Vec::new();
        while taken.len() < limit
            && self
                .pending
                .front()
                .is_some_and(|row| row.position() == after + 1 + taken.len() as i64)
        {
            taken.extend(self.pending.pop_front());
        }
        (!taken.is_empty()).then_some(taken)
    }

    /// Takes in what was handed over since the last call, keeping the newest
    /// [`HANDOFF_ROWS_MAX`] rows. A reader that lingers before reading calls it when it
    /// wakes, so that the rows the readers share are its no longer and the last reader
    /// takes them whole.
    pub fn receive(&mut self) {
        while let Some(rows) = self.next_group() {
            self.pending.extend(R::from_committed(rows));
        }
        let excess = self.pending.len().saturating_sub(HANDOFF_ROWS_MAX);
        self.pending.drain(..excess);
    }

    /// Drops everything handed over so far: for a reader that is not reading (a relay
    /// waiting to lead, a projector whose rounds another instance makes), so that it holds
    /// no rows it will never use.
    pub fn discard(&mut self) {
        while self.next_group().is_some() {}
        self.pending.clear();
    }
}

async fn run(
    options: &PgConnectOptions,
    limits: AppendLimits,
    mut dating: Dating,
    mut receiver: mpsc::Receiver<Vec<Request>>,
    outlets: Outlets,
) {
    // The head this appender last committed; `None` when unknown (start, or after an error
    // that may or may not have committed).
    let mut committed: Option<Head> = None;
    // The appender keeps one connection of its own rather than taking one from the pool per
    // group: no acquire, no liveness ping, its prepared statements stay warm, and its socket
    // is watched by this thread's reactor. Dropped after any error, so that a broken
    // connection is replaced.
    let mut connection: Option<PgConnection> = None;
    // Requests received and not yet in a group: the rest of a submission that held more
    // events than a group takes.
    let mut received: VecDeque<Request> = VecDeque::new();
    while let Some((group, events)) =
        next_group(&mut received, &mut receiver, limits.group_events_max).await
    {
        let started = Instant::now();
        let result = match connected(&mut connection, options).await {
            Ok(connection) => commit_group(connection, &group, &mut committed, &mut dating).await,
            Err(error) => Err(error),
        };
        match result {
            Ok(outcome) => {
                metrics::histogram!(crate::telemetry::APPEND_BATCH_EVENTS).record(events as f64);
                metrics::histogram!(crate::telemetry::APPEND_BATCH_SECONDS)
                    .record(started.elapsed().as_secs_f64());
                outlets.publish(outcome.rows, outcome.head);
                for (request, result) in group.into_iter().zip(outcome.results) {
                    let _ = request.reply.send(result);
                }
            }
            Err(error) => {
                // Whatever failed, the month is made again before the next try: a month
                // detached or dropped by hand would otherwise fail every append as
                // content ("no partition of relation found", a check violation).
                dating.forget();
                // A content error comes from Postgres, so the connection is there.
                let isolated = match connection.as_mut() {
                    Some(connection) if is_content_error(&error) => {
                        let state = (&mut committed, &mut dating);
                        isolate(connection, &group, state, &outlets, error).await
                    }
                    _ => Isolated {
                        results: Vec::new(),
                        failure: Some(error),
                    },
                };
                let failure = isolated.failure.map(|error| {
                    committed = None;
                    connection = None;
                    tracing::error!(error = %error, requests = group.len(), "group commit failed");
                    metrics::counter!(crate::telemetry::APPEND_FAILURES).increment(1);
                    AppendError::Store(Arc::new(error))
                });
                answer_isolated(group, isolated.results, failure);
            }
        }
    }
    tracing::info!("appender stopped");
}

/// The next group commit's requests and events ([`gather`]), waiting for a submission when
/// none is left over from the last; `None` once the queue is closed and drained.
async fn next_group(
    received: &mut VecDeque<Request>,
    receiver: &mut mpsc::Receiver<Vec<Request>>,
    group_events_max: usize,
) -> Option<(Vec<Request>, usize)> {
    loop {
        if received.is_empty() {
            received.extend(receiver.recv().await?);
        }
        let (group, events) = gather(received, receiver, group_events_max);
        if !group.is_empty() {
            return Some((group, events));
        }
    }
}

/// The requests of one group commit: those `received` and those queued behind them, in
/// order, up to `group_events_max` events (a single larger request still goes alone); and
/// how many events they hold. What a submission holds past the limit stays in `received`
/// for the next group. Everything that queued up during the last commit goes into this one.
/// Nothing here waits for more: on this thread a yield would let no producer run, and the
/// appender is already the bottleneck when the queue is long.
fn gather(
    received: &mut VecDeque<Request>,
    receiver: &mut mpsc::Receiver<Vec<Request>>,
    group_events_max: usize,
) -> (Vec<Request>, usize) {
    let mut group = Vec::new();
    let mut events = 0;
    while group.is_empty() || events < group_events_max {
        if received.is_empty() {
            match receiver.try_recv() {
                Ok(requests) => received.extend(requests),
                Err(_) => break,
            }
        }
        let Some(request) = received.pop_front() else {
            // An empty submission: none is sent, but nothing here depends on that.
            continue;
        };
        events += request.events.len();
        group.push(request);
    }
    (group, events)
}

/// The appender's connection, made when it has none.
async fn connected<'c>(
    connection: &'c mut Option<PgConnection>,
    options: &PgConnectOptions,
) -> Result<&'c mut PgConnection, sqlx::Error> {
    if connection.is_none() {
        *connection = Some(super::db::connect_one(options).await?);
    }
    Ok(connection.as_mut().expect("made above"))
}

/// Where a commit is announced: the rows to the handoffs, the head to whoever tails it.
struct Outlets {
    head: watch::Sender<i64>,
    handoffs: Handoffs,
}

impl Outlets {
    fn publish(&self, rows: Rows, head: Head) {
        metrics::counter!(crate::telemetry::APPEND_EVENTS).increment(rows.len() as u64);
        // Before the head moves, so that whoever it wakes finds the rows.
        if !rows.is_empty() && rows.len() <= HANDOFF_GROUP_EVENTS_MAX {
            self.handoffs.hand_over(rows);
        }
        if head.position > 0 {
            self.head.send_replace(head.position);
        }
    }
}

/// What isolating a group came to.
/// Answers each request of a group that failed: with its result where the isolation
/// reached one, else with `failure`.
fn answer_isolated(
    group: Vec<Request>,
    results: Vec<Option<Result<Vec<AppendedEvent>, AppendError>>>,
    failure: Option<AppendError>,
) {
    let mut results = results.into_iter();
    for request in group {
        let result = results.next().flatten().unwrap_or_else(|| {
            Err(failure
                .clone()
                .expect("a request is unanswered only after a failure"))
        });
        let _ = request.reply.send(result);
    }
}

struct Isolated {
    /// One per request of the group, in order; `None` for those left unanswered by
    /// `failure`.
    results: Vec<Option<Result<Vec<AppendedEvent>, AppendError>>>,
    /// An error that is not about the content (e.g. the connection broke) stopped the
    /// isolation; what was committed before it is answered, the rest gets it.
    failure: Option<sqlx::Error>,
}

/// Commits a group that Postgres refused for its content (`error`) in parts, so that only
/// the requests it refuses on their own fail, with [`AppendError::Unstorable`].
///
/// Bisection, left half first: a part that fails is halved again; a request that fails
/// alone is refused. Each part is prepared anew (positions, hashes) from the head actually
/// committed, so positions stay gap-free and the chain intact, and requests commit in
/// queue order. With k refused requests among n this takes about 2·k·log2(n) commits
/// rather than n one by one, and at most 2·n − 2 (every request refused): bounded by
/// the group, which is bounded by `group_events_max`.
async fn isolate(
    connection: &mut PgConnection,
    group: &[Request],
    (committed, dating): (&mut Option<Head>, &mut Dating),
    outlets: &Outlets,
    error: sqlx::Error,
) -> Isolated {
    assert!(is_content_error(&error));
    metrics::counter!(crate::telemetry::APPEND_ISOLATIONS).increment(1);
    tracing::warn!(error = %error, requests = group.len(), "group refused for its content; isolating");
    let attempts_max = 2 * group.len() - 2;
    let mut attempts = 0;
    let mut results: Vec<Option<Result<Vec<AppendedEvent>, AppendError>>> =
        group.iter().map(|_| None).collect();
    // Parts still to commit, the next on top; a part carries its error when it is known
    // to fail (only the whole group, at first).
    let mut parts = vec![(0, group.len(), Some(error))];
    while let Some((start, end, refused)) = parts.pop() {
        let error = match refused {
            Some(error) => error,
            None => {
                attempts += 1;
                assert!(
                    attempts <= attempts_max,
                    "isolation is bounded by the group"
                );
                let before = *committed;
                match commit_group(connection, &group[start..end], committed, dating).await {
                    Ok(outcome) => {
                        assert_follows(before, &outcome);
                        outlets.publish(outcome.rows, outcome.head);
                        for (slot, result) in results[start..end].iter_mut().zip(outcome.results) {
                            *slot = Some(result);
                        }
                        continue;
                    }
                    Err(error) if is_content_error(&error) => error,
                    Err(error) => {
                        return Isolated {
                            results,
                            failure: Some(error),
                        }
                    }
                }
            }
        };
        if end - start == 1 {
            results[start] = Some(Err(unstorable(&error)));
            continue;
        }
        let middle = start + (end - start) / 2;
        parts.push((middle, end, None));
        parts.push((start, middle, None));
    }
    assert!(
        results.iter().all(Option::is_some),
        "every request of an isolated group is answered"
    );
    Isolated {
        results,
        failure: None,
    }
}

/// A part committed during isolation follows the head committed before it, with
/// gap-free positions.
fn assert_follows(before: Option<Head>, outcome: &GroupOutcome) {
    if let Some(before) = before {
        // Unless another instance appended in between, the part follows exactly what was
        // committed before it.
        assert!(
            outcome.head.position >= before.position + outcome.rows.len() as i64,
            "a part's rows follow the head"
        );
    }
    if let Some(first) = outcome.rows.position.first() {
        assert_eq!(
            *first + outcome.rows.len() as i64 - 1,
            outcome.head.position,
            "a part's positions are gap-free up to the head"
        );
    }
}

/// The answer to a request that Postgres refuses on its own.
fn unstorable(error: &sqlx::Error) -> AppendError {
    metrics::counter!(crate::telemetry::APPEND_UNSTORABLE_REQUESTS).increment(1);
    let (sqlstate, reason) = match error {
        sqlx::Error::Database(error) => (
            error.code().unwrap_or_default().into_owned(),
            error.message().to_owned(),
        ),
        other => (String::new(), other.to_string()),
    };
    tracing::warn!(sqlstate, reason, "request refused for its content");
    AppendError::Unstorable { sqlstate, reason }
}

struct GroupOutcome {
    results: Vec<Result<Vec<AppendedEvent>, AppendError>>,
    /// The rows this group adds to the ledger (none when every event was known).
    rows: Rows,
    head: Head,
}

/// An event's content digest and the fields it was computed from.
struct Prepared {
    data: serde_json::Value,
    digest: [u8; 32],
}

type Known = HashMap<Uuid, (i64, [u8; 32])>;

fn plan_group(
    group: &[Request],
    prepared: &[Vec<Prepared>],
    known: &Known,
    head: Head,
    recorded_at: DateTime<Utc>,
) -> GroupOutcome {
    let mut known = known.clone();
    let mut rows = Rows::default();
    let mut next_position = head.position + 1;
    let mut prev_hash = head.hash;
    let results = group
        .iter()
        .zip(prepared)
        .map(|(request, prepared)| {
            plan_request(
                request,
                prepared,
                &mut known,
                &mut rows,
                &mut next_position,
                &mut prev_hash,
                recorded_at,
            )
        })
        .collect();
    GroupOutcome {
        results,
        rows,
        head: Head {
            position: next_position - 1,
            hash: prev_hash,
        },
    }
}

fn prepare(group: &[Request]) -> Vec<Vec<Prepared>> {
    group
        .iter()
        .map(|request| {
            request
                .events
                .iter()
                .map(|event| {
                    let data = event.data_json();
                    let digest = canonical::content_digest(&event.record_fields(&data));
                    Prepared { data, digest }
                })
                .collect()
        })
        .collect()
}

#[tracing::instrument(skip_all, fields(requests = group.len()))]
async fn commit_group(
    connection: &mut PgConnection,
    group: &[Request],
    committed: &mut Option<Head>,
    dating: &mut Dating,
) -> Result<GroupOutcome, sqlx::Error> {
    // Digests and hashes are computed before the lock is taken: the lock is the bottleneck.
    let prepared = prepare(group);
    // Before the lock too: making the month's table (once a month) is DDL.
    let recorded_at = dating.now(&mut *connection).await?;
    let mut known = Known::new();
    let mut head = match *committed {
        Some(head) => head,
        None => read::head(&mut *connection).await?,
    };
    for _ in 0..FAST_PATH_ATTEMPTS_MAX {
        let plan = plan_group(group, &prepared, &known, head, recorded_at);
        if !plan.rows.is_empty() {
            match append_fast(connection, head, &plan.rows).await? {
                FastOutcome::Appended => {}
                FastOutcome::Stale {
                    head: actual,
                    known: stored,
                } => {
                    known.extend(stored);
                    head = actual.unwrap_or(head);
                    continue;
                }
            }
        }
        *committed = Some(plan.head);
        return Ok(plan);
    }
    metrics::counter!(crate::telemetry::APPEND_LOCKED_FALLBACKS).increment(1);
    let outcome = commit_group_locked(connection, group, &prepared, recorded_at).await?;
    *committed = Some(outcome.head);
    Ok(outcome)
}

enum FastOutcome {
    Appended,
    /// Nothing was inserted: the head was not the one assumed (`Some`), and/or some ids
    /// are stored already.
    Stale {
        head: Option<Head>,
        known: Known,
    },
}

type FastRow = (
    String,
    Option<i64>,
    Option<Vec<u8>>,
    Option<Uuid>,
    Option<i64>,
    Option<Vec<u8>>,
);

#[tracing::instrument(skip_all, fields(rows = rows.len()))]
async fn append_fast(
    connection: &mut PgConnection,
    head: Head,
    rows: &Rows,
) -> Result<FastOutcome, sqlx::Error> {
    let query = sqlx::query(
        "SELECT * FROM ledger_append($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)",
    )
    .bind(head.position)
    .bind(head.hash.as_slice());
    let answers = rows.bind(query).fetch_all(connection).await?;
    let mut known = Known::new();
    let mut actual = None;
    let mut appended = false;
    for answer in &answers {
        let (outcome, head_position, head_hash, id, position, digest) = FastRow::from_row(answer)?;
        match (
            outcome.as_str(),
            head_position,
            head_hash,
            id,
            position,
            digest,
        ) {
            ("appended", ..) => appended = true,
            ("head_moved", Some(position), Some(hash), ..) => {
                actual = Some(Head {
                    position,
                    hash: hash.try_into().expect("hashes are 32 bytes"),
                })
            }
            ("known", _, _, Some(id), Some(position), Some(digest)) => {
                known.insert(
                    id,
                    (position, digest.try_into().expect("digests are 32 bytes")),
                );
            }
            other => panic!("ledger_append returned an unexpected row {other:?}"),
        }
    }
    if appended {
        assert!(
            actual.is_none() && known.is_empty(),
            "ledger_append appended and refused"
        );
        Ok(FastOutcome::Appended)
    } else {
        assert!(
            actual.is_some() || !known.is_empty(),
            "ledger_append did nothing and said nothing"
        );
        Ok(FastOutcome::Stale {
            head: actual,
            known,
        })
    }
}

/// The slow path: one transaction holds the ledger lock while it reads the head and the
/// stored ids, plans and inserts. Always makes progress, whatever other instances do.
async fn commit_group_locked(
    connection: &mut PgConnection,
    group: &[Request],
    prepared: &[Vec<Prepared>],
    recorded_at: DateTime<Utc>,
) -> Result<GroupOutcome, sqlx::Error> {
    let ids: Vec<Uuid> = group
        .iter()
        .flat_map(|r| r.events.iter().map(|e| e.id.as_uuid()))
        .collect();
    let mut tx = connection.begin().await?;
    sqlx::query(&format!(
        "SELECT pg_advisory_xact_lock($1), {}",
        super::db::BOUND_LOCK_IDLE
    ))
    .bind(LEDGER_LOCK_KEY)
    .execute(&mut *tx)
    .await?;
    let head = read::head(&mut *tx).await?;
    let known = existing(&mut tx, &ids).await?;
    let plan = plan_group(group, prepared, &known, head, recorded_at);
    if !plan.rows.is_empty() {
        plan.rows.insert_into(&mut *tx, "ledger").await?;
    }
    tx.commit().await?;
    Ok(plan)
}

/// Decides each event of one request: duplicate, conflict (refusing the whole request),
/// or new (appended to `rows` with the next position). A refused request leaves `known`,
/// `rows`, the position and the chain exactly as they were.
fn plan_request(
    request: &Request,
    prepared: &[Prepared],
    known: &mut Known,
    rows: &mut Rows,
    next_position: &mut i64,
    prev_hash: &mut [u8; 32],
    recorded_at: DateTime<Utc>,
) -> Result<Vec<AppendedEvent>, AppendError> {
    let mut staged: HashMap<Uuid, (i64, [u8; 32])> = HashMap::new();
    let mut outcome = Vec::with_capacity(request.events.len());
    let mut new = Vec::new();
    let mut position = *next_position;
    for (index, (event, prepared)) in request.events.iter().zip(prepared).enumerate() {
        let id = event.id.as_uuid();
        match staged.get(&id).or_else(|| known.get(&id)) {
            Some((stored_position, digest)) if *digest == prepared.digest => {
                outcome.push(AppendedEvent {
                    id: event.id,
                    position: *stored_position,
                    duplicate: true,
                });
            }
            Some(_) => {
                return Err(AppendError::IdempotencyConflict {
                    index,
                    id: event.id,
                })
            }
            None => {
                staged.insert(id, (position, prepared.digest));
                outcome.push(AppendedEvent {
                    id: event.id,
                    position,
                    duplicate: false,
                });
                new.push((position, event, prepared));
                position += 1;
            }
        }
    }
    for (position, event, prepared) in new {
        assert_eq!(
            position, *next_position,
            "positions are assigned without gaps"
        );
        *prev_hash = rows.push(
            event,
            prepared.data.clone(),
            prepared.digest,
            position,
            recorded_at,
            prev_hash,
        );
        *next_position += 1;
    }
    known.extend(staged);
    Ok(outcome)
}

#[tracing::instrument(skip_all)]
async fn existing(tx: &mut Transaction<'_, Postgres>, ids: &[Uuid]) -> Result<Known, sqlx::Error> {
    let rows: Vec<(Uuid, i64, Vec<u8>)> =
        sqlx::query_as("SELECT id, position, content_digest FROM ledger_ids WHERE id = ANY($1)")
            .bind(ids)
            .fetch_all(&mut **tx)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(id, position, digest)| {
            let digest: [u8; 32] = digest.try_into().expect("the schema checks digest length");
            (id, (position, digest))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(position: i64) -> LedgerRow {
        LedgerRow {
            position,
            id: Uuid::new_v4(),
            event_type: "container.resumed".to_owned(),
            org_id: "acme".to_owned(),
            container_id: Some("c1".to_owned()),
            occurred_at: Utc::now(),
            recorded_at: Utc::now(),
            data: serde_json::json!({}),
            source: None,
            source_event_id: None,
            attributes: None,
            hash: vec![0; 32],
        }
    }

    /// A handoff holding rows at `positions`, as if handed over in that order.
    fn handed(positions: impl IntoIterator<Item = i64>) -> Committed<LedgerRow> {
        let (_sender, receiver) = mpsc::channel(1);
        let mut committed = Committed::new(receiver, Arc::default());
        committed.pending.extend(positions.into_iter().map(row));
        committed
    }

    fn positions(rows: Option<Vec<LedgerRow>>) -> Option<Vec<i64>> {
        rows.map(|rows| rows.iter().map(|row| row.position).collect())
    }

    #[test]
    fn handed_rows_that_continue_the_reader_are_taken_in_order_up_to_the_limit() {
        let mut committed = handed(1..=5);
        assert_eq!(positions(committed.take_after(0, 3)), Some(vec![1, 2, 3]));
        assert_eq!(positions(committed.take_after(3, 3)), Some(vec![4, 5]));
        assert_eq!(positions(committed.take_after(5, 3)), None);
    }

    #[test]
    fn rows_the_reader_already_has_are_dropped_and_a_gap_sends_it_to_the_ledger() {
        let mut committed = handed([1, 2, 3, 6, 7]);
        assert_eq!(positions(committed.take_after(2, 10)), Some(vec![3]));
        // 4 and 5 were appended by another instance: only the ledger has them.
        assert_eq!(positions(committed.take_after(3, 10)), None);
        assert_eq!(positions(committed.take_after(5, 10)), Some(vec![6, 7]));
    }

    #[test]
    fn a_reader_ahead_of_everything_handed_gets_nothing_from_memory() {
        let mut committed = handed(1..=3);
        assert_eq!(positions(committed.take_after(10, 10)), None);
        assert!(committed.pending.is_empty(), "stale rows are not kept");
    }

    /// A reader that keeps only positions.
    #[derive(Debug, PartialEq)]
    struct Position(i64);

    impl Handed for Position {
        fn position(&self) -> i64 {
            self.0
        }

        fn from_committed(rows: Arc<Rows>) -> Vec<Position> {
            rows.position.iter().copied().map(Position).collect()
        }
    }

    /// A group holding only positions: enough for a reader of positions.
    fn group(positions: std::ops::RangeInclusive<i64>) -> Rows {
        Rows {
            position: positions.collect(),
            ..Rows::default()
        }
    }

    fn first_and_last(rows: Option<Vec<Position>>) -> Option<(i64, i64)> {
        let rows = rows?;
        Some((rows.first()?.0, rows.last()?.0))
    }

    #[test]
    fn a_reader_whose_queue_holds_its_limit_of_rows_is_handed_nothing_more_until_it_takes_them_in()
    {
        let handoffs = Handoffs::default();
        let mut slow = handoffs.add::<Position>();
        let mut quick = handoffs.add::<Position>();
        let half = HANDOFF_QUEUED_ROWS_MAX as i64 / 2;
        handoffs.hand_over(group(1..=half));
        quick.receive();
        handoffs.hand_over(group(half + 1..=2 * half));
        quick.receive();
        // The slow reader's queue holds its limit: one more row would pass it.
        handoffs.hand_over(group(2 * half + 1..=2 * half + 1));
        quick.receive();
        assert_eq!(
            first_and_last(quick.take_after(2 * half, 10)),
            Some((2 * half + 1, 2 * half + 1)),
            "a slow reader holds no other back"
        );

        slow.receive();
        assert_eq!(slow.queued.load(Ordering::Acquire), 0);
        assert_eq!(
            first_and_last(slow.take_after(2 * half - HANDOFF_ROWS_MAX as i64, 2 * half as usize)),
            Some((2 * half - HANDOFF_ROWS_MAX as i64 + 1, 2 * half)),
            "the newest rows it keeps"
        );
        assert!(
            slow.take_after(2 * half, 10).is_none(),
            "the group it was not handed is read from the ledger"
        );
        handoffs.hand_over(group(2 * half + 2..=2 * half + 3));
        assert_eq!(
            first_and_last(slow.take_after(2 * half + 1, 10)),
            Some((2 * half + 2, 2 * half + 3)),
            "with room again, it is handed the next group"
        );
    }

    #[test]
    fn past_its_limit_the_handoff_keeps_the_newest_rows() {
        let extra = 10;
        let mut committed = handed(1..=HANDOFF_ROWS_MAX as i64 + extra);
        assert_eq!(positions(committed.take_after(0, 1)), None, "1 was dropped");
        assert_eq!(committed.pending.len(), HANDOFF_ROWS_MAX);
        assert_eq!(
            positions(committed.take_after(extra, 1)),
            Some(vec![extra + 1])
        );
    }

    #[test]
    fn each_org_waits_for_its_own_last_acknowledged_position_and_every_org_for_plans() {
        let mut acknowledged = Acknowledged::default();
        assert_eq!(acknowledged.wanted("acme"), 0);
        acknowledged.record("acme", 5, false);
        acknowledged.record("beta", 7, false);
        acknowledged.record("acme", 3, false);
        assert_eq!(acknowledged.wanted("acme"), 5, "never moves back");
        assert_eq!(acknowledged.wanted("beta"), 7);
        assert_eq!(acknowledged.wanted("other"), 0);
        acknowledged.record("_plans", 6, true);
        assert_eq!(acknowledged.wanted("acme"), 6);
        assert_eq!(acknowledged.wanted("beta"), 7);
        assert_eq!(acknowledged.wanted("other"), 6);
    }

    #[test]
    fn past_its_limit_it_forgets_orgs_into_a_floor_that_makes_them_wait_longer_never_less() {
        let mut acknowledged = Acknowledged::default();
        for n in 0..ACKNOWLEDGED_ORGS_MAX {
            acknowledged.record(&format!("org{n}"), n as i64 + 1, false);
        }
        assert_eq!(acknowledged.wanted("org0"), 1);
        acknowledged.record("new", 1, false);
        let highest = ACKNOWLEDGED_ORGS_MAX as i64;
        assert_eq!(acknowledged.wanted("org0"), highest);
        assert_eq!(acknowledged.wanted("new"), highest);
        acknowledged.record("new", highest + 1, false);
        assert_eq!(acknowledged.wanted("new"), highest + 1);
        assert_eq!(acknowledged.positions.len(), 1);
    }
}
