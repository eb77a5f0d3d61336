//! Reads of one org for the console (decision 0026): its account state with the history of
//! its account events, its containers a page at a time, and its usage split by UTC day.
//! Each read takes its figures and the checkpoint from one snapshot, like [`super::query`].

use std::cmp::Reverse;

use chrono::{DateTime, NaiveDate, Utc};
use sqlx::{FromRow, PgConnection, PgPool};

use super::query::{self, AtPosition, PricedUsage};
use super::store::{self, LIVE, RUNNING_SQL};
use super::Error;
use crate::ledger::db::read_snapshot;
use crate::ledger::plans::{self, PlanVersion};
use crate::runtime::{self, AccountEntry, AccountState, AccountTimeline, Day, Period};

/// An org's account as of an instant.
#[derive(Debug)]
pub struct Account {
    pub state: AccountState,
    /// The version of the org's plan in effect at the instant.
    pub plan: PlanVersion,
    /// The org's account events, newest first by (`occurred_at`, position), at most the
    /// number asked for.
    pub history: Vec<AccountEntry>,
    /// Every account event the org has (voided ones aside).
    pub history_total: u64,
}

/// The account of `org_id` at `as_of`, with up to `history_max` of its account events. An
/// org with no account event is on `free`, unverified and not billing eligible.
pub async fn account(
    pool: &PgPool,
    org_id: &str,
    as_of: DateTime<Utc>,
    history_max: usize,
) -> Result<AtPosition<Account>, Error> {
    let mut transaction = read_snapshot(pool).await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    // The fold needs every entry anyway; an org has a handful (one per plan, verification
    // or eligibility change), so the history is cut from the same rows.
    let mut entries = store::account_entries(&mut transaction, org_id).await?;
    let state = AccountTimeline::fold(&entries).state_at(as_of);
    let versions = plans::versions(&mut *transaction, &state.plan).await?;
    let plan = plans::in_effect(&versions, as_of)
        .cloned()
        .ok_or_else(|| Error::Corrupt(format!("org {org_id} is on a plan with no version")))?;
    transaction.commit().await?;
    let history_total = entries.len() as u64;
    entries.sort_unstable_by_key(|entry| Reverse((entry.occurred_at, entry.position)));
    entries.truncate(history_max);
    Ok(AtPosition {
        position,
        figures: Account {
            state,
            plan,
            history: entries,
            history_total,
        },
    })
}

/// Which of an org's containers a page lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateFilter {
    All,
    Running,
    Stopped,
}

/// Not running: stopped, or never started.
const STOPPED_SQL: &str = "(intervals -> -1 -> 1 = 'null'::JSONB) IS NOT TRUE";

/// One container of an org's list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerSummary {
    pub container_id: String,
    /// The start of the interval it runs in at the instant asked for; `None` when not
    /// running then.
    pub running_since: Option<DateTime<Utc>>,
    /// The latest `occurred_at` of its events.
    pub last_event_at: DateTime<Utc>,
}

#[derive(FromRow)]
struct SummaryRow {
    container_id: String,
    /// The start of the interval it runs in; `None` when not running.
    since_ms: Option<i64>,
    last_at: DateTime<Utc>,
}

