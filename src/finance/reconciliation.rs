//! Running a reconciliation (contract §5): every line of a stored report against the
//! projection's container lifecycles, then the containers the report does not mention;
//! results, counts and money totals stored together in one transaction.

use std::collections::{BTreeMap, HashMap, HashSet};

use chrono::{DateTime, SubsecRound, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use sqlx::{FromRow, PgPool};
use uuid::Uuid;

use crate::billing::overage::round_amount;
use crate::billing::reconcile::{
    self, LedgerContainer, Reconciled, ReportLine, Status, Tolerance, Unit,
};
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
    container_id: String,
    org_id: Option<String>,
    consumed_quantity: Decimal,
    consumed_unit: String,
    billed_cost: Decimal,
    billing_currency: String,
}

impl LineRow {
    fn report_line(&self) -> ReportLine {
        ReportLine {
            charge_period: Window::new(self.charge_period_start, self.charge_period_end),
            container_id: self.container_id.clone(),
            org_id: self.org_id.clone(),
            quantity: self.consumed_quantity,
            unit: if self.consumed_unit == "Hours" {
                Unit::Hours
            } else {
                Unit::Seconds
            },
            billed_cost: self.billed_cost,
            currency: self.billing_currency.clone(),
        }
    }
}

#[derive(Default)]
struct Tally {
    count: u64,
    provider_cost: Decimal,
    expected_cost: Decimal,
    cost_delta: Decimal,
}

impl Tally {
    fn add(&mut self, line: &Reconciled) {
        self.count += 1;
        self.provider_cost += line.provider_cost;
        self.expected_cost += line.expected_cost;
        self.cost_delta += line.cost_delta;
    }

    fn json(&self, currency: &str) -> Value {
        json!({
            "lines": self.count,
            "provider_cost": round_amount(self.provider_cost, currency).to_string(),
            "expected_cost": round_amount(self.expected_cost, currency).to_string(),
            "cost_delta": round_amount(self.cost_delta, currency).to_string(),
        })
    }
}

/// Reconciles report `report_id` with `tolerance`, counting ledger runtime up to `now`.
pub async fn run(
    pool: &PgPool,
    report_id: Uuid,
    tolerance: Tolerance,
    now: DateTime<Utc>,
    actor: &str,
) -> Result<Summary, ReconcileError> {
    let window: Option<(DateTime<Utc>, DateTime<Utc>)> =
        sqlx::query_as("SELECT window_start, window_end FROM provider_report WHERE id = $1")
            .bind(report_id)
            .fetch_optional(pool)
            .await?;
    let Some((window_start, window_end)) = window else {
        return Err(ReconcileError::UnknownReport(report_id));
    };
    let as_of = now.trunc_subsecs(3);
    let mut transaction = pool.begin().await?;
    // One snapshot for every read: the ledger figures all come from one checkpoint, read
    // first, so that it is the position of the snapshot.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *transaction)
        .await?;
    let position = store::checkpoint(&mut transaction, LIVE).await?;
    let mut progress = Progress::new(Uuid::now_v7());
    reconcile_lines(&mut transaction, report_id, tolerance, as_of, &mut progress).await?;
    let missing = missing_in_provider(
        &mut transaction,
        Window::new(window_start, window_end),
        tolerance,
        as_of,
        &progress,
    )
    .await?;
    progress.record(&mut transaction, &missing).await?;
    let (counts, totals) = (progress.counts(), progress.totals());
    sqlx::query(
        "INSERT INTO reconciliation (id, report_id, tolerance_ms, tolerance_ratio, as_of, \
             ledger_position, counts, totals, created_at, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now(), $9)",
    )
    .bind(progress.id)
    .bind(report_id)
    .bind(tolerance.min_ms)
    .bind(tolerance.ratio)
    .bind(as_of)
    .bind(position)
    .bind(&counts)
    .bind(&totals)
    .bind(actor)
    .execute(&mut *transaction)
    .await?;
    transaction.commit().await?;
    Ok(Summary {
        id: progress.id,
        counts,
        totals,
        position,
    })
}

/// What a run has gathered: the lines stored so far, their tallies by status and by org,
/// the containers the report mentions and the report's currency.
struct Progress {
    id: Uuid,
    seq: i64,
    by_status: BTreeMap<&'static str, Tally>,
    by_org: BTreeMap<String, Tally>,
    mentioned: HashSet<String>,
    currency: String,
}

impl Progress {
    fn new(id: Uuid) -> Progress {
        Progress {
            id,
            seq: 0,
            by_status: BTreeMap::new(),
            by_org: BTreeMap::new(),
            mentioned: HashSet::new(),
            currency: String::from("USD"),
        }
    }

    /// Tallies `lines` and stores them after those stored before.
    async fn record(
        &mut self,
        transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        lines: &[Reconciled],
    ) -> Result<(), sqlx::Error> {
        tally(lines, &mut self.by_status, &mut self.by_org);
        insert(transaction, self.id, &mut self.seq, lines).await
    }

