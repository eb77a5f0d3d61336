//! The `TALLY_LEDGER` copy checked against the ledger: one message against its row, the
//! messages the relay resumes after, and the whole stream (`tally verify --stream`).
//!
//! The relay publishes consecutive ledger positions at consecutive stream sequences, and
//! every publish carries `Nats-Expected-Last-Sequence`, so the two numbers move together
//! for as long as nothing else writes to the stream: sequence `s` holds position
//! `s + offset`. The offset is 0 when the relay filled the stream from position 1; a stream
//! seeded with a later position (as `tally-bench` seeds its scratch stream) has the offset
//! of its first message, which must itself be its ledger row. Beyond that first message
//! the check never takes a position from a message: it compares the message at sequence
//! `s` with ledger row `s + offset`: the `Tally-Position` header, the event id
//! (`Nats-Msg-Id`), the hash (the `Tally-Hash` header, when the message has one, and the
//! payload's `hash`) and the content, recomputed from the payload and chained on the
//! ledger's previous hash. A message anyone else published breaks the numbering and is
//! found at the sequence it took.

use std::fmt;

use async_nats::jetstream::{self, consumer, stream::RawMessageErrorKind};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use futures::{StreamExt as _, TryStreamExt as _};
use serde::Deserialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::{Names, StreamFailure, HASH_HEADER, POSITION_HEADER};
use crate::event::canonical::{self, RecordFields, GENESIS_HASH};
use crate::ledger::read::{self, LedgerRow, ROW_COLUMNS};
use crate::ledger::verify::StreamReport;

/// Messages the whole-stream pass asks the server for at once. Memory holds at most this
/// many messages (each at most the stream's `max_msg_size`, 1 MiB; a ledger message is
/// usually under 1 KiB), however long the stream is.
pub const STREAM_VERIFY_BATCH_MESSAGES: i64 = 256;

/// A stream message that is not the ledger row it should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The stream sequence.
    pub sequence: u64,
    /// The ledger position that sequence should hold.
    pub position: i64,
    /// What differs, in words.
    pub difference: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stream message {} does not match ledger position {}: {}",
            self.sequence, self.position, self.difference
        )
    }
}

impl std::error::Error for Mismatch {}

/// A failure to read, not a finding: the ledger (Postgres) or the stream (NATS), which its
/// callers answer differently.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Ledger(#[from] sqlx::Error),
    #[error(transparent)]
    Stream(#[from] StreamFailure),
}

/// The payload the relay publishes ([`crate::ledger::read::LedgerMessage`]), read back.
/// Members it does not know are ignored rather than refused, so that a member added to
/// the message later does not make every message relayed before it (or after it, for an
/// older verifier) a difference; the hash covers what the ledger covers.
#[derive(Debug, Deserialize)]
struct Payload {
    position: i64,
    id: Uuid,
    #[serde(rename = "type")]
    event_type: String,
    org_id: String,
    container_id: Option<String>,
    occurred_at: String,
    recorded_at: String,
    data: serde_json::Value,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    source_event_id: Option<String>,
    #[serde(default)]
    attributes: Option<serde_json::Value>,
    hash: String,
}

fn header<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers
        .and_then(|headers| headers.get(name))
        .map(|value| value.as_str())
}

/// A timestamp as the relay writes it (canonical: RFC 3339, milliseconds, `Z`), or `None`.
fn canonical_timestamp(text: &str) -> Option<DateTime<Utc>> {
    let parsed = DateTime::parse_from_rfc3339(text).ok()?.with_timezone(&Utc);
    (canonical::timestamp(parsed) == text).then_some(parsed)
}

