//! The projection tables (see the `projections` migration): reading ledger events for the
//! projector, loading and storing lifecycles, writing a run's [`Changes`] with its
//! checkpoint. Every statement names its schema, because replay writes a fresh copy next
//! to the live one.

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::postgres::PgRow;
use sqlx::{Connection, FromRow, PgConnection, Row};
use uuid::Uuid;

use super::model::{
    AnomalyRows, Changes, ContainerKey, IdleCommands, OpenDelta, PeriodDelta, PortKey,
    ProjectedEvent, ANOMALIES_KEPT_MAX, LIFECYCLE_READ_MAX,
};
use super::Error;
use crate::event::{EventId, EventType, PlanId};
use crate::ledger::{Handed, Rows};
use crate::runtime::{
    AccountChange, AccountEntry, Anomaly, AnomalyKind, ContainerEntry, EntryKind, IdleSpan,
    Interval, Lifecycle, Period,
};

/// The schema readers use.
pub const LIVE: &str = "proj";
/// Where replay builds before swapping.
pub const BUILD: &str = "proj_build";

/// Rows per statement when writing: keeps every bind array and statement bounded, however
/// large a replay is.
pub const WRITE_CHUNK_ROWS: usize = 10_000;

/// The columns of [`EventRow`]: only what the projection reads, with `data` reduced in
/// Postgres to the two numbers it needs.
pub const EVENT_COLUMNS: &str = "position, id, type, org_id, container_id, occurred_at, \
     recorded_at, (data->>'duration_ms')::BIGINT AS duration_ms, (data->>'port')::INTEGER AS port, \
     data->>'plan' AS plan, (data->>'verified')::BOOLEAN AS verified, \
     (data->>'eligible')::BOOLEAN AS eligible, \
     CASE WHEN type = 'ledger.event_voided' THEN (data->>'event_id')::UUID END AS voids";

#[derive(Debug, PartialEq)]
pub struct EventRow {
    position: i64,
    id: Uuid,
    event_type: String,
    org_id: String,
    container_id: Option<String>,
    occurred_at: DateTime<Utc>,
    recorded_at: DateTime<Utc>,
    duration_ms: Option<i64>,
    port: Option<i32>,
    plan: Option<String>,
    verified: Option<bool>,
    eligible: Option<bool>,
    voids: Option<Uuid>,
}

/// By position, in the order of [`EVENT_COLUMNS`], which every query that reads an
/// [`EventRow`] selects exactly: finding each column by its name is a hash look-up per
/// value.
impl<'r> FromRow<'r, PgRow> for EventRow {
    fn from_row(row: &'r PgRow) -> sqlx::Result<EventRow> {
        Ok(EventRow {
            position: row.try_get(0)?,
            id: row.try_get(1)?,
            event_type: row.try_get(2)?,
            org_id: row.try_get(3)?,
            container_id: row.try_get(4)?,
            occurred_at: row.try_get(5)?,
            recorded_at: row.try_get(6)?,
            duration_ms: row.try_get(7)?,
            port: row.try_get(8)?,
            plan: row.try_get(9)?,
            verified: row.try_get(10)?,
            eligible: row.try_get(11)?,
            voids: row.try_get(12)?,
        })
    }
}

impl EventRow {
    /// Row `index` of a commit handed over by the appender, as [`EVENT_COLUMNS`] reads it
    /// back from the ledger; `None` when the row holds a value for which this is not
    /// certain (a field of another JSON type than tally writes, a number out of its
    /// column's range, an instant finer than Postgres keeps), which the projector then
    /// reads from the ledger. Every value the event parser admits is certain.
    pub fn of_committed(rows: &Rows, index: usize) -> Option<EventRow> {
        let data = &rows.data[index];
        let (occurred_at, recorded_at) = (rows.occurred_at[index], rows.recorded_at[index]);
        let microseconds = |at: DateTime<Utc>| at.timestamp_subsec_nanos().is_multiple_of(1_000);
        if !microseconds(occurred_at) || !microseconds(recorded_at) {
            return None;
        }
        let event_type = rows.event_type[index];
        let voids = if event_type == EventType::LedgerEventVoided.as_str() {
            match text(data, "event_id")? {
                Some(text) => Some(uuid(text)?),
                None => None,
            }
        } else {
            None
        };
        Some(EventRow {
            position: rows.position[index],
            id: rows.id[index],
            event_type: event_type.to_owned(),
            org_id: rows.org_id[index].clone(),
            container_id: rows.container_id[index].clone(),
            occurred_at,
            recorded_at,
            duration_ms: bigint(data, "duration_ms")?,
            port: bigint(data, "port")?.map(i32::try_from).transpose().ok()?,
            plan: text(data, "plan")?.map(str::to_owned),
            verified: boolean(data, "verified")?,
            eligible: boolean(data, "eligible")?,
            voids,
        })
    }

    pub fn into_event(self) -> Result<ProjectedEvent, Error> {
        let (account, container) = EventFields {
            position: self.position,
            id: self.id,
            event_type: &self.event_type,
            occurred_at: self.occurred_at,
            duration_ms: self.duration_ms,
            port: self.port,
            plan: self.plan.as_deref(),
            verified: self.verified,
            eligible: self.eligible,
        }
        .entries()?;
        let container = match (self.container_id, container) {
            (Some(container_id), Some(entry)) => Some((container_id, entry)),
            _ => None,
        };
        Ok(ProjectedEvent {
            position: self.position,
            recorded_at: self.recorded_at,
            org_id: self.org_id,
            container,
            account,
            voids: self.voids,
        })
    }
}

/// The columns of a ledger row that decide its entries, borrowed from wherever the row was
/// decoded: an [`EventRow`], a row of [`read_histories`], or replay's binary read, which
/// allocates nothing per row.
pub(super) struct EventFields<'a> {
    pub position: i64,
    pub id: Uuid,
    pub event_type: &'a str,
    pub occurred_at: DateTime<Utc>,
    pub duration_ms: Option<i64>,
    pub port: Option<i32>,
    pub plan: Option<&'a str>,
    pub verified: Option<bool>,
    pub eligible: Option<bool>,
}

impl EventFields<'_> {
    /// The event's entry in its org's account (org events) and in its container's history
    /// (container events of a type the runtime reads), when it has a container.
    pub fn entries(&self) -> Result<(Option<AccountEntry>, Option<ContainerEntry>), Error> {
        let position = self.position;
        let event_id = self.event_id()?;
        let change = match EventType::parse(self.event_type) {
            Some(EventType::OrgPlanChanged) => Some(AccountChange::Plan(
                PlanId::parse(self.plan.unwrap_or_default())
                    .map_err(|e| Error::corrupt(format!("the plan of position {position}"), e))?,
            )),
            Some(EventType::OrgVerificationChanged) => {
                Some(AccountChange::Verified(self.verified.ok_or_else(|| {
                    Error::Corrupt(format!("position {position}: no verified"))
                })?))
            }
            Some(EventType::OrgBillingEligibilityChanged) => Some(AccountChange::BillingEligible(
                self.eligible
                    .ok_or_else(|| Error::Corrupt(format!("position {position}: no eligible")))?,
            )),
            _ => None,
        };
        let account = change.map(|change| AccountEntry {
            occurred_at: self.occurred_at,
            position,
            event_id,
            change,
        });
        Ok((account, self.container_entry_of(event_id)?))
    }

    /// The container entry alone (`None` for an event of no container), for readers of
    /// container histories: an org event's fields are not needed, nor read.
    pub fn container_entry(&self) -> Result<Option<ContainerEntry>, Error> {
        self.container_entry_of(self.event_id()?)
    }

    fn container_entry_of(&self, event_id: EventId) -> Result<Option<ContainerEntry>, Error> {
        let kind = entry_kind(self.event_type, self.duration_ms, self.port)?;
        Ok(kind.map(|kind| ContainerEntry {
            occurred_at: self.occurred_at,
            position: self.position,
            event_id,
            kind,
        }))
    }

    fn event_id(&self) -> Result<EventId, Error> {
        EventId::from_uuid(self.id)
            .map_err(|e| Error::corrupt(format!("position {}", self.position), e))
    }
}

// What `data->>'key'` cast to a column type gives, for the JSON values whose answer is
// certain: `Some(None)` for an absent key, a JSON null or a `data` that is not an object
// (SQL NULL), `Some(Some(value))` for a value of the JSON type tally writes there, and
// `None` (not certain: read the ledger) for anything else, such as a number written as a
// string, which Postgres would cast, or a fraction, which it would refuse.

/// `(data->>key)::BIGINT`, for a JSON integer.
fn bigint(data: &serde_json::Value, key: &str) -> Option<Option<i64>> {
    match data.get(key) {
        None | Some(serde_json::Value::Null) => Some(None),
        Some(serde_json::Value::Number(number)) => number.as_i64().map(Some),
        Some(_) => None,
    }
}

/// `data->>key`, for a JSON string.
fn text<'a>(data: &'a serde_json::Value, key: &str) -> Option<Option<&'a str>> {
    match data.get(key) {
        None | Some(serde_json::Value::Null) => Some(None),
        Some(serde_json::Value::String(text)) => Some(Some(text)),
        Some(_) => None,
    }
}

