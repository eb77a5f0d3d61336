//! Period close (contract §5): each org's figures for a finished period frozen in a stored,
//! hashed snapshot; never edited. A late event that changes a closed period shows as an
//! adjustment — the difference between the figures now and the snapshot, with the events
//! recorded after the close that caused it — in the next open period's usage export.
//!
//! A close of many orgs runs as a job (`period_close_job`): the process that claims the
//! period holds a session advisory lock on it for as long as the close runs, prices the
//! orgs in batches (`pricing`) and writes them inside one repeatable-read transaction
//! that also reads the projection's checkpoint, so the snapshot and its ledger position
//! come from one snapshot and become visible together, with the job's `done`, in one
//! commit. A process that dies mid-close leaves nothing of it but a `running` job whose
//! lock nobody holds, which reads as failed and is retried by the next request.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use chrono::{DateTime, Datelike, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::{Connection, FromRow, PgConnection, PgPool};
use uuid::Uuid;

use super::jobs;
pub use super::jobs::{JobError, JobStatus};
use super::pricing::{self, Figures, Pricer, USAGE_CSV_HEADER};
use super::Error;
use crate::error_code::ErrorCode;
use crate::projection::store::{self, LIVE};
use crate::runtime::Period;

/// Causing events listed per adjustment at most.
const CAUSES_MAX: i64 = 100;

/// Snapshot rows read per statement when a stored snapshot is re-hashed: bounds the memory
/// of verifying a period of any number of orgs.
const SNAPSHOT_READ_ROWS: i64 = 5_000;

/// The first key of the two-key advisory locks that mark a running close (the second is the
/// period as YYYYMM): `'peri'` in ASCII. The one-key locks (ledger, relay, replay) are a
/// different lock space, so they cannot collide.
const CLOSE_LOCK_CLASS: i32 = 0x7065_7269;

/// How many times, [`JOB_VISIBLE_WAIT_MS`] apart, a request that finds the period's lock
/// taken looks for the job of the process holding it: it takes the lock just before it
/// stores its job, so the job shows up within a statement or two.
const JOB_VISIBLE_ATTEMPTS: u32 = 50;
const JOB_VISIBLE_WAIT_MS: u64 = 20;

/// What a failed job tells its caller; the cause is logged with the job id.
const FAILED_CODE: &str = ErrorCode::CloseFailed.as_str();
const FAILED_MESSAGE: &str = "the close failed and nothing of it was stored; retry";
const ABANDONED_CODE: &str = ErrorCode::CloseAbandoned.as_str();
const ABANDONED_MESSAGE: &str =
    "the process running the close stopped before it finished; nothing of it was stored; retry";

#[derive(Debug, thiserror::Error)]
pub enum CloseError {
    #[error("period {0} is still running until {1}")]
    Running(Period, DateTime<Utc>),
    #[error("period {0} is already closed")]
    AlreadyClosed(Period),
    #[error("a close of period {0} is starting; retry")]
    Starting(Period),
    #[error(transparent)]
    Store(#[from] Error),
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
    /// The ledger position the snapshot reflects: the projection's checkpoint, read in the
    /// snapshot's own transaction.
    pub position: i64,
}

impl Closed {
    pub fn json(&self) -> Value {
        json!({
            "period": self.period.to_string(),
            "closed_at": crate::event::canonical::timestamp(self.closed_at),
            "orgs": self.orgs,
            "sha256": self.sha256,
            "verified": self.verified,
            "position": self.position,
        })
    }
}

/// One attempt to close a period; `closed` is the closed period once it is `done`.
#[derive(Debug, Clone)]
pub struct CloseJob {
    pub id: Uuid,
    pub period: Period,
    pub status: JobStatus,
    pub requested_by: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error: Option<JobError>,
    pub closed: Option<Closed>,
}

#[derive(FromRow)]
struct JobRow {
    id: Uuid,
    status: String,
    requested_by: String,
    started_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    error_code: Option<String>,
    error: Option<String>,
}

impl JobRow {
    fn into_job(self, period: Period) -> Result<CloseJob, Error> {
        Ok(CloseJob {
            id: self.id,
            period,
            status: JobStatus::parse(&self.status, "period_close_job")?,
            requested_by: self.requested_by,
            started_at: self.started_at,
            finished_at: self.finished_at,
            error: JobError::stored(self.error_code, self.error),
            closed: None,
        })
    }
}

const JOB_COLUMNS: &str = "id, status, requested_by, started_at, finished_at, error_code, error";

/// The key of the period's close lock: YYYYMM.
fn lock_key(period: Period) -> i32 {
    let start = period.start();
    start.year() * 100 + start.month() as i32
}

/// Some process holds the period's close lock, so a `running` job of it is really running.
async fn lock_held(connection: &mut PgConnection, period: Period) -> sqlx::Result<bool> {
    jobs::lock_held(connection, CLOSE_LOCK_CLASS, lock_key(period)).await
}

async fn latest_job_row(
    connection: &mut PgConnection,
    period: Period,
) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as(&format!(
        "SELECT {JOB_COLUMNS} FROM period_close_job WHERE period = $1 \
         ORDER BY started_at DESC, (status = 'running') DESC LIMIT 1"
    ))
    .bind(period.to_string())
    .fetch_optional(connection)
    .await
}

