//! What finance has stored, listed for browsing (the console's finance pages): the periods
//! with their close states, the imported provider reports and the reconciliations, newest
//! first, and one reconciliation's stored summary. Each list is one bounded query on an
//! index (migration `20261202000100`); nothing here computes a figure, it reads what the
//! imports, runs and closes stored.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::Value;
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use super::periods::{self, JobStatus};
use super::Error;
use crate::runtime::Period;

/// Where a period stands: `open` until a close is asked for; `closing` while a close job
/// runs; `closed` once its snapshot is stored; `failed` when its latest close failed (or
/// its process stopped) and nothing was stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeriodState {
    Open,
    Closing,
    Closed,
    Failed,
}

impl PeriodState {
    pub fn as_str(self) -> &'static str {
        match self {
            PeriodState::Open => "open",
            PeriodState::Closing => "closing",
            PeriodState::Closed => "closed",
            PeriodState::Failed => "failed",
        }
    }
}

/// One period of the list; the close's figures when it is closed.
#[derive(Debug, Clone)]
pub struct PeriodEntry {
    pub period: Period,
    pub state: PeriodState,
    pub closed_at: Option<DateTime<Utc>>,
    pub orgs: Option<i64>,
    pub sha256: Option<String>,
}

/// The month of the earliest `occurred_at` in the ledger, or `None` when it is empty. The
/// ledger has no index on `occurred_at` alone (appends would pay for it), so this walks its
/// `(org_id, occurred_at, position)` index once per org: a loose index scan that reads two
/// index entries per org, never the table.
async fn earliest_event(pool: &PgPool) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    sqlx::query_scalar(
        "WITH RECURSIVE orgs (org_id) AS ( \
             (SELECT org_id FROM ledger ORDER BY org_id LIMIT 1) \
             UNION ALL \
             SELECT (SELECT l.org_id FROM ledger l WHERE l.org_id > orgs.org_id \
                     ORDER BY l.org_id LIMIT 1) \
             FROM orgs WHERE orgs.org_id IS NOT NULL) \
         SELECT min((SELECT l.occurred_at FROM ledger l WHERE l.org_id = orgs.org_id \
                     ORDER BY l.occurred_at LIMIT 1)) \
         FROM orgs WHERE orgs.org_id IS NOT NULL",
    )
    .fetch_one(pool)
    .await
}

/// The newest `limit` periods whose close was asked for (closed or with a job).
async fn asked_periods(pool: &PgPool, limit: i64) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT period FROM (SELECT period FROM period_close \
                             UNION SELECT period FROM period_close_job) asked \
         ORDER BY period DESC LIMIT $1",
    )
    .bind(limit)
    .fetch_all(pool)
    .await
}

#[derive(FromRow)]
struct CloseRow {
    period: String,
    closed_at: DateTime<Utc>,
    orgs: i64,
    sha256: Vec<u8>,
}

/// The newest `limit` periods, newest first: every month from the earliest ledger event's
/// (the current month's when the ledger is empty) to the current one, and any period whose
/// close was asked for.
async fn listed_periods(
    pool: &PgPool,
    now: DateTime<Utc>,
    limit: usize,
) -> Result<Vec<Period>, Error> {
    let current = Period::containing(now);
    let first = earliest_event(pool)
        .await?
        .map_or(current, Period::containing)
        .min(current);
    let mut wanted = BTreeSet::new();
    let mut month = current;
    // Walks back from the current month: `limit` months at most, not the ledger's age.
    while wanted.len() < limit {
        wanted.insert(month);
        if month <= first {
            break;
        }
        month = previous(month);
    }
    for period in asked_periods(pool, limit as i64).await? {
        let period = Period::parse_stored(&period)
            .map_err(|error| Error::Corrupt(format!("a stored close's period: {error}")))?;
        wanted.insert(period);
    }
    Ok(wanted.into_iter().rev().take(limit).collect())
}

