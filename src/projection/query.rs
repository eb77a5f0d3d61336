//! Reads the API serves from the projection: an org's usage for a period, a container's
//! timeline.
//!
//! Usage as of an instant after the org's latest event (the normal case: "as of now")
//! comes from the org's totals alone — one statement, independent of how many containers
//! the org has. An earlier `as_of` has to cut intervals, commands and ports at that instant:
//! it reads the org's stored lifecycles, its port pairs, and counts its commands from the
//! ledger up to the projection's checkpoint, all in one snapshot.

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgConnection, PgPool};

use std::collections::HashMap;

use super::store::{self, LIVE};
use super::Error;
use crate::billing::overage::{self, Overage, PlanVersion};
use crate::billing::Plan;
use crate::event::PlanId;
use crate::ledger::db::read_snapshot;
use crate::ledger::plans;
use crate::runtime::{
    self, AccountTimeline, Anomaly, Interval, OpenRuns, Period, PeriodTotals, Usage,
};

#[derive(FromRow)]
struct TotalsRow {
    latest_at: Option<DateTime<Utc>>,
    closed_runtime_ms: i64,
    commands: i64,
    command_ms: i64,
    ports_published: i64,
    open_periods: Vec<String>,
    open_running: Vec<i64>,
    open_offsets: Vec<i64>,
}

/// Figures with the projection checkpoint of the snapshot they were read in: the ledger
/// position they reflect.
#[derive(Debug)]
pub struct AtPosition<T> {
    pub position: i64,
    pub figures: T,
}

