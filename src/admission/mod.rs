//! Admission against the database (contract §4): gathers the facts of [`billing::decide`]
//! from the projection, the plans and the live reservations; grants and releases
//! reservations; and consumes them when their container's `created`/`resumed` is projected.
//!
//! Race-freedom: a grant takes a per-org transaction advisory lock, then reads every fact
//! it counts slots with — running containers (projection) and live reservations — in ONE
//! statement, so one snapshot, taken after the lock is granted. The projector consumes a
//! reservation in the same transaction that makes its container count as running, so a
//! snapshot sees the slot taken exactly once: as a reservation before, as a running
//! container after. Grants and consuming rounds exclude each other
//! ([`store::CONSUME_LOCK_KEY`]): a grant committed first is consumed by the round; one
//! that reads after the round finds its container running (or starting, for a start dated
//! ahead) and is refused (decision 0046). Expired reservations stop counting by their
//! `expires_at` alone.

pub mod cache;
mod checker;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, Utc};
use sqlx::{FromRow, PgConnection, PgPool, Postgres, Transaction};
use uuid::Uuid;

use crate::billing::{self, Action, Decision, Facts, Reason};
use crate::clock::Clock;
use crate::event::{ContainerId, EventId, OrgId, PlanId};
use crate::ledger::plans;
use crate::projection::model::{OpenDelta, PeriodDelta};
use crate::projection::notice::{self, Notice};
use crate::projection::{query, store, Freshness, WaitError};
pub use checker::Checker;

use crate::runtime::{
    self, AccountEntry, AccountTimeline, Lifecycle, Period, PeriodTotals, INTERVALS_MAX,
};

/// How long a check waits for the projection to include this instance's own appends
/// before it answers 503 rather than from stale figures, unless told otherwise
/// ([`Wait::within`]; the HTTP routes wait `TALLY_READ_WAIT_MS`, as reads do).
pub const FRESHNESS_WAIT_MS: u64 = 2_000;
/// Reservation lifetimes (contract §4).
pub const TTL_SECONDS_MIN: u64 = 1;
pub const TTL_SECONDS_MAX: u64 = 300;
pub const TTL_SECONDS_DEFAULT: u64 = 60;

/// One admission question.
#[derive(Debug, Clone)]
pub struct Request {
    pub org_id: OrgId,
    pub action: Action,
    pub container_id: Option<ContainerId>,
}

/// What an admission answer must reflect, and how long to wait for the projection to
/// reach it. Every answer reflects this instance's own appends of the org (and plan
/// definitions): [`Freshness::wanted_for`]. `min_position` adds a position acknowledged
/// elsewhere, e.g. by another instance, that the caller needs counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// A ledger position the projection must reach as well; 0 for none.
    pub min_position: i64,
    /// How long to wait for it before [`AdmissionError::Stale`].
    pub within: Duration,
}

impl Default for Wait {
    fn default() -> Wait {
        Wait {
            min_position: 0,
            within: Duration::from_millis(FRESHNESS_WAIT_MS),
        }
    }
}

impl Wait {
    /// The position the facts of `org` must reflect.
    fn wanted(&self, freshness: &Freshness, org: &OrgId) -> i64 {
        freshness.wanted_for(org.as_str()).max(self.min_position)
    }

    /// After facts were found short of `wanted`: waits, until `deadline`, for the stored
    /// checkpoint to reach it (woken by this instance's projector, which it hurries, and
    /// reading the checkpoint row for another instance's), so that the facts are read
    /// again only once they can serve.
    async fn catch_up(
        &self,
        pool: &PgPool,
        freshness: &Freshness,
        wanted: i64,
        deadline: Instant,
    ) -> Result<(), AdmissionError> {
        let left = deadline.saturating_duration_since(Instant::now());
        match freshness.wait_projected(pool, wanted, left).await {
            Ok(_) => Ok(()),
            Err(WaitError::Lagging { wanted, checkpoint }) => Err(AdmissionError::Stale {
                wanted,
                checkpoint,
                waited_ms: self.within.as_millis(),
            }),
            Err(WaitError::Database(error)) => Err(error.into()),
        }
    }
}

/// A decision with the figures it was made from.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The projection's checkpoint the facts reflect: of the snapshot they were read in, or
    /// for facts kept in memory, the latest checkpoint notified since (see [`cache`]).
    pub position: i64,
    pub decision: Decision,
    pub plan: PlanId,
    pub period: Period,
    pub runtime_used_ms: i64,
    pub running_containers: u64,
    pub max_running_containers: u64,
    pub at: DateTime<Utc>,
    /// Whether the container the request names runs at `at`, or starts after it (an event
    /// dated ahead of the clock).
    pub container_started: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("the projection is at position {checkpoint}, short of {wanted} after {waited_ms} ms; retry later")]
    Stale {
        wanted: i64,
        checkpoint: i64,
        waited_ms: u128,
    },
    #[error("more than {0} admission checks are waiting; retry later")]
    Busy(usize),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Projection(#[from] crate::projection::Error),
    /// Facts that do not add up: a bug or a hand-edited table, never the caller's.
    #[error("{0}")]
    Corrupt(String),
    /// The failure of the check that read this one's facts together with its own.
    #[error(transparent)]
    Group(std::sync::Arc<AdmissionError>),
    #[error("the check reading this one's facts stopped")]
    LeadStopped,
}

impl AdmissionError {
    /// A stored value that does not decode: what it is, and why not.
    fn corrupt(what: impl std::fmt::Display, why: impl std::fmt::Display) -> AdmissionError {
        AdmissionError::Corrupt(format!("{what}: {why}"))
    }

    /// The database error this comes from, if any: the HTTP layer answers 503 for one that
    /// is an outage.
    pub fn database(&self) -> Option<&sqlx::Error> {
        match self {
            AdmissionError::Database(error) => Some(error),
            AdmissionError::Projection(error) => error.database(),
            AdmissionError::Group(error) => error.database(),
            AdmissionError::Stale { .. }
            | AdmissionError::Busy(_)
            | AdmissionError::Corrupt(_)
            | AdmissionError::LeadStopped => None,
        }
    }
}

