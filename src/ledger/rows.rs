//! Ledger rows column by column, as the appender writes them with one
//! `INSERT … SELECT FROM UNNEST` (or one `ledger_append` call): each row's position, content
//! digest and chained hash are computed here, before any lock is taken.

use chrono::{DateTime, Utc};
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{PgExecutor, Postgres};
use uuid::Uuid;

use super::read::LedgerRow;
use crate::event::canonical;
use crate::event::Event;

/// The ledger's columns in the order [`Rows::bind`] binds them.
pub const COLUMNS: &str = "position, id, type, org_id, container_id, occurred_at, recorded_at, \
     data, source, source_event_id, attributes, content_digest, hash";

#[derive(Debug, Clone, Default)]
pub struct Rows {
    pub position: Vec<i64>,
    pub id: Vec<Uuid>,
    pub event_type: Vec<&'static str>,
    pub org_id: Vec<String>,
    pub container_id: Vec<Option<String>>,
    pub occurred_at: Vec<DateTime<Utc>>,
    pub recorded_at: Vec<DateTime<Utc>>,
    pub data: Vec<serde_json::Value>,
    pub source: Vec<Option<String>>,
    pub source_event_id: Vec<Option<String>>,
    pub attributes: Vec<Option<serde_json::Value>>,
    pub content_digest: Vec<Vec<u8>>,
    pub hash: Vec<Vec<u8>>,
}

impl Rows {
    pub fn len(&self) -> usize {
        self.position.len()
    }

    pub fn is_empty(&self) -> bool {
        self.position.is_empty()
    }

    /// Adds `event` at `position`, chained after `prev_hash`; returns its hash. `data` and
    /// `digest` are `event.data_json()` and its content digest, computed once by the caller.
    pub fn push(
        &mut self,
        event: &Event,
        data: serde_json::Value,
        digest: [u8; 32],
        position: i64,
        recorded_at: DateTime<Utc>,
        prev_hash: &[u8; 32],
    ) -> [u8; 32] {
        let attributes = event.origin.as_ref().and_then(|o| o.attributes_json());
        let fields = canonical::RecordFields {
            attributes: attributes.as_ref(),
            ..event.record_fields(&data)
        };
        let bytes = canonical::record_bytes(&fields, position, recorded_at);
        let hash = canonical::chain_hash(prev_hash, &bytes);
        self.position.push(position);
        self.id.push(event.id.as_uuid());
        self.event_type.push(event.event_type.as_str());
        self.org_id.push(event.org_id.as_str().to_owned());
        self.container_id
            .push(event.container_id.as_ref().map(|c| c.as_str().to_owned()));
        self.occurred_at.push(event.occurred_at);
        self.recorded_at.push(recorded_at);
        self.data.push(data);
        self.source
            .push(event.origin.as_ref().map(|o| o.source.clone()));
        self.source_event_id
            .push(event.origin.as_ref().map(|o| o.id.clone()));
        self.attributes.push(attributes);
        self.content_digest.push(digest.to_vec());
        self.hash.push(hash.to_vec());
        hash
    }

    /// The rows as a reader of the ledger gets them back (`read::read_after`). Equal
    /// because every `data` tally stores (event payloads, plan definitions, corrections)
    /// holds only objects, strings, booleans and integers, which JSONB gives back as they
    /// went in; a float, `-0.0` or a repeated key would not come back the same.
    pub fn into_ledger_rows(mut self) -> Vec<LedgerRow> {
        (0..self.len())
            .map(|i| LedgerRow {
                position: self.position[i],
                id: self.id[i],
                event_type: self.event_type[i].to_owned(),
                org_id: std::mem::take(&mut self.org_id[i]),
                container_id: self.container_id[i].take(),
                occurred_at: self.occurred_at[i],
                recorded_at: self.recorded_at[i],
                data: self.data[i].take(),
                source: self.source[i].take(),
                source_event_id: self.source_event_id[i].take(),
                attributes: self.attributes[i].take(),
                hash: std::mem::take(&mut self.hash[i]),
            })
            .collect()
    }

    /// Binds the thirteen column arrays, in [`COLUMNS`] order, as the next parameters.
    pub fn bind<'q>(
        &'q self,
        query: Query<'q, Postgres, PgArguments>,
    ) -> Query<'q, Postgres, PgArguments> {
        query
            .bind(&self.position)
            .bind(&self.id)
            .bind(&self.event_type)
            .bind(&self.org_id)
            .bind(&self.container_id)
            .bind(&self.occurred_at)
            .bind(&self.recorded_at)
            .bind(&self.data)
            .bind(&self.source)
            .bind(&self.source_event_id)
            .bind(&self.attributes)
            .bind(&self.content_digest)
            .bind(&self.hash)
    }

    /// Binds row `row`'s thirteen values, in [`COLUMNS`] order, as the next parameters.
    pub fn bind_row<'q>(
        &'q self,
        query: Query<'q, Postgres, PgArguments>,
        row: usize,
    ) -> Query<'q, Postgres, PgArguments> {
        query
            .bind(self.position[row])
            .bind(self.id[row])
            .bind(self.event_type[row])
            .bind(&self.org_id[row])
            .bind(&self.container_id[row])
            .bind(self.occurred_at[row])
            .bind(self.recorded_at[row])
            .bind(&self.data[row])
            .bind(&self.source[row])
            .bind(&self.source_event_id[row])
            .bind(&self.attributes[row])
            .bind(&self.content_digest[row])
            .bind(&self.hash[row])
    }

    /// Inserts every row into `table` (the ledger, or a table shaped like it) in one
    /// statement; returns the rows inserted.
    #[tracing::instrument(skip_all, fields(rows = self.len()))]
    pub async fn insert_into(
        &self,
        executor: impl PgExecutor<'_>,
        table: &str,
    ) -> Result<u64, sqlx::Error> {
        let statement = format!(
            "INSERT INTO {table} ({COLUMNS}) \
             SELECT * FROM UNNEST($1::bigint[], $2::uuid[], $3::text[], $4::text[], \
             $5::text[], $6::timestamptz[], $7::timestamptz[], $8::jsonb[], $9::text[], \
             $10::text[], $11::jsonb[], $12::bytea[], $13::bytea[])"
        );
        Ok(self
            .bind(sqlx::query(&statement))
            .execute(executor)
            .await?
            .rows_affected())
    }
}