/// Up to `limit` of the org's containers after `after`, in container id order (bytewise,
/// whatever the database's collation), each in its state at `now`, with the checkpoint.
///
/// A container whose events all lie at or before `now` is in the state its last event
/// left it: one range scan of an index that holds the state asked for. Events dated ahead
/// of the clock (up to [`crate::event::FUTURE_SKEW_MAX_SECONDS`]) can start or stop a
/// container after `now`; the few with such events are read apart, by the org's index on
/// the hour of `last_at`, their state taken at `now` from every interval, and the two
/// lists merged ([`ContainerListSql`]).
pub async fn containers(
    pool: &PgPool,
    org_id: &str,
    filter: StateFilter,
    after: Option<&str>,
    limit: usize,
    now: DateTime<Utc>,
) -> Result<AtPosition<Vec<ContainerSummary>>, Error> {
    let sql = ContainerListSql::of(filter);
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let mut transaction = read_snapshot(pool).await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let mut rows: Vec<SummaryRow> = sqlx::query_as(&sql.settled)
        .bind(org_id)
        .bind(after.unwrap_or(""))
        .bind(limit)
        .bind(now)
        .fetch_all(&mut *transaction)
        .await?;
    let ahead: Vec<SummaryRow> = sqlx::query_as(&sql.ahead)
        .bind(org_id)
        .bind(after.unwrap_or(""))
        .bind(limit)
        .bind(now)
        .bind(now.timestamp_millis())
        .fetch_all(&mut *transaction)
        .await?;
    rows.extend(ahead);
    transaction.commit().await?;
    rows.sort_by(|a, b| a.container_id.as_bytes().cmp(b.container_id.as_bytes()));
    rows.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
    Ok(AtPosition {
        position,
        figures: rows.into_iter().map(summary).collect::<Result<_, _>>()?,
    })
}

/// The two queries of an org's container list, each taking the org ($1), the cursor ($2),
/// the page's length ($3) and now ($4), `ahead` also now in epoch milliseconds ($5); each
/// returns a page of [`SummaryRow`]s, and the two sets never share a container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerListSql {
    /// Containers with no event after now, in the state their last event left them: on
    /// the partial index of that state (`container_org_running`, `container_org_stopped`),
    /// or `container_org_id` for all.
    pub settled: String,
    /// Containers with an event after now (dated ahead of the clock), on
    /// `container_org_hour`, each running when an interval holds now: start <= now < end,
    /// an open end holding every instant after its start (`Interval::contains`;
    /// boundaries are whole milliseconds).
    pub ahead: String,
}

impl ContainerListSql {
    pub fn of(filter: StateFilter) -> ContainerListSql {
        let (settled_state, ahead_state) = match filter {
            StateFilter::All => (String::new(), ""),
            StateFilter::Running => (format!("AND {RUNNING_SQL}"), "WHERE since_ms IS NOT NULL"),
            StateFilter::Stopped => (format!("AND {STOPPED_SQL}"), "WHERE since_ms IS NULL"),
        };
        ContainerListSql {
            settled: format!(
                "SELECT container_id, CASE WHEN {RUNNING_SQL} \
                        THEN (intervals -> -1 ->> 0)::BIGINT END AS since_ms, last_at \
                 FROM {LIVE}.container \
                 WHERE org_id = $1 AND container_id COLLATE \"C\" > $2 {settled_state} \
                   AND last_at <= $4 \
                 ORDER BY container_id COLLATE \"C\" LIMIT $3"
            ),
            ahead: format!(
                "SELECT * FROM ( \
                     SELECT container_id, last_at, \
                            (SELECT (i ->> 0)::BIGINT FROM jsonb_array_elements(intervals) AS i \
                             WHERE (i ->> 0)::BIGINT <= $5 \
                               AND (i -> 1 = 'null'::JSONB OR (i ->> 1)::BIGINT > $5) \
                             LIMIT 1) AS since_ms \
                     FROM {LIVE}.container \
                     WHERE org_id = $1 \
                       AND last_hour >= date_trunc('hour', $4 AT TIME ZONE 'UTC') \
                       AND last_at > $4 AND container_id COLLATE \"C\" > $2 \
                 ) AS ahead {ahead_state} \
                 ORDER BY container_id COLLATE \"C\" LIMIT $3"
            ),
        }
    }
}

fn summary(row: SummaryRow) -> Result<ContainerSummary, Error> {
    let running_since = row
        .since_ms
        .map(|ms| {
            DateTime::from_timestamp_millis(ms)
                .ok_or_else(|| Error::Corrupt(format!("container {}: {ms} ms", row.container_id)))
        })
        .transpose()?;
    Ok(ContainerSummary {
        container_id: row.container_id,
        running_since,
        last_event_at: row.last_at,
    })
}

