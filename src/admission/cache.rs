//! Admission facts kept in memory between checks, for as long as nothing they were read
//! from changes.
//!
//! A check's facts come from the projection and the reservations, and most checks ask
//! about orgs none of whose figures moved since the last check: the same statement, the
//! same rows. So each instance keeps the facts it read, per org (and, for an org with
//! more containers than facts hold, per container asked about), parsed, and answers from
//! them at the instant of each later check. They are
//! dropped when Postgres says they may be out of date:
//!
//! - Every projector round, in its own transaction, sends a notice (`NOTIFY`, delivered
//!   only when that transaction commits, in commit order) naming its new checkpoint and the
//!   orgs of its events, or "all" when it holds a plan definition or more orgs than a
//!   notice carries; a replay's swap says "all". Reservations granted and released say
//!   their org in their transaction, and the instance that granted or released one drops
//!   that org's facts itself before it answers, so its own next check sees it.
//! - The instance whose projector ran the round keeps what it changed, under the tag the
//!   notice carries ([`Rounds`]). Its listener, hearing that notice, advances the facts it
//!   keeps of the round's orgs by the round's deltas ([`super::Prepared::advanced`]) rather
//!   than dropping them, in the notice's place in commit order, so that an org whose events
//!   keep coming stays answerable from memory. Orgs with an account event, a void or a
//!   consumed reservation in the round are dropped all the same; every other instance,
//!   which does not hold the round's changes, drops the round's orgs.
//! - A read that a notice overtook (it touched the org, or was "all", between the read's
//!   start and its end) is answered from but not kept, so the facts kept never miss a
//!   change that was notified.
//! - The cache answers only while the listener holds a live `LISTEN`: it starts empty once
//!   `LISTEN` is in place (every commit after it is notified; a read started after it sees
//!   every commit before it) and empties itself when the connection is lost, since notices
//!   sent meanwhile are lost with it.
//! - Read-your-writes: a check is answered from memory only when the notices received reach
//!   past every event this instance has acknowledged; otherwise it reads Postgres, waiting
//!   for the projection as an uncached check does.
//!
//! What a kept answer can miss is what Postgres has committed but not yet delivered to the
//! listener: a change by another instance, for the time a notice takes to arrive (well
//! under a millisecond on one machine), on top of the projection's own lag. Reservations
//! themselves never read the cache: they are granted under the org's lock from a fresh
//! snapshot.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

// anyhow, not a typed error, for the listener's failures: they end at its loop, which logs
// them and listens again; none reaches an HTTP answer.
use anyhow::Context as _;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{OrgRound, Prepared, Request};
use crate::billing::Action;
use crate::event::ContainerId;
use crate::projection::notice::{notify, Notice, RoundChanges, Rounds, CHANNEL};
use crate::projection::store;
use crate::projection::Freshness;

/// Orgs with facts kept, or with a read in flight; past it, everything is dropped.
pub const ORGS_MAX: usize = 100_000;
/// Facts kept at most, each counting one plus the containers it holds (an org with
/// facts that hold all its containers has one; a larger org one for each container asked
/// about), its containers with events after its read counted again; past it, everything is
/// dropped and the cache starts over. Facts hold no more than
/// [`super::RECENT_INTERVALS_MAX`] intervals of any container, so this bounds memory.
pub const ENTRIES_MAX: usize = 200_000;
/// Facts kept of one org at most, counted as for [`ENTRIES_MAX`]; past it, that org's are
/// dropped and its facts kept anew. Checks naming ever new containers of one org (they
/// need not exist) would otherwise fill the cache every org shares, and every other org
/// not yet kept would be read from Postgres until something dropped everything; and each
/// projector round of that org would advance all its facts under the cache's lock.
pub const ORG_ENTRIES_MAX: usize = 2_000;
/// The application name of the listener's connection, so that operators can tell it apart.
pub const LISTENER_APPLICATION_NAME: &str = "tally admission listener";
/// The application name of the connection that sends this instance's heartbeats.
pub const HEARTBEAT_APPLICATION_NAME: &str = "tally admission heartbeat";
/// How long the listener waits before connecting again after it lost its connection.
const RECONNECT_DELAY_MS: u64 = 200;
/// How often each instance sends the channel an empty notice, which changes nothing, so
/// that every listener hears something even while nothing changes.
pub const HEARTBEAT_INTERVAL_MS: u64 = 1_000;
/// How long a listener may hear nothing at all, not even a heartbeat, before it takes its
/// connection for lost. A connection dropped without a reset (a NAT's or firewall's idle
/// timeout, a pooler in between) is otherwise noticed only when TCP gives up, many minutes
/// later, and until then the facts kept would miss every change.
pub const HEARTBEAT_DEADLINE_MS: u64 = 5_000;

/// The listener's liveness check: how often this instance sends a heartbeat (`None`: it
/// sends none) and how long it waits to hear any notice before it reconnects.
#[derive(Debug, Clone, Copy)]
pub struct Heartbeat {
    pub interval: Option<Duration>,
    pub deadline: Duration,
}

impl Default for Heartbeat {
    fn default() -> Heartbeat {
        Heartbeat {
            interval: Some(Duration::from_millis(HEARTBEAT_INTERVAL_MS)),
            deadline: Duration::from_millis(HEARTBEAT_DEADLINE_MS),
        }
    }
}

/// Taken before a read; the read's facts are kept only when no notice touched the org
/// since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    generation: u64,
    org_generation: u64,
}

#[derive(Default)]
struct Slot {
    generation: u64,
    facts: HashMap<Option<ContainerId>, Arc<Prepared>>,
    /// The facts' weights added up, as counted against [`ORG_ENTRIES_MAX`].
    entries: usize,
}

#[derive(Default)]
struct State {
    /// Whether the listener holds a live `LISTEN`: nothing is answered or kept otherwise.
    listening: bool,
    /// Moves whenever everything is dropped, so that no read begun before is kept.
    generation: u64,
    /// The highest checkpoint a notice has reported (or read when listening began).
    projected: i64,
    orgs: HashMap<String, Slot>,
    entries: usize,
}

impl State {
    fn drop_all(&mut self) {
        self.generation += 1;
        self.orgs.clear();
        self.entries = 0;
    }
}

