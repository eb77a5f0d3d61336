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
    /// The start of its open interval, while running.
    pub running_since: Option<DateTime<Utc>>,
    /// The latest `occurred_at` of its events.
    pub last_event_at: DateTime<Utc>,
}

#[derive(FromRow)]
struct SummaryRow {
    container_id: String,
    running: bool,
    since_ms: Option<i64>,
    last_at: DateTime<Utc>,
}

/// Up to `limit` of the org's containers after `after`, in container id order (bytewise,
/// whatever the database's collation), with the checkpoint: one range scan of an index.
pub async fn containers(
    pool: &PgPool,
    org_id: &str,
    filter: StateFilter,
    after: Option<&str>,
    limit: usize,
) -> Result<AtPosition<Vec<ContainerSummary>>, Error> {
    let state_condition = match filter {
        StateFilter::All => String::new(),
        StateFilter::Running => format!("AND {RUNNING_SQL}"),
        StateFilter::Stopped => format!("AND {STOPPED_SQL}"),
    };
    let mut transaction = read_snapshot(pool).await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let rows: Vec<SummaryRow> = sqlx::query_as(&format!(
        "SELECT container_id, ({RUNNING_SQL}) AS running, \
                (intervals -> -1 ->> 0)::BIGINT AS since_ms, last_at \
         FROM {LIVE}.container \
         WHERE org_id = $1 AND container_id COLLATE \"C\" > $2 {state_condition} \
         ORDER BY container_id COLLATE \"C\" LIMIT $3"
    ))
    .bind(org_id)
    .bind(after.unwrap_or(""))
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_all(&mut *transaction)
    .await?;
    transaction.commit().await?;
    let containers = rows
        .into_iter()
        .map(|row| {
            let running_since = match (row.running, row.since_ms) {
                (false, _) => None,
                (true, Some(ms)) => Some(DateTime::from_timestamp_millis(ms).ok_or_else(|| {
                    Error::Corrupt(format!("container {}: {ms} ms", row.container_id))
                })?),
                (true, None) => {
                    return Err(Error::Corrupt(format!(
                        "container {} runs from no start",
                        row.container_id
                    )))
                }
            };
            Ok(ContainerSummary {
                container_id: row.container_id,
                running_since,
                last_event_at: row.last_at,
            })
        })
        .collect::<Result<_, Error>>()?;
    Ok(AtPosition {
        position,
        figures: containers,
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