/// One UTC day of an org's usage: the figures of [`runtime::Usage`] that add up over days.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DayUsage {
    pub day: Day,
    pub runtime_ms: i64,
    pub commands: u64,
    pub command_ms: i64,
}

/// [`query::priced_usage`] with the same figures split by UTC day, from one snapshot. The
/// days add up exactly to the period's figures; a difference is a projection bug, and the
/// read fails rather than show figures that disagree.
pub async fn priced_usage_by_day(
    pool: &PgPool,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<AtPosition<(PricedUsage, Vec<DayUsage>)>, Error> {
    let mut transaction = read_snapshot(pool).await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let priced = query::priced_usage_on(&mut transaction, org_id, period, as_of).await?;
    let days = usage_by_day(&mut transaction, org_id, period, as_of, position).await?;
    transaction.commit().await?;
    let usage = priced.usage;
    let summed = (
        days.iter().map(|day| day.runtime_ms).sum::<i64>(),
        days.iter().map(|day| day.commands).sum::<u64>(),
        days.iter().map(|day| day.command_ms).sum::<i64>(),
    );
    if summed != (usage.runtime_ms, usage.commands, usage.command_ms) {
        return Err(Error::Corrupt(format!(
            "org {org_id} {period}: the days sum to {summed:?}, the period has \
             ({}, {}, {})",
            usage.runtime_ms, usage.commands, usage.command_ms
        )));
    }
    Ok(AtPosition {
        position,
        figures: (priced, days),
    })
}

/// The org's runtime, commands and command time in each UTC day of `period` before
/// `as_of`. Runtime comes from the stored intervals of the org's containers; commands from
/// the ledger (the projection keeps them per period only), as [`query::usage_on`] counts
/// them for an `as_of` inside the period: up to the checkpoint, voided ones left out.
async fn usage_by_day(
    connection: &mut PgConnection,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
    checkpoint: i64,
) -> Result<Vec<DayUsage>, Error> {
    let window = period.window().until(as_of);
    let days = runtime::days(window);
    let Some(first) = days.first() else {
        return Ok(Vec::new());
    };
    let lifecycles = store::org_lifecycles(&mut *connection, org_id).await?;
    let runtime_ms = runtime::runtime_by_day(
        lifecycles
            .iter()
            .flat_map(|lifecycle| lifecycle.intervals()),
        &days,
    );
    let commands: Vec<(NaiveDate, i64, i64)> = sqlx::query_as(
        "SELECT (occurred_at AT TIME ZONE 'UTC')::DATE AS day, count(*), \
                COALESCE(sum((data->>'duration_ms')::BIGINT), 0)::BIGINT \
         FROM ledger \
         WHERE org_id = $1 AND occurred_at >= $2 AND occurred_at < $3 AND position <= $4 \
           AND type = 'container.command_ran' \
           AND NOT EXISTS (SELECT 1 FROM proj.voided v WHERE v.event_id = ledger.id) \
         GROUP BY day",
    )
    .bind(org_id)
    .bind(window.start())
    .bind(window.end())
    .bind(checkpoint)
    .fetch_all(&mut *connection)
    .await?;
    let mut by_day: Vec<DayUsage> = days
        .iter()
        .zip(runtime_ms)
        .map(|(day, runtime_ms)| DayUsage {
            day: *day,
            runtime_ms,
            commands: 0,
            command_ms: 0,
        })
        .collect();
    for (date, count, command_ms) in commands {
        let index = usize::try_from((date - first.date).num_days())
            .ok()
            .filter(|index| *index < by_day.len())
            .ok_or_else(|| Error::Corrupt(format!("commands on {date}, outside {period}")))?;
        by_day[index].commands = u64::try_from(count).map_err(|e| Error::corrupt("commands", e))?;
        by_day[index].command_ms = command_ms;
    }
    Ok(by_day)
}