/// Hits and misses since the start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    /// Times the listener started listening (heard its first notice on a connection):
    /// once, plus once for every reconnection.
    pub listens: u64,
    /// Times a round of this instance's projector advanced an org's kept facts rather
    /// than dropping them.
    pub advanced: u64,
}

/// The facts kept for one request, as a read of Postgres would give them; two are equal
/// when every fact is. Tests compare them with [`super::read_facts`].
#[derive(Debug, Clone, PartialEq)]
pub struct KeptFacts(pub(crate) Arc<Prepared>);

impl KeptFacts {
    /// The instant the facts were read at.
    pub fn read_at(&self) -> chrono::DateTime<chrono::Utc> {
        self.0.read_at
    }

    /// The checkpoint they reflect.
    pub fn projected(&self) -> i64 {
        self.0.projected
    }

    /// Whether they hold every container of the org (see
    /// [`super::ORG_CONTAINERS_KEPT_MAX`]), and so answer a check naming any of them.
    pub fn whole(&self) -> bool {
        self.0.whole()
    }

    /// The org's containers with an event after the instant the facts were read at, by id.
    pub fn future_containers(&self) -> impl Iterator<Item = &str> {
        self.0.future.keys().map(String::as_str)
    }

    /// Of the container `id`, when the facts hold it: how many intervals it has, and those
    /// the facts hold of them (the ones ending after the read, or open).
    pub fn intervals_of(&self, id: &str) -> Option<(usize, &[crate::runtime::Interval])> {
        self.0
            .container(id)
            .map(|held| (held.intervals_total, held.recent.intervals()))
    }

    /// Whether a check would keep them (see [`Prepared::keepable`]).
    pub fn keepable(&self) -> bool {
        self.0.keepable()
    }
}

/// The facts of this instance's checks; cheap to clone.
#[derive(Clone)]
pub struct FactsCache {
    state: Arc<Mutex<State>>,
    stats: Arc<Counters>,
    /// Told of every projector round its listener hears, any instance's, so that reads
    /// waiting for another instance's round are woken by it rather than by their poll.
    rounds: Option<Freshness>,
    /// What this instance's projector rounds changed, until their notices are heard.
    committed: Rounds,
    /// The checkpoint the notices heard have reported, for checks that wait for it; 0
    /// while not listening.
    heard: Arc<watch::Sender<i64>>,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    listens: AtomicU64,
    advanced: AtomicU64,
}

impl Default for FactsCache {
    fn default() -> FactsCache {
        FactsCache {
            state: Arc::default(),
            stats: Arc::default(),
            rounds: None,
            committed: Rounds::default(),
            heard: Arc::new(watch::Sender::new(0)),
        }
    }
}

