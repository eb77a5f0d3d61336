//! Running a reconciliation (contract §5): every line of a stored report against the
//! projection's container lifecycles, then the containers the report does not mention;
//! results, counts and money totals stored together in one transaction.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::str::FromStr;

use chrono::{DateTime, SubsecRound, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use sqlx::{Connection, FromRow, PgConnection, PgPool};
use uuid::Uuid;

use super::jobs::{self, JobError, JobStatus};
use crate::billing::overage::{minor_unit_digits, round_amount};
use crate::billing::reconcile::{
    self, Compared, LedgerContainer, Reconciled, ReportLine, Status, Tolerance,
};
use crate::error_code::ErrorCode;
use crate::projection::store::{self, StoredContainer, LIVE};
use crate::runtime::Window;

/// Report lines read and reconciled per round.
const LINES_PER_ROUND: i64 = 5_000;

#[derive(Debug, Clone)]
pub struct Summary {
    pub id: Uuid,
    pub counts: Value,
    pub totals: Value,
    /// The ledger position the figures reflect (stored as `ledger_position`): the
    /// projection's checkpoint, read in the snapshot every line was reconciled in.
    pub position: i64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("no report {0}")]
    UnknownReport(Uuid),
    /// A line's figures, or their sum up to that line, are past what `Decimal` holds.
    #[error(transparent)]
    OutOfRange(#[from] reconcile::OutOfRange),
    #[error(transparent)]
    Store(#[from] super::Error),
}

impl From<sqlx::Error> for ReconcileError {
    fn from(error: sqlx::Error) -> Self {
        ReconcileError::Store(error.into())
    }
}

impl From<crate::projection::Error> for ReconcileError {
    fn from(error: crate::projection::Error) -> Self {
        ReconcileError::Store(error.into())
    }
}

#[derive(FromRow)]
struct LineRow {
    line: i64,
    charge_period_start: DateTime<Utc>,
    charge_period_end: DateTime<Utc>,
    charge_category: String,
    charge_class: Option<String>,
    resource_id: Option<String>,
    org_id: Option<String>,
    consumed_quantity: Option<Decimal>,
    consumed_unit: Option<String>,
    /// As text: a `NUMERIC` zero read as a `Decimal` loses its scale.
    billed_cost: String,
    billing_currency: String,
}

impl LineRow {
    fn report_line(self) -> ReportLine {
        ReportLine {
            charge_period: Window::new(self.charge_period_start, self.charge_period_end),
            charge_category: self.charge_category,
            charge_class: self.charge_class,
            resource_id: self.resource_id,
            org_id: self.org_id,
            quantity: self.consumed_quantity,
            unit: self.consumed_unit,
            billed_cost: Decimal::from_str(&self.billed_cost)
                .expect("a stored NUMERIC is a decimal"),
            currency: self.billing_currency,
        }
    }
}

/// The money of a set of lines, summed exactly (at the report's precision); rounded only
/// when shown.
#[derive(Default)]
struct Tally {
    count: u64,
    provider_cost: Decimal,
    /// `None` while no line of the set was compared (`not_runtime` lines carry no
    /// expectation).
    expected_cost: Option<Decimal>,
    cost_delta: Option<Decimal>,
}

impl Tally {
    /// `None`, leaving the tally part-added, when a sum would be past what `Decimal` holds.
    fn add(&mut self, line: &Reconciled) -> Option<()> {
        self.count += 1;
        self.provider_cost = reconcile::exact_sum(self.provider_cost, line.provider_cost)?;
        if let Some(compared) = &line.compared {
            let expected = self.expected_cost.get_or_insert(Decimal::ZERO);
            *expected = reconcile::exact_sum(*expected, compared.expected_cost)?;
            let delta = self.cost_delta.get_or_insert(Decimal::ZERO);
            *delta = reconcile::exact_sum(*delta, compared.cost_delta)?;
        }
        Some(())
    }

    /// Each figure rounded once to the currency's minor unit, and exactly as summed. A zero
    /// is written without a sign, however it was reached (`-0.00` from a report's own).
    fn json(&self, currency: &str) -> Value {
        let unsigned = |mut amount: Decimal| {
            if amount.is_zero() {
                amount.set_sign_positive(true);
            }
            amount
        };
        let rounded = |amount: Option<Decimal>| {
            amount.map(|amount| {
                let mut rounded = unsigned(round_amount(amount, currency));
                rounded.rescale(minor_unit_digits(currency));
                rounded.to_string()
            })
        };
        let exact = |amount: Option<Decimal>| amount.map(|amount| unsigned(amount).to_string());
        json!({
            "lines": self.count,
            "provider_cost": rounded(Some(self.provider_cost)),
            "expected_cost": rounded(self.expected_cost),
            "cost_delta": rounded(self.cost_delta),
            "provider_cost_exact": exact(Some(self.provider_cost)),
            "expected_cost_exact": exact(self.expected_cost),
            "cost_delta_exact": exact(self.cost_delta),
        })
    }
}

/// The tallies of one currency: overall, by status and by org.
#[derive(Default)]
struct CurrencyTally {
    total: Tally,
    by_status: BTreeMap<&'static str, Tally>,
    by_org: BTreeMap<String, Tally>,
}

/// How totals are rounded, named in every summary.
pub const ROUNDING: &str = "half_away_from_zero_to_minor_unit_once_per_total";

/// What a reconciliation is asked for: which report, with what tolerance, by whom.
#[derive(Debug, Clone)]
pub struct Asked {
    pub report_id: Uuid,
    pub tolerance: Tolerance,
    pub actor: String,
}

/// Reconciles report `report_id` with `tolerance`, counting ledger runtime up to `now`, in
/// the caller's time (the command line's; the service runs a [`Claim`]).
pub async fn run(
    pool: &PgPool,
    asked: &Asked,
    now: DateTime<Utc>,
) -> Result<Summary, ReconcileError> {
    let window = report_window(pool, asked.report_id).await?;
    let mut connection = pool.acquire().await?;
    reconcile(&mut connection, (Uuid::now_v7(), asked, window), now, false).await
}

/// The report's window; [`ReconcileError::UnknownReport`] when no such report is stored.
pub async fn report_window(pool: &PgPool, report_id: Uuid) -> Result<Window, ReconcileError> {
    let window: Option<(DateTime<Utc>, DateTime<Utc>)> =
        sqlx::query_as("SELECT window_start, window_end FROM provider_report WHERE id = $1")
            .bind(report_id)
            .fetch_optional(pool)
            .await?;
    let (start, end) = window.ok_or(ReconcileError::UnknownReport(report_id))?;
    Ok(Window::new(start, end))
}

/// Reconciliation `id` of what was `asked` over the report's `window`, in one
/// repeatable-read transaction on `connection`, stored with its lines, counts and totals;
/// with `job`, its job is marked `done` in the same commit.
async fn reconcile(
    connection: &mut PgConnection,
    (id, asked, window): (Uuid, &Asked, Window),
    now: DateTime<Utc>,
    job: bool,
) -> Result<Summary, ReconcileError> {
    let as_of = now.trunc_subsecs(3);
    let mut transaction = connection.begin().await?;
    // One snapshot for every read: the ledger figures all come from one checkpoint, read
    // first, so that it is the position of the snapshot.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *transaction)
        .await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let mut progress = Progress::new(id);
    let tolerance = asked.tolerance;
    reconcile_lines(
        &mut transaction,
        asked.report_id,
        tolerance,
        as_of,
        &mut progress,
    )
    .await?;
    let missing =
        missing_in_provider(&mut transaction, window, tolerance, as_of, &progress).await?;
    progress.record(&mut transaction, &missing).await?;
    let (counts, totals) = (progress.counts(), progress.totals());
    sqlx::query(
        "INSERT INTO reconciliation (id, report_id, tolerance_ms, tolerance_ratio, as_of, \
             ledger_position, counts, totals, created_at, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now(), $9)",
    )
    .bind(id)
    .bind(asked.report_id)
    .bind(tolerance.min_ms)
    .bind(tolerance.ratio)
    .bind(as_of)
    .bind(position)
    .bind(&counts)
    .bind(&totals)
    .bind(&asked.actor)
    .execute(&mut *transaction)
    .await?;
    if job {
        sqlx::query(
            "UPDATE reconciliation_job SET status = 'done', finished_at = now() WHERE id = $1",
        )
        .bind(id)
        .execute(&mut *transaction)
        .await?;
    }
    transaction.commit().await?;
    Ok(Summary {
        id,
        counts,
        totals,
        position,
    })
}

/// What a caller is told of a report whose amounts cannot be reconciled.
pub fn out_of_range_refusal(out_of_range: &reconcile::OutOfRange) -> String {
    format!("{out_of_range}: the amounts cannot be reconciled; nothing was stored")
}

/// The first key of the two-key advisory locks that mark a running reconciliation (the
/// second comes from its id): `'reco'` in ASCII, beside the period close's `'peri'`.
const JOB_LOCK_CLASS: i32 = 0x7265_636f;

/// The longest a statement of a reconciliation job may take (its session's
/// `statement_timeout`, in place of `TALLY_DB_STATEMENT_TIMEOUT_MS`).
pub const JOB_STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// How many ids a claim tries before it gives up: an id whose lock key another running
/// reconciliation holds (one chance in 2^32 each) is replaced by a new one.
const CLAIM_ATTEMPTS: usize = 8;

const FAILED_MESSAGE: &str = "the reconciliation failed and nothing of it was stored; retry";
const ABANDONED_MESSAGE: &str = "the process running the reconciliation stopped before it \
     finished; nothing of it was stored; retry";

/// One reconciliation asked of the service: `running`, then `done` (stored under the same
/// id) or `failed` (nothing stored).
#[derive(Debug, Clone)]
pub struct Job {
    pub id: Uuid,
    pub report_id: Uuid,
    pub tolerance: Tolerance,
    pub status: JobStatus,
    pub requested_by: String,
    pub started_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    pub error: Option<JobError>,
}

#[derive(FromRow)]
struct JobRow {
    id: Uuid,
    report_id: Uuid,
    tolerance_ms: i64,
    tolerance_ratio: Decimal,
    status: String,
    requested_by: String,
    started_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    error_code: Option<String>,
    error: Option<String>,
}

const JOB_COLUMNS: &str = "id, report_id, tolerance_ms, tolerance_ratio, status, requested_by, \
     started_at, finished_at, error_code, error";

impl JobRow {
    fn into_job(self) -> Result<Job, super::Error> {
        Ok(Job {
            id: self.id,
            report_id: self.report_id,
            tolerance: Tolerance {
                min_ms: self.tolerance_ms,
                ratio: self.tolerance_ratio,
            },
            status: JobStatus::parse(&self.status, "reconciliation_job")?,
            requested_by: self.requested_by,
            started_at: self.started_at,
            finished_at: self.finished_at,
            error: JobError::stored(self.error_code, self.error),
        })
    }
}

/// The second key of a job's lock: the low half of its id, the random part of a v7 UUID.
fn lock_key(id: Uuid) -> i32 {
    id.as_u64_pair().1 as u32 as i32
}

async fn job_row(connection: &mut PgConnection, id: Uuid) -> sqlx::Result<Option<JobRow>> {
    sqlx::query_as(&format!(
        "SELECT {JOB_COLUMNS} FROM reconciliation_job WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(connection)
    .await
}

/// The job `id` as it stands: a `running` job whose lock nobody holds was abandoned by a
/// process that stopped, and is reported failed. `None` when no such job was asked for
/// (reconciliations of the command line have none).
pub async fn job(pool: &PgPool, id: Uuid) -> Result<Option<Job>, super::Error> {
    let mut connection = pool.acquire().await?;
    let Some(mut row) = job_row(&mut connection, id).await? else {
        return Ok(None);
    };
    // The runner takes the lock before it stores the job and lets it go only after it has
    // stored how the job ended, so a job still running after the lock was seen free is one
    // that nobody runs.
    if row.status == "running"
        && !jobs::lock_held(&mut connection, JOB_LOCK_CLASS, lock_key(id)).await?
    {
        row = job_row(&mut connection, id)
            .await?
            .ok_or_else(|| super::Error::Corrupt(format!("reconciliation job {id} disappeared")))?;
        if row.status == "running" {
            row.status = "failed".to_owned();
            row.error_code = Some(ErrorCode::ReconciliationAbandoned.as_str().to_owned());
            row.error = Some(ABANDONED_MESSAGE.to_owned());
        }
    }
    row.into_job().map(Some)
}

/// The right to run a reconciliation: a session, outside the pool, that holds the job's
/// lock, and the `running` job stored for it. Dropping it without running it abandons the
/// job.
pub struct Claim {
    connection: PgConnection,
    job: Job,
    asked: Asked,
    window: Window,
}

/// Stores a `running` job for what was `asked` of the report whose window
/// ([`report_window`]) is `window`, and claims it.
pub async fn claim(pool: &PgPool, asked: Asked, window: Window) -> Result<Claim, ReconcileError> {
    // The job's own session: it lives as long as the run, and ending it (closed, or cut by
    // a crash) is what lets the lock go.
    let mut connection = pool.acquire().await?.detach();
    let claimed = claim_on(&mut connection, &asked).await;
    match claimed {
        Ok(job) => Ok(Claim {
            connection,
            job,
            asked,
            window,
        }),
        Err(error) => {
            let _ = connection.close().await;
            Err(error)
        }
    }
}

async fn claim_on(connection: &mut PgConnection, asked: &Asked) -> Result<Job, ReconcileError> {
    // The session's own bound on a statement, in place of the pool's: the commit of a
    // million lines checks each line's reference to its reconciliation.
    sqlx::query(&format!(
        "SET statement_timeout = {}",
        JOB_STATEMENT_TIMEOUT.as_millis()
    ))
    .execute(&mut *connection)
    .await?;
    for _ in 0..CLAIM_ATTEMPTS {
        let id = Uuid::now_v7();
        let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1, $2)")
            .bind(JOB_LOCK_CLASS)
            .bind(lock_key(id))
            .fetch_one(&mut *connection)
            .await?;
        if !locked {
            continue;
        }
        let row: JobRow = sqlx::query_as(&format!(
            "INSERT INTO reconciliation_job (id, report_id, tolerance_ms, tolerance_ratio, \
                 status, requested_by, started_at) \
             VALUES ($1, $2, $3, $4, 'running', $5, now()) RETURNING {JOB_COLUMNS}"
        ))
        .bind(id)
        .bind(asked.report_id)
        .bind(asked.tolerance.min_ms)
        .bind(asked.tolerance.ratio)
        .bind(&asked.actor)
        .fetch_one(&mut *connection)
        .await?;
        return Ok(row.into_job()?);
    }
    Err(ReconcileError::Store(super::Error::Corrupt(format!(
        "{CLAIM_ATTEMPTS} new reconciliation ids in a row had their lock taken"
    ))))
}

impl Claim {
    pub fn job(&self) -> &Job {
        &self.job
    }

    /// Runs the reconciliation, however long it takes, counting ledger runtime up to
    /// `now`, and stores how the job ended; the lock goes with the session at the end.
    pub async fn run(self, now: DateTime<Utc>) -> Result<Summary, ReconcileError> {
        let Claim {
            mut connection,
            job,
            asked,
            window,
        } = self;
        let result = reconcile(&mut connection, (job.id, &asked, window), now, true).await;
        if let Err(error) = &result {
            let (code, message) = match error {
                ReconcileError::UnknownReport(id) => {
                    (ErrorCode::ReportNotFound, format!("no report {id}"))
                }
                ReconcileError::OutOfRange(out_of_range) => (
                    ErrorCode::AmountsOutOfRange,
                    out_of_range_refusal(out_of_range),
                ),
                ReconcileError::Store(_) => {
                    (ErrorCode::ReconciliationFailed, FAILED_MESSAGE.to_owned())
                }
            };
            if matches!(error, ReconcileError::Store(_)) {
                tracing::error!(job_id = %job.id, error = format!("{error:#}"), "reconciliation failed");
            }
            let failed = JobError {
                code: code.as_str().to_owned(),
                message,
            };
            jobs::mark_failed(&mut connection, "reconciliation_job", job.id, &failed).await;
        }
        let _ = connection.close().await;
        result
    }
}

/// What a run has gathered: the lines stored so far, their tallies per currency, the
/// ledger's containers the report's runtime lines were compared with and the report's
/// currency.
struct Progress {
    id: Uuid,
    seq: i64,
    counts: BTreeMap<Status, u64>,
    currencies: BTreeMap<String, CurrencyTally>,
    /// What runtime lines claimed of the ledger's containers they were compared with.
    claims: reconcile::Claims,
    /// The first line's currency: `missing_in_provider` lines, which carry no money, are
    /// listed in it.
    currency: Option<String>,
}

impl Progress {
    fn new(id: Uuid) -> Progress {
        Progress {
            id,
            seq: 0,
            counts: BTreeMap::new(),
            currencies: BTreeMap::new(),
            claims: reconcile::Claims::default(),
            currency: None,
        }
    }

    /// Tallies `lines` and stores them after those stored before.
    async fn record(
        &mut self,
        transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        lines: &[Reconciled],
    ) -> Result<(), ReconcileError> {
        for line in lines {
            *self.counts.entry(line.status).or_default() += 1;
            let tally = self.currencies.entry(line.currency.clone()).or_default();
            // (A `missing_in_provider` line has no report line, and no money to overflow.)
            let out_of_range = reconcile::OutOfRange {
                line: line.report_line.unwrap_or(0),
            };
            let org = line.org_id.clone().unwrap_or_default();
            let by_status = tally.by_status.entry(line.status.as_str()).or_default();
            by_status.add(line).ok_or(out_of_range)?;
            tally
                .by_org
                .entry(org)
                .or_default()
                .add(line)
                .ok_or(out_of_range)?;
            tally.total.add(line).ok_or(out_of_range)?;
        }
        Ok(insert(transaction, self.id, &mut self.seq, lines).await?)
    }

    /// The number of lines of every status, zeros included.
    fn counts(&self) -> Value {
        Status::ALL
            .iter()
            .map(|status| {
                let count = self.counts.get(status).copied().unwrap_or(0);
                (status.as_str().to_owned(), json!(count))
            })
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// Money per currency, overall, by status and by org: each figure exact and rounded
    /// once to the currency's minor unit.
    fn totals(&self) -> Value {
        let currencies: serde_json::Map<_, _> = self
            .currencies
            .iter()
            .map(|(currency, tally)| {
                let by_status: serde_json::Map<_, _> = tally
                    .by_status
                    .iter()
                    .map(|(status, tally)| ((*status).to_owned(), tally.json(currency)))
                    .collect();
                let by_org: serde_json::Map<_, _> = tally
                    .by_org
                    .iter()
                    .map(|(org, tally)| (org.clone(), tally.json(currency)))
                    .collect();
                let figures = json!({
                    "minor_unit_digits": minor_unit_digits(currency),
                    "total": tally.total.json(currency),
                    "by_status": by_status,
                    "by_org": by_org,
                });
                (currency.clone(), figures)
            })
            .collect();
        json!({"rounding": ROUNDING, "currencies": currencies})
    }
}

/// Every line of the report, a round of [`LINES_PER_ROUND`] at a time, against the
/// lifecycles of the containers its runtime lines name.
async fn reconcile_lines(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    report_id: Uuid,
    tolerance: Tolerance,
    as_of: DateTime<Utc>,
    progress: &mut Progress,
) -> Result<(), ReconcileError> {
    let mut after = 0i64;
    loop {
        // A line stored without a category predates its requirement: it is container
        // runtime (see the migration that made the other columns optional).
        let rows: Vec<LineRow> = sqlx::query_as(
            "SELECT line, charge_period_start, charge_period_end, \
                    COALESCE(charge_category, 'Usage') AS charge_category, charge_class, \
                    resource_id, org_id, consumed_quantity, consumed_unit, billed_cost::TEXT, \
                    billing_currency \
             FROM provider_report_line WHERE report_id = $1 AND line > $2 ORDER BY line LIMIT $3",
        )
        .bind(report_id)
        .bind(after)
        .bind(LINES_PER_ROUND)
        .fetch_all(&mut **transaction)
        .await?;
        let Some(last) = rows.last() else {
            return Ok(());
        };
        after = last.line;
        let lines: Vec<(i64, ReportLine)> = rows
            .into_iter()
            .map(|row| (row.line, row.report_line()))
            .collect();
        let ids: Vec<&str> = lines
            .iter()
            .filter_map(|(_, line)| line.runtime().map(|(id, _)| id))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let mut known: HashMap<String, Vec<StoredContainer>> = HashMap::new();
        for stored in store::containers_by_ids(transaction, &ids).await? {
            known
                .entry(stored.container_id.clone())
                .or_default()
                .push(stored);
        }
        let results = reconcile_round(&lines, &known, tolerance, as_of, progress)?;
        progress.record(transaction, &results).await?;
    }
}

/// One round's lines against the ledger's containers they name (`known`), noting the
/// containers they were compared with and the report's first currency.
fn reconcile_round(
    lines: &[(i64, ReportLine)],
    known: &HashMap<String, Vec<StoredContainer>>,
    tolerance: Tolerance,
    as_of: DateTime<Utc>,
    progress: &mut Progress,
) -> Result<Vec<Reconciled>, reconcile::OutOfRange> {
    let mut results = Vec::with_capacity(lines.len());
    for (number, line) in lines {
        let container = line.runtime().map(|(id, _)| id);
        let ledger: Vec<LedgerContainer> = container
            .and_then(|id| known.get(id))
            .map(|stored| {
                stored
                    .iter()
                    .map(|stored| LedgerContainer {
                        org_id: &stored.org_id,
                        lifecycle: &stored.lifecycle,
                    })
                    .collect()
            })
            .unwrap_or_default();
        if progress.currency.is_none() {
            progress.currency = Some(line.currency.clone());
        }
        let reconciled = reconcile::reconcile_line(
            *number,
            line,
            &ledger,
            (tolerance, as_of),
            &progress.claims,
        )?;
        // The line claims its charge period of the container it names, not of every org's
        // container of that id: another org's is still missing from the report.
        if let (Some(id), Some(named)) = (container, reconcile::container_named(line, &ledger)) {
            progress.claims.claim(named.org_id, id, line.charge_period);
        }
        results.push(reconciled);
    }
    Ok(results)
}

/// One `missing_in_provider` line for each container that ran in the report's window
/// above the tolerance and that the report does not mention, in (org, container) order.
async fn missing_in_provider(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    window: Window,
    tolerance: Tolerance,
    as_of: DateTime<Utc>,
    progress: &Progress,
) -> Result<Vec<Reconciled>, ReconcileError> {
    let mut missing = Vec::new();
    for stored in store::containers_running_since(transaction, window.start()).await? {
        if progress
            .claims
            .mentions(&stored.org_id, &stored.container_id)
        {
            continue;
        }
        missing.extend(reconcile::missing_in_provider(
            &stored.org_id,
            &stored.container_id,
            &stored.lifecycle,
            window,
            tolerance,
            as_of,
            progress.currency.as_deref().unwrap_or("USD"),
        ));
    }
    missing.sort_by(|a, b| (&a.org_id, &a.container_id).cmp(&(&b.org_id, &b.container_id)));
    Ok(missing)
}

// Long: one bound array per column of a stored line (seventeen), in the INSERT's order.
async fn insert(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    id: Uuid,
    seq: &mut i64,
    lines: &[Reconciled],
) -> Result<(), sqlx::Error> {
    if lines.is_empty() {
        return Ok(());
    }
    let seqs: Vec<i64> = (0..lines.len() as i64).map(|n| *seq + n + 1).collect();
    *seq += lines.len() as i64;
    let text = |pick: fn(&Reconciled) -> Option<String>| -> Vec<Option<String>> {
        lines.iter().map(pick).collect()
    };
    let number = |pick: fn(&Compared) -> i64| -> Vec<Option<i64>> {
        lines
            .iter()
            .map(|line| line.compared.as_ref().map(pick))
            .collect()
    };
    // Money travels as decimal text: a `Decimal` bound as `NUMERIC` loses the scale of a
    // zero (`0.00000000000` would be stored as `0`), and lines keep the report's precision.
    let money = |pick: fn(&Compared) -> Decimal| -> Vec<Option<String>> {
        lines
            .iter()
            .map(|line| {
                line.compared
                    .as_ref()
                    .map(|compared| pick(compared).to_string())
            })
            .collect()
    };
    let starts: Vec<DateTime<Utc>> = lines
        .iter()
        .map(|line| line.charge_period.start())
        .collect();
    let ends: Vec<DateTime<Utc>> = lines.iter().map(|line| line.charge_period.end()).collect();
    let costs: Vec<String> = lines
        .iter()
        .map(|line| line.provider_cost.to_string())
        .collect();
    let report_lines: Vec<Option<i64>> = lines.iter().map(|line| line.report_line).collect();
    sqlx::query(
        "INSERT INTO reconciliation_line (reconciliation_id, seq, org_id, container_id, \
             charge_period_start, charge_period_end, ledger_runtime_ms, provider_runtime_ms, \
             delta_ms, status, provider_cost, expected_cost, cost_delta, currency, \
             provider_org_id, report_line, charge_category) \
         SELECT $1, seq, org, container, period_start, period_end, ledger_ms, provider_ms, \
             delta, status, cost::NUMERIC, expected::NUMERIC, cost_delta::NUMERIC, currency, \
             provider_org, report_line, category \
         FROM UNNEST($2::BIGINT[], $3::TEXT[], $4::TEXT[], $5::TIMESTAMPTZ[], \
             $6::TIMESTAMPTZ[], $7::BIGINT[], $8::BIGINT[], $9::BIGINT[], $10::TEXT[], \
             $11::TEXT[], $12::TEXT[], $13::TEXT[], $14::TEXT[], $15::TEXT[], \
             $16::BIGINT[], $17::TEXT[]) \
             AS line (seq, org, container, period_start, period_end, ledger_ms, provider_ms, \
                 delta, status, cost, expected, cost_delta, currency, provider_org, report_line, \
                 category)",
    )
    .bind(id)
    .bind(&seqs)
    .bind(text(|line| line.org_id.clone()))
    .bind(text(|line| line.container_id.clone()))
    .bind(&starts)
    .bind(&ends)
    .bind(number(|compared| compared.ledger_runtime_ms))
    .bind(number(|compared| compared.provider_runtime_ms))
    .bind(number(|compared| compared.delta_ms))
    .bind(text(|line| Some(line.status.as_str().to_owned())))
    .bind(&costs)
    .bind(money(|compared| compared.expected_cost))
    .bind(money(|compared| compared.cost_delta))
    .bind(text(|line| Some(line.currency.clone())))
    .bind(text(|line| line.provider_org_id.clone()))
    .bind(&report_lines)
    .bind(text(|line| line.charge_category.clone()))
    .execute(&mut **transaction)
    .await?;
    Ok(())
}

/// The header of `lines.csv` (contract §6).
pub const LINES_CSV_HEADER: &str = "org_id,container_id,charge_period_start,charge_period_end,\
     ledger_runtime_ms,provider_runtime_ms,delta_ms,status,provider_cost,expected_cost,cost_delta,currency,\
     provider_org_id,report_line,charge_category";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_total_that_comes_to_zero_is_written_without_a_sign() {
        let tally = Tally {
            count: 1,
            provider_cost: "-0.00".parse().unwrap(),
            expected_cost: Some("-0.004".parse().unwrap()),
            cost_delta: Some("-0.000".parse().unwrap()),
        };
        let json = tally.json("USD");
        assert_eq!(json["provider_cost"], "0.00");
        assert_eq!(json["provider_cost_exact"], "0.00");
        assert_eq!(json["cost_delta"], "0.00");
        assert_eq!(json["cost_delta_exact"], "0.000");
        assert_eq!(json["expected_cost"], "0.00", "rounded to zero");
        assert_eq!(json["expected_cost_exact"], "-0.004");
    }
}