/// `(data->>key)::BOOLEAN`, for a JSON boolean.
fn boolean(data: &serde_json::Value, key: &str) -> Option<Option<bool>> {
    match data.get(key) {
        None | Some(serde_json::Value::Null) => Some(None),
        Some(serde_json::Value::Bool(value)) => Some(Some(*value)),
        Some(_) => None,
    }
}

/// `text::UUID`, for a UUID in the hyphenated form (in either case), which Postgres and
/// [`Uuid::try_parse`] read alike; `None` for any other spelling.
fn uuid(text: &str) -> Option<Uuid> {
    if text.len() != 36 {
        return None;
    }
    Uuid::try_parse(text).ok()
}

/// An event of a commit handed over by the appender, as [`read_events`] reads it; left
/// out (so read from the ledger) when [`EventRow::of_committed`] is not certain of it, or
/// when it does not decode, so that the ledger path reports it.
impl Handed for ProjectedEvent {
    fn position(&self) -> i64 {
        self.position
    }

    fn from_committed(rows: Arc<Rows>) -> Vec<ProjectedEvent> {
        (0..rows.len())
            .filter_map(|index| EventRow::of_committed(&rows, index)?.into_event().ok())
            .collect()
    }
}

/// The runtime entry of a stored event type; `None` for types the runtime does not read.
fn entry_kind(
    event_type: &str,
    duration_ms: Option<i64>,
    port: Option<i32>,
) -> Result<Option<EntryKind>, Error> {
    let kind = match EventType::parse(event_type) {
        Some(EventType::ContainerCreated) => EntryKind::Created,
        Some(EventType::ContainerResumed) => EntryKind::Resumed,
        Some(EventType::ContainerStopped) => EntryKind::Stopped,
        Some(EventType::ContainerCommandRan) => EntryKind::CommandRan {
            duration_ms: duration_ms
                .ok_or_else(|| Error::Corrupt("a stored command has no duration_ms".to_owned()))?,
        },
        Some(EventType::ContainerPortPublished) => EntryKind::PortPublished {
            port: port
                .and_then(|port| u16::try_from(port).ok())
                .ok_or_else(|| {
                    Error::Corrupt("a stored port_published has no valid port".to_owned())
                })?,
        },
        _ => return Ok(None),
    };
    Ok(Some(kind))
}

/// Up to `limit` events after `after`, in position order.
pub async fn read_events(
    connection: &mut PgConnection,
    after: i64,
    limit: usize,
) -> Result<Vec<ProjectedEvent>, Error> {
    let rows: Vec<EventRow> = sqlx::query_as(&format!(
        "SELECT {EVENT_COLUMNS} FROM ledger WHERE position > $1 ORDER BY position LIMIT $2"
    ))
    .bind(after)
    .bind(i64::try_from(limit).unwrap_or(i64::MAX))
    .fetch_all(connection)
    .await?;
    rows.into_iter().map(EventRow::into_event).collect()
}

/// Which events of a container [`read_histories`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum History {
    /// Every event: the whole history, for a container a void reached.
    Whole,
    /// `created`, `resumed` and `stopped`: what [`Changes::refold_lifecycle`] folds, read
    /// by instant from the ledger's partial index of them (the same types as its
    /// predicate), so that the container's commands are not read; only the first
    /// [`LIFECYCLE_READ_MAX`] in (`occurred_at`, position) order, through the function
    /// `tally_first_lifecycle_events`, which walks the index in its order and stops there.
    Lifecycle,
}

/// The events of each container that `history` names, up to and including `until`,
/// voided ones left out. Another org's events under the same container id are left in the
/// table, not read and decoded: a container's refold costs its own history, whatever other
/// orgs send. Each row is read as it arrives (its container as its index in `keys`, its
/// position, id, type and instant, and the payload's two figures only when commands and
/// ports are read) and kept only as its entry: a container with a million lifecycle events
/// costs their entries in memory, not their rows as well.
pub async fn read_histories(
    connection: &mut PgConnection,
    keys: &[ContainerKey],
    until: i64,
    history: History,
) -> Result<HashMap<ContainerKey, Vec<ContainerEntry>>, Error> {
    let ids: Vec<&str> = keys.iter().map(|key| key.container_id.as_str()).collect();
    let orgs: Vec<&str> = keys.iter().map(|key| key.org_id.as_str()).collect();
    // The lifecycle events through a function that walks the lifecycle index in its order
    // and stops at the first LIFECYCLE_READ_MAX (its migration says why it is a function).
    let query = match history {
        History::Whole => format!(
            "SELECT k.i, l.* \
             FROM UNNEST($1::TEXT[], $2::TEXT[]) WITH ORDINALITY k (org_id, container_id, i) \
             CROSS JOIN LATERAL (SELECT position, id, type, occurred_at, \
                 (data->>'duration_ms')::BIGINT, (data->>'port')::INTEGER FROM ledger \
               WHERE ledger.container_id = k.container_id AND ledger.org_id = k.org_id \
                 AND position <= $3 \
                 AND NOT EXISTS (SELECT 1 FROM {LIVE}.voided v WHERE v.event_id = ledger.id)) l"
        ),
        History::Lifecycle => "SELECT h.*, NULL::BIGINT, NULL::INTEGER \
             FROM tally_first_lifecycle_events($1::TEXT[], $2::TEXT[], $3, $4) h"
            .to_owned(),
    };
    let mut histories: Vec<Vec<ContainerEntry>> = vec![Vec::new(); keys.len()];
    let mut query = sqlx::query(&query).bind(&orgs).bind(&ids).bind(until);
    if history == History::Lifecycle {
        query = query.bind(i64::try_from(LIFECYCLE_READ_MAX).expect("a small constant"));
    }
    let mut rows = query.fetch(connection);
    while let Some(row) = rows.try_next().await? {
        let index: i64 = row.try_get(0)?;
        let fields = EventFields {
            position: row.try_get(1)?,
            id: row.try_get(2)?,
            event_type: row.try_get(3)?,
            occurred_at: row.try_get(4)?,
            duration_ms: row.try_get(5)?,
            port: row.try_get(6)?,
            plan: None,
            verified: None,
            eligible: None,
        };
        let history = usize::try_from(index - 1)
            .ok()
            .and_then(|index| histories.get_mut(index))
            .ok_or_else(|| Error::Corrupt(format!("no container at index {index}")))?;
        history.extend(fields.container_entry()?);
    }
    Ok(keys.iter().cloned().zip(histories).collect())
}

/// Each container's commands up to and including `until` that one of its idle spans
/// holds, voided ones left out: how many, and the first `first_max` (at least one) of them
/// in (`occurred_at`, position) order. One pass over each container's commands by the
/// container index, in Postgres: only the first ones come back, each with the count.
pub async fn read_idle_commands(
    connection: &mut PgConnection,
    spans: &[(&ContainerKey, Vec<IdleSpan>)],
    until: i64,
    first_max: u64,
) -> Result<HashMap<ContainerKey, IdleCommands>, Error> {
    assert!(first_max > 0, "the count comes with the first ones");
    let ids: Vec<&str> = spans
        .iter()
        .map(|(key, _)| key.container_id.as_str())
        .collect();
    let orgs: Vec<&str> = spans.iter().map(|(key, _)| key.org_id.as_str()).collect();
    let each: Vec<(i32, IdleSpan)> = (1i32..)
        .zip(spans)
        .flat_map(|(owner, (_, idle))| idle.iter().map(move |span| (owner, *span)))
        .collect();
    // Each container's spans as one multirange; a span names its container by its place
    // (from 1) in `$4` and `$5`. A range's missing bound is unbounded.
    let first: Vec<(i32, Uuid, DateTime<Utc>, i64, i64)> = sqlx::query_as(&format!(
        "WITH idle AS ( \
           SELECT owner, range_agg(tstzrange(from_at, until_at, '[)')) AS spans \
           FROM UNNEST($1::INT[], $2::TIMESTAMPTZ[], $3::TIMESTAMPTZ[]) s (owner, from_at, until_at) \
           GROUP BY owner) \
         SELECT idle.owner, c.id, c.occurred_at, c.position, c.total FROM idle \
         CROSS JOIN LATERAL ( \
           SELECT id, occurred_at, position, count(*) OVER () AS total FROM ledger \
           WHERE container_id = ($4::TEXT[])[idle.owner] AND org_id = ($5::TEXT[])[idle.owner] \
             AND type = 'container.command_ran' AND position <= $6 \
             AND idle.spans @> occurred_at \
             AND NOT EXISTS (SELECT 1 FROM {LIVE}.voided v WHERE v.event_id = ledger.id) \
           ORDER BY occurred_at, position LIMIT $7) c"
    ))
    .bind(each.iter().map(|(owner, _)| *owner).collect::<Vec<_>>())
    .bind(each.iter().map(|(_, span)| span.from).collect::<Vec<_>>())
    .bind(each.iter().map(|(_, span)| span.until).collect::<Vec<_>>())
    .bind(&ids)
    .bind(&orgs)
    .bind(until)
    .bind(i64::try_from(first_max).unwrap_or(i64::MAX))
    .fetch_all(connection)
    .await?;
    let mut idle: Vec<IdleCommands> = vec![IdleCommands::default(); spans.len()];
    for (owner, id, occurred_at, position, total) in first {
        let of = &mut idle[usize::try_from(owner - 1).expect("places start at 1")];
        of.total = u64::try_from(total).map_err(|e| Error::corrupt("a count of commands", e))?;
        of.first.push(Anomaly {
            kind: AnomalyKind::CommandWhileNotRunning,
            event_id: EventId::from_uuid(id)
                .map_err(|e| Error::corrupt(format!("position {position}"), e))?,
            occurred_at,
            position,
        });
    }
    Ok(spans
        .iter()
        .map(|(key, _)| (*key).clone())
        .zip(idle)
        .collect())
}