#[derive(FromRow)]
struct FactsRow {
    /// The projection's checkpoint in the same snapshot as the facts.
    projected: i64,
    latest_at: Option<DateTime<Utc>>,
    closed_runtime_ms: i64,
    commands: i64,
    command_ms: i64,
    ports_published: i64,
    open_periods: Vec<String>,
    open_running: Vec<i64>,
    open_offsets: Vec<i64>,
    /// The containers with events after `now`, and their intervals in the same order: only
    /// these can be running at `now` other than by an open interval that started before it.
    /// Of each container, how many intervals it has and those a check needs
    /// ([`recent_intervals`]).
    future_containers: Vec<String>,
    future_totals: Vec<i32>,
    future_lifecycles: Vec<i64>,
    future_intervals: Vec<String>,
    target_total: Option<i32>,
    target_lifecycle: Option<i64>,
    target_intervals: Option<String>,
    /// Every container of the org, up to one more than [`ORG_CONTAINERS_KEPT_MAX`] (all of
    /// them when there are no more than that), and then their intervals in the same order
    /// (none when there are more: the facts will not hold them).
    org_containers: Vec<String>,
    org_totals: Vec<i32>,
    org_lifecycles: Vec<i64>,
    org_intervals: Vec<String>,
    /// When each slot held by reservations stops being held: a live reservation's expiry,
    /// or the instant of a start dated after `now` that consumed some (once a start, however
    /// many it consumed); those past `now` do not count.
    reservation_expiries: Vec<DateTime<Utc>>,
    /// Events past the checkpoint that consumed reservations (see [`Prepared`]).
    consumed_unprojected: i64,
    account: Option<String>,
    /// Every version of every plan the org has been on, and of `free`: [data, ms, position].
    plan_versions: Option<String>,
}

/// Everything the decision needs, read in one statement (one snapshot); `None` when that
/// snapshot's projection does not reach position `wanted` yet. The checkpoint is read in
/// the facts statement rather than before it, which saves a statement per check and
/// proves that the very snapshot the facts come from holds the wanted appends.
async fn load(
    connection: &mut PgConnection,
    request: &Request,
    now: DateTime<Utc>,
    wanted: i64,
) -> Result<Option<Answer>, AdmissionError> {
    let row = load_facts(&mut *connection, &[request], now)
        .await?
        .pop()
        .expect("one row a request");
    if row.projected < wanted {
        return Ok(None);
    }
    let facts = Prepared::from_row(row, request, now)?;
    answer_from(Reader::Connection(connection), request, &facts, now)
        .await
        .map(Some)
}