/// The usage of `org_id` in `period` as of `as_of` (already truncated to milliseconds).
/// An org the projection has never seen has zero usage.
pub async fn usage(
    pool: &PgPool,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<Usage, Error> {
    let mut transaction = read_snapshot(pool).await?;
    let usage = usage_on(&mut transaction, org_id, period, as_of).await?;
    transaction.commit().await?;
    Ok(usage)
}

/// [`usage`] on a connection the caller holds (and perhaps a transaction it runs).
pub async fn usage_on(
    connection: &mut PgConnection,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<Usage, Error> {
    match from_totals(&mut *connection, org_id, period, as_of).await? {
        Some(usage) => Ok(usage),
        None => cut_at(connection, org_id, period, as_of).await,
    }
}

/// An org's open-interval groups from the three parallel arrays the totals statements
/// select (`org_open` ordered by period).
pub fn open_runs(
    periods: &[String],
    running: &[i64],
    offsets: &[i64],
) -> Result<Vec<OpenRuns>, Error> {
    periods
        .iter()
        .zip(running)
        .zip(offsets)
        .map(|((since_period, running), offset)| {
            Ok(OpenRuns {
                since_period: Period::parse(since_period)
                    .map_err(|e| Error::corrupt("since_period", e))?,
                running: u64::try_from(*running).map_err(|e| Error::corrupt("running", e))?,
                since_offset_ms: *offset,
            })
        })
        .collect()
}

/// Usage from the org's totals in one statement; `None` when `as_of` is before the org's
/// latest event and every figure has to be cut at it.
async fn from_totals(
    connection: &mut PgConnection,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<Option<Usage>, Error> {
    let row: TotalsRow = sqlx::query_as(&format!(
        "SELECT (SELECT latest_at FROM {LIVE}.org WHERE org_id = $1) AS latest_at, \
                COALESCE(p.closed_runtime_ms, 0) AS closed_runtime_ms, \
                COALESCE(p.commands, 0) AS commands, \
                COALESCE(p.command_ms, 0) AS command_ms, \
                COALESCE(p.ports_published, 0) AS ports_published, \
                ARRAY(SELECT since_period FROM {LIVE}.org_open \
                      WHERE org_id = $1 AND running > 0 ORDER BY since_period) AS open_periods, \
                ARRAY(SELECT running FROM {LIVE}.org_open \
                      WHERE org_id = $1 AND running > 0 ORDER BY since_period) AS open_running, \
                ARRAY(SELECT since_offset_ms FROM {LIVE}.org_open \
                      WHERE org_id = $1 AND running > 0 ORDER BY since_period) AS open_offsets \
         FROM (SELECT 1) AS one \
         LEFT JOIN {LIVE}.org_period p ON p.org_id = $1 AND p.period = $2"
    ))
    .bind(org_id)
    .bind(period.to_string())
    .fetch_one(connection)
    .await?;
    let totals = PeriodTotals {
        closed_runtime_ms: row.closed_runtime_ms,
        commands: u64::try_from(row.commands).map_err(|e| Error::corrupt("commands", e))?,
        command_ms: row.command_ms,
        ports_published: u64::try_from(row.ports_published)
            .map_err(|e| Error::corrupt("ports_published", e))?,
    };
    let open = open_runs(&row.open_periods, &row.open_running, &row.open_offsets)?;
    let settled_at = row.latest_at.map(runtime::settled_at);
    Ok(runtime::usage_from_totals(
        totals, &open, period, as_of, settled_at,
    ))
}

/// Usage as of an instant the org's events reach past: every figure cut at `as_of`. Run
/// it in one snapshot (a repeatable-read transaction) for figures that agree.
async fn cut_at(
    connection: &mut PgConnection,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<Usage, Error> {
    let window = period.window().until(as_of);
    let checkpoint = store::checkpoint(&mut *connection, LIVE).await?;
    let lifecycles = store::org_lifecycles(&mut *connection, org_id).await?;
    let (commands, command_ms): (i64, i64) = sqlx::query_as(
        "SELECT count(*), COALESCE(sum((data->>'duration_ms')::BIGINT), 0)::BIGINT FROM ledger \
         WHERE org_id = $1 AND occurred_at >= $2 AND occurred_at < $3 AND position <= $4 \
           AND type = 'container.command_ran' \
           AND NOT EXISTS (SELECT 1 FROM proj.voided v WHERE v.event_id = ledger.id)",
    )
    .bind(org_id)
    .bind(window.start())
    .bind(window.end())
    .bind(checkpoint)
    .fetch_one(&mut *connection)
    .await?;
    let ports_published: i64 = sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {LIVE}.port WHERE org_id = $1 AND period = $2 AND first_at < $3"
    ))
    .bind(org_id)
    .bind(period.to_string())
    .bind(window.end())
    .fetch_one(&mut *connection)
    .await?;
    Ok(Usage {
        runtime_ms: lifecycles
            .iter()
            .map(|lifecycle| lifecycle.runtime_ms(window))
            .sum(),
        commands: u64::try_from(commands).map_err(|e| Error::corrupt("commands", e))?,
        command_ms,
        ports_published: u64::try_from(ports_published)
            .map_err(|e| Error::corrupt("ports_published", e))?,
        running_containers: lifecycles
            .iter()
            .filter(|lifecycle| lifecycle.running_at(as_of))
            .count() as u64,
    })
}

/// What [`container`] found: the container's lifecycle for each org that used its id and,
/// when exactly one did, a page of its kept anomalies.
#[derive(Debug)]
pub struct ContainerFound {
    pub containers: Vec<store::StoredContainer>,
    pub anomalies: Vec<Anomaly>,
}

/// A container's lifecycle for each org that used its id (normally one) and, when exactly
/// one did, up to `limit` of its kept anomalies after `after`, read in one snapshot with
/// the checkpoint.
pub async fn container(
    pool: &PgPool,
    container_id: &str,
    org_id: Option<&str>,
    after: Option<store::AnomalyCursor>,
    limit: usize,
) -> Result<AtPosition<ContainerFound>, Error> {
    let mut transaction = read_snapshot(pool).await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let containers = store::containers_by_id(&mut transaction, container_id, org_id).await?;
    let anomalies = match containers.as_slice() {
        [only] => {
            store::container_anomalies(&mut transaction, &only.org_id, container_id, after, limit)
                .await?
        }
        _ => Vec::new(),
    };
    transaction.commit().await?;
    Ok(AtPosition {
        position,
        figures: ContainerFound {
            containers,
            anomalies,
        },
    })
}

/// Usage with its overage and the plan in effect (contract §6 usage).
#[derive(Debug, Clone)]
pub struct PricedUsage {
    pub usage: Usage,
    /// Overage time and its amount, unrounded (exports round once per org and period).
    pub overage: Overage,
    /// The plan in effect at the last instant of the window (at the period's start when
    /// `as_of` is before it).
    pub plan: Plan,
    /// The currency of the overage amount: that of the plans in the window that price
    /// overage (they share one, decision 0045), else of `plan`.
    pub currency: String,
}

/// [`usage`] plus overage: the allowance is consumed in time order across the org's
/// containers, switching plan, allowance and price where the org's plan or that plan's
/// version changes. With one plan over the whole window this needs no interval; with
/// several it sweeps the org's intervals. Every figure, and the checkpoint, from one
/// snapshot.
pub async fn priced_usage(
    pool: &PgPool,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<AtPosition<PricedUsage>, Error> {
    let mut transaction = read_snapshot(pool).await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let priced = priced_usage_on(&mut transaction, org_id, period, as_of).await?;
    transaction.commit().await?;
    Ok(AtPosition {
        position,
        figures: priced,
    })
}

/// [`priced_usage`] on a connection the caller holds (and a snapshot it runs).
pub async fn priced_usage_on(
    connection: &mut PgConnection,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
) -> Result<PricedUsage, Error> {
    let usage = usage_on(&mut *connection, org_id, period, as_of).await?;
    let account = AccountTimeline::fold(&store::account_entries(&mut *connection, org_id).await?);
    price(
        connection,
        org_id,
        period,
        as_of,
        usage,
        &account,
        &mut PlanVersions::default(),
    )
    .await
}

/// Plan versions as read, by plan id: a batch of orgs on a few plans reads each plan once.
/// Read them in the same snapshot as the usage they price.
#[derive(Debug, Default)]
pub struct PlanVersions(HashMap<String, Vec<PlanVersion>>);

impl PlanVersions {
    async fn load(&mut self, connection: &mut PgConnection, id: &PlanId) -> Result<(), Error> {
        if !self.0.contains_key(id.as_str()) {
            let versions = plans::versions(&mut *connection, id).await?;
            self.0.insert(id.as_str().to_owned(), versions);
        }
        Ok(())
    }

    fn of(&self, id: &str) -> Option<&[PlanVersion]> {
        self.0
            .get(id)
            .map(Vec::as_slice)
            .filter(|found| !found.is_empty())
    }
}

/// Prices `usage` (of `org_id` in `period` as of `as_of`) with the org's account timeline:
/// the plan in effect at the window's last instant, and the overage (see [`priced_usage`]).
pub async fn price(
    connection: &mut PgConnection,
    org_id: &str,
    period: Period,
    as_of: DateTime<Utc>,
    usage: Usage,
    account: &AccountTimeline,
    versions: &mut PlanVersions,
) -> Result<PricedUsage, Error> {
    let window = period.window().until(as_of);
    versions
        .load(&mut *connection, &account.state_at(window.start()).plan)
        .await?;
    for change in account.changes() {
        if window.contains(change.from) {
            versions.load(&mut *connection, &change.state.plan).await?;
        }
    }
    let versions: &PlanVersions = versions;
    let versions_of = |id: &str| versions.of(id);
    let last_instant = if window.length_ms() > 0 {
        window.end() - chrono::Duration::milliseconds(1)
    } else {
        window.start()
    };
    let plan = plans::in_effect(
        versions_of(account.state_at(last_instant).plan.as_str())
            .ok_or_else(|| Error::Corrupt(format!("org {org_id} is on a plan with no version")))?,
        last_instant,
    )
    .ok_or_else(|| Error::Corrupt(format!("org {org_id} is on a plan with no version")))?
    .plan
    .clone();
    let segments = overage::plan_segments(account, versions_of, window)
        .ok_or_else(|| Error::Corrupt(format!("org {org_id} was on a plan with no version")))?;
    let overage = match segments.as_slice() {
        [only] => overage::single_plan(usage.runtime_ms, &only.plan),
        _ => {
            let lifecycles = store::org_lifecycles(&mut *connection, org_id).await?;
            let intervals: Vec<Interval> = lifecycles
                .iter()
                .flat_map(|lifecycle| lifecycle.intervals().iter().copied())
                .collect();
            overage::overage(&intervals, &segments, window)
        }
    };
    // A plan that prices nothing (such as `free`) says nothing of the amount's currency.
    let currency = segments
        .iter()
        .rev()
        .map(|segment| &segment.plan)
        .find(|priced| !priced.overage_price_per_hour.is_zero())
        .unwrap_or(&plan)
        .currency
        .clone();
    Ok(PricedUsage {
        usage,
        overage,
        plan,
        currency,
    })
}