/// Records `voids` (voided event, position of the void) and returns the events voided for
/// the first time, as the projection reads them. An event voided twice is taken back once.
pub async fn record_voids(
    connection: &mut PgConnection,
    schema: &str,
    voids: &[(Uuid, i64)],
) -> Result<Vec<ProjectedEvent>, Error> {
    if voids.is_empty() {
        return Ok(Vec::new());
    }
    let ids: Vec<Uuid> = voids.iter().map(|(id, _)| *id).collect();
    let positions: Vec<i64> = voids.iter().map(|(_, position)| *position).collect();
    let newly: Vec<Uuid> = sqlx::query_scalar(&format!(
        "INSERT INTO {schema}.voided (event_id, position) \
         SELECT * FROM UNNEST($1::UUID[], $2::BIGINT[]) ON CONFLICT (event_id) DO NOTHING \
         RETURNING event_id"
    ))
    .bind(&ids)
    .bind(&positions)
    .fetch_all(&mut *connection)
    .await?;
    let rows: Vec<EventRow> = sqlx::query_as(&format!(
        "SELECT {EVENT_COLUMNS} FROM (SELECT l.* FROM ledger_ids i \
         JOIN ledger l USING (position, recorded_at) WHERE i.id = ANY($1)) ledger \
         ORDER BY position"
    ))
    .bind(&newly)
    .fetch_all(connection)
    .await?;
    rows.into_iter().map(EventRow::into_event).collect()
}

/// Reservations consumed by a start dated ahead that is now voided: the start will never
/// come, so they stop holding its slot at once (their start instant is forgotten; they
/// stay consumed). Runs in the round that records the voids.
pub async fn forget_voided_starts(
    connection: &mut PgConnection,
    voided: &[ProjectedEvent],
) -> sqlx::Result<()> {
    let starts: Vec<Uuid> = voided
        .iter()
        .filter_map(|event| event.container.as_ref())
        .filter(|(_, entry)| matches!(entry.kind, EntryKind::Created | EntryKind::Resumed))
        .map(|(_, entry)| entry.event_id.as_uuid())
        .collect();
    if starts.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "UPDATE admission_reservation SET consumed_starts_at = NULL \
         WHERE consumed_by = ANY($1) AND consumed_starts_at IS NOT NULL",
    )
    .bind(&starts)
    .execute(connection)
    .await?;
    Ok(())
}

/// The checkpoint of `schema`, locked for this transaction, which may then sit idle for at
/// most `LOCK_IDLE_TIMEOUT_MS`; `None` when another transaction (another instance's
/// projector, or a replay swapping) holds it.
pub async fn lock_checkpoint(
    connection: &mut PgConnection,
    schema: &str,
) -> sqlx::Result<Option<i64>> {
    sqlx::query_scalar(&format!(
        "SELECT position, {} FROM {schema}.checkpoint FOR UPDATE SKIP LOCKED",
        crate::ledger::db::BOUND_LOCK_IDLE
    ))
    .fetch_optional(connection)
    .await
}

pub async fn checkpoint(connection: &mut PgConnection, schema: &str) -> sqlx::Result<i64> {
    sqlx::query_scalar(&format!("SELECT position FROM {schema}.checkpoint"))
        .fetch_one(connection)
        .await
}

#[derive(FromRow)]
struct LifecycleRow {
    org_id: String,
    container_id: String,
    intervals: String,
    anomalies_total: i64,
    lifecycle_total: i64,
    last_at: DateTime<Utc>,
}

/// The columns of [`LifecycleRow`]: never the anomalies themselves, which are rows of
/// `container_anomaly`, read a page at a time ([`container_anomalies`]).
const CONTAINER_COLUMNS: &str = "org_id, container_id, intervals::TEXT AS intervals, \
     anomalies_total, lifecycle_total, last_at";

impl LifecycleRow {
    fn lifecycle(&self) -> Result<Lifecycle, Error> {
        decode_lifecycle(
            &self.intervals,
            self.anomalies_total,
            self.lifecycle_total,
            self.last_at,
        )
        .map_err(|e| {
            Error::corrupt(
                format!("stored container {} of {}", self.container_id, self.org_id),
                e,
            )
        })
    }

    fn decode(self) -> Result<StoredContainer, Error> {
        let lifecycle = self.lifecycle()?;
        Ok(StoredContainer {
            org_id: self.org_id,
            container_id: self.container_id,
            lifecycle,
        })
    }
}

/// The stored lifecycles of the containers that have one.
pub async fn load_lifecycles(
    connection: &mut PgConnection,
    schema: &str,
    keys: &[ContainerKey],
) -> Result<HashMap<ContainerKey, Lifecycle>, Error> {
    let orgs: Vec<&str> = keys.iter().map(|key| key.org_id.as_str()).collect();
    let ids: Vec<&str> = keys.iter().map(|key| key.container_id.as_str()).collect();
    let rows: Vec<LifecycleRow> = sqlx::query_as(&format!(
        "SELECT {CONTAINER_COLUMNS} \
         FROM UNNEST($1::TEXT[], $2::TEXT[]) AS k(org_id, container_id) \
         JOIN {schema}.container c USING (container_id, org_id)"
    ))
    .bind(&orgs)
    .bind(&ids)
    .fetch_all(connection)
    .await?;
    rows.into_iter()
        .map(|row| {
            let lifecycle = row.lifecycle()?;
            let key = ContainerKey {
                org_id: row.org_id,
                container_id: row.container_id,
            };
            Ok((key, lifecycle))
        })
        .collect()
}

/// One stored container, as the container endpoint reads it.
#[derive(Debug)]
pub struct StoredContainer {
    pub org_id: String,
    pub container_id: String,
    pub lifecycle: Lifecycle,
}

/// Every org's record of a container id (one, unless orgs reused it), or of one org's.
pub async fn containers_by_id(
    connection: &mut PgConnection,
    container_id: &str,
    org_id: Option<&str>,
) -> Result<Vec<StoredContainer>, Error> {
    let rows: Vec<LifecycleRow> = sqlx::query_as(&format!(
        "SELECT {CONTAINER_COLUMNS} FROM {LIVE}.container WHERE container_id = $1 AND ($2::TEXT IS NULL OR org_id = $2) \
         ORDER BY org_id"
    ))
    .bind(container_id)
    .bind(org_id)
    .fetch_all(connection)
    .await?;
    rows.into_iter().map(LifecycleRow::decode).collect()
}

/// The lifecycles of an org's containers.
pub async fn org_lifecycles(
    connection: &mut PgConnection,
    org_id: &str,
) -> Result<Vec<Lifecycle>, Error> {
    let rows: Vec<LifecycleRow> = sqlx::query_as(&format!(
        "SELECT {CONTAINER_COLUMNS} FROM {LIVE}.container WHERE org_id = $1"
    ))
    .bind(org_id)
    .fetch_all(connection)
    .await?;
    rows.into_iter()
        .map(|row| Ok(row.decode()?.lifecycle))
        .collect()
}

fn encode_intervals(lifecycle: &Lifecycle) -> String {
    let intervals: Vec<(i64, Option<i64>)> = lifecycle
        .intervals()
        .iter()
        .map(|interval| {
            (
                interval.start().timestamp_millis(),
                interval.end().map(|end| end.timestamp_millis()),
            )
        })
        .collect();
    serde_json::to_string(&intervals).expect("numbers serialize")
}

fn instant(ms: i64) -> Result<DateTime<Utc>, Error> {
    DateTime::from_timestamp_millis(ms)
        .ok_or_else(|| Error::Corrupt(format!("{ms} ms is not an instant")))
}

/// A container's stored `intervals` column (`[[start_ms, end_ms or null], ...]`).
pub fn decode_intervals(intervals: &str) -> Result<Vec<Interval>, Error> {
    let pairs: Vec<(i64, Option<i64>)> =
        serde_json::from_str(intervals).map_err(|e| Error::corrupt("intervals", e))?;
    pairs
        .into_iter()
        .map(|(start, end)| {
            Ok(Interval::new(
                instant(start)?,
                end.map(instant).transpose()?,
            ))
        })
        .collect()
}