/// How a message differs from the ledger row at `position` (`row`, `None` when the ledger
/// has no such position); `prev_hash` is the stored hash of the row before it (the
/// genesis hash before position 1). `None` when it is that row, relayed.
pub fn difference(
    position: i64,
    headers: Option<&HeaderMap>,
    payload: &[u8],
    row: Option<&LedgerRow>,
    prev_hash: &[u8; 32],
) -> Option<String> {
    let Some(row) = row else {
        return Some(format!("the ledger has no position {position}"));
    };
    assert_eq!(
        row.position, position,
        "the caller pairs a message with its row"
    );
    let ledger_hash = hex::encode(&row.hash);
    let id = row.id.hyphenated().to_string();
    if let Some(difference) = headers_difference(headers, row, &id, &ledger_hash) {
        return Some(difference);
    }
    let payload: Payload = match serde_json::from_slice(payload) {
        Ok(payload) => payload,
        Err(error) => return Some(format!("its payload is not a ledger message: {error}")),
    };
    if payload.position != row.position || payload.id != row.id || payload.hash != ledger_hash {
        return Some(format!(
            "its payload names position {}, id {} and hash {}; the ledger has {}, {id} and {ledger_hash}",
            payload.position, payload.id, payload.hash, row.position
        ));
    }
    let (Some(occurred_at), Some(recorded_at)) = (
        canonical_timestamp(&payload.occurred_at),
        canonical_timestamp(&payload.recorded_at),
    ) else {
        return Some("its payload's timestamps are not canonical".to_owned());
    };
    let fields = RecordFields {
        id: payload.id,
        event_type: &payload.event_type,
        org_id: &payload.org_id,
        container_id: payload.container_id.as_deref(),
        occurred_at,
        data: &payload.data,
        origin_source: payload.source.as_deref(),
        origin_id: payload.source_event_id.as_deref(),
        attributes: payload.attributes.as_ref(),
    };
    let bytes = canonical::record_bytes(&fields, payload.position, recorded_at);
    let content_hash = canonical::chain_hash(prev_hash, &bytes);
    if content_hash.as_slice() != row.hash.as_slice() {
        return Some(format!(
            "its content hashes to {}, the ledger's hash is {ledger_hash}",
            hex::encode(content_hash)
        ));
    }
    None
}

/// How a message's headers differ from ledger row `row` (event id `id`, hash
/// `ledger_hash`), if they do.
fn headers_difference(
    headers: Option<&HeaderMap>,
    row: &LedgerRow,
    id: &str,
    ledger_hash: &str,
) -> Option<String> {
    match header(headers, POSITION_HEADER) {
        None => return Some(format!("it has no {POSITION_HEADER} header")),
        Some(position) if position != row.position.to_string() => {
            return Some(format!("its {POSITION_HEADER} header is {position:?}"))
        }
        Some(_) => {}
    }
    match header(headers, "Nats-Msg-Id") {
        None => return Some("it has no Nats-Msg-Id header".to_owned()),
        Some(message_id) if message_id != id => {
            return Some(format!(
                "its Nats-Msg-Id is {message_id:?}, the ledger's event id is {id}"
            ))
        }
        Some(_) => {}
    }
    // Messages relayed before the header existed have only the payload's hash.
    if let Some(hash) = header(headers, HASH_HEADER) {
        if hash != ledger_hash {
            return Some(format!(
                "its {HASH_HEADER} is {hash:?}, the ledger's hash is {ledger_hash}"
            ));
        }
    }
    None
}

/// The stored hash of the row before `position`: the genesis hash before position 1.
async fn hash_before(pool: &PgPool, position: i64) -> Result<Option<[u8; 32]>, Error> {
    if position <= 1 {
        return Ok(Some(GENESIS_HASH));
    }
    let hash: Option<Vec<u8>> = sqlx::query_scalar("SELECT hash FROM ledger WHERE position = $1")
        .bind(position - 1)
        .fetch_optional(pool)
        .await?;
    Ok(hash.map(|hash| hash.try_into().expect("32-byte hashes")))
}

/// Reads the message at `sequence`; `Ok(None)` when the stream no longer holds it.
async fn message_at(
    stream: &jetstream::stream::Stream,
    sequence: u64,
) -> Result<Option<jetstream::message::StreamMessage>, Error> {
    match stream.get_raw_message(sequence).await {
        Ok(message) => Ok(Some(message)),
        Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => Ok(None),
        Err(error) => {
            Err(StreamFailure::doing(format!("reading stream message {sequence}"))(error).into())
        }
    }
}