/// The facts of every request, in request order, from one statement (one snapshot, so one
/// checkpoint for all). A check costs Postgres a dozen index lookups; in a statement of its
/// own it also costs a round trip, a bind and an executor start-up for each of a dozen
/// subplans, which cost more than the lookups (see `Checker`).
// Long: one statement, one snapshot; most of the function is its SQL, a subquery a fact.
async fn load_facts(
    connection: &mut PgConnection,
    requests: &[&Request],
    now: DateTime<Utc>,
) -> Result<Vec<FactsRow>, AdmissionError> {
    let period = Period::containing(now);
    let live = store::LIVE;
    // One more than are kept, to tell an org with more apart.
    let whole = ORG_CONTAINERS_KEPT_MAX + 1;
    // The org's containers with an event after `now`. A container's last event is one of
    // its events in the ledger, so the ledger's events of the org after `now` (its
    // `(org_id, occurred_at)` index; events are dated at most minutes ahead) name every
    // such container, and some more (events voided or not projected yet), which their
    // stored `last_at` then leaves out. The container table's org index is keyed by the
    // hour of `last_at` (so that most projector updates leave it alone, decision 0037) and
    // reads every container of the org touched in the hour. So the statement reads the
    // ledger's events ahead, and reads the hour instead only when there are more than
    // `EVENTS_AHEAD_READ_MAX` of them (a producer whose clock runs ahead sends that many
    // in seconds). Either is read only when the org's latest event (never earlier than any
    // of its containers' last) is after `now`: a probe of each month's ledger index would
    // otherwise cost every check.
    let events_max = EVENTS_AHEAD_READ_MAX;
    let containers_ahead = format!(
        "(WITH events AS MATERIALIZED ( \
              SELECT l.container_id FROM ledger l \
              WHERE l.org_id = r.org AND l.occurred_at > $3 AND l.container_id IS NOT NULL \
                AND EXISTS (SELECT FROM {live}.org o \
                            WHERE o.org_id = r.org AND o.latest_at > $3) \
              LIMIT {events_max} + 1) \
          SELECT container_id FROM events \
          WHERE (SELECT count(*) FROM events) <= {events_max} \
          UNION \
          SELECT container_id FROM {live}.container \
          WHERE org_id = r.org AND last_hour >= date_trunc('hour', $3 AT TIME ZONE 'UTC') \
            AND last_at > $3 AND (SELECT count(*) FROM events) > {events_max}) AS a \
         JOIN {live}.container c \
           ON c.org_id = r.org AND c.container_id = a.container_id AND c.last_at > $3"
    );
    let recent = recent_intervals("intervals");
    let orgs: Vec<&str> = requests.iter().map(|r| r.org_id.as_str()).collect();
    let containers: Vec<Option<&str>> = requests
        .iter()
        .map(|r| r.container_id.as_ref().map(ContainerId::as_str))
        .collect();
    // Facts that come from the same rows (an org's open periods; its containers with an
    // event after `now`) are aggregated together in one lateral, so those rows are read once.
    // `OFFSET 0` keeps the planner from flattening the period lookup into a hash join over
    // every org's period row: it stays one index lookup a request.
    let rows: Vec<FactsRow> = sqlx::query_as(&format!(
        "SELECT (SELECT position FROM {live}.checkpoint) AS projected, \
                (SELECT latest_at FROM {live}.org o WHERE o.org_id = r.org) AS latest_at, \
                COALESCE(p.closed_runtime_ms, 0) AS closed_runtime_ms, \
                COALESCE(p.commands, 0) AS commands, \
                COALESCE(p.command_ms, 0) AS command_ms, \
                COALESCE(p.ports_published, 0) AS ports_published, \
                COALESCE(o.open_periods, '{{}}') AS open_periods, \
                COALESCE(o.open_running, '{{}}') AS open_running, \
                COALESCE(o.open_offsets, '{{}}') AS open_offsets, \
                COALESCE(f.future_containers, '{{}}') AS future_containers, \
                COALESCE(f.future_totals, '{{}}') AS future_totals, \
                COALESCE(f.future_lifecycles, '{{}}') AS future_lifecycles, \
                COALESCE(f.future_intervals, '{{}}') AS future_intervals, \
                t.total AS target_total, t.lifecycle_total AS target_lifecycle, \
                t.recent AS target_intervals, \
                COALESCE(w.org_containers, '{{}}') AS org_containers, \
                COALESCE(w.org_totals, '{{}}') AS org_totals, \
                COALESCE(w.org_lifecycles, '{{}}') AS org_lifecycles, \
                COALESCE(w.org_intervals, '{{}}') AS org_intervals, \
                ARRAY(SELECT expires_at FROM admission_reservation \
                      WHERE org_id = r.org AND released_at IS NULL AND consumed_at IS NULL \
                        AND expires_at > $3 \
                      UNION ALL \
                      SELECT min(consumed_starts_at) FROM admission_reservation \
                      WHERE org_id = r.org AND consumed_starts_at > $3 AND consumed_position <= \
                        (SELECT position FROM {live}.checkpoint) \
                      GROUP BY consumed_by \
                      ORDER BY 1) AS reservation_expiries, \
                (SELECT count(DISTINCT consumed_by) FROM admission_reservation \
                      WHERE org_id = r.org AND consumed_position > \
                        (SELECT position FROM {live}.checkpoint)) AS consumed_unprojected, \
                (SELECT json_agg(json_build_array(position, \
                        (extract(epoch FROM occurred_at) * 1000)::BIGINT, event_id, plan, verified, \
                        billing_eligible))::TEXT \
                      FROM {live}.account_change WHERE org_id = r.org) AS account, \
                (SELECT json_agg(json_build_array(l.data, \
                        (extract(epoch FROM l.occurred_at) * 1000)::BIGINT, l.position) \
                        ORDER BY l.occurred_at, l.position)::TEXT \
                      FROM ledger l WHERE l.type = 'plan.defined' AND l.data->>'id' IN \
                        (SELECT plan FROM {live}.account_change \
                         WHERE org_id = r.org AND plan IS NOT NULL UNION ALL SELECT 'free')) \
                      AS plan_versions \
         FROM UNNEST($1::TEXT[], $4::TEXT[]) WITH ORDINALITY AS r(org, container, i) \
         LEFT JOIN LATERAL (SELECT * FROM {live}.org_period \
                            WHERE org_id = r.org AND period = $2 OFFSET 0) AS p ON true \
         LEFT JOIN LATERAL (SELECT array_agg(since_period ORDER BY since_period) AS open_periods, \
                                   array_agg(running ORDER BY since_period) AS open_running, \
                                   array_agg(since_offset_ms ORDER BY since_period) \
                                   AS open_offsets \
                            FROM {live}.org_open WHERE org_id = r.org AND running > 0) AS o \
                   ON true \
         LEFT JOIN LATERAL (SELECT array_agg(c.container_id ORDER BY c.container_id) \
                                   AS future_containers, \
                                   array_agg(jsonb_array_length(intervals) \
                                             ORDER BY c.container_id) AS future_totals, \
                                   array_agg(c.lifecycle_total ORDER BY c.container_id) \
                                   AS future_lifecycles, \
                                   array_agg({recent} ORDER BY c.container_id) \
                                   AS future_intervals \
                            FROM {containers_ahead}) AS f ON true \
         LEFT JOIN LATERAL (SELECT array_agg(container_id ORDER BY container_id COLLATE \"C\") \
                                   AS org_containers, \
                                   array_agg(jsonb_array_length(intervals) \
                                             ORDER BY container_id COLLATE \"C\") \
                                   FILTER (WHERE kept) AS org_totals, \
                                   array_agg(lifecycle_total ORDER BY container_id COLLATE \"C\") \
                                   FILTER (WHERE kept) AS org_lifecycles, \
                                   array_agg({recent} ORDER BY container_id COLLATE \"C\") \
                                   FILTER (WHERE kept) AS org_intervals \
                            FROM (SELECT container_id, intervals, lifecycle_total, \
                                         count(*) OVER () <= {ORG_CONTAINERS_KEPT_MAX} AS kept \
                                  FROM (SELECT container_id, intervals, lifecycle_total \
                                        FROM {live}.container \
                                        WHERE org_id = r.org ORDER BY container_id COLLATE \"C\" \
                                        LIMIT {whole}) AS c) AS c) AS w ON true \
         LEFT JOIN LATERAL (SELECT jsonb_array_length(intervals) AS total, lifecycle_total, \
                                   {recent} AS recent \
                            FROM {live}.container \
                            WHERE org_id = r.org AND container_id = r.container \
                              AND cardinality(w.org_containers) > {ORG_CONTAINERS_KEPT_MAX}) \
                   AS t ON true \
         ORDER BY r.i"
    ))
    .bind(&orgs)
    .bind(period.to_string())
    .bind(now)
    .bind(&containers)
    .fetch_all(&mut *connection)
    .await?;
    if rows.len() != requests.len() {
        return Err(AdmissionError::Corrupt(format!(
            "{} rows of facts for {} requests",
            rows.len(),
            requests.len()
        )));
    }
    Ok(rows)
}

/// The facts of `request` as a check reading Postgres at `read_at` would keep them: what
/// kept facts are compared with ([`cache::FactsCache::kept`]).
pub async fn read_facts(
    pool: &PgPool,
    request: &Request,
    read_at: DateTime<Utc>,
) -> Result<cache::KeptFacts, AdmissionError> {
    let mut connection = pool.acquire().await?;
    let row = load_facts(&mut connection, &[request], read_at)
        .await?
        .pop()
        .expect("one row a request");
    let facts = Prepared::from_row(row, request, read_at)?;
    Ok(cache::KeptFacts(std::sync::Arc::new(facts)))
}