/// The change an `account_change` row stores: exactly one of its three values is set.
pub fn account_change(
    position: i64,
    plan: Option<String>,
    verified: Option<bool>,
    billing_eligible: Option<bool>,
) -> Result<AccountChange, Error> {
    Ok(match (plan, verified, billing_eligible) {
        (Some(plan), None, None) => {
            AccountChange::Plan(PlanId::parse(&plan).map_err(|e| Error::corrupt("plan", e))?)
        }
        (None, Some(value), None) => AccountChange::Verified(value),
        (None, None, Some(value)) => AccountChange::BillingEligible(value),
        _ => {
            return Err(Error::Corrupt(format!(
                "account change at position {position} sets not exactly one value"
            )))
        }
    })
}

fn decode_lifecycle(
    intervals: &str,
    anomalies_total: i64,
    lifecycle_total: i64,
    last_at: DateTime<Utc>,
) -> Result<Lifecycle, Error> {
    let intervals = decode_intervals(intervals)?;
    let anomalies_total =
        u64::try_from(anomalies_total).map_err(|e| Error::corrupt("anomalies_total", e))?;
    let lifecycle_total =
        u64::try_from(lifecycle_total).map_err(|e| Error::corrupt("lifecycle_total", e))?;
    Ok(Lifecycle::restore(
        intervals,
        anomalies_total,
        lifecycle_total,
        Some(last_at),
    ))
}

/// Where a page of a container's anomalies starts: after the anomaly with this
/// (`occurred_at`, position), the order they are kept in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AnomalyCursor {
    pub occurred_at: DateTime<Utc>,
    pub position: i64,
}

impl AnomalyCursor {
    pub fn of(anomaly: &Anomaly) -> AnomalyCursor {
        AnomalyCursor {
            occurred_at: anomaly.occurred_at,
            position: anomaly.position,
        }
    }
}

#[derive(FromRow)]
struct AnomalyRow {
    kind: String,
    event_id: Uuid,
    occurred_at: DateTime<Utc>,
    position: i64,
}

/// Up to `limit` of a container's kept anomalies after `after`, in (`occurred_at`,
/// position) order: one range scan of the primary key, whatever the container keeps.
pub async fn container_anomalies(
    connection: &mut PgConnection,
    org_id: &str,
    container_id: &str,
    after: Option<AnomalyCursor>,
    limit: usize,
) -> Result<Vec<Anomaly>, Error> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    let rows: Vec<AnomalyRow> = match after {
        None => {
            sqlx::query_as(&format!(
                "SELECT kind, event_id, occurred_at, position FROM {LIVE}.container_anomaly \
                 WHERE container_id = $1 AND org_id = $2 \
                 ORDER BY occurred_at, position LIMIT $3"
            ))
            .bind(container_id)
            .bind(org_id)
            .bind(limit)
            .fetch_all(connection)
            .await?
        }
        Some(after) => {
            sqlx::query_as(&format!(
                "SELECT kind, event_id, occurred_at, position FROM {LIVE}.container_anomaly \
                 WHERE container_id = $1 AND org_id = $2 AND (occurred_at, position) > ($3, $4) \
                 ORDER BY occurred_at, position LIMIT $5"
            ))
            .bind(container_id)
            .bind(org_id)
            .bind(after.occurred_at)
            .bind(after.position)
            .bind(limit)
            .fetch_all(connection)
            .await?
        }
    };
    rows.into_iter()
        .map(|row| {
            Ok(Anomaly {
                kind: AnomalyKind::parse(&row.kind)
                    .ok_or_else(|| Error::Corrupt(format!("anomaly kind {:?}", row.kind)))?,
                event_id: EventId::from_uuid(row.event_id)
                    .map_err(|e| Error::corrupt("event id", e))?,
                occurred_at: row.occurred_at,
                position: row.position,
            })
        })
        .collect()
}

/// How a write reaches a schema's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Load {
    /// Into tables that may hold rows already (a projector round): each statement merges
    /// with `ON CONFLICT`, and the indexes are kept up to date row by row.
    Merge,
    /// Into the empty tables of a schema that a replay is building, stripped of their
    /// indexes ([`strip_indexes`]): every key is new (each comes from one map entry or one
    /// ledger position), so rows are appended as they are, and each index is then built
    /// once, by a sort, rather than by one B-tree descent per row.
    Fresh,
}

impl Load {
    /// `clause` when merging, nothing when loading fresh tables (which have no index for
    /// `ON CONFLICT` to find a conflict by, and no row to conflict with).
    fn merging(self, clause: &str) -> &str {
        match self {
            Load::Merge => clause,
            Load::Fresh => "",
        }
    }
}

/// Writes a finished run of changes into `schema` and moves its checkpoint to `position`.
/// Call inside the transaction that locked the checkpoint (or, for replay, the only writer).
pub async fn write(
    connection: &mut PgConnection,
    schema: &str,
    changes: &mut Changes,
    position: i64,
) -> Result<(), Error> {
    let first = write_ports(connection, schema, changes, Load::Merge).await?;
    count_first_publications(changes, first);
    recount_voided_ports(connection, schema, changes, position).await?;
    let (moved, rest): (Vec<_>, Vec<_>) = changes
        .lifecycles()
        .partition(|(key, _)| changes.intervals_unchanged(key));
    move_containers(connection, schema, &moved).await?;
    write_containers(connection, schema, &rest, Load::Merge).await?;
    write_anomalies(connection, schema, changes).await?;
    write_voids(connection, schema, changes).await?;
    write_rest(connection, schema, changes, Load::Merge).await?;
    write_checkpoint(connection, schema, position).await
}

/// The tables [`write_fresh`] loads without their indexes: all that grow with the ledger.
/// `voided` keeps its primary key: an event voided twice is stored once, by `ON CONFLICT`.
const FRESH_TABLES: [&str; 7] = [
    "container",
    "container_anomaly",
    "port",
    "org_period",
    "org_open",
    "org",
    "account_change",
];

/// Writes a replay's changes ([`Changes::from_histories`]) into `schema`, freshly created
/// by `tally_create_projection_schema` and empty, and moves its checkpoint to `position`:
/// the same rows as [`write`], loaded before the indexes are built. The indexes and
/// primary keys are dropped first and created again afterwards from their own definitions
/// (so the schema ends as the function made it); creating a primary key's index also checks
/// that no key was written twice.
///
/// `connection` and `helper` (a second connection) each write and commit a share of the
/// rows, then build the indexes between them: one backend doing either alone leaves a core
/// idle. `schema` is not live until the replay swaps it in, so nobody sees it without its
/// indexes; a replay that stops half-way leaves it to the next, which drops it. The
/// checkpoint is written last, after the indexes.
pub async fn write_fresh(
    connection: &mut PgConnection,
    helper: &mut PgConnection,
    schema: &str,
    mut changes: Changes,
    position: i64,
) -> Result<FreshWrite, Error> {
    let started = std::time::Instant::now();
    let mut transaction = connection.begin().await?;
    let indexes = strip_indexes(&mut transaction, schema, &FRESH_TABLES).await?;
    transaction.commit().await?;
    // What [`write`] recounts after a void: a replay leaves voided events out before it
    // counts anything, so its changes hold none.
    assert!(
        changes.voided_ports.is_empty(),
        "a replay's changes count no voided publication"
    );
    // Every pair is stored for the first time: each is one entry of the map.
    let pairs: Vec<(String, Period)> = changes
        .ports
        .keys()
        .map(|key| (key.org_id.clone(), key.period))
        .collect();
    count_first_publications(&mut changes, pairs);
    // Two connections at once, each writing half of the containers, one of them also the
    // anomalies and the per-org tables, the other the ports: the build schema is read by no
    // one until the swap, so each commits on its own.
    let changes = &changes;
    let lifecycles: Vec<_> = changes.lifecycles().collect();
    let (first_half, second_half) = lifecycles.split_at(lifecycles.len() / 2);
    let (first, second) = tokio::join!(
        async {
            let mut transaction = connection.begin().await?;
            write_containers(&mut transaction, schema, first_half, Load::Fresh).await?;
            let rows: Vec<(&ContainerKey, AnomalyRows)> =
                changes.anomaly_rows(ANOMALIES_KEPT_MAX).collect();
            // Nothing is stored to replace or trim: only the rows to insert count.
            let inserted: Vec<(&ContainerKey, &Anomaly)> = rows
                .iter()
                .flat_map(|(key, rows)| rows.insert.iter().map(move |anomaly| (*key, anomaly)))
                .collect();
            insert_anomalies(&mut transaction, schema, &inserted).await?;
            write_rest(&mut transaction, schema, changes, Load::Fresh).await?;
            transaction.commit().await?;
            Ok::<_, Error>(())
        },
        async {
            let mut transaction = helper.begin().await?;
            write_ports(&mut transaction, schema, changes, Load::Fresh).await?;
            write_containers(&mut transaction, schema, second_half, Load::Fresh).await?;
            transaction.commit().await?;
            Ok::<_, Error>(())
        }
    );
    first?;
    second?;
    let rows = started.elapsed();
    restore_indexes(&mut *connection, helper, &indexes).await?;
    let indexes = started.elapsed() - rows;
    let mut transaction = connection.begin().await?;
    // `voided` kept its primary key (see [`FRESH_TABLES`]); a replay's changes remove no
    // container, so the rest of this deletes nothing.
    write_voids(&mut transaction, schema, changes).await?;
    write_checkpoint(&mut transaction, schema, position).await?;
    transaction.commit().await?;
    Ok(FreshWrite { rows, indexes })
}

