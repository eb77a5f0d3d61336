//! Plan versions, read from the ledger's `plan.defined` events (by their partial index).
//! Each event is a version, in effect from its `occurred_at`; `free` has a built-in version
//! 0 in effect before any definition of it.

use std::collections::HashSet;

use chrono::{DateTime, Utc};
use sqlx::{FromRow, PgExecutor};

use super::Error;
pub use crate::billing::overage::{in_effect, PlanVersion};
use crate::billing::Plan;
use crate::event::{Event, EventData, PlanId};
use crate::runtime::FREE_PLAN;

#[derive(FromRow)]
struct VersionRow {
    id: String,
    data: serde_json::Value,
    version: i64,
    occurred_at: DateTime<Utc>,
    position: i64,
}

impl VersionRow {
    fn into_version(self) -> Result<PlanVersion, Error> {
        let id = PlanId::parse(&self.id)
            .map_err(|error| Error::Corrupt(format!("stored plan id {:?}: {error}", self.id)))?;
        let plan = Plan::parse(&id, &self.data).map_err(|errors| {
            Error::Corrupt(format!("stored plan {id} does not parse: {errors:?}"))
        })?;
        Ok(PlanVersion {
            plan,
            version: self.version,
            effective_from: self.occurred_at,
            position: self.position,
        })
    }
}

const VERSIONS: &str = "SELECT data->>'id' AS id, data, occurred_at, position, \
     row_number() OVER (PARTITION BY data->>'id' ORDER BY occurred_at, position) AS version \
     FROM ledger WHERE type = 'plan.defined'";

/// The latest version of every plan, `free` included, by id.
pub async fn current(executor: impl PgExecutor<'_>) -> Result<Vec<PlanVersion>, Error> {
    let rows: Vec<VersionRow> = sqlx::query_as(&format!(
        "SELECT DISTINCT ON (id) * FROM ({VERSIONS}) AS v ORDER BY id, version DESC"
    ))
    .fetch_all(executor)
    .await?;
    let mut versions = rows
        .into_iter()
        .map(VersionRow::into_version)
        .collect::<Result<Vec<_>, _>>()?;
    if !versions
        .iter()
        .any(|version| version.plan.id.as_str() == FREE_PLAN)
    {
        versions.push(PlanVersion::builtin_free());
    }
    versions.sort_by(|a, b| a.plan.id.as_str().cmp(b.plan.id.as_str()));
    Ok(versions)
}

/// The currency plans price overage in: that of the first stored version with an
/// overage price other than zero, with that version's plan id; `None` while no version
/// prices overage. Every such version shares it (`PUT /v1/plans` refuses another,
/// decision 0045), versions stored before that rule aside.
pub async fn billing_currency(
    executor: impl PgExecutor<'_>,
) -> sqlx::Result<Option<(String, String)>> {
    sqlx::query_as(
        "SELECT data->>'currency', data->>'id' FROM ledger \
         WHERE type = 'plan.defined' AND (data->>'overage_price_per_hour')::NUMERIC <> 0 \
         ORDER BY position LIMIT 1",
    )
    .fetch_optional(executor)
    .await
}

/// Every version of one plan, oldest first (`free` starts with its built-in version).
pub async fn versions(
    executor: impl PgExecutor<'_>,
    id: &PlanId,
) -> Result<Vec<PlanVersion>, Error> {
    let rows: Vec<VersionRow> = sqlx::query_as(
        "SELECT data->>'id' AS id, data, occurred_at, position, \
                row_number() OVER (ORDER BY occurred_at, position) AS version \
         FROM ledger WHERE type = 'plan.defined' AND data->>'id' = $1 \
         ORDER BY occurred_at, position",
    )
    .bind(id.as_str())
    .fetch_all(executor)
    .await?;
    let mut versions = Vec::with_capacity(rows.len() + 1);
    if id.as_str() == FREE_PLAN {
        versions.push(PlanVersion::builtin_free());
    }
    for row in rows {
        versions.push(row.into_version()?);
    }
    Ok(versions)
}

/// The first event of `events` that moves an org to a plan that does not exist (contract §4:
/// 422 `unknown_plan`), as (index, plan id). Plans are never removed, so a plan found here
/// still exists when the event is appended.
pub async fn unknown_reference(
    executor: impl PgExecutor<'_>,
    events: &[Event],
) -> sqlx::Result<Option<(usize, String)>> {
    let referenced: Vec<(usize, &str)> = events
        .iter()
        .enumerate()
        .filter_map(|(index, event)| match &event.data {
            EventData::OrgPlanChanged(changed) => Some((index, changed.plan.as_str())),
            _ => None,
        })
        .collect();
    if referenced.is_empty() {
        return Ok(None);
    }
    let ids: Vec<&str> = referenced.iter().map(|(_, id)| *id).collect();
    let known = known(executor, &ids).await?;
    Ok(referenced
        .into_iter()
        .find(|(_, id)| !known.contains(*id))
        .map(|(index, id)| (index, id.to_owned())))
}

/// Which of `ids` name a plan (defined in the ledger, or the built-in `free`).
pub async fn known(executor: impl PgExecutor<'_>, ids: &[&str]) -> sqlx::Result<HashSet<String>> {
    let mut known: HashSet<String> = sqlx::query_scalar(
        "SELECT DISTINCT data->>'id' FROM ledger \
         WHERE type = 'plan.defined' AND data->>'id' = ANY($1)",
    )
    .bind(ids)
    .fetch_all(executor)
    .await?
    .into_iter()
    .collect();
    if ids.contains(&FREE_PLAN) {
        known.insert(FREE_PLAN.to_owned());
    }
    Ok(known)
}