impl FactsCache {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("the facts cache is never held across a panic")
    }

    /// The facts kept for `request`, when they are known to include every event up to
    /// `wanted` and every change notified, with the position they reflect: kept facts
    /// are those of the projection at every checkpoint a notice reported since they were
    /// read (a notice touching the org would have dropped them), so the later of that and
    /// the checkpoint they were read at.
    pub(crate) fn get(&self, request: &Request, wanted: i64) -> Option<(Arc<Prepared>, i64)> {
        let state = self.lock();
        if !state.listening {
            return None;
        }
        let facts = state
            .orgs
            .get(request.org_id.as_str())
            .and_then(|slot| kept_for(slot, request))
            .cloned()?;
        let position = state.projected.max(facts.projected);
        (position >= wanted).then_some((facts, position))
    }

    /// Counts a check answered from memory (`hit`) or from Postgres.
    pub fn count(&self, hit: bool) {
        let (counter, source) = match hit {
            true => (&self.stats.hits, "memory"),
            false => (&self.stats.misses, "postgres"),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(crate::telemetry::ADMISSION_CHECK_FACTS, "source" => source).increment(1);
    }

    /// To be taken before reading the facts of an org; `None` while not listening.
    pub fn ticket(&self, org: &str) -> Option<Ticket> {
        let mut state = self.lock();
        if !state.listening {
            return None;
        }
        if !state.orgs.contains_key(org) && state.orgs.len() >= ORGS_MAX {
            state.drop_all();
        }
        let generation = state.generation;
        let slot = state.orgs.entry(org.to_owned()).or_default();
        Some(Ticket {
            generation,
            org_generation: slot.generation,
        })
    }

    /// Keeps the facts of `request` read under `ticket`, unless a notice touched its org
    /// (or everything) since the ticket was taken, the facts are not to be kept (see
    /// [`Prepared::keepable`]), or the cache is full.
    pub(crate) fn keep(&self, ticket: Ticket, request: &Request, facts: Arc<Prepared>) -> bool {
        if !facts.keepable() {
            return false;
        }
        let mut state = self.lock();
        if !state.listening || state.generation != ticket.generation {
            return false;
        }
        let (entries, added) = (state.entries, weight(&facts));
        let Some(slot) = state.orgs.get_mut(request.org_id.as_str()) else {
            return false;
        };
        if slot.generation != ticket.org_generation {
            return false;
        }
        // Facts that hold every container of the org answer for any of them.
        let key = match facts.whole() {
            true => None,
            false => match key(request) {
                Some(key) => key,
                None => return false,
            },
        };
        let mut replaced = slot.facts.get(&key).map_or(0, |kept| weight(kept));
        let mut entries = entries;
        if slot.entries - replaced + added > ORG_ENTRIES_MAX {
            slot.facts.clear();
            entries -= slot.entries;
            slot.entries = 0;
            replaced = 0;
        }
        if entries - replaced + added > ENTRIES_MAX {
            state.entries = entries;
            state.drop_all();
            return false;
        }
        slot.facts.insert(key, facts);
        slot.entries = slot.entries - replaced + added;
        state.entries = entries - replaced + added;
        true
    }

    /// A cache whose listener also tells `freshness` of every projector round it hears.
    pub fn waking(freshness: Freshness) -> FactsCache {
        FactsCache {
            rounds: Some(freshness),
            ..FactsCache::default()
        }
    }

    /// Where this instance's projector keeps what each round changed, for this cache.
    pub fn rounds(&self) -> Rounds {
        self.committed.clone()
    }

    /// Drops what `notice` says may have changed, or advances it by the changes of the
    /// round the notice comes from when this instance projected it; then records its
    /// checkpoint.
    pub fn apply(&self, notice: &Notice) {
        let round = notice.round.and_then(|tag| self.committed.take(tag));
        let mut state = self.lock();
        if notice.all {
            state.drop_all();
        } else {
            match (round, notice.position) {
                (Some(round), Some(position)) => {
                    let advanced = advance_orgs(&mut state, &notice.orgs, &round, position);
                    self.stats.advanced.fetch_add(advanced, Ordering::Relaxed);
                }
                _ => {
                    for org in &notice.orgs {
                        forget_org(&mut state, org);
                    }
                }
            }
        }
        // Notices come in commit order, and the checkpoint moves forward except at a
        // replay's swap, whose notice drops everything: the last notice's is the one.
        if let Some(position) = notice.position {
            state.projected = if notice.all {
                position
            } else {
                state.projected.max(position)
            };
            self.heard.send_replace(state.projected);
        }
    }

    /// Drops the facts of `org`: this instance has just changed its reservations.
    pub fn forget(&self, org: &str) {
        forget_org(&mut self.lock(), org);
    }

    /// The listener holds a live `LISTEN` and the projection's checkpoint read after it
    /// was `projected`: answer from here on, starting empty.
    pub fn listening(&self, projected: i64) {
        self.stats.listens.fetch_add(1, Ordering::Relaxed);
        let mut state = self.lock();
        state.drop_all();
        state.listening = true;
        state.projected = projected;
        self.heard.send_replace(projected);
    }

    /// The listener lost its connection: notices may be lost, so nothing kept is trusted.
    /// Returns whether it was listening until now.
    pub fn deaf(&self) -> bool {
        let mut state = self.lock();
        state.drop_all();
        let was = std::mem::replace(&mut state.listening, false);
        // Wakes the checks waiting for notices: none will come on this connection.
        self.heard.send_replace(0);
        was
    }

    /// Waits until the notices heard reach `wanted`, calling `hurry` whenever it goes on
    /// waiting (to end the projector's linger), until `deadline`; `false` when the time is
    /// up first or the listener is not listening (or stops).
    pub async fn heard(&self, wanted: i64, deadline: std::time::Instant, hurry: impl Fn()) -> bool {
        let mut heard = self.heard.subscribe();
        let mut waiting = None;
        let reached = loop {
            {
                let state = self.lock();
                if !state.listening {
                    break false;
                }
                if state.projected >= wanted {
                    break true;
                }
            }
            waiting.get_or_insert_with(std::time::Instant::now);
            hurry();
            let deadline = tokio::time::Instant::from_std(deadline);
            match tokio::time::timeout_at(deadline, heard.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => break false,
            }
        };
        if let Some(since) = waiting {
            record_wait(WAITED_FOR_NOTICES, since);
        }
        reached
    }

    /// Whether the cache answers: its listener has heard a notice on a connection it still
    /// holds.
    pub fn is_listening(&self) -> bool {
        self.lock().listening
    }

    /// The facts kept for `request`, whatever position they reflect.
    pub fn kept(&self, request: &Request) -> Option<KeptFacts> {
        let state = self.lock();
        let facts = kept_for(state.orgs.get(request.org_id.as_str())?, request)?;
        Some(KeptFacts(Arc::clone(facts)))
    }

    /// The highest checkpoint the notices heard have reported; `None` while not listening.
    pub fn projected(&self) -> Option<i64> {
        let state = self.lock();
        state.listening.then_some(state.projected)
    }

    /// Facts kept now, as counted against [`ENTRIES_MAX`].
    pub fn len(&self) -> usize {
        self.lock().entries
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            hits: self.stats.hits.load(Ordering::Relaxed),
            misses: self.stats.misses.load(Ordering::Relaxed),
            listens: self.stats.listens.load(Ordering::Relaxed),
            advanced: self.stats.advanced.load(Ordering::Relaxed),
        }
    }
}

/// What a check waited for, as `tally_admission_wait_seconds` labels it: the notices of
/// this instance's rounds (its facts kept in memory) or the stored checkpoint (before
/// reading them from Postgres).
pub(crate) const WAITED_FOR_NOTICES: &str = "notices";
pub(crate) const WAITED_FOR_CHECKPOINT: &str = "checkpoint";

/// Records how long a check waited, since `since`, for the projection to hold its org's
/// acknowledged events.
pub(crate) fn record_wait(waited_for: &'static str, since: std::time::Instant) {
    metrics::histogram!(crate::telemetry::ADMISSION_WAIT_SECONDS, "for" => waited_for)
        .record(since.elapsed());
}

/// Which of an org's kept facts answer a request: the container counts for the actions
/// that need it running, and for a `resume`, which asks how many intervals and lifecycle
/// events it has (`interval_limit`, `lifecycle_limit`); a `create` names a container that
/// does not exist yet. `None`: nothing kept answers it (a `run` or `publish_port` naming
/// no container, which HTTP refuses anyway).
fn key(request: &Request) -> Option<Option<ContainerId>> {
    match request.action {
        Action::Run | Action::PublishPort => request.container_id.clone().map(Some),
        Action::Resume => Some(request.container_id.clone()),
        Action::Create => Some(None),
    }
}

/// The facts of `slot` that answer `request`: those kept under its key, or for a check
/// naming a container, the org's facts when they hold every container.
fn kept_for<'a>(slot: &'a Slot, request: &Request) -> Option<&'a Arc<Prepared>> {
    let key = key(request)?;
    slot.facts.get(&key).or_else(|| match key {
        Some(_) => slot.facts.get(&None).filter(|facts| facts.whole()),
        None => None,
    })
}

/// What one kept fact counts against [`ENTRIES_MAX`]: one, and one for each container it
/// holds (see [`Prepared::containers_kept`]).
fn weight(facts: &Prepared) -> usize {
    1 + facts.containers_kept()
}