/// How long [`write_fresh`] took to write the rows and to build the indexes.
#[derive(Debug, Clone, Copy)]
pub struct FreshWrite {
    pub rows: std::time::Duration,
    pub indexes: std::time::Duration,
}

/// The per-org tables: period totals, open intervals, latest instants, account changes.
async fn write_rest(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
    load: Load,
) -> Result<(), Error> {
    write_periods(connection, schema, changes, load).await?;
    write_open(connection, schema, changes, load).await?;
    write_latest(connection, schema, changes, load).await?;
    write_accounts(connection, schema, changes, load).await
}

async fn write_checkpoint(
    connection: &mut PgConnection,
    schema: &str,
    position: i64,
) -> Result<(), Error> {
    sqlx::query(&format!(
        "UPDATE {schema}.checkpoint SET position = $1, projected_at = now()"
    ))
    .bind(position)
    .execute(&mut *connection)
    .await?;
    Ok(())
}

/// What [`strip_indexes`] dropped: the statements that build the indexes again (those of
/// primary keys and unique constraints as plain unique indexes, so that any two can be
/// built at once: adding a constraint locks its table whole), then those that make such
/// indexes the constraints they were.
#[derive(Debug)]
struct StrippedIndexes {
    builds: Vec<String>,
    constraints: Vec<String>,
}

/// Drops every index and primary key of `tables` in `schema`, and returns the statements
/// that create them again exactly as they were (names, columns, collations, predicates),
/// read from the catalog rather than repeated here, so that they cannot drift from the
/// migrations.
async fn strip_indexes(
    connection: &mut PgConnection,
    schema: &str,
    tables: &[&str],
) -> Result<StrippedIndexes, Error> {
    let qualified: Vec<String> = tables
        .iter()
        .map(|table| format!("{schema}.{table}"))
        .collect();
    // Constraints first (their indexes go with them), then the other indexes. A primary
    // key or unique constraint is built again as its index, then attached to it by name; an
    // exclusion constraint cannot be, and is added again whole.
    let constraints: Vec<(String, String, String, String, String, String)> = sqlx::query_as(
        "SELECT conrelid::regclass::TEXT, quote_ident(conname), contype::TEXT, \
                pg_get_constraintdef(c.oid), pg_get_indexdef(conindid), quote_ident(i.relname) \
         FROM pg_constraint c JOIN pg_class i ON i.oid = c.conindid \
         WHERE conrelid = ANY($1::TEXT[]::REGCLASS[]) AND contype IN ('p', 'u', 'x') \
         ORDER BY conrelid, conname",
    )
    .bind(&qualified)
    .fetch_all(&mut *connection)
    .await?;
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexrelid::regclass::TEXT, pg_get_indexdef(indexrelid) FROM pg_index i \
         WHERE indrelid = ANY($1::TEXT[]::REGCLASS[]) \
           AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid) \
         ORDER BY indrelid, indexrelid",
    )
    .bind(&qualified)
    .fetch_all(&mut *connection)
    .await?;
    let mut drops = Vec::new();
    let mut stripped = StrippedIndexes {
        builds: Vec::new(),
        constraints: Vec::new(),
    };
    for (table, name, kind, definition, index_definition, index) in &constraints {
        drops.push(format!("ALTER TABLE {table} DROP CONSTRAINT {name}"));
        let kind = match kind.as_str() {
            "p" => "PRIMARY KEY",
            "u" => "UNIQUE",
            _ => {
                stripped.constraints.push(format!(
                    "ALTER TABLE {table} ADD CONSTRAINT {name} {definition}"
                ));
                continue;
            }
        };
        stripped.builds.push(index_definition.clone());
        stripped.constraints.push(format!(
            "ALTER TABLE {table} ADD CONSTRAINT {name} {kind} USING INDEX {index}"
        ));
    }
    for (index, definition) in &indexes {
        drops.push(format!("DROP INDEX {index}"));
        stripped.builds.push(definition.clone());
    }
    for statement in drops {
        execute_statement(connection, statement).await?;
    }
    Ok(stripped)
}

/// Creates again what [`strip_indexes`] dropped: the indexes on `connection` and `helper`
/// at once, each taking the next statement when it is done, then the constraints.
async fn restore_indexes(
    connection: &mut PgConnection,
    helper: &mut PgConnection,
    indexes: &StrippedIndexes,
) -> Result<(), Error> {
    let queue = std::sync::Mutex::new(indexes.builds.iter());
    futures::try_join!(
        build_indexes(&mut *connection, &queue),
        build_indexes(helper, &queue)
    )?;
    for statement in &indexes.constraints {
        execute_statement(connection, statement.clone()).await?;
    }
    Ok(())
}

/// Runs the statements of `queue` on `connection` until none is left.
async fn build_indexes(
    connection: &mut PgConnection,
    queue: &std::sync::Mutex<std::slice::Iter<'_, String>>,
) -> Result<(), Error> {
    loop {
        let next = queue.lock().expect("never poisoned").next().cloned();
        let Some(statement) = next else {
            return Ok(());
        };
        execute_statement(connection, statement).await?;
    }
}

/// Runs a statement made here, naming it in the error.
async fn execute_statement(connection: &mut PgConnection, statement: String) -> Result<(), Error> {
    sqlx::raw_sql(&statement)
        .execute(&mut *connection)
        .await
        .map_err(|source| Error::Statement { statement, source })?;
    Ok(())
}

/// Stores each (container, port, period) once with its first instant; returns the org and
/// period of each pair stored for the first time under [`Load::Merge`] (under
/// [`Load::Fresh`] every pair is, and nothing is returned: the caller counts them all).
// Long: the merge and the fresh load of a chunk bind the same five column arrays; apart,
// each would build them again.
async fn write_ports(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
    load: Load,
) -> Result<Vec<(String, Period)>, Error> {
    let mut first = Vec::new();
    let ports: Vec<_> = changes
        .ports
        .iter()
        .map(|(key, at)| (key.clone(), *at))
        .collect();
    for chunk in ports.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|(key, _)| key.org_id.as_str()).collect();
        let periods: Vec<String> = chunk
            .iter()
            .map(|(key, _)| key.period.to_string())
            .collect();
        let containers: Vec<&str> = chunk
            .iter()
            .map(|(key, _)| key.container_id.as_str())
            .collect();
        let numbers: Vec<i32> = chunk.iter().map(|(key, _)| i32::from(key.port)).collect();
        let firsts: Vec<DateTime<Utc>> = chunk.iter().map(|(_, at)| *at).collect();
        match load {
            Load::Merge => sqlx::query_as(&format!(
                "INSERT INTO {schema}.port AS p (org_id, period, container_id, port, first_at) \
                 SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::INTEGER[], \
                                      $5::TIMESTAMPTZ[]) \
                 ON CONFLICT (org_id, period, container_id, port) \
                 DO UPDATE SET first_at = LEAST(p.first_at, EXCLUDED.first_at) \
                 RETURNING org_id, period, (xmax = 0) AS inserted"
            ))
            .bind(&orgs)
            .bind(&periods)
            .bind(&containers)
            .bind(&numbers)
            .bind(&firsts)
            .fetch_all(&mut *connection)
            .await
            .map_err(Error::from)
            .and_then(|rows: Vec<(String, String, bool)>| {
                for (org_id, period, inserted) in rows {
                    if inserted {
                        let period =
                            Period::parse(&period).map_err(|e| Error::corrupt("period", e))?;
                        first.push((org_id, period));
                    }
                }
                Ok(())
            })?,
            Load::Fresh => {
                sqlx::query(&format!(
                    "INSERT INTO {schema}.port (org_id, period, container_id, port, first_at) \
                     SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::INTEGER[], \
                                          $5::TIMESTAMPTZ[])"
                ))
                .bind(&orgs)
                .bind(&periods)
                .bind(&containers)
                .bind(&numbers)
                .bind(&firsts)
                .execute(&mut *connection)
                .await?;
            }
        }
    }
    Ok(first)
}

/// Counts each pair stored for the first time into its period's totals.
fn count_first_publications(changes: &mut Changes, first: Vec<(String, Period)>) {
    for key in first {
        changes.periods.entry(key).or_default().ports_published += 1;
    }
}

async fn write_containers(
    connection: &mut PgConnection,
    schema: &str,
    lifecycles: &[(&ContainerKey, &Lifecycle)],
    load: Load,
) -> Result<(), Error> {
    for chunk in lifecycles.chunks(WRITE_CHUNK_ROWS) {
        let columns = ContainerColumns::of(chunk);
        let intervals: Vec<String> = chunk
            .iter()
            .map(|(_, lifecycle)| encode_intervals(lifecycle))
            .collect();
        sqlx::query(&format!(
            "INSERT INTO {schema}.container \
                 (org_id, container_id, intervals, anomalies_total, lifecycle_total, last_at) \
             SELECT o, c, i::JSONB, a, n, l \
             FROM UNNEST($1::TEXT[], $2::TEXT[], $3::TEXT[], $4::BIGINT[], $5::BIGINT[], \
                         $6::TIMESTAMPTZ[]) \
                 AS r(o, c, i, a, n, l) {}",
            load.merging(
                "ON CONFLICT (container_id, org_id) DO UPDATE SET intervals = EXCLUDED.intervals, \
                 anomalies_total = EXCLUDED.anomalies_total, \
                 lifecycle_total = EXCLUDED.lifecycle_total, last_at = EXCLUDED.last_at"
            )
        ))
        .bind(&columns.orgs)
        .bind(&columns.ids)
        .bind(&intervals)
        .bind(&columns.totals)
        .bind(&columns.lifecycle_totals)
        .bind(&columns.last_at)
        .execute(&mut *connection)
        .await?;
    }
    Ok(())
}