/// The stream's offset (sequence `s` holds position `s + offset`), from its first message
/// at `first_sequence`, which must be the ledger row it names; a [`Mismatch`] otherwise.
/// Errors are failures to read (NATS or Postgres), not findings.
pub async fn offset(
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    first_sequence: u64,
) -> Result<Result<i64, Mismatch>, Error> {
    let first =
        i64::try_from(first_sequence).map_err(StreamFailure::doing("the first sequence"))?;
    let Some(message) = message_at(stream, first_sequence).await? else {
        return Ok(Err(Mismatch {
            sequence: first_sequence,
            position: first,
            difference: "the stream no longer holds it".to_owned(),
        }));
    };
    // Only the first message's position is read from it, and only to be checked below.
    let position = header(Some(&message.headers), POSITION_HEADER)
        .and_then(|value| value.parse::<i64>().ok())
        .filter(|position| *position >= 1)
        .unwrap_or(first);
    let row = read::read_after(pool, position - 1, 1).await?.pop();
    let row = row.filter(|row| row.position == position);
    let prev_hash = hash_before(pool, position).await?.unwrap_or(GENESIS_HASH);
    match difference(
        position,
        Some(&message.headers),
        &message.payload,
        row.as_ref(),
        &prev_hash,
    ) {
        Some(difference) => Ok(Err(Mismatch {
            sequence: first_sequence,
            position,
            difference,
        })),
        None => Ok(Ok(position - first)),
    }
}

/// Checks stream messages `from..=last` (at least 1) against ledger rows `from + offset`
/// on, in order; the first that differs is returned. Errors are failures to read (NATS or
/// Postgres), not findings. Reads `last - from + 1` rows, so the caller bounds the range.
pub async fn check_range(
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    from: u64,
    last: u64,
    offset: i64,
) -> Result<Option<Mismatch>, Error> {
    assert!(from >= 1 && from <= last, "a range of stream sequences");
    let count = usize::try_from(last - from + 1).expect("a bounded range");
    let position_of = |sequence: u64| i64::try_from(sequence).expect("a stream sequence") + offset;
    let start = position_of(from);
    let rows = read::read_after(pool, start - 1, count).await?;
    let mut rows = rows.iter().peekable();
    let Some(mut prev_hash) = hash_before(pool, start).await? else {
        return Ok(Some(Mismatch {
            sequence: from,
            position: start,
            difference: format!("the ledger has no position {}", start - 1),
        }));
    };
    for sequence in from..=last {
        let position = position_of(sequence);
        let Some(message) = message_at(stream, sequence).await? else {
            return Ok(Some(Mismatch {
                sequence,
                position,
                difference: "the stream no longer holds it".to_owned(),
            }));
        };
        let row = rows.next_if(|row| row.position == position);
        if let Some(difference) = difference(
            position,
            Some(&message.headers),
            &message.payload,
            row,
            &prev_hash,
        ) {
            return Ok(Some(Mismatch {
                sequence,
                position,
                difference,
            }));
        }
        let row = row.expect("a matching message has its row");
        prev_hash = row.hash.as_slice().try_into().expect("32-byte hashes");
    }
    Ok(None)
}

/// Compares every message of `TALLY_LEDGER` with its ledger row, from the first, and names
/// the first difference. Rows after the stream's last message (the relay's lag) are only
/// counted. Streams both sides, so memory stays flat however long they are.
#[tracing::instrument(skip_all)]
pub async fn verify_stream(
    pool: &PgPool,
    context: &jetstream::Context,
    names: &Names,
) -> Result<StreamReport, Error> {
    let (stream, state) = ledger_stream(context, names).await?;
    let last_sequence = state.last_sequence;
    let mut report = StreamReport {
        ok: true,
        messages_checked: 0,
        last_sequence,
        first_position: 0,
        rows_not_in_stream: 0,
        first_bad_position: None,
        problem: None,
    };
    let mut found: Option<Mismatch> = None;
    let mut offset = 0;
    if last_sequence > 0 {
        match self::offset(pool, &stream, state.first_sequence).await? {
            Ok(value) => offset = value,
            Err(mismatch) => found = Some(mismatch),
        }
        report.first_position = i64::try_from(state.first_sequence)
            .map_err(StreamFailure::doing("the first sequence"))?
            + offset;
    }
    let mut transaction = crate::ledger::db::begin(pool).await?;
    // One long statement, as in the chain's full pass.
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *transaction)
        .await?;
    if last_sequence > 0 && found.is_none() {
        found = compare(
            &mut transaction,
            pool,
            &stream,
            state.first_sequence..=last_sequence,
            offset,
            &mut report,
        )
        .await?;
    }
    if found.is_none() {
        // Whatever the ledger holds past the stream has not been relayed yet.
        let relayed = i64::try_from(last_sequence)
            .map_err(StreamFailure::doing("the last sequence"))?
            + offset;
        let unrelayed: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE position > $1")
            .bind(relayed)
            .fetch_one(&mut *transaction)
            .await?;
        report.rows_not_in_stream =
            u64::try_from(unrelayed).map_err(StreamFailure::doing("the rows not in the stream"))?;
    }
    transaction.commit().await?;
    if let Some(mismatch) = found {
        report.ok = false;
        report.first_bad_position = Some(mismatch.position);
        report.problem = Some(mismatch.to_string());
    }
    Ok(report)
}

