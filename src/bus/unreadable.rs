//! Ingest messages no NATS client can take.
//!
//! nats-server stores a message's header block as its producer wrote it, and some blocks
//! break the client they are delivered to (async-nats 0.51):
//! - a header name with a space, a line without a colon, bytes that are not UTF-8: the
//!   client drops its connection, so the message is never acknowledged and is delivered
//!   again after every ack wait, cutting the connection, and the batch around it, each time;
//! - a carriage return inside a value: the client's connection task panics and the client
//!   is dead for good;
//! - a status other than 200 on the `NATS/1.0` line, which only the server may put there:
//!   the client takes the message for the server's word on the fetch, and ends the fetch
//!   (404, 408), fails it (most others) or skips the message (100).
//!
//! - a subject that is not UTF-8, or white space other than a space or tab in the subject of
//!   a message with headers: the client drops its connection.
//!
//! The ingest consumer therefore has a connection of its own (`ingest::run`), and such
//! messages are read here in a way the client cannot stumble on: through the stream's
//! message-get API, on the instance's shared connection, whose JSON answer carries the
//! header block base64-encoded. The ingest stream is a work queue, so its first message is
//! the oldest one not acknowledged. Every [`WATCH_INTERVAL`] each instance reads it; after
//! the consumer's connection dropped, its consumer failed or a fetch ended early
//! ([`Suspicion`]), every message up to the last one the consumer was delivered. A message
//! the client cannot take gets its dead letter (the block base64-encoded in
//! [`ORIGINAL_HEADERS_HEADER`], the payload as sent) and is deleted from the stream, which
//! ends its deliveries. Instances
//! that find the same message publish the same dead-letter id, which the dead-letter stream
//! keeps once; a message deleted already is not deleted again.

use std::str::FromStr as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::header::HeaderName;
use async_nats::jetstream::{self, response::Response};
use async_nats::{HeaderMap, StatusCode};
use base64::Engine as _;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{dead_letter, Names};
use crate::error_code::ErrorCode;

/// On the dead letter of a message with unreadable headers: its header block, base64.
pub const ORIGINAL_HEADERS_HEADER: &str = "Tally-Original-Headers";
/// On such a dead letter whose header block was cut to [`ORIGINAL_HEADERS_MAX`]: the
/// block's whole length.
pub const HEADERS_TRUNCATED_HEADER: &str = "Tally-Headers-Truncated";
/// How often the ingest stream is looked at: well under the ingest consumer's ack wait, so
/// that a message the consumer could not take is gone before its next delivery.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(5);
/// Messages read in one look; more wait for the next. As many as the consumer may hold
/// unacknowledged, so that a look after a failure reads every one of them.
const READ_PER_LOOK_MAX: u64 = super::INGEST_ACK_PENDING_MAX.unsigned_abs();
/// The longest header block a dead letter keeps (before base64), so that the payload
/// still fits beside it.
const ORIGINAL_HEADERS_MAX: usize = 16 * 1024;
/// JetStream's error for a sequence the stream does not hold (acknowledged or deleted).
const NO_MESSAGE_FOUND: u64 = 10_037;

/// Whether the ingest consumer may have been delivered a message it could not take since the
/// last look: its connection dropped, its consumer failed, or a fetch ended early.
#[derive(Clone)]
pub struct Suspicion(Arc<AtomicBool>);

impl Suspicion {
    pub fn raised() -> Suspicion {
        Suspicion(Arc::new(AtomicBool::new(true)))
    }

    pub fn raise(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    /// `options` that raise the suspicion whenever the connection drops.
    pub fn on_disconnect(&self, options: async_nats::ConnectOptions) -> async_nats::ConnectOptions {
        let raised = Arc::clone(&self.0);
        options.event_callback(move |event| {
            if matches!(event, async_nats::Event::Disconnected) {
                raised.store(true, Ordering::Relaxed);
            }
            async {}
        })
    }

    fn take(&self) -> bool {
        self.0.swap(false, Ordering::Relaxed)
    }
}

/// Looks at the ingest stream every [`WATCH_INTERVAL`] until `shutdown`: at its oldest
/// message, or at every message the consumer may hold when `suspicion` was raised. A look
/// that fails is logged, and the next one reads every message the consumer may hold.
pub async fn watch(
    context: jetstream::Context,
    names: Names,
    suspicion: Suspicion,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            _ = shutdown.cancelled() => return,
        }
        let every_delivered = suspicion.take();
        if every_delivered {
            tracing::info!("reading every ingest message the consumer was delivered");
        }
        let look = dead_letter_unreadable(&context, &names, every_delivered, &shutdown);
        if let Err(error) = look.await {
            suspicion.raise();
            tracing::warn!(
                error = format!("{error:#}"),
                "cannot look for unreadable ingest messages; will look again"
            );
        }
    }
}