/// The columns of a chunk of containers that both the upsert and the move write.
struct ContainerColumns<'a> {
    orgs: Vec<&'a str>,
    ids: Vec<&'a str>,
    totals: Vec<i64>,
    lifecycle_totals: Vec<i64>,
    last_at: Vec<DateTime<Utc>>,
}

impl<'a> ContainerColumns<'a> {
    fn of(chunk: &[(&'a ContainerKey, &Lifecycle)]) -> ContainerColumns<'a> {
        ContainerColumns {
            orgs: chunk.iter().map(|(key, _)| key.org_id.as_str()).collect(),
            ids: chunk
                .iter()
                .map(|(key, _)| key.container_id.as_str())
                .collect(),
            totals: chunk
                .iter()
                .map(|(_, lifecycle)| {
                    i64::try_from(lifecycle.anomalies_total()).expect("fewer anomalies than events")
                })
                .collect(),
            lifecycle_totals: chunk
                .iter()
                .map(|(_, lifecycle)| {
                    i64::try_from(lifecycle.lifecycle_total()).expect("fewer than 2^63 events")
                })
                .collect(),
            last_at: chunk
                .iter()
                .map(|(_, lifecycle)| {
                    lifecycle
                        .last_at()
                        .expect("a touched container has an event")
                })
                .collect(),
        }
    }
}

/// Moves the last instant and anomaly count of containers whose stored intervals this
/// round left as they were ([`Changes::intervals_unchanged`]), without writing their
/// intervals again: for most events of a busy platform (commands and ports of running
/// containers) a round would otherwise parse each container's whole intervals into `jsonb`
/// and go through `ON CONFLICT`'s insert attempt, only to store what the row already
/// holds. The round read each of these rows under the checkpoint's lock; a row gone since
/// (an operator's hand) fails the round, and the next one, finding no row, stores the
/// container whole.
async fn move_containers(
    connection: &mut PgConnection,
    schema: &str,
    lifecycles: &[(&ContainerKey, &Lifecycle)],
) -> Result<(), Error> {
    for chunk in lifecycles.chunks(WRITE_CHUNK_ROWS) {
        let columns = ContainerColumns::of(chunk);
        let updated = sqlx::query(&format!(
            "UPDATE {schema}.container c \
             SET anomalies_total = r.a, lifecycle_total = r.n, last_at = r.l \
             FROM UNNEST($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[], $5::TIMESTAMPTZ[]) \
                 AS r(o, c, a, n, l) \
             WHERE c.container_id = r.c AND c.org_id = r.o"
        ))
        .bind(&columns.orgs)
        .bind(&columns.ids)
        .bind(&columns.totals)
        .bind(&columns.lifecycle_totals)
        .bind(&columns.last_at)
        .execute(&mut *connection)
        .await?
        .rows_affected();
        if updated != chunk.len() as u64 {
            return Err(Error::Corrupt(format!(
                "{} of the {} container rows this round read were gone when it moved them",
                chunk.len() as u64 - updated,
                chunk.len()
            )));
        }
    }
    Ok(())
}

/// Appends each touched container's new anomalies to `container_anomaly` (or replaces
/// them after a refold) and trims what falls past [`ANOMALIES_KEPT_MAX`]: rows written per
/// event are bounded, whatever a container keeps (see [`Changes::anomaly_rows`]).
async fn write_anomalies(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
) -> Result<(), Error> {
    let rows: Vec<(&ContainerKey, AnomalyRows)> =
        changes.anomaly_rows(ANOMALIES_KEPT_MAX).collect();
    let replaced: Vec<&ContainerKey> = rows
        .iter()
        .filter(|(_, rows)| rows.replace)
        .map(|(key, _)| *key)
        .collect();
    for chunk in replaced.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|key| key.org_id.as_str()).collect();
        let ids: Vec<&str> = chunk.iter().map(|key| key.container_id.as_str()).collect();
        sqlx::query(&format!(
            "DELETE FROM {schema}.container_anomaly a \
             USING UNNEST($1::TEXT[], $2::TEXT[]) AS k(o, c) \
             WHERE a.container_id = k.c AND a.org_id = k.o"
        ))
        .bind(&orgs)
        .bind(&ids)
        .execute(&mut *connection)
        .await?;
    }
    let inserted: Vec<(&ContainerKey, &Anomaly)> = rows
        .iter()
        .flat_map(|(key, rows)| rows.insert.iter().map(move |anomaly| (*key, anomaly)))
        .collect();
    insert_anomalies(connection, schema, &inserted).await?;
    let trimmed: Vec<(&ContainerKey, i64)> = rows
        .iter()
        .filter(|(_, rows)| rows.trim > 0)
        .map(|(key, rows)| (*key, i64::try_from(rows.trim).expect("a bounded trim")))
        .collect();
    for chunk in trimmed.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|(key, _)| key.org_id.as_str()).collect();
        let ids: Vec<&str> = chunk
            .iter()
            .map(|(key, _)| key.container_id.as_str())
            .collect();
        let counts: Vec<i64> = chunk.iter().map(|(_, count)| *count).collect();
        // The last `n` in order: a backward scan of the primary key, `n` rows long.
        sqlx::query(&format!(
            "DELETE FROM {schema}.container_anomaly a \
             USING UNNEST($1::TEXT[], $2::TEXT[], $3::BIGINT[]) AS k(o, c, n), \
                 LATERAL (SELECT l.occurred_at, l.position FROM {schema}.container_anomaly l \
                          WHERE l.container_id = k.c AND l.org_id = k.o \
                          ORDER BY l.occurred_at DESC, l.position DESC LIMIT k.n) AS t \
             WHERE a.container_id = k.c AND a.org_id = k.o \
               AND a.occurred_at = t.occurred_at AND a.position = t.position"
        ))
        .bind(&orgs)
        .bind(&ids)
        .bind(&counts)
        .execute(&mut *connection)
        .await?;
    }
    Ok(())
}

/// Inserts `inserted`, each container's new anomalies, in chunks.
async fn insert_anomalies(
    connection: &mut PgConnection,
    schema: &str,
    inserted: &[(&ContainerKey, &Anomaly)],
) -> Result<(), Error> {
    for chunk in inserted.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|(key, _)| key.org_id.as_str()).collect();
        let ids: Vec<&str> = chunk
            .iter()
            .map(|(key, _)| key.container_id.as_str())
            .collect();
        let instants: Vec<DateTime<Utc>> = chunk.iter().map(|(_, a)| a.occurred_at).collect();
        let positions: Vec<i64> = chunk.iter().map(|(_, a)| a.position).collect();
        let kinds: Vec<&str> = chunk.iter().map(|(_, a)| a.kind.as_str()).collect();
        let events: Vec<Uuid> = chunk.iter().map(|(_, a)| a.event_id.as_uuid()).collect();
        // No ON CONFLICT: each event is projected once, so a row already there is a bug,
        // and the round fails rather than count an anomaly it did not keep.
        sqlx::query(&format!(
            "INSERT INTO {schema}.container_anomaly \
                 (org_id, container_id, occurred_at, position, kind, event_id) \
             SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[], $3::TIMESTAMPTZ[], $4::BIGINT[], \
                                  $5::TEXT[], $6::UUID[])"
        ))
        .bind(&orgs)
        .bind(&ids)
        .bind(&instants)
        .bind(&positions)
        .bind(&kinds)
        .bind(&events)
        .execute(&mut *connection)
        .await?;
    }
    Ok(())
}

async fn write_periods(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
    load: Load,
) -> Result<(), Error> {
    let periods: Vec<(&(String, Period), &PeriodDelta)> = changes
        .periods
        .iter()
        .filter(|(_, delta)| **delta != PeriodDelta::default())
        .collect();
    for chunk in periods.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|((org, _), _)| org.as_str()).collect();
        let names: Vec<String> = chunk
            .iter()
            .map(|((_, period), _)| period.to_string())
            .collect();
        let column = |pick: fn(&PeriodDelta) -> i64| -> Vec<i64> {
            chunk.iter().map(|(_, delta)| pick(delta)).collect()
        };
        sqlx::query(&format!(
            "INSERT INTO {schema}.org_period AS t \
                 (org_id, period, closed_runtime_ms, commands, command_ms, ports_published) \
             SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[], \
                                  $5::BIGINT[], $6::BIGINT[]) {}",
            load.merging(
                "ON CONFLICT (org_id, period) DO UPDATE SET \
                 closed_runtime_ms = t.closed_runtime_ms + EXCLUDED.closed_runtime_ms, \
                 commands = t.commands + EXCLUDED.commands, \
                 command_ms = t.command_ms + EXCLUDED.command_ms, \
                 ports_published = t.ports_published + EXCLUDED.ports_published"
            )
        ))
        .bind(&orgs)
        .bind(&names)
        .bind(column(|delta| delta.closed_runtime_ms))
        .bind(column(|delta| delta.commands))
        .bind(column(|delta| delta.command_ms))
        .bind(column(|delta| delta.ports_published))
        .execute(&mut *connection)
        .await?;
        if matches!(load, Load::Merge) {
            forget_emptied_periods(connection, schema, chunk).await?;
        }
    }
    Ok(())
}

