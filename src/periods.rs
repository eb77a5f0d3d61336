//! Period close (DESIGN §5): each org's figures for a finished period frozen in a stored,
//! hashed snapshot; never edited. A late event that changes a closed period shows as an
//! adjustment — the difference between the figures now and the snapshot, with the events
//! recorded after the close that caused it — in the next open period's usage export.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use rust_decimal::Decimal;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use crate::exports::{self, Figures, USAGE_CSV_HEADER};
use crate::projection::store::{self, LIVE};
use crate::runtime::Period;

/// Causing events listed per adjustment at most.
const CAUSES_MAX: i64 = 100;

#[derive(Debug, thiserror::Error)]
pub enum CloseError {
    #[error("period {0} is still running until {1}")]
    Running(Period, DateTime<Utc>),
    #[error("period {0} is already closed")]
    AlreadyClosed(Period),
    #[error(transparent)]
    Store(#[from] anyhow::Error),
}

impl From<sqlx::Error> for CloseError {
    fn from(error: sqlx::Error) -> Self {
        CloseError::Store(error.into())
    }
}

/// A closed period as stored, and whether its snapshot still hashes to the stored sha256.
#[derive(Debug, Clone)]
pub struct Closed {
    pub period: Period,
    pub closed_at: DateTime<Utc>,
    pub orgs: i64,
    pub sha256: String,
    pub verified: bool,
}

impl Closed {
    pub fn json(&self) -> Value {
        json!({
            "period": self.period.to_string(),
            "closed_at": crate::event::canonical::timestamp(self.closed_at),
            "orgs": self.orgs,
            "sha256": self.sha256,
            "verified": self.verified,
        })
    }
}

/// The bytes a snapshot's hash covers: the usage export of its rows.
fn snapshot_bytes(rows: &[Figures]) -> String {
    let mut text = format!("{USAGE_CSV_HEADER}\n");
    for row in rows {
        text.push_str(&row.csv());
    }
    text
}

/// Closes `period`: 409-style errors when it is still running or already closed.
pub async fn close(pool: &PgPool, period: Period, actor: &str) -> Result<Closed, CloseError> {
    let now = Utc::now();
    if now < period.end() {
        return Err(CloseError::Running(period, period.end()));
    }
    let mut connection = pool.acquire().await?;
    let position = store::checkpoint(&mut connection, LIVE).await?;
    drop(connection);
    let rows: Vec<Figures> = exports::usage_rows(pool.clone(), period, period.end())
        .try_collect()
        .await?;
    let sha256: [u8; 32] = Sha256::digest(snapshot_bytes(&rows).as_bytes()).into();
    let mut transaction = pool.begin().await?;
    let inserted = sqlx::query(
        "INSERT INTO period_close (period, closed_at, closed_by, ledger_position, orgs, sha256) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (period) DO NOTHING",
    )
    .bind(period.to_string())
    .bind(now)
    .bind(actor)
    .bind(position)
    .bind(rows.len() as i64)
    .bind(&sha256[..])
    .execute(&mut *transaction)
    .await?;
    if inserted.rows_affected() == 0 {
        return Err(CloseError::AlreadyClosed(period));
    }
    for row in &rows {
        sqlx::query(
            "INSERT INTO period_snapshot (period, org_id, plan, runtime_ms, included_ms, overage_ms, \
                 overage_amount, currency, commands, ports_published) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(period.to_string())
        .bind(&row.org_id)
        .bind(&row.plan)
        .bind(row.runtime_ms)
        .bind(row.included_ms)
        .bind(row.overage_ms)
        .bind(row.overage_amount)
        .bind(&row.currency)
        .bind(row.commands)
        .bind(row.ports_published)
        .execute(&mut *transaction)
        .await?;
    }
    transaction.commit().await?;
    Ok(Closed {
        period,
        closed_at: now,
        orgs: rows.len() as i64,
        sha256: hex::encode(sha256),
        verified: true,
    })
}

#[derive(FromRow)]
struct SnapshotRow {
    org_id: String,
    plan: String,
    runtime_ms: i64,
    included_ms: i64,
    overage_ms: i64,
    overage_amount: Decimal,
    currency: String,
    commands: i64,
    ports_published: i64,
}

async fn snapshot(pool: &PgPool, period: Period) -> Result<Vec<Figures>, sqlx::Error> {
    let rows: Vec<SnapshotRow> = sqlx::query_as(
        "SELECT org_id, plan, runtime_ms, included_ms, overage_ms, overage_amount, currency, \
                commands, ports_published \
         FROM period_snapshot WHERE period = $1 ORDER BY org_id",
    )
    .bind(period.to_string())
    .fetch_all(pool)
    .await?;
    Ok(rows
        .into_iter()
        .map(|row| Figures {
            org_id: row.org_id,
            plan: row.plan,
            period,
            runtime_ms: row.runtime_ms,
            included_ms: row.included_ms,
            overage_ms: row.overage_ms,
            overage_amount: row.overage_amount,
            currency: row.currency,
            commands: row.commands,
            ports_published: row.ports_published,
        })
        .collect())
}

/// A closed period, its snapshot re-hashed to verify it; `None` when it is not closed.
pub async fn get(pool: &PgPool, period: Period) -> anyhow::Result<Option<Closed>> {
    let row: Option<(DateTime<Utc>, i64, Vec<u8>)> =
        sqlx::query_as("SELECT closed_at, orgs, sha256 FROM period_close WHERE period = $1")
            .bind(period.to_string())
            .fetch_optional(pool)
            .await?;
    let Some((closed_at, orgs, sha256)) = row else {
        return Ok(None);
    };
    let rows = snapshot(pool, period).await?;
    let recomputed: [u8; 32] = Sha256::digest(snapshot_bytes(&rows).as_bytes()).into();
    Ok(Some(Closed {
        period,
        closed_at,
        orgs,
        sha256: hex::encode(&sha256),
        verified: recomputed[..] == sha256[..] && rows.len() as i64 == orgs,
    }))
}

/// An adjustment: how a closed period's figures for one org differ now from its snapshot,
/// and the events recorded after the close that made the difference.
#[derive(Debug, Clone)]
pub struct Adjustment {
    pub delta: Figures,
    pub caused_by: Vec<Uuid>,
}

impl Adjustment {
    pub fn json(&self) -> Value {
        let mut value = self.delta.json();
        value["caused_by"] = json!(self.caused_by);
        value
    }
}

/// The adjustments that belong in `period`'s export: those of every closed period whose
/// next open period is `period`.
pub async fn adjustments(pool: &PgPool, period: Period) -> anyhow::Result<Vec<Adjustment>> {
    let closed: Vec<(String, i64)> =
        sqlx::query_as("SELECT period, ledger_position FROM period_close ORDER BY period")
            .fetch_all(pool)
            .await?;
    let closed_set: BTreeSet<&str> = closed.iter().map(|(name, _)| name.as_str()).collect();
    let mut adjustments = Vec::new();
    for (name, position) in &closed {
        let affected = Period::parse(name)?;
        let mut next = affected.next();
        while closed_set.contains(next.to_string().as_str()) {
            next = next.next();
        }
        if next != period {
            continue;
        }
        let frozen: BTreeMap<String, Figures> = snapshot(pool, affected)
            .await?
            .into_iter()
            .map(|row| (row.org_id.clone(), row))
            .collect();
        let now: BTreeMap<String, Figures> =
            exports::usage_rows(pool.clone(), affected, affected.end())
                .map_ok(|row| (row.org_id.clone(), row))
                .try_collect()
                .await?;
        let orgs: BTreeSet<&String> = frozen.keys().chain(now.keys()).collect();
        for org in orgs {
            let before = frozen.get(org);
            let after = now.get(org);
            let template = after.or(before).expect("the org is in one of them");
            let empty = Figures::empty(org, affected, &template.plan, &template.currency);
            let delta = after.unwrap_or(&empty).minus(before.unwrap_or(&empty));
            if delta.is_zero() {
                continue;
            }
            let caused_by: Vec<Uuid> = sqlx::query_scalar(
                "SELECT id FROM ledger WHERE org_id = $1 AND position > $2 \
                   AND (occurred_at >= $3 AND occurred_at < $4 OR type = 'ledger.event_voided') \
                 ORDER BY position LIMIT $5",
            )
            .bind(org)
            .bind(position)
            .bind(affected.start())
            .bind(affected.end())
            .bind(CAUSES_MAX)
            .fetch_all(pool)
            .await?;
            adjustments.push(Adjustment { delta, caused_by });
        }
    }
    Ok(adjustments)
}