/// The ledger stream and its state now.
pub(super) async fn ledger_stream(
    context: &jetstream::Context,
    names: &Names,
) -> Result<(jetstream::stream::Stream, jetstream::stream::State), StreamFailure> {
    let mut stream = context
        .get_stream(names.ledger_stream())
        .await
        .map_err(StreamFailure::doing("cannot find the ledger stream"))?;
    let state = stream
        .info()
        .await
        .map_err(StreamFailure::doing("reading the ledger stream's state"))?
        .state
        .clone();
    Ok((stream, state))
}

/// Compares the messages of `sequences` with their rows in order, counting each that
/// matches in `report`; the first difference, if any.
async fn compare(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    sequences: std::ops::RangeInclusive<u64>,
    offset: i64,
    report: &mut StreamReport,
) -> Result<Option<Mismatch>, Error> {
    let first_position = report.first_position;
    let query = format!("SELECT {ROW_COLUMNS} FROM ledger WHERE position >= $1 ORDER BY position");
    let mut rows = sqlx::query_as::<_, LedgerRow>(&query)
        .bind(first_position)
        .fetch(&mut **transaction);
    let mut prev_hash = hash_before(pool, first_position)
        .await?
        .unwrap_or(GENESIS_HASH);
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: *sequences.start(),
            },
            max_batch: STREAM_VERIFY_BATCH_MESSAGES,
            ..Default::default()
        })
        .await
        .map_err(StreamFailure::doing("cannot read the ledger stream"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(StreamFailure::doing("cannot read the ledger stream"))?;
    for expected in sequences {
        let position =
            i64::try_from(expected).map_err(StreamFailure::doing("a stream sequence"))? + offset;
        let (message, sequence) = next_message(&mut messages, expected).await?;
        if sequence != expected {
            return Ok(Some(Mismatch {
                sequence: expected,
                position,
                difference: "the stream no longer holds it".to_owned(),
            }));
        }
        let row = rows.try_next().await?;
        let row = row.filter(|row| row.position == position);
        if let Some(difference) = difference(
            position,
            message.headers.as_ref(),
            &message.payload,
            row.as_ref(),
            &prev_hash,
        ) {
            return Ok(Some(Mismatch {
                sequence,
                position,
                difference,
            }));
        }
        let row = row.expect("a matching message has its row");
        prev_hash = row.hash.as_slice().try_into().expect("32-byte hashes");
        report.messages_checked += 1;
    }
    Ok(None)
}

/// The next message of the ordered consumer, expected at `expected`, with the sequence it
/// is at.
async fn next_message(
    messages: &mut consumer::pull::Ordered,
    expected: u64,
) -> Result<(jetstream::Message, u64), Error> {
    let message = messages
        .next()
        .await
        .ok_or_else(|| StreamFailure::new("the ledger stream ended early"))?
        .map_err(StreamFailure::doing(format!(
            "reading stream message {expected}"
        )))?;
    let sequence = message
        .info()
        .map_err(StreamFailure::doing(format!("stream message {expected}")))?
        .stream_sequence;
    Ok((message, sequence))
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone as _;
    use serde_json::{json, Value};

    use super::*;

    /// Row `position` chained on `prev_hash`, as the appender would store it.
    fn row(position: i64, prev_hash: &[u8; 32]) -> LedgerRow {
        let mut row = LedgerRow {
            position,
            id: Uuid::from_u128(position as u128),
            event_type: "container.created".to_owned(),
            org_id: "org_1".to_owned(),
            container_id: Some("ctr_1".to_owned()),
            occurred_at: Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 0).unwrap(),
            recorded_at: Utc.with_ymd_and_hms(2026, 11, 30, 12, 0, 1).unwrap(),
            data: json!({"name": "n", "image": "i"}),
            source: None,
            source_event_id: None,
            attributes: None,
            hash: Vec::new(),
        };
        let bytes = canonical::record_bytes(&row.fields(), position, row.recorded_at);
        row.hash = canonical::chain_hash(prev_hash, &bytes).to_vec();
        row
    }

    /// The headers and payload the relay publishes for `row`.
    fn relayed(row: &LedgerRow) -> (HeaderMap, Vec<u8>) {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", row.id.hyphenated().to_string().as_str());
        headers.insert(POSITION_HEADER, row.position.to_string().as_str());
        headers.insert(HASH_HEADER, hex::encode(&row.hash).as_str());
        (headers, serde_json::to_vec(&row.to_message()).unwrap())
    }

    #[test]
    fn a_relayed_row_matches_and_every_kind_of_forgery_is_named() {
        let first = row(1, &GENESIS_HASH);
        let prev: [u8; 32] = first.hash.as_slice().try_into().unwrap();
        let second = row(2, &prev);
        let (headers, payload) = relayed(&second);
        assert_eq!(
            difference(2, Some(&headers), &payload, Some(&second), &prev),
            None
        );
        // Relayed before the hash header existed: the payload alone still proves it.
        let mut old_headers = HeaderMap::new();
        old_headers.insert("Nats-Msg-Id", second.id.hyphenated().to_string().as_str());
        old_headers.insert(POSITION_HEADER, "2");
        assert_eq!(
            difference(2, Some(&old_headers), &payload, Some(&second), &prev),
            None
        );

        let found = |headers: Option<&HeaderMap>, payload: &[u8], row: Option<&LedgerRow>| {
            difference(2, headers, payload, row, &prev).expect("a difference")
        };
        assert_eq!(
            found(None, b"{}", Some(&second)),
            "it has no Tally-Position header"
        );
        assert_eq!(
            found(Some(&headers), &payload, None),
            "the ledger has no position 2"
        );
        let mut far = headers.clone();
        far.insert(POSITION_HEADER, "1000000");
        assert_eq!(
            found(Some(&far), &payload, Some(&second)),
            "its Tally-Position header is \"1000000\""
        );
        // The first row's message at the second's place: its id gives it away.
        let (first_headers, first_payload) = relayed(&first);
        let mut replayed = first_headers.clone();
        replayed.insert(POSITION_HEADER, "2");
        assert!(
            found(Some(&replayed), &first_payload, Some(&second)).starts_with("its Nats-Msg-Id is")
        );
        // Altered content under genuine headers and a genuine hash.
        let mut altered: Value = serde_json::from_slice(&payload).unwrap();
        altered["data"]["name"] = json!("forged");
        let altered = serde_json::to_vec(&altered).unwrap();
        assert!(found(Some(&headers), &altered, Some(&second)).starts_with("its content hashes to"));
        // A ledger row rewritten (and rehashed) after it was relayed.
        let mut rewritten = second.clone();
        rewritten.data = json!({"name": "rewritten"});
        let bytes = canonical::record_bytes(&rewritten.fields(), 2, rewritten.recorded_at);
        rewritten.hash = canonical::chain_hash(&prev, &bytes).to_vec();
        assert!(found(Some(&headers), &payload, Some(&rewritten)).starts_with("its Tally-Hash is"));
        assert!(found(Some(&old_headers), &payload, Some(&rewritten))
            .starts_with("its payload names position 2"));
        assert!(found(Some(&headers), b"{}", Some(&second))
            .starts_with("its payload is not a ledger message"));
    }
}