/// Deletes the org periods of `chunk` that its deltas left with no usage at all: a void or
/// a late event can take back all of a period's figures, and replay, which writes only
/// periods with usage, would leave no row. The usage export and a period close list an org
/// by its row, so a row of zeros would list it where a replay would not. Only a delta that
/// takes something back can empty a row, so the others cost no statement.
async fn forget_emptied_periods(
    connection: &mut PgConnection,
    schema: &str,
    chunk: &[(&(String, Period), &PeriodDelta)],
) -> Result<(), Error> {
    let (orgs, names): (Vec<&str>, Vec<String>) = chunk
        .iter()
        .filter(|(_, delta)| {
            delta.closed_runtime_ms < 0
                || delta.commands < 0
                || delta.command_ms < 0
                || delta.ports_published < 0
        })
        .map(|((org, period), _)| (org.as_str(), period.to_string()))
        .unzip();
    let empty = "t.closed_runtime_ms = 0 AND t.commands = 0 AND t.command_ms = 0 \
                 AND t.ports_published = 0";
    let table = format!("{schema}.org_period");
    forget_emptied(connection, (&table, "period"), empty, (orgs, names)).await
}

/// Deletes the rows of `table` (keyed by org and by the period in `period_column`) at
/// `keys` that hold nothing, as `empty` says of a row `t`.
async fn forget_emptied(
    connection: &mut PgConnection,
    (table, period_column): (&str, &str),
    empty: &str,
    (orgs, names): (Vec<&str>, Vec<String>),
) -> Result<(), Error> {
    if orgs.is_empty() {
        return Ok(());
    }
    sqlx::query(&format!(
        "DELETE FROM {table} t USING UNNEST($1::TEXT[], $2::TEXT[]) AS k(org_id, period) \
         WHERE t.org_id = k.org_id AND t.{period_column} = k.period AND {empty}"
    ))
    .bind(&orgs)
    .bind(&names)
    .execute(connection)
    .await?;
    Ok(())
}

async fn write_open(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
    load: Load,
) -> Result<(), Error> {
    let open: Vec<_> = changes
        .open
        .iter()
        .filter(|(_, delta)| delta.running != 0 || delta.since_offset_ms != 0)
        .collect();
    for chunk in open.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|((org, _), _)| org.as_str()).collect();
        let names: Vec<String> = chunk
            .iter()
            .map(|((_, period), _)| period.to_string())
            .collect();
        let running: Vec<i64> = chunk.iter().map(|(_, delta)| delta.running).collect();
        let offsets: Vec<i64> = chunk
            .iter()
            .map(|(_, delta)| delta.since_offset_ms)
            .collect();
        sqlx::query(&format!(
            "INSERT INTO {schema}.org_open AS t (org_id, since_period, running, since_offset_ms) \
             SELECT * FROM UNNEST($1::TEXT[], $2::TEXT[], $3::BIGINT[], $4::BIGINT[]) {}",
            load.merging(
                "ON CONFLICT (org_id, since_period) DO UPDATE SET \
                 running = t.running + EXCLUDED.running, \
                 since_offset_ms = t.since_offset_ms + EXCLUDED.since_offset_ms"
            )
        ))
        .bind(&orgs)
        .bind(&names)
        .bind(&running)
        .bind(&offsets)
        .execute(&mut *connection)
        .await?;
        if matches!(load, Load::Merge) {
            forget_emptied_open(connection, schema, chunk).await?;
        }
    }
    Ok(())
}

/// Deletes the open runs of `chunk` that its deltas left with none running: every
/// container that started in the period has stopped, and replay, which writes only the
/// runs still open, would leave no row. Only a delta that stops something can empty a row.
async fn forget_emptied_open(
    connection: &mut PgConnection,
    schema: &str,
    chunk: &[(&(String, Period), &OpenDelta)],
) -> Result<(), Error> {
    let (orgs, names): (Vec<&str>, Vec<String>) = chunk
        .iter()
        .filter(|(_, delta)| delta.running < 0)
        .map(|((org, period), _)| (org.as_str(), period.to_string()))
        .unzip();
    let empty = "t.running = 0 AND t.since_offset_ms = 0";
    let table = format!("{schema}.org_open");
    forget_emptied(connection, (&table, "since_period"), empty, (orgs, names)).await
}

async fn write_latest(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
    load: Load,
) -> Result<(), Error> {
    let latest: Vec<_> = changes.latest.iter().collect();
    for chunk in latest.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|(org, _)| org.as_str()).collect();
        let instants: Vec<DateTime<Utc>> = chunk.iter().map(|(_, at)| **at).collect();
        sqlx::query(&format!(
            "INSERT INTO {schema}.org AS t (org_id, latest_at) \
             SELECT * FROM UNNEST($1::TEXT[], $2::TIMESTAMPTZ[]) {}",
            load.merging(
                "ON CONFLICT (org_id) DO UPDATE SET \
                 latest_at = GREATEST(t.latest_at, EXCLUDED.latest_at)"
            )
        ))
        .bind(&orgs)
        .bind(&instants)
        .execute(&mut *connection)
        .await?;
    }
    Ok(())
}

async fn write_accounts(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
    load: Load,
) -> Result<(), Error> {
    for chunk in changes.accounts.chunks(WRITE_CHUNK_ROWS) {
        let orgs: Vec<&str> = chunk.iter().map(|(org, _)| org.as_str()).collect();
        let positions: Vec<i64> = chunk.iter().map(|(_, entry)| entry.position).collect();
        let instants: Vec<DateTime<Utc>> =
            chunk.iter().map(|(_, entry)| entry.occurred_at).collect();
        let ids: Vec<Uuid> = chunk
            .iter()
            .map(|(_, entry)| entry.event_id.as_uuid())
            .collect();
        let mut plans: Vec<Option<&str>> = Vec::with_capacity(chunk.len());
        let mut verified: Vec<Option<bool>> = Vec::with_capacity(chunk.len());
        let mut eligible: Vec<Option<bool>> = Vec::with_capacity(chunk.len());
        for (_, entry) in chunk {
            let (plan, is_verified, is_eligible) = match &entry.change {
                AccountChange::Plan(plan) => (Some(plan.as_str()), None, None),
                AccountChange::Verified(value) => (None, Some(*value), None),
                AccountChange::BillingEligible(value) => (None, None, Some(*value)),
            };
            plans.push(plan);
            verified.push(is_verified);
            eligible.push(is_eligible);
        }
        sqlx::query(&format!(
            "INSERT INTO {schema}.account_change \
                 (org_id, position, occurred_at, event_id, plan, verified, billing_eligible) \
             SELECT * FROM UNNEST($1::TEXT[], $2::BIGINT[], $3::TIMESTAMPTZ[], $4::UUID[], \
                                  $5::TEXT[], $6::BOOLEAN[], $7::BOOLEAN[]) {}",
            load.merging("ON CONFLICT (org_id, position) DO NOTHING")
        ))
        .bind(&orgs)
        .bind(&positions)
        .bind(&instants)
        .bind(&ids)
        .bind(&plans)
        .bind(&verified)
        .bind(&eligible)
        .execute(&mut *connection)
        .await?;
    }
    Ok(())
}

#[derive(FromRow)]
struct AccountRow {
    position: i64,
    occurred_at: DateTime<Utc>,
    event_id: Uuid,
    plan: Option<String>,
    verified: Option<bool>,
    billing_eligible: Option<bool>,
}

/// An org's account events, in any order (the fold orders them).
pub async fn account_entries(
    connection: &mut PgConnection,
    org_id: &str,
) -> Result<Vec<AccountEntry>, Error> {
    let rows: Vec<AccountRow> = sqlx::query_as(&format!(
        "SELECT position, occurred_at, event_id, plan, verified, billing_eligible \
         FROM {LIVE}.account_change WHERE org_id = $1"
    ))
    .bind(org_id)
    .fetch_all(connection)
    .await?;
    rows.into_iter()
        .map(|row| {
            let change =
                account_change(row.position, row.plan, row.verified, row.billing_eligible)?;
            Ok(AccountEntry {
                occurred_at: row.occurred_at,
                position: row.position,
                event_id: EventId::from_uuid(row.event_id)
                    .map_err(|e| Error::corrupt("event id", e))?,
                change,
            })
        })
        .collect()
}