/// The period's latest close job, as it stands: a `running` job whose lock nobody holds was
/// abandoned by a process that stopped, and is reported failed; a `done` job carries the
/// closed period, verified. `None` when no close was ever asked for.
pub async fn job(pool: &PgPool, period: Period) -> Result<Option<CloseJob>, Error> {
    let mut connection = pool.acquire().await?;
    let Some(mut row) = latest_job_row(&mut connection, period).await? else {
        return Ok(None);
    };
    // The holder takes the lock before it stores the job and lets it go only after it has
    // stored how the job ended, so a job still running after the lock was seen free is one
    // that nobody runs.
    if row.status == "running" && !lock_held(&mut connection, period).await? {
        match latest_job_row(&mut connection, period).await? {
            Some(again) if again.id == row.id && again.status == "running" => {
                row.status = "failed".to_owned();
                row.error_code = Some(ABANDONED_CODE.to_owned());
                row.error = Some(ABANDONED_MESSAGE.to_owned());
            }
            Some(again) => row = again,
            None => {
                return Err(Error::Corrupt(format!(
                    "the close job of {period} disappeared"
                )))
            }
        }
    }
    drop(connection);
    let mut job = row.into_job(period)?;
    if job.status == JobStatus::Done {
        job.closed = get(pool, period).await?;
        if job.closed.is_none() {
            return Err(Error::Corrupt(format!(
                "close job {} is done but period {period} is not closed",
                job.id
            )));
        }
    }
    Ok(Some(job))
}

/// What asking to close a period found.
pub enum Start {
    /// This process now holds the period: run the claim to close it.
    Claimed(Claim),
    /// The period is already closed (a `done` job) or being closed (a `running` one).
    Existing(CloseJob),
}

/// The right to close a period: a session that holds its close lock, and the `running` job
/// stored for it. Dropping it without running it abandons the job.
pub struct Claim {
    connection: PgConnection,
    pub job: CloseJob,
    batch_orgs: i64,
}

