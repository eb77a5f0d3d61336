//! The `TALLY_LEDGER` copy checked against the ledger: one message against its row, the
//! messages the relay resumes after, and the whole stream (`tally verify --stream`).
//!
//! The relay publishes ledger position `n` as stream sequence `n`: it starts at sequence 1
//! with position 1, and every publish carries `Nats-Expected-Last-Sequence`, so the two
//! numbers move together for as long as nothing else writes to the stream. The check
//! therefore never takes a position from a message: it compares stream message `n` with
//! ledger row `n`: the `Tally-Position` header, the event id (`Nats-Msg-Id`), the hash
//! (the `Tally-Hash` header, when the message has one, and the payload's `hash`) and the
//! content, recomputed from the payload and chained on the ledger's previous hash. A message
//! anyone else published breaks the numbering and is found at the sequence it took.

use std::fmt;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer, stream::RawMessageErrorKind};
use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use futures::{StreamExt as _, TryStreamExt as _};
use serde::Deserialize;
use sqlx::PgPool;
use uuid::Uuid;

use super::relay::{HASH_HEADER, POSITION_HEADER};
use super::Names;
use crate::event::canonical::{self, RecordFields, GENESIS_HASH};
use crate::ledger::read::{self, LedgerRow, ROW_COLUMNS};
use crate::ledger::verify::StreamReport;

/// Messages the whole-stream pass asks the server for at once. Memory holds at most this
/// many messages (each at most the stream's `max_msg_size`, 1 MiB; a ledger message is
/// usually under 1 KiB), however long the stream is.
pub const STREAM_VERIFY_BATCH_MESSAGES: i64 = 256;

/// A stream message that is not the ledger row at its sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    /// The stream sequence, which is also the ledger position it should hold.
    pub sequence: u64,
    /// What differs, in words.
    pub difference: String,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "stream message {sequence} does not match ledger position {sequence}: {}",
            self.difference,
            sequence = self.sequence
        )
    }
}

impl std::error::Error for Mismatch {}

/// The payload the relay publishes ([`crate::ledger::read::LedgerMessage`]), read back.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
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