/// Each pair a voided publication belonged to, recomputed from the publications left (up
/// to `until`): its first instant moves, or the pair goes and its period counts one fewer.
async fn recount_voided_ports(
    connection: &mut PgConnection,
    schema: &str,
    changes: &mut Changes,
    until: i64,
) -> Result<(), Error> {
    let keys: Vec<PortKey> = changes.voided_ports.iter().cloned().collect();
    for key in keys {
        let window = key.period.window();
        let first: Option<DateTime<Utc>> = sqlx::query_scalar(&format!(
            "SELECT min(occurred_at) FROM ledger l \
             WHERE l.org_id = $1 AND l.container_id = $2 AND l.type = 'container.port_published' \
               AND (l.data->>'port')::INTEGER = $3 AND l.occurred_at >= $4 AND l.occurred_at < $5 \
               AND l.position <= $6 \
               AND NOT EXISTS (SELECT 1 FROM {schema}.voided v WHERE v.event_id = l.id)"
        ))
        .bind(&key.org_id)
        .bind(&key.container_id)
        .bind(i32::from(key.port))
        .bind(window.start())
        .bind(window.end())
        .bind(until)
        .fetch_one(&mut *connection)
        .await?;
        let period = key.period.to_string();
        match first {
            Some(first) => {
                sqlx::query(&format!(
                    "UPDATE {schema}.port SET first_at = $5 \
                     WHERE org_id = $1 AND period = $2 AND container_id = $3 AND port = $4"
                ))
                .bind(&key.org_id)
                .bind(&period)
                .bind(&key.container_id)
                .bind(i32::from(key.port))
                .bind(first)
                .execute(&mut *connection)
                .await?;
            }
            None => {
                let deleted = sqlx::query(&format!(
                    "DELETE FROM {schema}.port \
                     WHERE org_id = $1 AND period = $2 AND container_id = $3 AND port = $4"
                ))
                .bind(&key.org_id)
                .bind(&period)
                .bind(&key.container_id)
                .bind(i32::from(key.port))
                .execute(&mut *connection)
                .await?;
                if deleted.rows_affected() > 0 {
                    changes
                        .periods
                        .entry((key.org_id.clone(), key.period))
                        .or_default()
                        .ports_published -= 1;
                }
            }
        }
    }
    Ok(())
}

/// Stores the voids, removes the account changes of voided org events and the rows of
/// containers left with no event.
async fn write_voids(
    connection: &mut PgConnection,
    schema: &str,
    changes: &Changes,
) -> Result<(), Error> {
    if !changes.voided.is_empty() {
        let ids: Vec<Uuid> = changes.voided.iter().map(|(id, _)| *id).collect();
        let positions: Vec<i64> = changes
            .voided
            .iter()
            .map(|(_, position)| *position)
            .collect();
        sqlx::query(&format!(
            "INSERT INTO {schema}.voided (event_id, position) \
             SELECT * FROM UNNEST($1::UUID[], $2::BIGINT[]) ON CONFLICT (event_id) DO NOTHING"
        ))
        .bind(&ids)
        .bind(&positions)
        .execute(&mut *connection)
        .await?;
    }
    if !changes.voided_accounts.is_empty() {
        sqlx::query(&format!(
            "DELETE FROM {schema}.account_change WHERE event_id = ANY($1)"
        ))
        .bind(&changes.voided_accounts)
        .execute(&mut *connection)
        .await?;
    }
    for key in changes.removed() {
        for table in ["container", "container_anomaly"] {
            sqlx::query(&format!(
                "DELETE FROM {schema}.{table} WHERE org_id = $1 AND container_id = $2"
            ))
            .bind(&key.org_id)
            .bind(&key.container_id)
            .execute(&mut *connection)
            .await?;
        }
    }
    Ok(())
}

/// Every org's record of each of `container_ids`.
pub async fn containers_by_ids(
    connection: &mut PgConnection,
    container_ids: &[&str],
) -> Result<Vec<StoredContainer>, Error> {
    let rows: Vec<LifecycleRow> = sqlx::query_as(&format!(
        "SELECT {CONTAINER_COLUMNS} FROM {LIVE}.container WHERE container_id = ANY($1)"
    ))
    .bind(container_ids)
    .fetch_all(connection)
    .await?;
    rows.into_iter().map(LifecycleRow::decode).collect()
}

/// Whether a stored container is running: its last interval is open. Spelled exactly as
/// the predicates of the `container_list_indexes` migration's partial indexes, so that the
/// planner matches them.
pub const RUNNING_SQL: &str = "(intervals -> -1 -> 1 = 'null'::JSONB) IS TRUE";

/// Containers that may have run at or after `since`: an event then, or still running (its
/// last interval open; only the last one can be).
pub async fn containers_running_since(
    connection: &mut PgConnection,
    since: DateTime<Utc>,
) -> Result<Vec<StoredContainer>, Error> {
    // (A JSON path over the intervals, `$[*] ? (@[1] == null)`, never matched: in lax mode
    // the filter unwraps each interval into its numbers, and a number has no `[1]`.)
    let rows: Vec<LifecycleRow> = sqlx::query_as(&format!(
        "SELECT {CONTAINER_COLUMNS} FROM {LIVE}.container WHERE last_at >= $1 OR {RUNNING_SQL}"
    ))
    .bind(since)
    .fetch_all(connection)
    .await?;
    rows.into_iter().map(LifecycleRow::decode).collect()
}

/// The key of an org's admission lock, as SQL of the text expression `org`: a grant holds
/// it while it counts the org's slots and stores its reservation.
pub fn admission_lock(org: &str) -> String {
    format!("hashtextextended('tally.admission.' || {org}, 0)")
}

/// The advisory lock between grants and the projector's consuming of reservations: a grant
/// holds it shared from before it reads its facts to its commit; a projector round that starts
/// containers holds it alone from before it consumes to its commit. `'consum'` in ASCII.
pub const CONSUME_LOCK_KEY: i64 = 0x636f_6e73_756d;

/// A `created` or `resumed` of a projector round, as the consuming of reservations reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Start {
    pub event_id: Uuid,
    pub position: i64,
    /// The event's `occurred_at`: from then on its container counts as running.
    pub at: DateTime<Utc>,
}

/// Admission's reservations taken up by a projector round: consumes, for each container
/// that a `created` or `resumed` of this projector round starts, every live reservation
/// naming it (unexpired at `now`) — unless that event consumed some already (it is
/// projected again after a replay's swap) — and records the event's position and instant on
/// them. Runs in the round's transaction; returns the org of each reservation consumed.
///
/// Every one, not the oldest only: two grants for one container (a retried request) would
/// otherwise leave one holding a slot next to the running container until it expired. A
/// start dated ahead of the clock counts from its instant on; until then the reservations
/// it consumed still hold the slot (`admission::load_facts` reads `consumed_starts_at`).
///
/// [`CONSUME_LOCK_KEY`] is taken first and held to the round's commit: a grant then either
/// committed before the consuming statement's snapshot (and is consumed) or reads its facts
/// after the round commits (and finds its container running). Without it a grant that read
/// before the commit and stored after the statement was never consumed. (One lock, not one
/// an org: a round starting thousands of orgs' containers would fill Postgres's lock table.)
/// No grant waits for a round while holding the lock, except through Postgres's lock queue:
/// behind a replay's swap or a new ledger partition, whose exclusive table locks queue
/// behind this round's. Postgres's deadlock check is documented to resolve such a cycle by
/// reordering the queue after `deadlock_timeout` (a stall of a second, not an error); no
/// test here has made it happen.
pub async fn consume_reservations(
    connection: &mut PgConnection,
    starts: &HashMap<(String, String), Start>,
    now: DateTime<Utc>,
) -> sqlx::Result<Vec<String>> {
    if starts.is_empty() {
        return Ok(Vec::new());
    }
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(CONSUME_LOCK_KEY)
        .execute(&mut *connection)
        .await?;
    let mut orgs = Vec::with_capacity(starts.len());
    let mut containers = Vec::with_capacity(starts.len());
    let mut events = Vec::with_capacity(starts.len());
    let mut positions = Vec::with_capacity(starts.len());
    let mut instants = Vec::with_capacity(starts.len());
    for ((org, container), start) in starts {
        orgs.push(org.as_str());
        containers.push(container.as_str());
        events.push(start.event_id);
        positions.push(start.position);
        instants.push(start.at);
    }
    sqlx::query_scalar(
        "UPDATE admission_reservation r \
         SET consumed_at = now(), consumed_by = s.event_id, consumed_position = s.position, \
             consumed_starts_at = s.starts_at \
         FROM UNNEST($1::TEXT[], $2::TEXT[], $3::UUID[], $4::BIGINT[], $5::TIMESTAMPTZ[]) \
              AS s(org_id, container_id, event_id, position, starts_at) \
         WHERE r.org_id = s.org_id AND r.container_id = s.container_id \
           AND r.released_at IS NULL AND r.consumed_at IS NULL AND r.expires_at > $6 \
           AND NOT EXISTS (SELECT 1 FROM admission_reservation c \
                           WHERE c.consumed_by = s.event_id) \
         RETURNING r.org_id",
    )
    .bind(&orgs)
    .bind(&containers)
    .bind(&events)
    .bind(&positions)
    .bind(&instants)
    .bind(now)
    .fetch_all(connection)
    .await
}