/// Asks to close `period` on behalf of `actor`: claims it, or finds the close that exists
/// or runs; an error when the period is still running at `now`. `batch_orgs` bounds the
/// orgs priced and written per statement.
pub async fn start(
    pool: &PgPool,
    period: Period,
    now: DateTime<Utc>,
    actor: &str,
    batch_orgs: i64,
) -> Result<Start, CloseError> {
    assert!(batch_orgs > 0, "a batch holds at least one org");
    if now < period.end() {
        return Err(CloseError::Running(period, period.end()));
    }
    if let Some(job) = job(pool, period).await? {
        if job.status == JobStatus::Done {
            return Ok(Start::Existing(job));
        }
    }
    // The close's own session, outside the pool: it lives as long as the close, and ending
    // it (closed, or cut by a crash) is what lets the lock go.
    let mut connection = pool.acquire().await?.detach();
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
        .bind(CLOSE_LOCK_CLASS)
        .bind(lock_key(period))
        .fetch_one(&mut connection)
        .await?;
    if !locked {
        let _ = connection.close().await;
        for _ in 0..JOB_VISIBLE_ATTEMPTS {
            match job(pool, period).await? {
                Some(job) if job.status != JobStatus::Failed => return Ok(Start::Existing(job)),
                _ => tokio::time::sleep(Duration::from_millis(JOB_VISIBLE_WAIT_MS)).await,
            }
        }
        return Err(CloseError::Starting(period));
    }
    match claim(&mut connection, period, actor).await {
        Ok(Some(job)) => Ok(Start::Claimed(Claim {
            connection,
            job,
            batch_orgs,
        })),
        Ok(None) => {
            let _ = connection.close().await;
            match job(pool, period).await? {
                Some(job) => Ok(Start::Existing(job)),
                None => Err(CloseError::AlreadyClosed(period)),
            }
        }
        Err(error) => {
            let _ = connection.close().await;
            Err(CloseError::Store(error))
        }
    }
}

/// Under the period's lock: the new `running` job, or `None` when the period was closed
/// meanwhile. Jobs left `running` by a process that stopped are marked failed first.
async fn claim(
    connection: &mut PgConnection,
    period: Period,
    actor: &str,
) -> Result<Option<CloseJob>, Error> {
    let closed: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM period_close WHERE period = $1)")
            .bind(period.to_string())
            .fetch_one(&mut *connection)
            .await?;
    if closed {
        return Ok(None);
    }
    let mut transaction = connection.begin().await?;
    sqlx::query(
        "UPDATE period_close_job SET status = 'failed', finished_at = now(), \
             error_code = $2, error = $3 \
         WHERE period = $1 AND status = 'running'",
    )
    .bind(period.to_string())
    .bind(ABANDONED_CODE)
    .bind(ABANDONED_MESSAGE)
    .execute(&mut *transaction)
    .await?;
    let row: JobRow = sqlx::query_as(&format!(
        "INSERT INTO period_close_job (id, period, status, requested_by, started_at) \
         VALUES ($1, $2, 'running', $3, $4) RETURNING {JOB_COLUMNS}"
    ))
    .bind(Uuid::now_v7())
    .bind(period.to_string())
    .bind(actor)
    .bind(Utc::now())
    .fetch_one(&mut *transaction)
    .await?;
    transaction.commit().await?;
    Ok(Some(
        row.into_job(period)
            .map_err(|error| sqlx::Error::Decode(error.into()))?,
    ))
}

impl Claim {
    /// Closes the period, however long it takes, and stores how the job ended; the lock
    /// goes with the session at the end.
    pub async fn run(self) -> Result<Closed, CloseError> {
        let Claim {
            mut connection,
            job,
            batch_orgs,
        } = self;
        let result = close(&mut connection, &job, batch_orgs).await;
        if let Err(error) = &result {
            tracing::error!(
                job_id = %job.id,
                period = %job.period,
                error = format!("{error:#}"),
                "period close failed"
            );
            let failed = JobError {
                code: FAILED_CODE.to_owned(),
                message: FAILED_MESSAGE.to_owned(),
            };
            jobs::mark_failed(&mut connection, "period_close_job", job.id, &failed).await;
        }
        let _ = connection.close().await;
        result
    }
}