/// Where `answer` reads the org's usage in the rare case its totals do not settle it (events
/// dated after now): the connection the facts came from, or any from the pool.
enum Reader<'a> {
    Connection(&'a mut PgConnection),
    Pool(&'a PgPool),
}

/// The decision on `request` at `now` from facts read before, asking the ledger for the
/// org's usage only when the totals do not settle it.
async fn answer_from(
    reader: Reader<'_>,
    request: &Request,
    prepared: &Prepared,
    now: DateTime<Utc>,
) -> Result<Answer, AdmissionError> {
    let runtime_used_ms = match prepared.runtime_used_ms(now) {
        Some(runtime_ms) => runtime_ms,
        None => {
            let (org, period) = (request.org_id.as_str(), prepared.period);
            let usage = match reader {
                Reader::Connection(connection) => {
                    query::usage_on(connection, org, period, now).await?
                }
                Reader::Pool(pool) => {
                    let mut connection = pool.acquire().await?;
                    query::usage_on(&mut connection, org, period, now).await?
                }
            };
            usage.runtime_ms
        }
    };
    prepared.answer(request, now, runtime_used_ms)
}

/// Events of an org dated after a check's instant that the facts statement reads to find
/// the org's containers with events after it; past it, it reads the org's containers
/// touched in the instant's hour instead (see `load_facts`).
pub const EVENTS_AHEAD_READ_MAX: usize = 1_000;

/// Containers with events after the instant kept facts were read at, at most: past it, the
/// facts are read again rather than advanced (see [`Prepared::advanced`]), which would make
/// each answer walk them all.
pub const FUTURE_CONTAINERS_MAX: usize = 256;

/// Containers an org may have for its facts to hold every one of them, so that they answer
/// a check naming any of its containers; an org with more keeps facts per container asked
/// about.
pub const ORG_CONTAINERS_KEPT_MAX: usize = 32;

/// One check's facts as read at `read_at`, parsed: all a decision needs at that instant or
/// any later one of the same period, for as long as nothing of the org changes in the
/// projection or its reservations, or for as long as the projector's rounds that change it
/// advance them ([`Prepared::advanced`]). What depends on the instant (running containers,
/// usage so far, account state, plan in effect, live reservations) is worked out at each
/// answer.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Prepared {
    /// The projection's checkpoint in the snapshot the facts were read in, or of the last
    /// round that advanced them.
    projected: i64,
    read_at: DateTime<Utc>,
    period: Period,
    latest_at: Option<DateTime<Utc>>,
    totals: PeriodTotals,
    open: Vec<runtime::OpenRuns>,
    /// The containers with events after `read_at`, by id: only these can be running at a
    /// later instant other than by an open interval. A container whose last event is before
    /// that later instant changes nothing (running at it exactly when its interval is
    /// open), so the list read at `read_at` serves every later instant.
    future: BTreeMap<String, ContainerFacts>,
    /// Every container of the org by id, as stored, when it has at most
    /// [`ORG_CONTAINERS_KEPT_MAX`]: then the facts answer a check naming any container of
    /// the org (one not among them does not exist), and `target_id` and `target` are
    /// `None`.
    containers: Option<BTreeMap<String, ContainerFacts>>,
    /// Of an org with more containers: the container the request that read the facts
    /// named, and its lifecycle when it exists.
    target_id: Option<ContainerId>,
    target: Option<ContainerFacts>,
    reservation_expiries: Vec<DateTime<Utc>>,
    /// Reservations consumed by an event the projection does not hold: only after a
    /// replay's swap moved the checkpoint back past it (the projector consumes in the round
    /// that projects the event). Their containers are running but not counted by the
    /// projection, so each holds its slot, whatever its expiry, until projected again.
    consumed_unprojected: u64,
    account: AccountTimeline,
    /// Every version of every plan the org has been on, and of `free`, oldest first.
    plans: HashMap<String, Vec<plans::PlanVersion>>,
}

impl Prepared {
    fn from_row(
        row: FactsRow,
        request: &Request,
        read_at: DateTime<Utc>,
    ) -> Result<Prepared, AdmissionError> {
        let account = match &row.account {
            Some(json) => AccountTimeline::fold(&account_entries(json)?),
            None => AccountTimeline::fold(&[]),
        };
        let containers = (row.org_containers.len() <= ORG_CONTAINERS_KEPT_MAX)
            .then(|| {
                let totals = (&row.org_totals[..], &row.org_lifecycles[..]);
                ContainerFacts::read_all(row.org_containers, totals, &row.org_intervals, read_at)
            })
            .transpose()?;
        let whole = containers.is_some();
        let future = ContainerFacts::read_all(
            row.future_containers,
            (&row.future_totals, &row.future_lifecycles),
            &row.future_intervals,
            read_at,
        )?;
        Ok(Prepared {
            projected: row.projected,
            read_at,
            period: Period::containing(read_at),
            latest_at: row.latest_at,
            totals: PeriodTotals {
                closed_runtime_ms: row.closed_runtime_ms,
                commands: u64::try_from(row.commands)
                    .map_err(|e| AdmissionError::corrupt("commands", e))?,
                command_ms: row.command_ms,
                ports_published: u64::try_from(row.ports_published)
                    .map_err(|e| AdmissionError::corrupt("ports_published", e))?,
            },
            open: query::open_runs(&row.open_periods, &row.open_running, &row.open_offsets)?,
            future,
            containers,
            target_id: request.container_id.clone().filter(|_| !whole),
            target: match (
                whole,
                row.target_total.zip(row.target_lifecycle),
                row.target_intervals.as_deref(),
            ) {
                (false, Some(totals), Some(intervals)) => {
                    Some(ContainerFacts::read(totals, intervals, read_at)?)
                }
                _ => None,
            },
            reservation_expiries: row.reservation_expiries,
            consumed_unprojected: u64::try_from(row.consumed_unprojected)
                .map_err(|e| AdmissionError::corrupt("consumed_unprojected", e))?,
            account,
            plans: plan_versions(row.plan_versions.as_deref())?,
        })
    }