    /// The number of lines of every status, zeros included.
    fn counts(&self) -> Value {
        [
            Status::Matched,
            Status::ProviderOver,
            Status::ProviderUnder,
            Status::MissingInLedger,
            Status::OrgMismatch,
            Status::MissingInProvider,
        ]
        .iter()
        .map(|status| {
            let count = self
                .by_status
                .get(status.as_str())
                .map_or(0, |tally| tally.count);
            (status.as_str().to_owned(), json!(count))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
    }

    /// Money by status and by org, each rounded once to the currency's minor unit.
    fn totals(&self) -> Value {
        let currency = &self.currency;
        json!({
            "currency": currency,
            "by_status": self.by_status.iter().map(|(status, tally)| ((*status).to_owned(), tally.json(currency))).collect::<serde_json::Map<_, _>>(),
            "by_org": self.by_org.iter().map(|(org, tally)| (org.clone(), tally.json(currency))).collect::<serde_json::Map<_, _>>(),
        })
    }
}

/// Every line of the report, a round of [`LINES_PER_ROUND`] at a time, against the
/// lifecycles of the containers it names.
async fn reconcile_lines(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    report_id: Uuid,
    tolerance: Tolerance,
    as_of: DateTime<Utc>,
    progress: &mut Progress,
) -> Result<(), ReconcileError> {
    let mut after = 0i64;
    loop {
        let rows: Vec<LineRow> = sqlx::query_as(
            "SELECT line, charge_period_start, charge_period_end, container_id, org_id, \
                    consumed_quantity, consumed_unit, billed_cost, billing_currency \
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
        let ids: Vec<&str> = rows
            .iter()
            .map(|row| row.container_id.as_str())
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
        let mut results = Vec::with_capacity(rows.len());
        for row in &rows {
            let ledger: Vec<LedgerContainer> = known
                .get(&row.container_id)
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
            progress.currency.clone_from(&row.billing_currency);
            progress.mentioned.insert(row.container_id.clone());
            results.push(reconcile::reconcile_line(
                &row.report_line(),
                &ledger,
                tolerance,
                as_of,
            ));
        }
        progress.record(transaction, &results).await?;
    }
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
        if progress.mentioned.contains(&stored.container_id) {
            continue;
        }
        missing.extend(reconcile::missing_in_provider(
            &stored.org_id,
            &stored.container_id,
            &stored.lifecycle,
            window,
            tolerance,
            as_of,
            &progress.currency,
        ));
    }
    missing.sort_by(|a, b| (&a.org_id, &a.container_id).cmp(&(&b.org_id, &b.container_id)));
    Ok(missing)
}

fn tally(
    lines: &[Reconciled],
    by_status: &mut BTreeMap<&'static str, Tally>,
    by_org: &mut BTreeMap<String, Tally>,
) {
    for line in lines {
        by_status.entry(line.status.as_str()).or_default().add(line);
        by_org
            .entry(line.org_id.clone().unwrap_or_default())
            .or_default()
            .add(line);
    }
}

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
    let number = |pick: fn(&Reconciled) -> i64| -> Vec<i64> { lines.iter().map(pick).collect() };
    let money =
        |pick: fn(&Reconciled) -> Decimal| -> Vec<Decimal> { lines.iter().map(pick).collect() };
    let starts: Vec<DateTime<Utc>> = lines
        .iter()
        .map(|line| line.charge_period.start())
        .collect();
    let ends: Vec<DateTime<Utc>> = lines.iter().map(|line| line.charge_period.end()).collect();
    sqlx::query(
        "INSERT INTO reconciliation_line (reconciliation_id, seq, org_id, container_id, \
             charge_period_start, charge_period_end, ledger_runtime_ms, provider_runtime_ms, \
             delta_ms, status, provider_cost, expected_cost, cost_delta, currency) \
         SELECT $1, * FROM UNNEST($2::BIGINT[], $3::TEXT[], $4::TEXT[], $5::TIMESTAMPTZ[], \
             $6::TIMESTAMPTZ[], $7::BIGINT[], $8::BIGINT[], $9::BIGINT[], $10::TEXT[], \
             $11::NUMERIC[], $12::NUMERIC[], $13::NUMERIC[], $14::TEXT[])",
    )
    .bind(id)
    .bind(&seqs)
    .bind(text(|line| line.org_id.clone()))
    .bind(text(|line| Some(line.container_id.clone())))
    .bind(&starts)
    .bind(&ends)
    .bind(number(|line| line.ledger_runtime_ms))
    .bind(number(|line| line.provider_runtime_ms))
    .bind(number(|line| line.delta_ms))
    .bind(text(|line| Some(line.status.as_str().to_owned())))
    .bind(money(|line| line.provider_cost))
    .bind(money(|line| line.expected_cost))
    .bind(money(|line| line.cost_delta))
    .bind(text(|line| Some(line.currency.clone())))
    .execute(&mut **transaction)
    .await?;
    Ok(())
}

/// The header of `lines.csv` (contract §6).
pub const LINES_CSV_HEADER: &str = "org_id,container_id,charge_period_start,charge_period_end,\
     ledger_runtime_ms,provider_runtime_ms,delta_ms,status,provider_cost,expected_cost,cost_delta,currency";