/// The close itself, in one repeatable-read transaction: the checkpoint, every org's
/// figures streamed in batches of `batch_orgs` (priced, written, hashed), the period's row
/// and the job's `done`, committed together.
async fn close(
    connection: &mut PgConnection,
    job: &CloseJob,
    batch_orgs: i64,
) -> Result<Closed, CloseError> {
    let period = job.period;
    let mut transaction = connection.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *transaction)
        .await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let mut hasher = Sha256::new();
    hasher.update(format!("{USAGE_CSV_HEADER}\n").as_bytes());
    let mut pricer = Pricer::new(period, period.end());
    let mut orgs_total: i64 = 0;
    let mut after = String::new();
    loop {
        let orgs = pricing::orgs_after(&mut transaction, period, &after, batch_orgs).await?;
        let Some(last) = orgs.last() else { break };
        after.clone_from(last);
        let rows = pricer.price(&mut transaction, &orgs).await?;
        for row in &rows {
            hasher.update(row.csv().as_bytes());
        }
        insert_snapshot_rows(&mut transaction, period, &rows).await?;
        orgs_total += rows.len() as i64;
        if (orgs.len() as i64) < batch_orgs {
            break;
        }
    }
    let sha256: [u8; 32] = hasher.finalize().into();
    let closed_at = Utc::now();
    let inserted = sqlx::query(
        "INSERT INTO period_close (period, closed_at, closed_by, ledger_position, orgs, sha256) \
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (period) DO NOTHING",
    )
    .bind(period.to_string())
    .bind(closed_at)
    .bind(&job.requested_by)
    .bind(position)
    .bind(orgs_total)
    .bind(&sha256[..])
    .execute(&mut *transaction)
    .await?;
    if inserted.rows_affected() == 0 {
        return Err(CloseError::AlreadyClosed(period));
    }
    sqlx::query(
        "UPDATE period_close_job SET status = 'done', finished_at = $2 \
         WHERE id = $1 AND status = 'running'",
    )
    .bind(job.id)
    .bind(closed_at)
    .execute(&mut *transaction)
    .await?;
    transaction.commit().await?;
    Ok(Closed {
        period,
        closed_at,
        orgs: orgs_total,
        sha256: hex::encode(sha256),
        verified: true,
        position,
    })
}

/// One batch of snapshot rows in one statement.
async fn insert_snapshot_rows(
    connection: &mut PgConnection,
    period: Period,
    rows: &[Figures],
) -> sqlx::Result<()> {
    let column = |value: fn(&Figures) -> i64| rows.iter().map(value).collect::<Vec<i64>>();
    let text = |value: fn(&Figures) -> &str| {
        rows.iter()
            .map(|row| value(row).to_owned())
            .collect::<Vec<String>>()
    };
    sqlx::query(
        "INSERT INTO period_snapshot (period, org_id, plan, runtime_ms, included_ms, \
             overage_ms, overage_amount, currency, commands, ports_published) \
         SELECT $1, * FROM unnest($2::TEXT[], $3::TEXT[], $4::BIGINT[], $5::BIGINT[], \
             $6::BIGINT[], $7::NUMERIC[], $8::TEXT[], $9::BIGINT[], $10::BIGINT[])",
    )
    .bind(period.to_string())
    .bind(text(|row| &row.org_id))
    .bind(text(|row| &row.plan))
    .bind(column(|row| row.runtime_ms))
    .bind(column(|row| row.included_ms))
    .bind(column(|row| row.overage_ms))
    .bind(
        rows.iter()
            .map(|row| row.overage_amount)
            .collect::<Vec<Decimal>>(),
    )
    .bind(text(|row| &row.currency))
    .bind(column(|row| row.commands))
    .bind(column(|row| row.ports_published))
    .execute(connection)
    .await?;
    Ok(())
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

impl SnapshotRow {
    fn figures(self, period: Period) -> Figures {
        Figures {
            org_id: self.org_id,
            plan: self.plan,
            period,
            runtime_ms: self.runtime_ms,
            included_ms: self.included_ms,
            overage_ms: self.overage_ms,
            overage_amount: self.overage_amount,
            currency: self.currency,
            commands: self.commands,
            ports_published: self.ports_published,
        }
    }
}

const SNAPSHOT_COLUMNS: &str = "org_id, plan, runtime_ms, included_ms, overage_ms, \
     overage_amount, currency, commands, ports_published";

/// A closed period, its snapshot re-hashed (in batches, in org order) to verify it; `None`
/// when it is not closed.
pub async fn get(pool: &PgPool, period: Period) -> Result<Option<Closed>, Error> {
    let mut connection = pool.acquire().await?;
    let row: Option<(DateTime<Utc>, i64, Vec<u8>, i64)> = sqlx::query_as(
        "SELECT closed_at, orgs, sha256, ledger_position FROM period_close WHERE period = $1",
    )
    .bind(period.to_string())
    .fetch_optional(&mut *connection)
    .await?;
    let Some((closed_at, orgs, sha256, position)) = row else {
        return Ok(None);
    };
    let mut hasher = Sha256::new();
    hasher.update(format!("{USAGE_CSV_HEADER}\n").as_bytes());
    let mut rows_total: i64 = 0;
    let mut after = String::new();
    loop {
        let rows =
            snapshot_after(&mut connection, period, &after, SNAPSHOT_READ_ROWS, None).await?;
        let Some(last) = rows.last() else { break };
        after.clone_from(&last.org_id);
        let count = rows.len() as i64;
        rows_total += count;
        for row in rows {
            hasher.update(row.csv().as_bytes());
        }
        if count < SNAPSHOT_READ_ROWS {
            break;
        }
    }
    let recomputed: [u8; 32] = hasher.finalize().into();
    Ok(Some(Closed {
        period,
        closed_at,
        orgs,
        sha256: hex::encode(&sha256),
        verified: recomputed[..] == sha256[..] && rows_total == orgs,
        position,
    }))
}

/// The ledger position closed period `period` was closed at; `None` when it is not closed.
pub async fn close_position<'c>(
    executor: impl sqlx::PgExecutor<'c>,
    period: Period,
) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar("SELECT ledger_position FROM period_close WHERE period = $1")
        .bind(period.to_string())
        .fetch_optional(executor)
        .await
}