    /// These facts as a read at `read_at` would give them after `round`, which moved the
    /// projection on from the position they reflect: its deltas added to the period's
    /// totals and to the open intervals, its containers put in place. `None` when they are
    /// to be read again instead: reservations are consumed past the checkpoint (only after
    /// a replay's swap), a count would go below zero, an org's facts held whole would hold
    /// more than [`ORG_CONTAINERS_KEPT_MAX`] containers, or the facts would no longer be
    /// kept ([`Prepared::keepable`]). The round
    /// must hold no account event, void or consumed reservation of the org (those are
    /// read again by the caller).
    pub(crate) fn advanced(&self, round: &OrgRound<'_>) -> Option<Prepared> {
        if self.consumed_unprojected > 0 {
            return None;
        }
        // Read after the round committed (its checkpoint is in their snapshot), before its
        // notice was heard: they hold it already.
        if self.projected >= round.position {
            return Some(self.clone());
        }
        let mut next = self.clone();
        next.projected = round.position;
        if let Some(latest) = round.latest_at {
            next.latest_at = Some(next.latest_at.map_or(latest, |kept| kept.max(latest)));
        }
        for (period, delta) in &round.periods {
            if *period == self.period {
                let totals = &mut next.totals;
                totals.closed_runtime_ms = totals
                    .closed_runtime_ms
                    .checked_add(delta.closed_runtime_ms)?;
                totals.commands = totals.commands.checked_add_signed(delta.commands)?;
                totals.command_ms = totals.command_ms.checked_add(delta.command_ms)?;
                totals.ports_published = totals
                    .ports_published
                    .checked_add_signed(delta.ports_published)?;
            }
        }
        for (since_period, delta) in &round.open {
            match next
                .open
                .binary_search_by_key(since_period, |runs| runs.since_period)
            {
                Ok(index) => {
                    let runs = &mut next.open[index];
                    runs.running = runs.running.checked_add_signed(delta.running)?;
                    runs.since_offset_ms =
                        runs.since_offset_ms.checked_add(delta.since_offset_ms)?;
                    if runs.running == 0 {
                        next.open.remove(index);
                    }
                }
                // Stored with none running, so with no offset either: left out of a read.
                Err(index) => match u64::try_from(delta.running).ok()? {
                    0 => {}
                    running => next.open.insert(
                        index,
                        runtime::OpenRuns {
                            since_period: *since_period,
                            running,
                            since_offset_ms: delta.since_offset_ms,
                        },
                    ),
                },
            }
        }
        for (container, lifecycle) in &round.containers {
            next.put_container(container, lifecycle);
        }
        let whole_fits = next
            .containers
            .as_ref()
            .is_none_or(|containers| containers.len() <= ORG_CONTAINERS_KEPT_MAX);
        (whole_fits && next.keepable()).then_some(next)
    }

    /// Puts `container`, as a round left it, where the facts hold it: among every container
    /// of the org, as the request's container, among those with events after `read_at`.
    fn put_container(&mut self, container: &str, lifecycle: &Lifecycle) {
        // As a read at `read_at` would hold it.
        let held = ContainerFacts::of(lifecycle, self.read_at);
        if let Some(containers) = &mut self.containers {
            containers.insert(container.to_owned(), held.clone());
        }
        if self.target_id.as_ref().map(ContainerId::as_str) == Some(container) {
            self.target = Some(held.clone());
        }
        if lifecycle.last_at() > Some(self.read_at) {
            self.future.insert(container.to_owned(), held);
        } else {
            self.future.remove(container);
        }
    }

    /// Whether these facts may be kept to answer later checks: no more than
    /// [`FUTURE_CONTAINERS_MAX`] containers with events after `read_at` (past it, each answer
    /// reads the ledger anyway) and no container with more than [`RECENT_INTERVALS_MAX`]
    /// intervals ending after `read_at`, so each kept fact costs memory, copies and answers
    /// in proportion to its containers, not to their histories.
    pub(crate) fn keepable(&self) -> bool {
        let mut held = self.future.values().chain(self.target.iter()).chain(
            self.containers
                .iter()
                .flat_map(|containers| containers.values()),
        );
        self.future.len() <= FUTURE_CONTAINERS_MAX
            && held.all(|container| container.recent.intervals().len() <= RECENT_INTERVALS_MAX)
    }

    /// Whether these facts hold every container of the org, and so answer a check naming
    /// any of them.
    pub(crate) fn whole(&self) -> bool {
        self.containers.is_some()
    }

    /// Containers kept with the facts beside the org's own, as the cache counts its
    /// entries: every container of the org when they hold them all, and those with events
    /// after `read_at`.
    pub(crate) fn containers_kept(&self) -> usize {
        self.containers.as_ref().map_or(0, BTreeMap::len) + self.future.len()
    }

    /// The container `id` as the facts hold it, wherever they hold it.
    fn container(&self, id: &str) -> Option<&ContainerFacts> {
        let among_all = self.containers.as_ref().and_then(|all| all.get(id));
        let named = self
            .target
            .as_ref()
            .filter(|_| self.target_id.as_ref().map(ContainerId::as_str) == Some(id));
        among_all.or(named).or_else(|| self.future.get(id))
    }

    /// The container `request` names: from every container of the org when the facts hold
    /// them, else the one the reading request named, when it is the same (the cache keeps
    /// such facts under that container).
    fn target_of(&self, request: &Request) -> Option<&ContainerFacts> {
        match (&self.containers, &request.container_id) {
            (Some(containers), Some(id)) => containers.get(id.as_str()),
            (Some(_), None) => None,
            (None, named) => self.target.as_ref().filter(|_| *named == self.target_id),
        }
    }

    /// Whether these facts answer for `now`: not before they were read, same period.
    fn serves(&self, now: DateTime<Utc>) -> bool {
        now >= self.read_at && Period::containing(now) == self.period
    }

    /// The org's runtime this period up to `now`: from the totals, corrected by the
    /// containers with events after `now` when there are any (the others' intervals all lie
    /// before it); `None`, leaving it to the ledger, when more than
    /// [`FUTURE_CONTAINERS_MAX`] have (the ledger's figure reads every container of the
    /// org).
    fn runtime_used_ms(&self, now: DateTime<Utc>) -> Option<i64> {
        let settled_at = self.latest_at.map(runtime::settled_at);
        if let Some(usage) =
            runtime::usage_from_totals(self.totals, &self.open, self.period, now, settled_at)
        {
            return Some(usage.runtime_ms);
        }
        (self.future.len() <= FUTURE_CONTAINERS_MAX).then(|| {
            runtime::runtime_from_totals_and_ahead(
                self.totals,
                &self.open,
                self.period,
                now,
                self.future.values().map(|container| &container.recent),
            )
        })
    }