/// A message as the stream's message-get API gives it.
#[derive(Deserialize)]
struct MessageGet {
    message: ApiMessage,
}

#[derive(Deserialize)]
struct ApiMessage {
    subject: String,
    seq: u64,
    /// The header block, base64.
    #[serde(default)]
    hdrs: Option<String>,
    /// The payload, base64.
    #[serde(default)]
    data: Option<String>,
}

/// A message of the ingest stream, its header block decoded; its payload is decoded only
/// for a dead letter.
struct StoredMessage {
    subject: String,
    seq: u64,
    headers: Vec<u8>,
    /// The payload, base64.
    data: Option<String>,
}

/// One look of [`watch`]: dead-letters the ingest stream's messages the client cannot take,
/// from the oldest on, up to the first it can take, or with `every_delivered` up to the
/// last one the consumer was delivered; at most [`READ_PER_LOOK_MAX`] read.
pub async fn dead_letter_unreadable(
    context: &jetstream::Context,
    names: &Names,
    every_delivered: bool,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    let stream_name = names.ingest_stream();
    let stream = context.get_stream(&stream_name).await?;
    let state = &stream.cached_info().state;
    if state.messages == 0 {
        return Ok(());
    }
    let last = if every_delivered {
        let consumer = stream.consumer_info(super::INGEST_CONSUMER).await?;
        consumer.delivered.stream_sequence.min(state.last_sequence)
    } else {
        state.last_sequence
    };
    let subjects = format!("{}>", names.ingest_prefix());
    let mut from = state.first_sequence;
    let mut bytes_max = None;
    for _ in 0..READ_PER_LOOK_MAX {
        if shutdown.is_cancelled() {
            break;
        }
        // The next message held, past those acknowledged (or deleted) meanwhile.
        let Some(stored) = next(context, &stream_name, &subjects, from).await? else {
            break;
        };
        if stored.seq > last.max(state.first_sequence) {
            break;
        }
        from = stored.seq + 1;
        let Some(reason) = untakeable_because(&stored.subject, &stored.headers) else {
            if every_delivered {
                continue;
            }
            break;
        };
        let bytes_max = match bytes_max {
            Some(max) => max,
            None => *bytes_max.insert(dead_letter::bytes_max(context, names).await?),
        };
        dead_letter_one(context, names, &stream_name, &stored, reason, bytes_max).await?;
    }
    Ok(())
}

/// Publishes the dead letter of `stored`, which the client cannot take for `reason`, then
/// deletes it from the ingest stream.
async fn dead_letter_one(
    context: &jetstream::Context,
    names: &Names,
    stream_name: &str,
    stored: &StoredMessage,
    (code, reason): (ErrorCode, String),
    bytes_max: usize,
) -> anyhow::Result<()> {
    let original = dead_letter::Original {
        subject: &stored.subject,
        sequence: Some((stream_name, stored.seq)),
        headers: kept_block(&stored.headers),
        payload: decoded(stored.data.as_deref())?.into(),
    };
    let text = format!(
        "the message cannot be taken by a NATS client: {reason}; its header block is in \
         {ORIGINAL_HEADERS_HEADER}, base64-encoded"
    );
    let code = code.as_str();
    let held = dead_letter::publish(context, names, &original, (code, &text), bytes_max).await?;
    delete(context, stream_name, stored.seq).await?;
    // Counted by the instance whose copy the stream kept.
    if !held {
        tracing::info!(subject = %stored.subject, sequence = stored.seq, code, error = text, "ingest message dead-lettered");
        metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "nats", "outcome" => "dead_lettered")
            .increment(1);
    }
    Ok(())
}

/// What the stream API gives base64-encoded, decoded; nothing when it gives nothing.
fn decoded(encoded: Option<&str>) -> anyhow::Result<Vec<u8>> {
    encoded.map_or(Ok(Vec::new()), |encoded| {
        base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .context("the stream gave invalid base64")
    })
}

/// The first message of the ingest stream at or after `from`, if it holds one.
async fn next(
    context: &jetstream::Context,
    stream_name: &str,
    subjects: &str,
    from: u64,
) -> anyhow::Result<Option<StoredMessage>> {
    get(
        context,
        stream_name,
        serde_json::json!({ "seq": from, "next_by_subj": subjects }),
    )
    .await
}