/// One page of closed period `period`'s snapshot: the rows of the orgs after `after`, at
/// most `limit`, in org order; with `only_org`, that org's alone.
pub async fn snapshot_after(
    connection: &mut PgConnection,
    period: Period,
    after: &str,
    limit: i64,
    only_org: Option<&str>,
) -> sqlx::Result<Vec<Figures>> {
    Ok(sqlx::query_as::<_, SnapshotRow>(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM period_snapshot \
         WHERE period = $1 AND org_id > $2 AND ($4::text IS NULL OR org_id = $4) \
         ORDER BY org_id LIMIT $3"
    ))
    .bind(period.to_string())
    .bind(after)
    .bind(limit)
    .bind(only_org)
    .fetch_all(connection)
    .await?
    .into_iter()
    .map(|row| row.figures(period))
    .collect())
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

/// The closed periods whose adjustments belong in `period`'s export (those whose next open
/// period is `period`), in period order, each with the ledger position it was closed at.
pub async fn closed_into(
    connection: &mut PgConnection,
    period: Period,
) -> Result<Vec<(Period, i64)>, Error> {
    let closed: Vec<(String, i64)> =
        sqlx::query_as("SELECT period, ledger_position FROM period_close ORDER BY period")
            .fetch_all(&mut *connection)
            .await?;
    let closed_set: BTreeSet<&str> = closed.iter().map(|(name, _)| name.as_str()).collect();
    let mut into = Vec::new();
    for (name, position) in &closed {
        let affected = Period::parse_stored(name)
            .map_err(|e| Error::Corrupt(format!("period {name:?}: {e}")))?;
        let mut next = affected.next();
        while closed_set.contains(next.to_string().as_str()) {
            next = next.next();
        }
        if next == period {
            into.push((affected, *position));
        }
    }
    Ok(into)
}

/// The snapshot rows of `orgs` in closed period `affected`, by org.
async fn frozen(
    connection: &mut PgConnection,
    affected: Period,
    orgs: &[String],
) -> sqlx::Result<HashMap<String, Figures>> {
    Ok(sqlx::query_as::<_, SnapshotRow>(&format!(
        "SELECT {SNAPSHOT_COLUMNS} FROM period_snapshot WHERE period = $1 AND org_id = ANY($2)"
    ))
    .bind(affected.to_string())
    .bind(orgs)
    .fetch_all(connection)
    .await?
    .into_iter()
    .map(|row| (row.org_id.clone(), row.figures(affected)))
    .collect())
}

