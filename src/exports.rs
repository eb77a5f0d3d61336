//! Finance exports (DESIGN §5, §6): usage per org for a period, streamed, one org at a
//! time, each priced with the plan versions in effect (overage amount rounded once,
//! half-up, to the currency's minor unit).

use chrono::{DateTime, Utc};
use futures::Stream;
use serde_json::{json, Value};
use sqlx::PgPool;

use rust_decimal::Decimal;

use crate::billing::overage::{minor_unit_digits, round_amount};
use crate::projection::query::{self, PricedUsage};
use crate::projection::store::LIVE;
use crate::runtime::Period;

/// The header of `usage.csv` (DESIGN §6).
pub const USAGE_CSV_HEADER: &str = "org_id,plan,period,runtime_ms,included_ms,overage_ms,\
     overage_amount,currency,commands,ports_published";

/// Orgs listed per query while streaming.
const ORGS_PER_CHUNK: i64 = 500;

/// Every org with usage in `period`: totals in it, or containers running into it.
async fn orgs_after(
    pool: &PgPool,
    period: Period,
    after: &str,
) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT org_id FROM ( \
             SELECT org_id FROM {LIVE}.org_period WHERE period = $1 \
             UNION SELECT org_id FROM {LIVE}.org_open WHERE running > 0 AND since_period <= $1 \
         ) AS orgs WHERE org_id > $2 ORDER BY org_id LIMIT $3"
    ))
    .bind(period.to_string())
    .bind(after)
    .bind(ORGS_PER_CHUNK)
    .fetch_all(pool)
    .await
}

/// One org's figures for a period, as exported and as frozen by a period close.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Figures {
    pub org_id: String,
    pub plan: String,
    pub period: Period,
    pub runtime_ms: i64,
    pub included_ms: i64,
    pub overage_ms: i64,
    /// Rounded once, half-up, to the currency's minor unit.
    pub overage_amount: Decimal,
    pub currency: String,
    pub commands: i64,
    pub ports_published: i64,
}

impl Figures {
    pub fn from_priced(org_id: String, period: Period, priced: &PricedUsage) -> Figures {
        let currency = priced.plan.currency.clone();
        Figures {
            org_id,
            plan: priced.plan.id.as_str().to_owned(),
            period,
            runtime_ms: priced.usage.runtime_ms,
            included_ms: priced.plan.included_runtime_ms(),
            overage_ms: priced.overage.overage_ms,
            overage_amount: round_amount(priced.overage.amount, &currency),
            currency,
            commands: priced.usage.commands as i64,
            ports_published: priced.usage.ports_published as i64,
        }
    }

    fn amount(&self) -> String {
        let digits = minor_unit_digits(&self.currency) as usize;
        format!("{:.digits$}", self.overage_amount)
    }

    pub fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{},{},{}\n",
            self.org_id,
            self.plan,
            self.period,
            self.runtime_ms,
            self.included_ms,
            self.overage_ms,
            self.amount(),
            self.currency,
            self.commands,
            self.ports_published,
        )
    }

    pub fn json(&self) -> Value {
        json!({
            "org_id": self.org_id, "plan": self.plan, "period": self.period.to_string(),
            "runtime_ms": self.runtime_ms, "included_ms": self.included_ms,
            "overage_ms": self.overage_ms, "overage_amount": self.amount(),
            "currency": self.currency, "commands": self.commands,
            "ports_published": self.ports_published,
        })
    }

    /// `self − before`, as an adjustment row: the same columns, figures as differences
    /// (`included_ms` 0), `period` the affected period.
    pub fn minus(&self, before: &Figures) -> Figures {
        Figures {
            org_id: self.org_id.clone(),
            plan: self.plan.clone(),
            period: self.period,
            runtime_ms: self.runtime_ms - before.runtime_ms,
            included_ms: 0,
            overage_ms: self.overage_ms - before.overage_ms,
            overage_amount: self.overage_amount - before.overage_amount,
            currency: self.currency.clone(),
            commands: self.commands - before.commands,
            ports_published: self.ports_published - before.ports_published,
        }
    }

    /// No figure differs from zero (for an adjustment).
    pub fn is_zero(&self) -> bool {
        self.runtime_ms == 0
            && self.overage_ms == 0
            && self.overage_amount.is_zero()
            && self.commands == 0
            && self.ports_published == 0
    }

    /// Figures of an org with nothing in the period.
    pub fn empty(org_id: &str, period: Period, plan: &str, currency: &str) -> Figures {
        Figures {
            org_id: org_id.to_owned(),
            plan: plan.to_owned(),
            period,
            runtime_ms: 0,
            included_ms: 0,
            overage_ms: 0,
            overage_amount: Decimal::ZERO,
            currency: currency.to_owned(),
            commands: 0,
            ports_published: 0,
        }
    }
}

/// The usage of every org in `period` as of `as_of`, in org order, one org at a time.
pub fn usage_rows(
    pool: PgPool,
    period: Period,
    as_of: DateTime<Utc>,
) -> impl Stream<Item = anyhow::Result<Figures>> + Send {
    // (orgs fetched but not yet priced, the last org listed, whether the list is done)
    futures::stream::unfold(
        (Vec::<String>::new(), String::new(), false),
        move |(mut pending, mut last, mut listed)| {
            let pool = pool.clone();
            async move {
                if pending.is_empty() && !listed {
                    match orgs_after(&pool, period, &last).await {
                        Ok(orgs) => {
                            listed = (orgs.len() as i64) < ORGS_PER_CHUNK;
                            if let Some(end) = orgs.last() {
                                last.clone_from(end);
                            }
                            pending = orgs.into_iter().rev().collect();
                        }
                        Err(error) => return Some((Err(error.into()), (Vec::new(), last, true))),
                    }
                }
                let org_id = pending.pop()?;
                let row = query::priced_usage(&pool, &org_id, period, as_of)
                    .await
                    .map(|priced| Figures::from_priced(org_id, period, &priced));
                Some((row, (pending, last, listed)))
            }
        },
    )
}

/// One org's row of the usage export of `period` as of `as_of`, for a token bound to that
/// org: `None` when [`usage_rows`] would not list the org (no usage in the period).
pub async fn org_usage_row(
    pool: &PgPool,
    period: Period,
    as_of: DateTime<Utc>,
    org_id: &str,
) -> anyhow::Result<Option<Figures>> {
    let listed: bool = sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM {LIVE}.org_period WHERE period = $1 AND org_id = $2) \
             OR EXISTS (SELECT 1 FROM {LIVE}.org_open \
                        WHERE org_id = $2 AND running > 0 AND since_period <= $1)"
    ))
    .bind(period.to_string())
    .bind(org_id)
    .fetch_one(pool)
    .await?;
    if !listed {
        return Ok(None);
    }
    let priced = query::priced_usage(pool, org_id, period, as_of).await?;
    Ok(Some(Figures::from_priced(
        org_id.to_owned(),
        period,
        &priced,
    )))
}
