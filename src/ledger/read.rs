//! Reading the ledger by position: the relay, verification and audit all tail it this way,
//! which is only safe because positions commit in order (see `append`).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::PgExecutor;
use uuid::Uuid;

use crate::event::canonical::{self, RecordFields};

/// One stored event, as it sits in the ledger.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct LedgerRow {
    pub position: i64,
    pub id: Uuid,
    #[sqlx(rename = "type")]
    pub event_type: String,
    pub org_id: String,
    pub container_id: Option<String>,
    pub occurred_at: DateTime<Utc>,
    pub recorded_at: DateTime<Utc>,
    pub data: serde_json::Value,
    pub source: Option<String>,
    pub source_event_id: Option<String>,
    /// A CloudEvent's kept attributes (decision 0023): chained, not content.
    pub attributes: Option<serde_json::Value>,
    pub hash: Vec<u8>,
}

/// The columns of [`LedgerRow`], in one place for every query that reads rows.
pub const ROW_COLUMNS: &str = "position, id, type, org_id, container_id, occurred_at, \
     recorded_at, data, source, source_event_id, attributes, hash";

impl LedgerRow {
    pub fn fields(&self) -> RecordFields<'_> {
        RecordFields {
            id: self.id,
            event_type: &self.event_type,
            org_id: &self.org_id,
            container_id: self.container_id.as_deref(),
            occurred_at: self.occurred_at,
            data: &self.data,
            origin_source: self.source.as_deref(),
            origin_id: self.source_event_id.as_deref(),
            attributes: self.attributes.as_ref(),
        }
    }

    /// The JSON a consumer of `TALLY_LEDGER` receives.
    pub fn to_message(&self) -> LedgerMessage<'_> {
        LedgerMessage {
            position: self.position,
            id: self.id,
            event_type: &self.event_type,
            org_id: &self.org_id,
            container_id: self.container_id.as_deref(),
            occurred_at: canonical::timestamp(self.occurred_at),
            recorded_at: canonical::timestamp(self.recorded_at),
            data: &self.data,
            source: self.source.as_deref(),
            source_event_id: self.source_event_id.as_deref(),
            attributes: self.attributes.as_ref(),
            hash: hex::encode(&self.hash),
        }
    }
}

#[derive(Debug, Serialize)]
pub struct LedgerMessage<'a> {
    pub position: i64,
    pub id: Uuid,
    #[serde(rename = "type")]
    pub event_type: &'a str,
    pub org_id: &'a str,
    pub container_id: Option<&'a str>,
    pub occurred_at: String,
    pub recorded_at: String,
    pub data: &'a serde_json::Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_event_id: Option<&'a str>,
    /// A CloudEvent's `datacontenttype`, `dataschema` and extensions, when it had any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attributes: Option<&'a serde_json::Value>,
    pub hash: String,
}

/// Up to `limit` rows after `position`, in position order.
#[tracing::instrument(skip_all)]
pub async fn read_after(
    executor: impl PgExecutor<'_>,
    position: i64,
    limit: usize,
) -> Result<Vec<LedgerRow>, sqlx::Error> {
    let query =
        format!("SELECT {ROW_COLUMNS} FROM ledger WHERE position > $1 ORDER BY position LIMIT $2");
    sqlx::query_as(&query)
        .bind(position)
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(executor)
        .await
}

/// A ledger head: the last position and its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub position: i64,
    pub hash: [u8; 32],
}

/// The head; position 0 and the genesis hash for an empty ledger. The highest position is
/// found in `ledger_ids`, and its hash in that row's month alone. Not a prepared statement:
/// one without parameters keeps its first plan for the session, and a plan made on a young
/// ledger would scan it whole (see `db::PLAN_CACHE_MODE`).
#[tracing::instrument(skip_all)]
pub async fn head(executor: impl PgExecutor<'_>) -> Result<Head, sqlx::Error> {
    let row: Option<(i64, Vec<u8>)> = sqlx::query_as(
        "SELECT l.position, l.hash FROM ledger l JOIN \
         (SELECT position, recorded_at FROM ledger_ids ORDER BY position DESC LIMIT 1) h \
         USING (position, recorded_at)",
    )
    .persistent(false)
    .fetch_optional(executor)
    .await?;
    Ok(match row {
        None => Head {
            position: 0,
            hash: canonical::GENESIS_HASH,
        },
        Some((position, hash)) => Head {
            position,
            hash: hash
                .try_into()
                .expect("the schema checks hashes are 32 bytes"),
        },
    })
}

/// Which events an audit page holds; every filter is optional.
#[derive(Debug, Clone, Default)]
pub struct Filter<'a> {
    pub org_id: Option<&'a str>,
    pub container_id: Option<&'a str>,
    pub event_type: Option<&'a str>,
}

/// Up to `limit` rows after `position` that match `filter`, in position order. The
/// statement names only the filters given, so that Postgres plans each combination on its
/// own index: (org_id, position) or (container_id, position).
#[tracing::instrument(skip_all)]
pub async fn read_filtered(
    executor: impl PgExecutor<'_>,
    filter: &Filter<'_>,
    position: i64,
    limit: usize,
) -> Result<Vec<LedgerRow>, sqlx::Error> {
    let mut query = sqlx::QueryBuilder::new(format!(
        "SELECT {ROW_COLUMNS} FROM ledger WHERE position > "
    ));
    query.push_bind(position);
    if let Some(org_id) = filter.org_id {
        query.push(" AND org_id = ").push_bind(org_id);
    }
    if let Some(container_id) = filter.container_id {
        query.push(" AND container_id = ").push_bind(container_id);
    }
    if let Some(event_type) = filter.event_type {
        query.push(" AND type = ").push_bind(event_type);
    }
    query
        .push(" ORDER BY position LIMIT ")
        .push_bind(i64::try_from(limit).unwrap_or(i64::MAX));
    query.build_query_as().fetch_all(executor).await
}