/// The newest `limit` periods (see [`listed_periods`]) and where each stands.
pub async fn periods(
    pool: &PgPool,
    now: DateTime<Utc>,
    limit: usize,
) -> Result<Vec<PeriodEntry>, Error> {
    let wanted = listed_periods(pool, now, limit).await?;
    let names: Vec<String> = wanted.iter().map(Period::to_string).collect();
    // Jobs before closes: a close that commits between the two reads is then seen
    // closed, never as a done job without its close.
    let jobs: BTreeMap<String, String> = sqlx::query_as(
        "SELECT DISTINCT ON (period) period, status FROM period_close_job \
         WHERE period = ANY($1) ORDER BY period, started_at DESC, (status = 'running') DESC",
    )
    .bind(&names)
    .fetch_all(pool)
    .await?
    .into_iter()
    .collect();
    let closes: BTreeMap<String, CloseRow> = sqlx::query_as::<_, CloseRow>(
        "SELECT period, closed_at, orgs, sha256 FROM period_close WHERE period = ANY($1)",
    )
    .bind(&names)
    .fetch_all(pool)
    .await?
    .into_iter()
    .map(|row| (row.period.clone(), row))
    .collect();
    let mut entries = Vec::with_capacity(wanted.len());
    for period in wanted {
        let name = period.to_string();
        let entry = match (closes.get(&name), jobs.get(&name).map(String::as_str)) {
            (Some(close), _) => PeriodEntry {
                period,
                state: PeriodState::Closed,
                closed_at: Some(close.closed_at),
                orgs: Some(close.orgs),
                sha256: Some(hex::encode(&close.sha256)),
            },
            (None, job) => PeriodEntry {
                period,
                state: match job {
                    None => PeriodState::Open,
                    Some("failed") => PeriodState::Failed,
                    // Rare: a running job needs its lock looked at, which `job` does.
                    Some(_) => job_state(pool, period).await?,
                },
                closed_at: None,
                orgs: None,
                sha256: None,
            },
        };
        entries.push(entry);
    }
    Ok(entries)
}

/// The state of a period whose latest job was `running` when listed: still closing, or
/// abandoned (failed), or finished since.
async fn job_state(pool: &PgPool, period: Period) -> Result<PeriodState, Error> {
    Ok(
        match periods::job(pool, period).await?.map(|job| job.status) {
            Some(JobStatus::Running) => PeriodState::Closing,
            Some(JobStatus::Done) => PeriodState::Closed,
            Some(JobStatus::Failed) => PeriodState::Failed,
            None => PeriodState::Open,
        },
    )
}

/// The month before `period`.
fn previous(period: Period) -> Period {
    Period::containing(period.start() - chrono::Duration::milliseconds(1))
}

/// An imported provider report, as stored.
#[derive(Debug, Clone, FromRow)]
pub struct ReportEntry {
    pub id: Uuid,
    pub sha256: Vec<u8>,
    pub lines: i64,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
    pub imported_at: DateTime<Utc>,
}

/// Where a keyset page starts: after the row with this time and id, in newest-first order.
#[derive(Debug, Clone, Copy)]
pub struct Cursor {
    pub at: DateTime<Utc>,
    pub id: Uuid,
}

/// The cursor of a report, `None` when there is no such report.
pub async fn report_cursor(pool: &PgPool, id: Uuid) -> Result<Option<Cursor>, sqlx::Error> {
    let at: Option<DateTime<Utc>> =
        sqlx::query_scalar("SELECT imported_at FROM provider_report WHERE id = $1")
            .bind(id)
            .fetch_optional(pool)
            .await?;
    Ok(at.map(|at| Cursor { at, id }))
}