/// Advances the kept facts of `orgs` by `round`, which reached `position`; drops those of
/// the orgs it cannot advance. Returns how many orgs' facts it advanced.
fn advance_orgs(state: &mut State, orgs: &[String], round: &RoundChanges, position: i64) -> u64 {
    let kept: HashSet<&str> = orgs
        .iter()
        .map(String::as_str)
        .filter(|org| !round.reread.contains(*org))
        .filter(|org| {
            state
                .orgs
                .get(*org)
                .is_some_and(|slot| !slot.facts.is_empty())
        })
        .collect();
    let mut by_org: HashMap<&str, OrgRound<'_>> = kept
        .iter()
        .map(|org| {
            let latest_at = round.changes.latest.get(*org).copied();
            let change = OrgRound {
                position,
                latest_at,
                ..OrgRound::default()
            };
            (*org, change)
        })
        .collect();
    if !by_org.is_empty() {
        let changes = &round.changes;
        for ((org, period), delta) in &changes.periods {
            if let Some(change) = by_org.get_mut(org.as_str()) {
                change.periods.push((*period, *delta));
            }
        }
        for ((org, period), delta) in &changes.open {
            if let Some(change) = by_org.get_mut(org.as_str()) {
                change.open.push((*period, *delta));
            }
        }
        for (key, lifecycle) in changes.lifecycles() {
            if let Some(change) = by_org.get_mut(key.org_id.as_str()) {
                change
                    .containers
                    .push((key.container_id.as_str(), lifecycle));
            }
        }
    }
    let mut advanced = 0;
    for org in orgs {
        let done = by_org
            .get(org.as_str())
            .is_some_and(|change| advance_org(state, org, change));
        if done {
            advanced += 1;
        } else {
            forget_org(state, org);
        }
    }
    advanced
}

/// Advances every fact kept of `org` by `change`; `false`, changing nothing, when one of
/// them cannot be or they would weigh more than [`ORG_ENTRIES_MAX`] together.
fn advance_org(state: &mut State, org: &str, change: &OrgRound<'_>) -> bool {
    let Some(slot) = state.orgs.get_mut(org) else {
        return false;
    };
    let mut facts = HashMap::with_capacity(slot.facts.len());
    let mut after = 0;
    for (key, kept) in &slot.facts {
        let Some(next) = kept.advanced(change) else {
            return false;
        };
        after += weight(&next);
        facts.insert(key.clone(), Arc::new(next));
    }
    if after > ORG_ENTRIES_MAX {
        return false;
    }
    // Reads begun before the round are not kept: they may not include it.
    slot.generation += 1;
    slot.facts = facts;
    // A round may add containers to facts (never past ORG_CONTAINERS_KEPT_MAX held whole,
    // nor past FUTURE_CONTAINERS_MAX ahead, see `Prepared::advanced`), which can take the
    // count past ENTRIES_MAX for a while: the next fact kept starts the cache over.
    state.entries = state.entries - slot.entries + after;
    slot.entries = after;
    true
}

fn forget_org(state: &mut State, org: &str) {
    if let Some(slot) = state.orgs.get_mut(org) {
        slot.generation += 1;
        state.entries -= slot.entries;
        slot.entries = 0;
        slot.facts.clear();
    }
}

/// Listens for the notices on a connection of its own and applies them to `cache` until
/// `shutdown`; connects again after losing the connection, or after hearing nothing for the
/// heartbeat's deadline, and keeps the cache off meanwhile.
pub async fn listen(pool: PgPool, cache: FactsCache, shutdown: CancellationToken) {
    listen_with(pool, cache, Heartbeat::default(), shutdown).await;
}

