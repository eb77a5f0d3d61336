//! Usage priced per org and period (contract §5, §6), as the usage export and a period
//! close list it: each org priced with the plan versions in effect (overage amount rounded
//! once, half-up, to the currency's minor unit). Orgs are read in batches (keyset on the
//! org id) and each batch is priced with a few statements, in the caller's snapshot.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use serde_json::{json, Value};
use sqlx::{FromRow, PgConnection};
use uuid::Uuid;

use rust_decimal::Decimal;

use crate::billing::overage::{minor_unit_digits, round_amount};
use crate::event::EventId;
use crate::projection::query::{self, PlanVersions, PricedUsage};
use crate::projection::store::{self, LIVE};
use crate::runtime::{self, AccountEntry, AccountTimeline, Period, PeriodTotals};

/// The header of `usage.csv` (contract §6).
pub const USAGE_CSV_HEADER: &str = "org_id,plan,period,runtime_ms,included_ms,overage_ms,\
     overage_amount,currency,commands,ports_published";

/// Every org with usage in `period` (totals in it, or containers running into it) after
/// `after` in org order, at most `limit`.
pub async fn orgs_after(
    connection: &mut PgConnection,
    period: Period,
    after: &str,
    limit: i64,
) -> Result<Vec<String>, sqlx::Error> {
    // Each branch limited in org order on its own, so that each walks its primary key from
    // `after` and stops: a batch costs its own rows, not every org after it.
    sqlx::query_scalar(&format!(
        "SELECT org_id FROM ( \
             (SELECT org_id FROM {LIVE}.org_period WHERE period = $1 AND org_id > $2 \
              ORDER BY org_id LIMIT $3) \
             UNION (SELECT org_id FROM {LIVE}.org_open \
                    WHERE running > 0 AND since_period <= $1 AND org_id > $2 \
                    ORDER BY org_id LIMIT $3) \
         ) AS orgs ORDER BY org_id LIMIT $3"
    ))
    .bind(period.to_string())
    .bind(after)
    .bind(limit)
    .fetch_all(connection)
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
        let currency = priced.currency.clone();
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
    /// (`included_ms` 0), `period` the affected period. Its currency is that of whichever
    /// side has an amount (amounts are in one currency, decision 0045): an org whose window
    /// no longer prices anything is labelled with its end plan's, not the snapshot's.
    pub fn minus(&self, before: &Figures) -> Figures {
        let currency = if self.overage_amount.is_zero() && !before.overage_amount.is_zero() {
            &before.currency
        } else {
            &self.currency
        };
        Figures {
            org_id: self.org_id.clone(),
            plan: self.plan.clone(),
            period: self.period,
            runtime_ms: self.runtime_ms - before.runtime_ms,
            included_ms: 0,
            overage_ms: self.overage_ms - before.overage_ms,
            overage_amount: self.overage_amount - before.overage_amount,
            currency: currency.clone(),
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

#[derive(FromRow)]
struct TotalsRow {
    org_id: String,
    latest_at: Option<DateTime<Utc>>,
    closed_runtime_ms: i64,
    commands: i64,
    command_ms: i64,
    ports_published: i64,
    open_periods: Vec<String>,
    open_running: Vec<i64>,
    open_offsets: Vec<i64>,
}

#[derive(FromRow)]
struct AccountRow {
    org_id: String,
    position: i64,
    occurred_at: DateTime<Utc>,
    event_id: Uuid,
    plan: Option<String>,
    verified: Option<bool>,
    billing_eligible: Option<bool>,
}

/// Prices batches of orgs for one period as of one instant, as [`query::priced_usage`]
/// prices one org: the totals and account changes of a whole batch in one statement each,
/// each plan's versions read once. Use it within one snapshot.
pub struct Pricer {
    period: Period,
    as_of: DateTime<Utc>,
    versions: PlanVersions,
}

impl Pricer {
    pub fn new(period: Period, as_of: DateTime<Utc>) -> Pricer {
        Pricer {
            period,
            as_of,
            versions: PlanVersions::default(),
        }
    }

    pub fn period(&self) -> Period {
        self.period
    }

    /// The figures of `orgs`, in the same order.
    pub async fn price(
        &mut self,
        connection: &mut PgConnection,
        orgs: &[String],
    ) -> Result<Vec<Figures>, super::Error> {
        let period = self.period;
        let totals: Vec<TotalsRow> = sqlx::query_as(&format!(
            "SELECT o.org_id, org.latest_at, \
                    COALESCE(p.closed_runtime_ms, 0) AS closed_runtime_ms, \
                    COALESCE(p.commands, 0) AS commands, \
                    COALESCE(p.command_ms, 0) AS command_ms, \
                    COALESCE(p.ports_published, 0) AS ports_published, \
                    ARRAY(SELECT since_period FROM {LIVE}.org_open x \
                          WHERE x.org_id = o.org_id AND x.running > 0 \
                          ORDER BY x.since_period) AS open_periods, \
                    ARRAY(SELECT running FROM {LIVE}.org_open x \
                          WHERE x.org_id = o.org_id AND x.running > 0 \
                          ORDER BY x.since_period) AS open_running, \
                    ARRAY(SELECT since_offset_ms FROM {LIVE}.org_open x \
                          WHERE x.org_id = o.org_id AND x.running > 0 \
                          ORDER BY x.since_period) AS open_offsets \
             FROM unnest($1::TEXT[]) WITH ORDINALITY AS o (org_id, n) \
             LEFT JOIN {LIVE}.org org ON org.org_id = o.org_id \
             LEFT JOIN {LIVE}.org_period p ON p.org_id = o.org_id AND p.period = $2 \
             ORDER BY o.n"
        ))
        .bind(orgs)
        .bind(period.to_string())
        .fetch_all(&mut *connection)
        .await?;
        assert_eq!(totals.len(), orgs.len(), "one totals row per org asked for");
        let entries = account_entries(&mut *connection, orgs).await?;
        let mut figures = Vec::with_capacity(orgs.len());
        for row in totals {
            let usage = match runtime::usage_from_totals(
                PeriodTotals {
                    closed_runtime_ms: row.closed_runtime_ms,
                    commands: u64::try_from(row.commands).map_err(corrupt("commands"))?,
                    command_ms: row.command_ms,
                    ports_published: u64::try_from(row.ports_published)
                        .map_err(corrupt("ports_published"))?,
                },
                &query::open_runs(&row.open_periods, &row.open_running, &row.open_offsets)?,
                period,
                self.as_of,
                self.settled_at(row.latest_at),
            ) {
                Some(usage) => usage,
                None => query::usage_on(&mut *connection, &row.org_id, period, self.as_of).await?,
            };
            let account =
                AccountTimeline::fold(entries.get(&row.org_id).map(Vec::as_slice).unwrap_or(&[]));
            let priced: PricedUsage = query::price(
                &mut *connection,
                &row.org_id,
                period,
                self.as_of,
                usage,
                &account,
                &mut self.versions,
            )
            .await?;
            figures.push(Figures::from_priced(row.org_id, period, &priced));
        }
        Ok(figures)
    }

    /// When the org's totals alone give its figures (see [`runtime::usage_from_totals`]).
    /// The whole period (`as_of` at or past its end) always comes from them, whatever
    /// happened later: the projection splits closed intervals' runtime by period and counts
    /// commands and ports in the period they occurred in, so later events change only
    /// later periods' totals (and the count of containers running, which no figure here
    /// uses). Only a window cut before the org's latest event needs its history.
    fn settled_at(&self, latest_at: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
        if self.as_of >= self.period.end() {
            None
        } else {
            latest_at.map(runtime::settled_at)
        }
    }
}

/// The account changes of `orgs`, by org.
async fn account_entries(
    connection: &mut PgConnection,
    orgs: &[String],
) -> Result<HashMap<String, Vec<AccountEntry>>, super::Error> {
    let accounts: Vec<AccountRow> = sqlx::query_as(&format!(
        "SELECT org_id, position, occurred_at, event_id, plan, verified, billing_eligible \
         FROM {LIVE}.account_change WHERE org_id = ANY($1)"
    ))
    .bind(orgs)
    .fetch_all(&mut *connection)
    .await?;
    let mut entries: HashMap<String, Vec<AccountEntry>> = HashMap::new();
    for row in accounts {
        let change =
            store::account_change(row.position, row.plan, row.verified, row.billing_eligible)?;
        entries.entry(row.org_id).or_default().push(AccountEntry {
            occurred_at: row.occurred_at,
            position: row.position,
            event_id: EventId::from_uuid(row.event_id).map_err(corrupt("event_id"))?,
            change,
        });
    }
    Ok(entries)
}

/// A stored value that does not decode: `what` it is, with why not.
fn corrupt<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> super::Error {
    move |error| super::Error::Corrupt(format!("{what}: {error}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(amount: &str, currency: &str) -> Figures {
        Figures {
            overage_amount: amount.parse().unwrap(),
            ..Figures::empty("acme", Period::parse("2026-11").unwrap(), "team", currency)
        }
    }

    #[test]
    fn an_adjustment_is_in_the_currency_of_the_side_that_has_an_amount() {
        // Moved back to `free` (USD, no price) from the period's start: the EUR snapshot's
        // amount is taken back in EUR.
        let taken_back = figures("0.00", "USD").minus(&figures("2.00", "EUR"));
        assert_eq!(
            (taken_back.overage_amount, taken_back.currency.as_str()),
            ("-2.00".parse().unwrap(), "EUR")
        );
        let added = figures("3.00", "EUR").minus(&figures("0.00", "USD"));
        assert_eq!(
            (added.overage_amount, added.currency.as_str()),
            ("3.00".parse().unwrap(), "EUR")
        );
        let moved = figures("3.00", "EUR").minus(&figures("2.00", "EUR"));
        assert_eq!(moved.currency, "EUR");
    }
}
