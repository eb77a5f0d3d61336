//! Finance exports (DESIGN §5, §6): usage per org for a period, streamed, one org at a
//! time, each priced with the plan versions in effect (overage amount rounded once,
//! half-up, to the currency's minor unit).

use chrono::{DateTime, Utc};
use futures::Stream;
use serde_json::{json, Value};
use sqlx::PgPool;

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

/// One org's row.
pub struct UsageRow {
    pub org_id: String,
    pub period: Period,
    pub priced: PricedUsage,
}

impl UsageRow {
    fn amount(&self) -> String {
        let currency = &self.priced.plan.currency;
        let digits = minor_unit_digits(currency) as usize;
        format!(
            "{:.digits$}",
            round_amount(self.priced.overage.amount, currency)
        )
    }

    pub fn csv(&self) -> String {
        let usage = &self.priced.usage;
        format!(
            "{},{},{},{},{},{},{},{},{},{}\n",
            self.org_id,
            self.priced.plan.id,
            self.period,
            usage.runtime_ms,
            self.priced.plan.included_runtime_ms(),
            self.priced.overage.overage_ms,
            self.amount(),
            self.priced.plan.currency,
            usage.commands,
            usage.ports_published,
        )
    }

    pub fn json(&self) -> Value {
        let usage = &self.priced.usage;
        json!({
            "org_id": self.org_id, "plan": self.priced.plan.id.as_str(), "period": self.period.to_string(),
            "runtime_ms": usage.runtime_ms, "included_ms": self.priced.plan.included_runtime_ms(),
            "overage_ms": self.priced.overage.overage_ms, "overage_amount": self.amount(),
            "currency": self.priced.plan.currency, "commands": usage.commands,
            "ports_published": usage.ports_published,
        })
    }
}

/// The usage of every org in `period` as of `as_of`, in org order, one org at a time.
pub fn usage_rows(
    pool: PgPool,
    period: Period,
    as_of: DateTime<Utc>,
) -> impl Stream<Item = anyhow::Result<UsageRow>> {
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
                    .map(|priced| UsageRow {
                        org_id,
                        period,
                        priced,
                    });
                Some((row, (pending, last, listed)))
            }
        },
    )
}