/// Up to `limit` reports, newest import first (ties by id, descending), after `after`.
pub async fn reports(
    pool: &PgPool,
    after: Option<Cursor>,
    limit: i64,
) -> Result<Vec<ReportEntry>, sqlx::Error> {
    // Without a cursor the condition is left out, not made always true, so that every
    // page is a plain range scan of the index whatever plan the statement is given.
    let (condition, at, id) = match after {
        Some(cursor) => (
            "(imported_at, id) < ($2, $3)",
            Some(cursor.at),
            Some(cursor.id),
        ),
        None => ("$2::TIMESTAMPTZ IS NULL AND $3::UUID IS NULL", None, None),
    };
    sqlx::query_as(&format!(
        "SELECT id, sha256, lines, window_start, window_end, imported_at FROM provider_report \
         WHERE {condition} ORDER BY imported_at DESC, id DESC LIMIT $1"
    ))
    .bind(limit)
    .bind(at)
    .bind(id)
    .fetch_all(pool)
    .await
}

/// A reconciliation as stored: its parameters, counts and totals.
#[derive(Debug, Clone, FromRow)]
pub struct ReconciliationEntry {
    pub id: Uuid,
    pub report_id: Uuid,
    pub created_at: DateTime<Utc>,
    pub ledger_position: i64,
    pub tolerance_ms: i64,
    pub tolerance_ratio: Decimal,
    pub counts: Value,
    pub totals: Value,
}

impl ReconciliationEntry {
    /// Its lines: the sum of its counts, one per line.
    pub fn lines(&self) -> i64 {
        self.counts
            .as_object()
            .map(|counts| counts.values().filter_map(Value::as_i64).sum())
            .unwrap_or(0)
    }
}

const RECONCILIATION_COLUMNS: &str = "id, report_id, created_at, ledger_position, tolerance_ms, \
     tolerance_ratio, counts, totals";

/// One reconciliation, `None` when there is none with this id.
pub async fn reconciliation(
    pool: &PgPool,
    id: Uuid,
) -> Result<Option<ReconciliationEntry>, sqlx::Error> {
    sqlx::query_as(&format!(
        "SELECT {RECONCILIATION_COLUMNS} FROM reconciliation WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(pool)
    .await
}

/// The cursor of a reconciliation, `None` when there is no such reconciliation in the list
/// (of `report_id`'s reconciliations when given): a page cannot start after another list's row.
pub async fn reconciliation_cursor(
    pool: &PgPool,
    id: Uuid,
    report_id: Option<Uuid>,
) -> Result<Option<Cursor>, sqlx::Error> {
    let at: Option<DateTime<Utc>> = sqlx::query_scalar(
        "SELECT created_at FROM reconciliation \
         WHERE id = $1 AND ($2::UUID IS NULL OR report_id = $2)",
    )
    .bind(id)
    .bind(report_id)
    .fetch_optional(pool)
    .await?;
    Ok(at.map(|at| Cursor { at, id }))
}

/// Up to `limit` reconciliations, newest first (ties by id, descending), after `after`;
/// only `report_id`'s when given.
pub async fn reconciliations(
    pool: &PgPool,
    report_id: Option<Uuid>,
    after: Option<Cursor>,
    limit: i64,
) -> Result<Vec<ReconciliationEntry>, sqlx::Error> {
    // Conditions not asked for are left out of the statement (each bind still used), so
    // that every page is a plain range scan of one index.
    let report_condition = match report_id {
        Some(_) => "report_id = $2",
        None => "$2::UUID IS NULL",
    };
    let cursor_condition = match after {
        Some(_) => "(created_at, id) < ($3, $4)",
        None => "$3::TIMESTAMPTZ IS NULL AND $4::UUID IS NULL",
    };
    sqlx::query_as(&format!(
        "SELECT {RECONCILIATION_COLUMNS} FROM reconciliation \
         WHERE {report_condition} AND {cursor_condition} \
         ORDER BY created_at DESC, id DESC LIMIT $1"
    ))
    .bind(limit)
    .bind(report_id)
    .bind(after.map(|cursor| cursor.at))
    .bind(after.map(|cursor| cursor.id))
    .fetch_all(pool)
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_month_before_january_is_december_of_the_year_before() {
        let period = |name: &str| Period::parse(name).unwrap();
        assert_eq!(previous(period("2026-01")), period("2025-12"));
        assert_eq!(previous(period("2026-03")), period("2026-02"));
    }
}