/// The message `request` asks the stream's message-get API for, unless the stream holds none
/// such (acknowledged or deleted).
async fn get(
    context: &jetstream::Context,
    stream_name: &str,
    request: serde_json::Value,
) -> anyhow::Result<Option<StoredMessage>> {
    let answer: Response<MessageGet> = context
        .request(format!("STREAM.MSG.GET.{stream_name}"), &request)
        .await?;
    match answer {
        Response::Ok(MessageGet { message }) => Ok(Some(StoredMessage {
            headers: decoded(message.hdrs.as_deref())?,
            subject: message.subject,
            seq: message.seq,
            data: message.data,
        })),
        Response::Err { error } if error.error_code().0 == NO_MESSAGE_FOUND => Ok(None),
        Response::Err { error } => Err(error).context("cannot read an ingest message"),
    }
}

/// Deletes message `sequence` from the ingest stream; one another instance deleted already
/// is not an error. (JetStream refuses that delete with a code it gives other failures as
/// well, so whether the message is still there is asked.)
async fn delete(
    context: &jetstream::Context,
    stream_name: &str,
    sequence: u64,
) -> anyhow::Result<()> {
    let stream = context.get_stream_no_info(stream_name).await?;
    let Err(error) = stream.delete_message(sequence).await else {
        return Ok(());
    };
    match get(context, stream_name, serde_json::json!({ "seq": sequence })).await {
        Ok(None) => Ok(()),
        _ => Err(error).context("cannot delete the unreadable ingest message"),
    }
}

/// The headers a dead letter carries for an unreadable header block: the block itself,
/// base64, cut to [`ORIGINAL_HEADERS_MAX`].
fn kept_block(block: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    if block.is_empty() {
        return headers;
    }
    let kept = &block[..block.len().min(ORIGINAL_HEADERS_MAX)];
    let encoded = base64::engine::general_purpose::STANDARD.encode(kept);
    headers.insert(ORIGINAL_HEADERS_HEADER, encoded.as_str());
    if kept.len() < block.len() {
        headers.insert(HEADERS_TRUNCATED_HEADER, block.len().to_string().as_str());
    }
    headers
}

/// Why the NATS client (async-nats 0.51, reading a delivered message) would not take a
/// message on `subject` (as the stream API shows it) with this header block, and the code of
/// its dead letter; `None` when it takes it. The client reads the line that delivers a
/// message as UTF-8 (the API shows other bytes as U+FFFD), and splits the line of a message
/// with headers on any white space, where the server splits subjects on spaces and tabs
/// only.
fn untakeable_because(subject: &str, block: &[u8]) -> Option<(ErrorCode, String)> {
    if subject.contains(char::REPLACEMENT_CHARACTER) {
        let reason = "its subject is not UTF-8".to_owned();
        return Some((ErrorCode::UnreadableSubject, reason));
    }
    if !block.is_empty() && subject.contains(char::is_whitespace) {
        let reason = "its subject holds white space and it has headers".to_owned();
        return Some((ErrorCode::UnreadableSubject, reason));
    }
    unreadable_because(block).map(|reason| (ErrorCode::UnreadableHeaders, reason))
}

/// Why the NATS client (async-nats 0.51, reading a delivered message) would not take this
/// header block, or `None` when it takes it. The same steps as the client's parser: the
/// block is UTF-8 and begins with `NATS/1.0`; each line after that is empty, a continuation
/// of the line before (it begins with white space) or `name:value` with a valid name; a
/// value, its continuations joined and its ends trimmed, holds no carriage return (the
/// client panics on one). And it has no status, which the client takes for the server's.
fn unreadable_because(block: &[u8]) -> Option<String> {
    if block.is_empty() {
        return None;
    }
    let Ok(text) = std::str::from_utf8(block) else {
        return Some("its headers are not UTF-8".to_owned());
    };
    let mut lines = text.lines().peekable();
    let version = lines.next().unwrap_or_default();
    let Some(rest) = version.strip_prefix("NATS/1.0").map(str::trim) else {
        return Some("its headers do not begin with NATS/1.0".to_owned());
    };
    // A message with status 200 (or none) is a message; any other is the server's word.
    let status = rest
        .split_once(' ')
        .map_or(rest, |(status, _)| status.trim());
    if !status.is_empty() && StatusCode::from_str(status).ok() != Some(StatusCode::OK) {
        return Some(format!(
            "status {:?} is for the server to give",
            short(status)
        ));
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Some(format!("line {:?} has no colon", short(line)));
        };
        if HeaderName::from_str(name).is_err() {
            return Some(format!("header name {:?} is not valid", short(name)));
        }
        let mut value = value.trim_start().to_owned();
        while let Some(more) = lines.next_if(|next| next.starts_with(char::is_whitespace)) {
            value.push_str(more);
        }
        if value.trim_end().contains(['\r', '\n']) {
            return Some(format!(
                "the value of {:?} holds a carriage return",
                short(name)
            ));
        }
    }
    None
}