/// [`listen`] with a heartbeat of the caller's choosing.
pub async fn listen_with(
    pool: PgPool,
    cache: FactsCache,
    heartbeat: Heartbeat,
    shutdown: CancellationToken,
) {
    loop {
        let result = tokio::select! {
            result = listen_once(&pool, &cache, heartbeat) => result,
            _ = shutdown.cancelled() => Ok(()),
        };
        let was_listening = cache.deaf();
        if shutdown.is_cancelled() {
            return;
        }
        if let Err(error) = result {
            if was_listening {
                metrics::counter!(crate::telemetry::ADMISSION_LISTENER_LOSSES).increment(1);
            }
            tracing::warn!(error = %format!("{error:#}"), "admission listener: connection lost or not listening; checks read Postgres until it listens");
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(RECONNECT_DELAY_MS)) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

async fn listen_once(
    pool: &PgPool,
    cache: &FactsCache,
    heartbeat: Heartbeat,
) -> anyhow::Result<()> {
    // Pools of one connection of their own: the service's pool keeps all its connections,
    // and closing it does not wait for these.
    let own = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(named(pool, LISTENER_APPLICATION_NAME))
        .await?;
    let mut listener = PgListener::connect_with(&own).await?;
    // Lost is told at once, not after reconnecting, which could lose notices unseen.
    listener.eager_reconnect(false);
    listener.listen(CHANNEL).await?;
    // Sent on a connection of their own, not the service's pool: a pool that requests keep
    // busy for the deadline must not pass for a lost connection, which would empty the
    // cache just when it saves the most reads. It never ends; it is dropped with this
    // function, and with it the connection.
    let beats = PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy_with(named(pool, HEARTBEAT_APPLICATION_NAME));
    let beating = send_heartbeats(&beats, heartbeat);
    tokio::pin!(beating);
    // Trusted only once heard: `LISTEN` succeeds behind a pooler that never delivers.
    // The first notice tells nothing this instance needs (the cache is empty until the
    // checkpoint read below); every later one is applied.
    receive(&mut listener, &mut beating, heartbeat.deadline).await?;
    let projected: i64 =
        sqlx::query_scalar(&format!("SELECT position FROM {}.checkpoint", store::LIVE))
            .fetch_one(pool)
            .await?;
    cache.listening(projected);
    tracing::debug!(projected, "admission listener: listening");
    loop {
        let notification = receive(&mut listener, &mut beating, heartbeat.deadline).await?;
        match serde_json::from_str::<Notice>(notification.payload()) {
            Ok(notice) => {
                cache.apply(&notice);
                // Sent when the round's transaction committed: the checkpoint is there.
                if let (Some(freshness), Some(position)) = (&cache.rounds, notice.position) {
                    freshness.reached(position);
                }
            }
            Err(error) => {
                tracing::warn!(%error, payload = notification.payload(), "admission listener: a notice that does not parse; dropping every fact kept");
                cache.apply(&Notice::all(None));
            }
        }
    }
}

/// `pool`'s connect options under `application_name`, so that operators can tell the
/// connection apart.
fn named(pool: &PgPool, application_name: &str) -> PgConnectOptions {
    pool.connect_options()
        .as_ref()
        .clone()
        .application_name(application_name)
}

/// The next notice, heard within `deadline` while `beating` sends heartbeats.
async fn receive(
    listener: &mut PgListener,
    beating: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
    deadline: Duration,
) -> anyhow::Result<sqlx::postgres::PgNotification> {
    // Only the deadline cancels a receive, and then the listener is dropped with whatever
    // it had half read.
    let received = tokio::select! {
        received = tokio::time::timeout(deadline, listener.try_recv()) => received,
        () = beating.as_mut() => unreachable!("heartbeats never end"),
    };
    let Ok(received) = received else {
        anyhow::bail!(
            "no notice within {} ms, not even a heartbeat",
            deadline.as_millis()
        );
    };
    received?.context("the listening connection was closed")
}

/// Sends an empty notice every `heartbeat.interval` (forever; never when `None`). A
/// heartbeat that fails is only logged: the listener's deadline is what acts on silence.
async fn send_heartbeats(pool: &PgPool, heartbeat: Heartbeat) {
    let Some(interval) = heartbeat.interval else {
        return std::future::pending().await;
    };
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let empty = Notice::default().to_string();
    loop {
        ticks.tick().await;
        match tokio::time::timeout(heartbeat.deadline, notify(pool, &empty)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::debug!(%error, "admission listener: heartbeat not sent"),
            Err(_) => tracing::debug!("admission listener: heartbeat not sent in time"),
        }
    }
}

#[cfg(test)]
mod tests {
    use chrono::{DateTime, TimeZone, Utc};

    use super::*;
    use crate::admission::{ContainerFacts, RECENT_INTERVALS_MAX};
    use crate::billing::Action;
    use crate::event::OrgId;
    use std::collections::BTreeMap;

    use crate::admission::ORG_CONTAINERS_KEPT_MAX;
    use crate::event::EventId;
    use crate::projection::model::{Changes, PeriodDelta, ProjectedEvent};
    use crate::projection::notice::NOTICE_BYTES_MAX;
    use crate::runtime::{AccountTimeline, Period, PeriodTotals};
    use crate::runtime::{ContainerEntry, EntryKind, Interval, Lifecycle};

    /// A `run` (whose container counts) of `container`, or a `create` without one.
    fn request(org: &str, container: Option<&str>) -> Request {
        Request {
            org_id: OrgId::parse(org).unwrap(),
            action: match container {
                Some(_) => Action::Run,
                None => Action::Create,
            },
            container_id: container.map(|c| ContainerId::parse(c).unwrap()),
        }
    }

    fn read_at() -> DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap()
    }

    fn facts() -> Arc<Prepared> {
        Arc::new(Prepared {
            projected: 0,
            read_at: read_at(),
            period: Period::containing(read_at()),
            latest_at: None,
            totals: PeriodTotals::default(),
            open: Vec::new(),
            future: BTreeMap::new(),
            containers: None,
            target_id: None,
            target: None,
            reservation_expiries: Vec::new(),
            consumed_unprojected: 0,
            account: AccountTimeline::fold(&[]),
            plans: HashMap::new(),
        })
    }

    fn listening_cache(projected: i64) -> FactsCache {
        let cache = FactsCache::default();
        cache.listening(projected);
        cache
    }

    fn notice(position: Option<i64>, orgs: &[&str], all: bool) -> Notice {
        Notice {
            position,
            orgs: orgs.iter().map(|org| org.to_string()).collect(),
            all,
            round: None,
        }
    }

    /// The notice of a round tagged `tag` over `orgs`, whose changes this instance keeps:
    /// `commands` more commands for each org in the facts' period, `reread` to be read again.
    fn own_round(
        cache: &FactsCache,
        tag: u64,
        position: i64,
        orgs: &[&str],
        commands: i64,
        reread: &[&str],
    ) -> Notice {
        let mut changes = Changes::default().finish();
        for org in orgs {
            let delta = PeriodDelta {
                commands,
                ..PeriodDelta::default()
            };
            let key = (org.to_string(), Period::containing(read_at()));
            changes.periods.insert(key, delta);
        }
        let reread = reread.iter().map(|org| org.to_string()).collect();
        cache.rounds().record(tag, RoundChanges { changes, reread });
        Notice {
            round: Some(tag),
            ..notice(Some(position), orgs, false)
        }
    }

    fn commands_kept(cache: &FactsCache, request: &Request) -> Option<(u64, i64)> {
        let kept = cache.kept(request)?;
        Some((kept.0.totals.commands, kept.projected()))
    }

    /// Reads `request`'s facts as a check does: ticket, then keep.
    fn read(cache: &FactsCache, request: &Request) -> bool {
        let ticket = cache.ticket(request.org_id.as_str()).expect("listening");
        cache.keep(ticket, request, facts())
    }

    /// Facts that hold every container of their org: `containers`, running since an hour
    /// before they were read.
    fn whole_facts(containers: &[&str]) -> Arc<Prepared> {
        let since = read_at() - chrono::Duration::hours(1);
        let running = || {
            let lifecycle = Lifecycle::restore(vec![Interval::new(since, None)], 0, 0, None);
            ContainerFacts::of(&lifecycle, read_at())
        };
        let mut facts = (*facts()).clone();
        facts.containers = Some(
            containers
                .iter()
                .map(|container| (container.to_string(), running()))
                .collect(),
        );
        Arc::new(facts)
    }

    #[test]
    fn facts_that_hold_every_container_of_their_org_answer_checks_naming_any_of_them() {
        let cache = listening_cache(10);
        let (c1, c2) = (request("acme", Some("c1")), request("acme", Some("c2")));
        let ticket = cache.ticket("acme").unwrap();
        assert!(cache.keep(ticket, &c1, whole_facts(&["c1", "c2"])));
        assert_eq!(cache.len(), 3, "the facts and their two containers");
        for request in [
            &c1,
            &c2,
            &request("acme", Some("c7")),
            &request("acme", None),
        ] {
            assert!(cache.get(request, 10).is_some(), "{request:?}");
        }
        // The container a check names is looked up among them: one they do not hold does
        // not exist, so it does not run.
        let now = read_at() + chrono::Duration::minutes(1);
        let (whole, _) = cache.get(&request("acme", Some("c7")), 10).unwrap();
        assert!(whole
            .target_of(&c2)
            .is_some_and(|c| c.recent.running_at(now)));
        assert!(whole.target_of(&request("acme", Some("c7"))).is_none());

        // Facts of a larger org answer only the container they were read for.
        let ticket = cache.ticket("big").unwrap();
        let big = request("big", Some("c1"));
        assert!(cache.keep(ticket, &big, facts()));
        assert!(cache.get(&big, 10).is_some());
        assert!(cache.get(&request("big", Some("c2")), 10).is_none());
        cache.forget("acme");
        assert_eq!(cache.len(), 1);
    }

    /// The notice of a round of this instance, tagged `tag`, with one event: acme's
    /// `container` created a second after the facts were read.
    fn creating_round(cache: &FactsCache, tag: u64, position: i64, container: &str) -> Notice {
        let created = ContainerEntry {
            occurred_at: read_at() + chrono::Duration::seconds(1),
            position,
            event_id: EventId::from_uuid(uuid::Uuid::new_v4()).unwrap(),
            kind: EntryKind::Created,
        };
        let event = ProjectedEvent {
            position,
            recorded_at: read_at(),
            org_id: "acme".to_owned(),
            container: Some((container.to_owned(), created)),
            account: None,
            voids: None,
        };
        let changes = Changes::apply(&[event], &[], HashMap::new()).finish();
        let reread = HashSet::new();
        cache.rounds().record(tag, RoundChanges { changes, reread });
        Notice {
            round: Some(tag),
            ..notice(Some(position), &["acme"], false)
        }
    }

    #[test]
    fn a_round_that_takes_an_orgs_facts_past_what_one_org_keeps_drops_them() {
        let cache = listening_cache(10);
        let other = request("other", None);
        assert!(read(&cache, &other));
        // Facts of acme for that many containers named, each counting one.
        let named = ORG_ENTRIES_MAX / 2 + 1;
        for n in 0..named {
            assert!(read(&cache, &request("acme", Some(&format!("c{n}")))));
        }
        assert_eq!(cache.len(), 1 + named);
        // A container with an event after their read: each fact holds it, and counts it.
        cache.apply(&creating_round(&cache, 1, 11, "ahead"));
        assert!(cache.kept(&request("acme", Some("c0"))).is_none());
        assert_eq!(cache.len(), 1);
        assert!(cache.kept(&other).is_some());
    }

    #[test]
    fn a_round_that_takes_an_org_past_the_containers_kept_with_its_facts_drops_them() {
        let cache = listening_cache(10);
        let names: Vec<String> = (0..ORG_CONTAINERS_KEPT_MAX)
            .map(|n| format!("c{n}"))
            .collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let acme = request("acme", None);
        let ticket = cache.ticket("acme").unwrap();
        assert!(cache.keep(ticket, &acme, whole_facts(&names)));
        assert_eq!(cache.len(), 1 + ORG_CONTAINERS_KEPT_MAX);

        let round = |tag, position, container| creating_round(&cache, tag, position, container);
        // A round touching a container the facts hold keeps them whole (the container now
        // has an event after their read, and counts once more for it).
        cache.apply(&round(1, 11, "c0"));
        assert!(cache.kept(&acme).is_some_and(|kept| kept.whole()));
        assert_eq!(cache.len(), 1 + ORG_CONTAINERS_KEPT_MAX + 1);
        // One more container is one past the limit: read again.
        cache.apply(&round(2, 12, "new"));
        assert!(cache.kept(&acme).is_none());
        assert_eq!(cache.len(), 0);
    }

    /// A container that ran from an hour before the facts' read and then stopped and
    /// resumed `cycles` times after it, a minute apart: `cycles` + 1 intervals end after the
    /// read, or are open.
    fn churning(cycles: usize) -> Lifecycle {
        let minute = |n: usize| read_at() + chrono::Duration::minutes(n as i64);
        let mut intervals = vec![Interval::new(
            read_at() - chrono::Duration::hours(1),
            Some(minute(1)),
        )];
        for cycle in 1..=cycles {
            let end = (cycle < cycles).then(|| minute(2 * cycle + 1));
            intervals.push(Interval::new(minute(2 * cycle), end));
        }
        Lifecycle::restore(intervals, 0, 0, None)
    }

    /// Facts of acme that hold its one container `c0`, [`churning`] `cycles` times.
    fn churning_facts(cycles: usize) -> Arc<Prepared> {
        let mut facts = (*facts()).clone();
        facts.containers = Some(BTreeMap::from([(
            "c0".to_owned(),
            ContainerFacts::of(&churning(cycles), read_at()),
        )]));
        Arc::new(facts)
    }

    #[test]
    fn kept_facts_a_round_leaves_with_more_intervals_after_their_read_than_kept_are_read_again() {
        let facts = churning_facts(0);
        let round = |lifecycle| OrgRound {
            position: 11,
            containers: vec![("c0", lifecycle)],
            ..OrgRound::default()
        };
        let most = churning(RECENT_INTERVALS_MAX - 1);
        let advanced = facts.advanced(&round(&most)).expect("advanced");
        assert_eq!(
            advanced
                .container("c0")
                .map(|c0| c0.recent.intervals().len()),
            Some(RECENT_INTERVALS_MAX)
        );
        let more = churning(RECENT_INTERVALS_MAX);
        assert_eq!(facts.advanced(&round(&more)), None);
    }

    #[test]
    fn facts_holding_a_container_with_more_intervals_after_their_read_than_kept_answer_but_are_not_kept(
    ) {
        let cache = listening_cache(10);
        let acme = request("acme", Some("c0"));
        // The interval running at the read, and one for each cycle after it.
        let most = churning_facts(RECENT_INTERVALS_MAX - 1);
        let ticket = cache.ticket("acme").unwrap();
        assert!(cache.keep(ticket, &acme, most));
        assert!(cache.kept(&acme).is_some());
        cache.forget("acme");
        let more = churning_facts(RECENT_INTERVALS_MAX);
        assert!(!more.keepable());
        let ticket = cache.ticket("acme").unwrap();
        assert!(!cache.keep(ticket, &acme, more));
        assert!(cache.kept(&acme).is_none());
        assert_eq!(cache.len(), 0);
    }

    #[test]
    fn a_round_that_facts_read_after_its_commit_already_hold_is_not_added_to_them_again() {
        let cache = listening_cache(10);
        let acme = request("acme", None);
        let ticket = cache.ticket("acme").unwrap();
        let mut read = (*facts()).clone();
        read.projected = 12;
        assert!(cache.keep(ticket, &acme, Arc::new(read)));
        cache.apply(&own_round(&cache, 1, 12, &["acme"], 5, &[]));
        assert_eq!(commands_kept(&cache, &acme), Some((0, 12)));
        cache.apply(&own_round(&cache, 2, 13, &["acme"], 5, &[]));
        assert_eq!(commands_kept(&cache, &acme), Some((5, 13)));
    }

    #[test]
    fn nothing_is_kept_or_answered_until_the_listener_listens() {
        let cache = FactsCache::default();
        let acme = request("acme", None);
        assert_eq!(cache.ticket("acme"), None);
        cache.listening(10);
        let ticket = cache.ticket("acme").unwrap();
        cache.deaf();
        assert!(!cache.keep(ticket, &acme, facts()));
        assert!(cache.get(&acme, 0).is_none());
    }

    #[test]
    fn kept_facts_answer_until_a_notice_names_their_org_and_only_theirs() {
        let cache = listening_cache(10);
        let (acme, acme_c1, other) = (
            request("acme", None),
            request("acme", Some("c1")),
            request("other", None),
        );
        assert!(read(&cache, &acme) && read(&cache, &acme_c1) && read(&cache, &other));
        assert_eq!(cache.len(), 3);
        assert!(cache.get(&acme, 10).is_some() && cache.get(&acme_c1, 10).is_some());
        assert!(cache.get(&request("acme", Some("c2")), 10).is_none());
        cache.apply(&notice(Some(11), &["acme"], false));
        assert!(cache.get(&acme, 11).is_none() && cache.get(&acme_c1, 11).is_none());
        assert!(cache.get(&other, 11).is_some());
        assert_eq!(cache.len(), 1);
        cache.forget("other");
        assert!(cache.get(&other, 11).is_none());
        assert!(cache.is_empty());
    }

    #[test]
    fn creates_share_their_orgs_facts_whatever_container_they_name_and_resumes_do_not() {
        let cache = listening_cache(10);
        let with = |action, container: &str| Request {
            action,
            ..request("acme", Some(container))
        };
        assert!(read(&cache, &with(Action::Create, "new-1")));
        assert!(cache.get(&with(Action::Create, "new-2"), 10).is_some());
        assert!(cache.get(&request("acme", None), 10).is_some());
        // A resume asks how many intervals its container has (`interval_limit`), so facts
        // that do not hold every container answer only a resume of the one they were read
        // for.
        assert!(cache.get(&with(Action::Resume, "c1"), 10).is_none());
        assert!(read(&cache, &with(Action::Resume, "c1")));
        assert!(cache.get(&with(Action::Resume, "c1"), 10).is_some());
        assert!(cache.get(&with(Action::Resume, "c2"), 10).is_none());
        cache.forget("acme");
        assert!(read(&cache, &with(Action::Create, "new-1")));
        assert!(cache.get(&with(Action::Run, "c1"), 10).is_none());
        assert!(cache.get(&with(Action::PublishPort, "c1"), 10).is_none());
        assert_eq!(cache.len(), 1);
        // A run naming no container is never answered from what a create read.
        let nameless = Request {
            container_id: None,
            ..with(Action::Run, "c1")
        };
        assert!(cache.get(&nameless, 10).is_none());
        assert!(!read(&cache, &nameless));
    }

    #[test]
    fn a_read_that_a_notice_for_its_org_overtook_is_not_kept() {
        let cache = listening_cache(10);
        let acme = request("acme", None);
        let ticket = cache.ticket("acme").unwrap();
        cache.apply(&notice(Some(11), &["other"], false));
        let overtaken = cache.ticket("acme").unwrap();
        cache.apply(&notice(Some(12), &["acme"], false));
        assert!(!cache.keep(overtaken, &acme, facts()));
        // A reservation of this instance, forgotten while the read was in flight.
        let forgotten = cache.ticket("acme").unwrap();
        cache.forget("acme");
        assert!(!cache.keep(forgotten, &acme, facts()));
        assert!(cache.get(&acme, 0).is_none());
        // The first ticket was overtaken too (by the notice naming acme).
        assert!(!cache.keep(ticket, &acme, facts()));
        assert!(read(&cache, &acme));
    }

    #[test]
    fn a_notice_for_all_drops_everything_and_every_read_begun_before_it() {
        let cache = listening_cache(10);
        let (acme, other) = (request("acme", None), request("other", None));
        assert!(read(&cache, &acme));
        let ticket = cache.ticket("other").unwrap();
        cache.apply(&notice(Some(11), &[], true));
        assert!(cache.get(&acme, 0).is_none());
        assert!(!cache.keep(ticket, &other, facts()));
        assert!(cache.is_empty());
    }

    #[test]
    fn facts_answer_only_checks_whose_appends_the_notices_reach() {
        let cache = listening_cache(10);
        let acme = request("acme", None);
        assert!(read(&cache, &acme));
        assert!(cache.get(&acme, 10).is_some());
        assert!(
            cache.get(&acme, 11).is_none(),
            "position 11 is not notified yet"
        );
        cache.apply(&notice(Some(11), &["other"], false));
        assert!(cache.get(&acme, 11).is_some());
        // A notice without a position (a reservation) does not move the checkpoint.
        cache.apply(&notice(None, &["other"], false));
        assert!(cache.get(&acme, 12).is_none());
    }

    #[test]
    fn a_replays_swap_sets_the_checkpoint_back_to_what_it_replayed() {
        let cache = listening_cache(20);
        cache.apply(&notice(Some(15), &[], true));
        let acme = request("acme", None);
        assert!(read(&cache, &acme));
        assert!(cache.get(&acme, 15).is_some());
        assert!(cache.get(&acme, 16).is_none());
    }

    #[test]
    fn losing_the_listener_drops_everything_and_answers_nothing_until_it_listens_again() {
        let cache = listening_cache(10);
        let acme = request("acme", None);
        assert!(read(&cache, &acme));
        let ticket = cache.ticket("acme").unwrap();
        cache.deaf();
        assert!(cache.get(&acme, 0).is_none());
        cache.listening(10);
        assert!(!cache.keep(ticket, &acme, facts()), "begun before the loss");
        assert!(cache.get(&acme, 0).is_none());
        assert!(read(&cache, &acme));
    }

    #[test]
    fn past_its_limits_the_cache_starts_over() {
        let cache = listening_cache(0);
        for n in 0..ENTRIES_MAX {
            let org = format!("org{}", n % (ORGS_MAX / 2));
            let container = format!("c{}", n / (ORGS_MAX / 2));
            assert!(read(&cache, &request(&org, Some(&container))), "entry {n}");
        }
        assert_eq!(cache.len(), ENTRIES_MAX);
        // Replacing an entry kept is not growing.
        assert!(read(&cache, &request("org0", Some("c0"))));
        assert_eq!(cache.len(), ENTRIES_MAX);
        // One more drops everything; what is read next is kept.
        assert!(!read(&cache, &request("org0", Some("c-new"))), "full");
        assert!(cache.is_empty());
        assert!(read(&cache, &request("org1", Some("c-new"))));
        assert_eq!(cache.len(), 1);
        // Past the orgs limit everything is dropped and the cache starts over.
        for n in 0..ORGS_MAX {
            cache.ticket(&format!("new{n}")).unwrap();
        }
        assert!(cache.is_empty());
        assert!(read(&cache, &request("org0", None)));
    }

    #[test]
    fn one_org_asking_about_ever_new_containers_starts_its_own_facts_over_not_every_orgs() {
        let cache = listening_cache(0);
        let other = request("other", None);
        assert!(read(&cache, &other));
        for n in 0..ORG_ENTRIES_MAX * 3 {
            let container = format!("c{n}");
            assert!(
                read(&cache, &request("acme", Some(&container))),
                "entry {n}"
            );
            assert!(cache.len() <= ORG_ENTRIES_MAX + 1, "after entry {n}");
        }
        assert!(
            cache.get(&other, 0).is_some(),
            "the other org's facts stay kept"
        );
        let newcomer = request("newcomer", None);
        assert!(read(&cache, &newcomer));
        assert!(
            cache.get(&newcomer, 0).is_some(),
            "and a new org's are kept"
        );
        let last = format!("c{}", ORG_ENTRIES_MAX * 3 - 1);
        assert!(cache.get(&request("acme", Some(&last)), 0).is_some());
        assert!(
            cache.get(&request("acme", Some("c0")), 0).is_none(),
            "started over"
        );
    }

    #[test]
    fn a_round_this_instance_projected_advances_the_facts_kept_of_its_orgs_instead_of_dropping_them(
    ) {
        let cache = listening_cache(10);
        let (acme, other) = (request("acme", None), request("other", None));
        assert!(read(&cache, &acme) && read(&cache, &other));
        cache.apply(&own_round(&cache, 7, 11, &["acme"], 3, &[]));
        assert_eq!(commands_kept(&cache, &acme), Some((3, 11)));
        assert_eq!(commands_kept(&cache, &other), Some((0, 0)));
        assert_eq!(cache.stats().advanced, 1);
        assert!(cache.rounds().is_empty(), "the round is taken when heard");
        assert_eq!(cache.get(&acme, 11).map(|(_, at)| at), Some(11));
    }

    #[test]
    fn orgs_a_round_says_to_read_again_and_rounds_this_instance_did_not_project_drop_their_facts() {
        let cache = listening_cache(10);
        let (acme, other) = (request("acme", None), request("other", None));
        assert!(read(&cache, &acme) && read(&cache, &other));
        cache.apply(&own_round(&cache, 7, 11, &["acme", "other"], 1, &["acme"]));
        assert_eq!(commands_kept(&cache, &acme), None);
        assert_eq!(commands_kept(&cache, &other), Some((1, 11)));
        let elsewhere = Notice {
            round: Some(8),
            ..notice(Some(12), &["other"], false)
        };
        cache.apply(&elsewhere);
        assert_eq!(commands_kept(&cache, &other), None);
        assert_eq!(cache.stats().advanced, 1);
    }

    #[test]
    fn a_read_begun_before_a_round_that_advanced_its_org_is_not_kept() {
        let cache = listening_cache(10);
        let acme = request("acme", None);
        assert!(read(&cache, &acme));
        let ticket = cache.ticket("acme").unwrap();
        cache.apply(&own_round(&cache, 7, 11, &["acme"], 2, &[]));
        assert!(!cache.keep(ticket, &acme, facts()));
        assert_eq!(commands_kept(&cache, &acme), Some((2, 11)));
    }

    #[test]
    fn kept_facts_that_a_count_below_zero_would_leave_are_dropped() {
        let cache = listening_cache(10);
        let acme = request("acme", None);
        assert!(read(&cache, &acme));
        cache.apply(&own_round(&cache, 7, 11, &["acme"], -1, &[]));
        assert_eq!(commands_kept(&cache, &acme), None);
        assert_eq!(cache.stats().advanced, 0);
    }

    #[test]
    fn a_rounds_notice_names_each_org_once_or_says_all_when_they_do_not_fit() {
        let payload = Notice::of_round(42, ["b", "a", "b"], false, None);
        let parsed: Notice = serde_json::from_str(&payload).unwrap();
        assert_eq!(parsed, notice(Some(42), &["a", "b"], false));
        let many: Vec<String> = (0..1_000).map(|n| format!("org-{n:04}")).collect();
        let payload = Notice::of_round(43, many.iter().map(String::as_str), false, Some(9));
        assert!(payload.len() <= NOTICE_BYTES_MAX);
        let parsed: Notice = serde_json::from_str(&payload).unwrap();
        assert_eq!(parsed, notice(Some(43), &[], true));
        let plans = Notice::of_round(44, ["a"], true, None);
        assert_eq!(
            serde_json::from_str::<Notice>(&plans).unwrap(),
            notice(Some(44), &[], true)
        );
        assert_eq!(
            serde_json::from_str::<Notice>(&Notice::of_org("acme")).unwrap(),
            notice(None, &["acme"], false)
        );
    }
}