    fn answer(
        &self,
        request: &Request,
        now: DateTime<Utc>,
        runtime_used_ms: i64,
    ) -> Result<Answer, AdmissionError> {
        // Open intervals, corrected by the few containers with events after now.
        let mut running: i64 = self.open.iter().map(|runs| runs.running as i64).sum();
        for container in self.future.values() {
            let lifecycle = &container.recent;
            running += i64::from(lifecycle.running_at(now))
                - i64::from(lifecycle.running_since().is_some());
        }
        let running_containers = u64::try_from(running)
            .map_err(|e| AdmissionError::corrupt("running containers below zero", e))?;
        let target = self.target_of(request);
        let container_running = target.is_some_and(|held| held.recent.running_at(now));
        let container_started =
            container_running || target.is_some_and(|held| held.recent.starts_after(now).is_some());
        let container_at_interval_limit =
            !container_started && target.is_some_and(|held| held.intervals_total >= INTERVALS_MAX);
        let container_at_lifecycle_limit = !container_started
            && target
                .is_some_and(|held| runtime::resume_past_lifecycle_limit(held.lifecycle_total));
        let account = self.account.state_at(now);
        let versions = self
            .plans
            .get(account.plan.as_str())
            .map(Vec::as_slice)
            .unwrap_or_default();
        let plan = plans::in_effect(versions, now)
            .ok_or_else(|| {
                AdmissionError::Corrupt(format!(
                    "org {} is on plan {}, which has no version",
                    request.org_id, account.plan
                ))
            })?
            .plan
            .clone();
        let reservations = self
            .reservation_expiries
            .iter()
            .filter(|expires_at| **expires_at > now)
            .count() as u64
            + self.consumed_unprojected;
        let facts = Facts {
            plan: &plan,
            account: &account,
            period: self.period,
            runtime_used_ms,
            running_containers,
            reservations,
            container_running,
            container_at_interval_limit,
            container_at_lifecycle_limit,
            ports_published: self.totals.ports_published,
        };
        let decision = billing::decide(request.action, &facts);
        Ok(Answer {
            position: self.projected,
            decision,
            plan: plan.id.clone(),
            period: self.period,
            runtime_used_ms,
            running_containers,
            max_running_containers: plan.max_running_containers,
            at: now,
            container_started,
        })
    }
}

/// What one projector round changed of one org, as kept facts need it (see
/// [`Prepared::advanced`]).
#[derive(Debug, Default)]
pub(crate) struct OrgRound<'a> {
    /// The checkpoint the round moved the projection to.
    pub position: i64,
    /// The latest instant of the org's events in the round.
    pub latest_at: Option<DateTime<Utc>>,
    /// Additions to the org's totals, by period.
    pub periods: Vec<(Period, PeriodDelta)>,
    /// Additions to the org's open intervals, by the period they started in.
    pub open: Vec<(Period, OpenDelta)>,
    /// The org's containers the round touched, as they are after it.
    pub containers: Vec<(&'a str, &'a Lifecycle)>,
}

/// The versions of each plan in the facts statement's `plan_versions`, oldest first; `free`
/// starts with its built-in version.
fn plan_versions(
    json: Option<&str>,
) -> Result<HashMap<String, Vec<plans::PlanVersion>>, AdmissionError> {
    let rows: Vec<(serde_json::Value, i64, i64)> = match json {
        Some(json) => serde_json::from_str(json)
            .map_err(|e| AdmissionError::corrupt("stored plan versions", e))?,
        None => Vec::new(),
    };
    let mut plans: HashMap<String, Vec<plans::PlanVersion>> = HashMap::new();
    plans.insert(
        runtime::FREE_PLAN.to_owned(),
        vec![plans::PlanVersion::builtin_free()],
    );
    for (data, occurred_at_ms, position) in rows {
        let id = data
            .get("id")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| AdmissionError::Corrupt("a stored plan without an id".to_owned()))?;
        let id = PlanId::parse(id)
            .map_err(|error| AdmissionError::corrupt(format!("stored plan id {id}"), error))?;
        let plan = billing::Plan::parse(&id, &data).map_err(|errors| {
            AdmissionError::Corrupt(format!("stored plan {id} does not parse: {errors:?}"))
        })?;
        let versions = plans.entry(id.as_str().to_owned()).or_default();
        let version = versions.iter().filter(|v| v.position > 0).count() as i64 + 1;
        versions.push(plans::PlanVersion {
            plan,
            version,
            effective_from: DateTime::from_timestamp_millis(occurred_at_ms)
                .ok_or_else(|| AdmissionError::Corrupt(format!("{occurred_at_ms} ms")))?,
            position,
        });
    }
    Ok(plans)
}

/// Intervals ending after the instant facts are read at that a container may have for the
/// facts to be kept (see [`Prepared::keepable`]): a few are a start or stop dated ahead of
/// the clock, more than this are a producer stopping and resuming one container over and
/// over ahead of it.
pub const RECENT_INTERVALS_MAX: usize = 16;

/// A container as facts hold it: how many running intervals it has, and of them only those
/// that end after the instant the facts were read at, or are open. At that instant and
/// every later one these alone say whether it runs or starts and what runtime it adds
/// ([`Lifecycle::intervals_ending_after`]); its whole history would make each read, round
/// and kept fact cost as much as the history is long (up to [`INTERVALS_MAX`] intervals).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ContainerFacts {
    intervals_total: usize,
    /// How many lifecycle events it has ([`runtime::LIFECYCLE_EVENTS_MAX`]).
    lifecycle_total: u64,
    recent: Lifecycle,
}

impl ContainerFacts {
    /// Of `lifecycle`, the intervals that end after `read_at`.
    fn of(lifecycle: &Lifecycle, read_at: DateTime<Utc>) -> ContainerFacts {
        let recent = lifecycle.intervals_ending_after(read_at).to_vec();
        ContainerFacts {
            intervals_total: lifecycle.intervals().len(),
            lifecycle_total: lifecycle.lifecycle_total(),
            recent: Lifecycle::restore(recent, 0, 0, None),
        }
    }

    /// As the facts statement gives it: its numbers of intervals and of lifecycle events,
    /// and the text of as many of the last of its intervals as [`recent_intervals`] sends.
    fn read(
        (total, lifecycle_total): (i32, i64),
        intervals: &str,
        read_at: DateTime<Utc>,
    ) -> Result<ContainerFacts, AdmissionError> {
        let sent = Lifecycle::restore(store::decode_intervals(intervals)?, 0, 0, None);
        let total = usize::try_from(total)
            .ok()
            .filter(|total| *total >= sent.intervals().len())
            .ok_or_else(|| AdmissionError::corrupt("intervals", format!("{total} in all")))?;
        let lifecycle_total = u64::try_from(lifecycle_total)
            .map_err(|e| AdmissionError::corrupt("lifecycle_total", e))?;
        Ok(ContainerFacts {
            intervals_total: total,
            lifecycle_total,
            ..ContainerFacts::of(&sent, read_at)
        })
    }