/// At most the first 64 characters of `text`, for an error message.
fn short(text: &str) -> &str {
    text.char_indices()
        .nth(64)
        .map_or(text, |(end, _)| &text[..end])
}

#[cfg(test)]
mod tests {
    use base64::Engine as _;

    use super::{
        kept_block, unreadable_because, untakeable_because, HEADERS_TRUNCATED_HEADER,
        ORIGINAL_HEADERS_HEADER, ORIGINAL_HEADERS_MAX,
    };

    #[test]
    fn a_header_block_past_its_limit_is_kept_cut_with_its_whole_length() {
        let decode = |headers: &async_nats::HeaderMap| {
            let kept = headers.get(ORIGINAL_HEADERS_HEADER).unwrap().as_str();
            base64::engine::general_purpose::STANDARD
                .decode(kept)
                .unwrap()
        };
        let whole = vec![b'a'; ORIGINAL_HEADERS_MAX];
        let kept = kept_block(&whole);
        assert_eq!(decode(&kept), whole);
        assert!(kept.get(HEADERS_TRUNCATED_HEADER).is_none());

        let long = vec![b'b'; ORIGINAL_HEADERS_MAX + 1];
        let kept = kept_block(&long);
        assert_eq!(decode(&kept), long[..ORIGINAL_HEADERS_MAX]);
        let length = kept.get(HEADERS_TRUNCATED_HEADER).unwrap().as_str();
        assert_eq!(length, (ORIGINAL_HEADERS_MAX + 1).to_string());
    }

    #[test]
    fn headers_a_client_sends_are_readable() {
        for block in [
            "",
            "NATS/1.0\r\n\r\n",
            "NATS/1.0\r\nContent-Type: application/json\r\nce-id: 1\r\n\r\n",
            "NATS/1.0\r\nLong: first\r\n second\r\n\r\n",
            "NATS/1.0\r\nTrailing: x\r\r\n\r\n",
            "NATS/1.0 200\r\nA: b\r\n\r\n",
            "NATS/1.0 200 OK\r\n\r\n",
        ] {
            assert_eq!(unreadable_because(block.as_bytes()), None, "{block:?}");
        }
    }

    #[test]
    fn headers_the_client_cannot_take_are_unreadable_with_the_reason() {
        for (block, reason) in [
            ("NATS/1.0\r\nBad Name: x\r\n\r\n", "header name"),
            ("NATS/1.0\r\nno colon here\r\n\r\n", "no colon"),
            ("HTTP/1.1\r\nA: b\r\n\r\n", "NATS/1.0"),
            ("NATS/1.0 abc\r\n\r\n", "status"),
            ("NATS/1.0 503\r\n\r\n", "status"),
            ("NATS/1.0 100 Idle Heartbeat\r\n\r\n", "status"),
            ("NATS/1.0 408 Request Timeout\r\n\r\n", "status"),
            ("NATS/1.0\r\nA: x\ry\r\n\r\n", "carriage return"),
            ("NATS/1.0\r\nA: x\r\n y\rz\r\n\r\n", "carriage return"),
        ] {
            let found = unreadable_because(block.as_bytes());
            assert!(
                found.as_deref().is_some_and(|found| found.contains(reason)),
                "{block:?}: {found:?}"
            );
        }
        assert!(unreadable_because(b"NATS/1.0\r\nA: \xff\r\n\r\n").is_some());
    }

    #[test]
    fn subjects_the_client_cannot_take_are_unreadable_and_others_are_not() {
        use crate::error_code::ErrorCode::{UnreadableHeaders, UnreadableSubject};
        let headers = b"NATS/1.0\r\nA: b\r\n\r\n".as_slice();
        let code =
            |subject: &str, block: &[u8]| untakeable_because(subject, block).map(|(code, _)| code);
        assert_eq!(code("tally.ingest.\u{fffd}", b""), Some(UnreadableSubject));
        assert_eq!(
            code("tally.ingest.a\u{a0}b", headers),
            Some(UnreadableSubject)
        );
        assert_eq!(
            code("tally.ingest.a\u{3000}b", headers),
            Some(UnreadableSubject)
        );
        // Without headers, the client splits the line on spaces only.
        assert_eq!(code("tally.ingest.a\u{a0}b", b""), None);
        assert_eq!(code("tally.ingest.Ä", headers), None);
        assert_eq!(
            code("tally.ingest.ok", b"NATS/1.0\r\nBad Name: x\r\n\r\n"),
            Some(UnreadableHeaders)
        );
    }
}
