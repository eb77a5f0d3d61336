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
    Store(#[from] anyhow::Error),
}

impl From<sqlx::Error> for ReconcileError {
    fn from(error: sqlx::Error) -> Self {
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

/// Reconciles report `report_id` with `tolerance`, counting ledger runtime up to now.
pub async fn run(
    pool: &PgPool,
    report_id: Uuid,
    tolerance: Tolerance,
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
    let report_window = Window::new(window_start, window_end);
    let as_of = Utc::now().trunc_subsecs(3);
    let id = Uuid::now_v7();
    let mut transaction = pool.begin().await?;
    // One snapshot for every read: the ledger figures all come from one checkpoint, read
    // first, so that it is the position of the snapshot.
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *transaction)
        .await?;
    let ledger_position = store::checkpoint(&mut transaction, LIVE).await?;

    let mut mentioned: HashSet<String> = HashSet::new();
    let mut by_status: BTreeMap<&'static str, Tally> = BTreeMap::new();
    let mut by_org: BTreeMap<String, Tally> = BTreeMap::new();
    let mut currency = String::from("USD");
    let mut seq = 0i64;
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
        .fetch_all(&mut *transaction)
        .await?;
        let Some(last) = rows.last() else { break };
        after = last.line;
        let ids: Vec<&str> = rows
            .iter()
            .map(|row| row.container_id.as_str())
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        let mut known: HashMap<String, Vec<StoredContainer>> = HashMap::new();
        for stored in store::containers_by_ids(&mut transaction, &ids).await? {
            known
                .entry(stored.container_id.clone())
                .or_default()
                .push(stored);
        }
        let mut results = Vec::with_capacity(rows.len());
        for row in &rows {
            let line = ReportLine {
                charge_period: Window::new(row.charge_period_start, row.charge_period_end),
                container_id: row.container_id.clone(),
                org_id: row.org_id.clone(),
                quantity: row.consumed_quantity,
                unit: if row.consumed_unit == "Hours" {
                    Unit::Hours
                } else {
                    Unit::Seconds
                },
                billed_cost: row.billed_cost,
                currency: row.billing_currency.clone(),
            };
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
            currency.clone_from(&row.billing_currency);
            mentioned.insert(row.container_id.clone());
            results.push(reconcile::reconcile_line(&line, &ledger, tolerance, as_of));
        }
        tally(&results, &mut by_status, &mut by_org);
        insert(&mut transaction, id, &mut seq, &results).await?;
    }

    let mut missing = Vec::new();
    for stored in store::containers_running_since(&mut transaction, window_start).await? {
        if mentioned.contains(&stored.container_id) {
            continue;
        }
        missing.extend(reconcile::missing_in_provider(
            &stored.org_id,
            &stored.container_id,
            &stored.lifecycle,
            report_window,
            tolerance,
            as_of,
            &currency,
        ));
    }
    missing.sort_by(|a, b| (&a.org_id, &a.container_id).cmp(&(&b.org_id, &b.container_id)));
    tally(&missing, &mut by_status, &mut by_org);
    insert(&mut transaction, id, &mut seq, &missing).await?;

    let counts: Value = [
        Status::Matched,
        Status::ProviderOver,
        Status::ProviderUnder,
        Status::MissingInLedger,
        Status::OrgMismatch,
        Status::MissingInProvider,
    ]
    .iter()
    .map(|status| {
        let count = by_status
            .get(status.as_str())
            .map_or(0, |tally| tally.count);
        (status.as_str().to_owned(), json!(count))
    })
    .collect::<serde_json::Map<_, _>>()
    .into();
    let totals = json!({
        "currency": currency,
        "by_status": by_status.iter().map(|(status, tally)| ((*status).to_owned(), tally.json(&currency))).collect::<serde_json::Map<_, _>>(),
        "by_org": by_org.iter().map(|(org, tally)| (org.clone(), tally.json(&currency))).collect::<serde_json::Map<_, _>>(),
    });
    sqlx::query(
        "INSERT INTO reconciliation (id, report_id, tolerance_ms, tolerance_ratio, as_of, \
             ledger_position, counts, totals, created_at, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now(), $9)",
    )
    .bind(id)
    .bind(report_id)
    .bind(tolerance.min_ms)
    .bind(tolerance.ratio)
    .bind(as_of)
    .bind(ledger_position)
    .bind(&counts)
    .bind(&totals)
    .bind(actor)
    .execute(&mut *transaction)
    .await?;
    transaction.commit().await?;
    Ok(Summary {
        id,
        counts,
        totals,
        position: ledger_position,
    })
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