    /// Each of the containers `ids` as [`ContainerFacts::read`] reads it, from the
    /// statement's arrays of their numbers of intervals, of their numbers of lifecycle
    /// events and of their intervals, in the same order.
    fn read_all(
        ids: Vec<String>,
        (totals, lifecycles): (&[i32], &[i64]),
        intervals: &[String],
        read_at: DateTime<Utc>,
    ) -> Result<BTreeMap<String, ContainerFacts>, AdmissionError> {
        let lengths = (totals.len(), lifecycles.len(), intervals.len());
        if lengths != (ids.len(), ids.len(), ids.len()) {
            return Err(AdmissionError::Corrupt(format!(
                "{} and {} numbers and {} lists of intervals for {} containers",
                totals.len(),
                lifecycles.len(),
                intervals.len(),
                ids.len()
            )));
        }
        ids.into_iter()
            .zip(totals.iter().zip(lifecycles).zip(intervals))
            .map(|(id, ((total, lifecycle), intervals))| {
                Ok((
                    id,
                    ContainerFacts::read((*total, *lifecycle), intervals, read_at)?,
                ))
            })
            .collect()
    }
}

/// The facts statement's expression for what a check needs of a container's `column` of
/// intervals, as text: all of them when there are at most [`RECENT_INTERVALS_MAX`]; else
/// the last that many when the one before them ended by the check's instant (`$3`), as then
/// every earlier one did; else all of them (more than [`RECENT_INTERVALS_MAX`] end after
/// it, and facts holding them are not kept). Postgres reads a long array to count it
/// and to cut it, but sends and tally parses a handful of intervals, not the history.
fn recent_intervals(column: &str) -> String {
    let (kept, before) = (RECENT_INTERVALS_MAX, RECENT_INTERVALS_MAX + 1);
    format!(
        "CASE WHEN jsonb_array_length({column}) > {kept} \
                   AND ({column} -> -{before} ->> 1)::BIGINT <= extract(epoch FROM $3) * 1000 \
              THEN jsonb_path_query_array({column}, '$[last - {} to last]')::TEXT \
              ELSE {column}::TEXT END",
        kept - 1
    )
}

type StoredChange = (i64, i64, Uuid, Option<String>, Option<bool>, Option<bool>);

fn account_entries(json: &str) -> Result<Vec<AccountEntry>, AdmissionError> {
    let rows: Vec<StoredChange> = serde_json::from_str(json)
        .map_err(|e| AdmissionError::corrupt("stored account changes", e))?;
    rows.into_iter()
        .map(
            |(position, occurred_at_ms, event_id, plan, verified, eligible)| {
                let change = store::account_change(position, plan, verified, eligible)?;
                Ok(AccountEntry {
                    occurred_at: DateTime::from_timestamp_millis(occurred_at_ms)
                        .ok_or_else(|| AdmissionError::Corrupt(format!("{occurred_at_ms} ms")))?,
                    position,
                    event_id: EventId::from_uuid(event_id)
                        .map_err(|e| AdmissionError::corrupt("event_id", e))?,
                    change,
                })
            },
        )
        .collect()
}

/// A granted reservation.
#[derive(Debug, Clone)]
pub struct Reservation {
    pub id: Uuid,
    pub expires_at: DateTime<Utc>,
}

/// Grants a reservation when admission allows the request, serialized per org across
/// every instance; records a refusal otherwise. Either way returns the answer.
/// The instance's own kept facts of the org are dropped after a grant, so that its next
/// check counts the reservation without waiting for the notice. `clock` says when the
/// grant happens and so when it expires.
pub async fn reserve(
    pool: &PgPool,
    freshness: &Freshness,
    cache: &cache::FactsCache,
    clock: Clock,
    request: &Request,
    ttl_seconds: u64,
    actor: &str,
) -> Result<(Answer, Option<Reservation>), AdmissionError> {
    let wait = Wait::default();
    reserve_with(
        pool,
        freshness,
        cache,
        clock,
        request,
        ttl_seconds,
        actor,
        wait,
    )
    .await
}