/// The events of `org` recorded after the close at `position` that may have changed its
/// figures in `affected`: dated in it; a start, stop or account change dated before it,
/// which can reach into it (a container running on, the plan in effect); or voids. At most
/// [`CAUSES_MAX`], in position order.
async fn causes(
    connection: &mut PgConnection,
    org: &str,
    affected: Period,
    position: i64,
) -> sqlx::Result<Vec<Uuid>> {
    sqlx::query_scalar(
        "SELECT id FROM ledger WHERE org_id = $1 AND position > $2 \
           AND (occurred_at >= $3 AND occurred_at < $4 \
                OR occurred_at < $3 AND type IN ('container.created', 'container.resumed', \
                    'container.stopped', 'org.plan_changed', 'org.verification_changed', \
                    'org.billing_eligibility_changed') \
                OR type = 'ledger.event_voided') \
         ORDER BY position LIMIT $5",
    )
    .bind(org)
    .bind(position)
    .bind(affected.start())
    .bind(affected.end())
    .bind(CAUSES_MAX)
    .fetch_all(connection)
    .await
}

/// One batch of a closed period's adjustments (the period is the pricer's, closed at
/// ledger `position`): the orgs after `after` that are in its snapshot or have usage in it
/// now, at most `limit`, compared; with `only_org`, that org alone. Also the org to
/// continue after, `None` when done.
pub async fn adjustments_after(
    connection: &mut PgConnection,
    pricer: &mut Pricer,
    position: i64,
    after: &str,
    limit: i64,
    only_org: Option<&str>,
) -> Result<(Vec<Adjustment>, Option<String>), Error> {
    let affected = pricer.period();
    // `active`: has usage in the period now, as the export lists orgs. Each branch is
    // limited on its own, as in `pricing::orgs_after`.
    let orgs: Vec<(String, bool)> = sqlx::query_as(&format!(
        "SELECT org_id, bool_or(active) FROM ( \
             (SELECT org_id, false AS active FROM period_snapshot \
              WHERE period = $1 AND org_id > $2 AND ($4::text IS NULL OR org_id = $4) \
              ORDER BY org_id LIMIT $3) \
             UNION ALL (SELECT org_id, true FROM {LIVE}.org_period \
                        WHERE period = $1 AND org_id > $2 AND ($4::text IS NULL OR org_id = $4) \
                        ORDER BY org_id LIMIT $3) \
             UNION ALL (SELECT org_id, true FROM {LIVE}.org_open \
                        WHERE running > 0 AND since_period <= $1 AND org_id > $2 \
                        AND ($4::text IS NULL OR org_id = $4) ORDER BY org_id LIMIT $3) \
         ) AS orgs GROUP BY org_id ORDER BY org_id LIMIT $3"
    ))
    .bind(affected.to_string())
    .bind(after)
    .bind(limit)
    .bind(only_org)
    .fetch_all(&mut *connection)
    .await?;
    let next = match orgs.last() {
        Some((last, _)) if orgs.len() as i64 == limit => Some(last.clone()),
        _ => None,
    };
    let names: Vec<String> = orgs.iter().map(|(org, _)| org.clone()).collect();
    let frozen = frozen(&mut *connection, affected, &names).await?;
    let active: Vec<String> = orgs
        .iter()
        .filter(|(_, active)| *active)
        .map(|(org, _)| org.clone())
        .collect();
    let now: HashMap<String, Figures> = pricer
        .price(&mut *connection, &active)
        .await?
        .into_iter()
        .map(|row| (row.org_id.clone(), row))
        .collect();
    let mut adjustments = Vec::new();
    for org in &names {
        let before = frozen.get(org);
        let after = now.get(org);
        let template = after.or(before).expect("the org is in one of them");
        let empty = Figures::empty(org, affected, &template.plan, &template.currency);
        let delta = after.unwrap_or(&empty).minus(before.unwrap_or(&empty));
        if delta.is_zero() {
            continue;
        }
        let caused_by = causes(&mut *connection, org, affected, position).await?;
        adjustments.push(Adjustment { delta, caused_by });
    }
    Ok((adjustments, next))
}