/// How the message at `sequence` differs from the ledger row at that position (`None`
/// when the ledger has no such position); `prev_hash` is the stored hash of the row
/// before it (the genesis hash before position 1). `None` when it is that row, relayed.
pub fn difference(
    sequence: u64,
    headers: Option<&HeaderMap>,
    payload: &[u8],
    row: Option<&LedgerRow>,
    prev_hash: &[u8; 32],
) -> Option<String> {
    let Some(row) = row else {
        return Some(format!("the ledger has no position {sequence}"));
    };
    assert_eq!(
        u64::try_from(row.position).ok(),
        Some(sequence),
        "the caller pairs message n with row n"
    );
    let ledger_hash = hex::encode(&row.hash);
    match header(headers, POSITION_HEADER) {
        None => return Some(format!("it has no {POSITION_HEADER} header")),
        Some(position) if position != row.position.to_string() => {
            return Some(format!("its {POSITION_HEADER} header is {position:?}"))
        }
        Some(_) => {}
    }
    let id = row.id.hyphenated().to_string();
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

/// Checks stream messages `from..=last` (at least 1) against the ledger, in order; the first
/// that differs is returned. Errors are failures to read (NATS or Postgres), not findings.
/// Reads at most `last - from + 2` rows, so the caller bounds the range.
pub async fn check_range(
    pool: &PgPool,
    stream: &jetstream::stream::Stream,
    from: u64,
    last: u64,
) -> anyhow::Result<Option<Mismatch>> {
    assert!(from >= 1 && from <= last, "a range of stream sequences");
    let count = usize::try_from(last - from + 2).expect("a bounded range");
    let before = i64::try_from(from).expect("a stream sequence") - 1;
    // The row before `from` too: its hash is what `from`'s content chains on.
    let rows = read::read_after(pool, before - 1, count).await?;
    let mut rows = rows.iter().peekable();
    let mut prev_hash = GENESIS_HASH;
    if before > 0 {
        match rows.next_if(|row| row.position == before) {
            Some(row) => prev_hash = row.hash.as_slice().try_into().expect("32-byte hashes"),
            None => {
                return Ok(Some(Mismatch {
                    sequence: from,
                    difference: format!("the ledger has no position {from}"),
                }))
            }
        }
    }
    for sequence in from..=last {
        let message = match stream.get_raw_message(sequence).await {
            Ok(message) => message,
            Err(error) if error.kind() == RawMessageErrorKind::NoMessageFound => {
                return Ok(Some(Mismatch {
                    sequence,
                    difference: "the stream no longer holds it".to_owned(),
                }))
            }
            Err(error) => {
                return Err(error).with_context(|| format!("reading stream message {sequence}"))
            }
        };
        let row = rows.next_if(|row| u64::try_from(row.position).ok() == Some(sequence));
        if let Some(difference) = difference(
            sequence,
            Some(&message.headers),
            &message.payload,
            row,
            &prev_hash,
        ) {
            return Ok(Some(Mismatch {
                sequence,
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
) -> anyhow::Result<StreamReport> {
    let mut stream = context
        .get_stream(names.ledger_stream())
        .await
        .context("cannot find the ledger stream")?;
    let state = stream.info().await?.state.clone();
    let last_sequence = state.last_sequence;
    let mut report = StreamReport {
        ok: true,
        messages_checked: 0,
        last_sequence,
        rows_not_in_stream: 0,
        first_bad_position: None,
        problem: None,
    };
    let mut transaction = pool.begin().await?;
    // One long statement, as in the chain's full pass.
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *transaction)
        .await?;
    let query = format!("SELECT {ROW_COLUMNS} FROM ledger ORDER BY position");
    let mut rows = sqlx::query_as::<_, LedgerRow>(&query).fetch(&mut *transaction);
    let mut prev_hash = GENESIS_HASH;
    let mut found: Option<Mismatch> = None;
    if last_sequence > 0 && state.first_sequence > 1 {
        found = Some(Mismatch {
            sequence: 1,
            difference: format!(
                "the stream no longer holds it (its first message is {})",
                state.first_sequence
            ),
        });
    }
    if last_sequence > 0 && found.is_none() {
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                max_batch: STREAM_VERIFY_BATCH_MESSAGES,
                ..Default::default()
            })
            .await
            .context("cannot read the ledger stream")?;
        let mut messages = consumer.messages().await?;
        let mut expected = 1;
        while expected <= last_sequence {
            let message = messages
                .next()
                .await
                .context("the ledger stream ended early")??;
            let sequence = message
                .info()
                .map_err(|error| anyhow::anyhow!("{error}"))?
                .stream_sequence;
            if sequence != expected {
                found = Some(Mismatch {
                    sequence: expected,
                    difference: "the stream no longer holds it".to_owned(),
                });
                break;
            }
            let row = rows.try_next().await?;
            let row = row.filter(|row| u64::try_from(row.position).ok() == Some(sequence));
            if let Some(difference) = difference(
                sequence,
                message.headers.as_ref(),
                &message.payload,
                row.as_ref(),
                &prev_hash,
            ) {
                found = Some(Mismatch {
                    sequence,
                    difference,
                });
                break;
            }
            let row = row.expect("a matching message has its row");
            prev_hash = row.hash.as_slice().try_into().expect("32-byte hashes");
            report.messages_checked += 1;
            expected += 1;
        }
    }
    drop(rows);
    if found.is_none() {
        // Whatever the ledger holds past the stream has not been relayed yet.
        let unrelayed: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE position > $1")
            .bind(i64::try_from(last_sequence)?)
            .fetch_one(&mut *transaction)
            .await?;
        report.rows_not_in_stream = u64::try_from(unrelayed)?;
    }
    transaction.commit().await?;
    if let Some(mismatch) = found {
        report.ok = false;
        report.first_bad_position = Some(i64::try_from(mismatch.sequence)?);
        report.problem = Some(mismatch.to_string());
    }
    Ok(report)
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