/// [`reserve`], with the facts reflecting `wait.min_position` too, waiting `wait.within`.
// The instance's handles (pool, freshness, cache, clock) and the ask (request, ttl, actor,
// wait) are separate things; bundling either would only rename the parameters.
#[allow(clippy::too_many_arguments)]
pub async fn reserve_with(
    pool: &PgPool,
    freshness: &Freshness,
    cache: &cache::FactsCache,
    clock: Clock,
    request: &Request,
    ttl_seconds: u64,
    actor: &str,
    wait: Wait,
) -> Result<(Answer, Option<Reservation>), AdmissionError> {
    assert!(
        request.action.takes_slot(),
        "only create and resume reserve a slot"
    );
    // Read-your-writes: the projection must hold every event of the org (and every plan
    // definition) this instance acknowledged, and `min_position`. Checked on the facts read
    // under the org's lock, so that a replay's swap moving the checkpoint back cannot slip
    // in between; while they are behind, the lock is let go and the projector awaited,
    // within one deadline however often the checkpoint moves.
    let (mut transaction, now, mut answer) =
        locked_answer(pool, freshness, request, wait, clock).await?;
    // A running container (or one whose start, dated ahead, has been projected) holds its
    // slot already: a second one reserved for it would count it twice until the reservation
    // expired, and no start would consume it (decision 0046). For the same reason the slot
    // it holds is no concurrency limit to this request.
    if answer.container_started {
        let decision = &mut answer.decision;
        decision
            .reasons
            .retain(|reason| *reason != Reason::ConcurrencyLimit);
        decision.refuse(Reason::ContainerRunning);
    }
    if !answer.decision.allowed {
        record_refusal(&mut transaction, request, &answer.decision, actor, now).await?;
        transaction.commit().await?;
        return Ok((answer, None));
    }
    let reservation = Reservation {
        id: Uuid::now_v7(),
        expires_at: now + chrono::Duration::seconds(i64::try_from(ttl_seconds).unwrap_or(i64::MAX)),
    };
    sqlx::query(
        "INSERT INTO admission_reservation \
             (id, org_id, container_id, action, reserved_by, created_at, expires_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(reservation.id)
    .bind(request.org_id.as_str())
    .bind(request.container_id.as_ref().map(ContainerId::as_str))
    .bind(action_name(request.action))
    .bind(actor)
    .bind(now)
    .bind(reservation.expires_at)
    .execute(&mut *transaction)
    .await?;
    notice::notify(&mut *transaction, &Notice::of_org(request.org_id.as_str())).await?;
    transaction.commit().await?;
    cache.forget(request.org_id.as_str());
    Ok((answer, Some(reservation)))
}

/// Keeps a refused reservation's request, who asked, when and why, for audit.
async fn record_refusal(
    connection: &mut PgConnection,
    request: &Request,
    decision: &Decision,
    actor: &str,
    now: DateTime<Utc>,
) -> sqlx::Result<()> {
    let reasons: Vec<&str> = decision
        .reasons
        .iter()
        .map(|reason| reason.as_str())
        .collect();
    sqlx::query(
        "INSERT INTO admission_refusal (org_id, container_id, action, requested_by, requested_at, reasons) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(request.org_id.as_str())
    .bind(request.container_id.as_ref().map(ContainerId::as_str))
    .bind(action_name(request.action))
    .bind(actor)
    .bind(now)
    .bind(&reasons)
    .execute(connection)
    .await?;
    Ok(())
}

/// The action as its wire name (`create`, `resume`), as the reservation tables store it.
fn action_name(action: Action) -> String {
    serde_json::to_value(action)
        .ok()
        .and_then(|value| value.as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// The answer to `request` from facts that reflect `wait`, read in a transaction that holds
/// the org's admission lock; with that transaction and the instant the answer is for.
async fn locked_answer(
    pool: &PgPool,
    freshness: &Freshness,
    request: &Request,
    wait: Wait,
    clock: Clock,
) -> Result<(Transaction<'static, Postgres>, DateTime<Utc>, Answer), AdmissionError> {
    let wanted = wait.wanted(freshness, &request.org_id);
    let deadline = Instant::now() + wait.within;
    loop {
        let mut transaction = crate::ledger::db::begin(pool).await?;
        // The plan versions' lock first, so that a grant waiting for a plan version to be
        // projected holds no lock the projector needs (a round takes the consuming lock);
        // in that order by a function, whose statements run one after another (migration
        // 20261207000005).
        sqlx::query(&format!(
            "SELECT admission_grant_locks($3, {}, $2), {}",
            store::admission_lock("$1"),
            crate::ledger::db::BOUND_LOCK_IDLE
        ))
        .bind(request.org_id.as_str())
        .bind(store::CONSUME_LOCK_KEY)
        .bind(PLAN_VERSION_LOCK_KEY)
        .execute(&mut *transaction)
        .await?;
        // The clock is read after the lock, so that expiry is judged at the moment of
        // granting.
        let now = clock.now().trunc_subsecs(3);
        if let Some(answer) = load(&mut transaction, request, now, wanted).await? {
            return Ok((transaction, now, answer));
        }
        transaction.rollback().await?;
        wait.catch_up(pool, freshness, wanted, deadline).await?;
    }
}

/// The advisory lock between grants and plan definitions: a grant holds it shared from
/// before it takes its instant to its commit; a plan definition holds it alone from before
/// it takes its version's instant until the version is projected (or a bounded wait ends).
/// So no grant decides at an instant a new version covers with the version before it: a
/// lowered `max_running_containers` holds from the instant it is in effect. `'planve'` in
/// ASCII.
pub const PLAN_VERSION_LOCK_KEY: i64 = 0x706c_616e_7665;

/// What became of a reservation asked to be released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    Released,
    /// Released before: releasing is idempotent.
    AlreadyReleased,
    /// Consumed by its container's event: the slot is the running container's now.
    Consumed,
    NotFound,
}

/// The org a reservation belongs to, if it exists.
pub async fn reservation_org(pool: &PgPool, id: Uuid) -> sqlx::Result<Option<String>> {
    sqlx::query_scalar("SELECT org_id FROM admission_reservation WHERE id = $1")
        .bind(id)
        .fetch_optional(pool)
        .await
}

/// Releases reservation `id`; like a grant, drops the instance's own kept facts of its org.
pub async fn release(
    pool: &PgPool,
    cache: &cache::FactsCache,
    clock: Clock,
    id: Uuid,
    actor: &str,
) -> sqlx::Result<Released> {
    // The org's notice goes with the release, in its transaction.
    let mut transaction = crate::ledger::db::begin(pool).await?;
    let org: Option<String> =
        sqlx::query_scalar("SELECT org_id FROM admission_reservation WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *transaction)
            .await?;
    let Some(org) = org else {
        return Ok(Released::NotFound);
    };
    // In turn with the org's grants, and stamped by the clock they read after the same
    // lock: a grant that did not count the reservation is recorded after its release, one
    // that counted it before, so the stored record re-derives what each grant saw.
    sqlx::query(&format!(
        "SELECT pg_advisory_xact_lock({}), {}",
        store::admission_lock("$1"),
        crate::ledger::db::BOUND_LOCK_IDLE
    ))
    .bind(&org)
    .execute(&mut *transaction)
    .await?;
    let now = clock.now().trunc_subsecs(3);
    let released: Option<String> = sqlx::query_scalar(
        "UPDATE admission_reservation SET released_at = $3, released_by = $2 \
         WHERE id = $1 AND released_at IS NULL AND consumed_at IS NULL RETURNING org_id",
    )
    .bind(id)
    .bind(actor)
    .bind(now)
    .fetch_optional(&mut *transaction)
    .await?;
    if let Some(org) = released {
        notice::notify(&mut *transaction, &Notice::of_org(&org)).await?;
        transaction.commit().await?;
        cache.forget(&org);
        return Ok(Released::Released);
    }
    transaction.rollback().await?;
    let consumed: Option<bool> = sqlx::query_scalar(
        "SELECT consumed_at IS NOT NULL FROM admission_reservation WHERE id = $1",
    )
    .bind(id)
    .fetch_optional(pool)
    .await?;
    Ok(match consumed {
        None => Released::NotFound,
        Some(true) => Released::Consumed,
        Some(false) => Released::AlreadyReleased,
    })
}
