//! Ingest messages whose headers no NATS client can read.
//!
//! nats-server stores a message's header block as its producer wrote it. A block the client
//! cannot parse (a header name with a space, a line without a colon, bytes that are not
//! UTF-8) makes async-nats drop the whole connection when the message is delivered: the
//! ingest consumer never receives it, so never acknowledges it, and JetStream delivers it
//! again after every ack wait, cutting the connection, and the batch around it, each time.
//!
//! Such a message is read here the way the client cannot stumble on: through the stream's
//! message-get API, whose JSON answer carries the header block base64-encoded. The ingest
//! stream is a work queue, so its first message is the oldest one not acknowledged: every
//! [`WATCH_INTERVAL`] each instance reads it and, when its headers are unreadable, publishes
//! its dead letter (the header block base64-encoded in [`ORIGINAL_HEADERS_HEADER`], the
//! payload as sent) and then deletes it from the stream, which ends its deliveries. Instances
//! that find the same message publish the same dead-letter id, which the dead-letter stream
//! keeps once; a message deleted already is not deleted again.

use std::str::FromStr as _;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::header::HeaderName;
use async_nats::jetstream::{self, response::Response};
use async_nats::HeaderMap;
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
/// How often the oldest message of the ingest stream is looked at: well under the ingest
/// consumer's ack wait, so that an unreadable message is gone before its first redelivery.
pub const WATCH_INTERVAL: Duration = Duration::from_secs(5);
/// Unreadable messages dead-lettered in one look; more wait for the next.
const UNREADABLE_PER_LOOK_MAX: usize = 1_000;
/// The longest header block a dead letter keeps (before base64), so that the payload
/// still fits beside it.
const ORIGINAL_HEADERS_MAX: usize = 16 * 1024;
/// JetStream's error for a sequence the stream does not hold (acknowledged or deleted).
const NO_MESSAGE_FOUND: u64 = 10_037;

/// Looks at the oldest ingest message every [`WATCH_INTERVAL`] until `shutdown`; failures
/// are logged and the next look tries again.
pub async fn watch(context: jetstream::Context, names: Names, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
            _ = shutdown.cancelled() => return,
        }
        if let Err(error) = dead_letter_unreadable(&context, &names).await {
            tracing::warn!(
                error = format!("{error:#}"),
                "cannot look for unreadable ingest messages; will look again"
            );
        }
    }
}

/// A message as the stream's message-get API gives it.
#[derive(Deserialize)]
struct StoredMessage {
    subject: String,
    seq: u64,
    /// The header block, base64.
    #[serde(default)]
    hdrs: Option<String>,
    /// The payload, base64.
    #[serde(default)]
    data: Option<String>,
}

#[derive(Deserialize)]
struct MessageGet {
    message: StoredMessage,
}

/// Dead-letters the oldest messages of the ingest stream while their headers are
/// unreadable, at most [`UNREADABLE_PER_LOOK_MAX`] of them: one look of [`watch`].
pub async fn dead_letter_unreadable(
    context: &jetstream::Context,
    names: &Names,
) -> anyhow::Result<()> {
    let stream_name = names.ingest_stream();
    let mut bytes_max = None;
    for _ in 0..UNREADABLE_PER_LOOK_MAX {
        let Some(stored) = oldest(context, &stream_name).await? else {
            return Ok(());
        };
        let base64 = base64::engine::general_purpose::STANDARD;
        let headers = match &stored.hdrs {
            Some(encoded) => base64
                .decode(encoded)
                .context("the stream gave invalid base64")?,
            None => Vec::new(),
        };
        let Some(reason) = unreadable_because(&headers) else {
            return Ok(());
        };
        let payload = match &stored.data {
            Some(encoded) => base64
                .decode(encoded)
                .context("the stream gave invalid base64")?,
            None => Vec::new(),
        };
        let bytes_max = match bytes_max {
            Some(max) => max,
            None => *bytes_max.insert(dead_letter::bytes_max(context, names).await?),
        };
        let original = dead_letter::Original {
            subject: &stored.subject,
            sequence: Some((&stream_name, stored.seq)),
            headers: kept_block(&headers),
            payload: payload.into(),
        };
        let text = format!(
            "the message's headers cannot be read ({reason}); its header block is in \
             {ORIGINAL_HEADERS_HEADER}, base64-encoded"
        );
        let code = ErrorCode::UnreadableHeaders.as_str();
        dead_letter::publish(context, names, &original, (code, &text), bytes_max).await?;
        delete(context, &stream_name, stored.seq).await?;
        tracing::info!(subject = %stored.subject, sequence = stored.seq, code, error = text, "ingest message dead-lettered");
        metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "nats", "outcome" => "dead_lettered")
            .increment(1);
    }
    Ok(())
}

/// The oldest message of the ingest stream, if it holds any.
async fn oldest(
    context: &jetstream::Context,
    stream_name: &str,
) -> anyhow::Result<Option<StoredMessage>> {
    let stream = context.get_stream(stream_name).await?;
    let state = &stream.cached_info().state;
    if state.messages == 0 {
        return Ok(None);
    }
    get(context, stream_name, state.first_sequence).await
}

/// Message `sequence` of the ingest stream, unless the stream does not hold it
/// (acknowledged or deleted).
async fn get(
    context: &jetstream::Context,
    stream_name: &str,
    sequence: u64,
) -> anyhow::Result<Option<StoredMessage>> {
    let answer: Response<MessageGet> = context
        .request(
            format!("STREAM.MSG.GET.{stream_name}"),
            &serde_json::json!({ "seq": sequence }),
        )
        .await?;
    match answer {
        Response::Ok(got) => Ok(Some(got.message)),
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
    match get(context, stream_name, sequence).await {
        Ok(None) => Ok(()),
        _ => Err(error).context("cannot delete the unreadable ingest message"),
    }
}

/// The headers a dead letter carries for an unreadable header block: the block itself,
/// base64, cut to [`ORIGINAL_HEADERS_MAX`].
fn kept_block(block: &[u8]) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let kept = &block[..block.len().min(ORIGINAL_HEADERS_MAX)];
    let encoded = base64::engine::general_purpose::STANDARD.encode(kept);
    headers.insert(ORIGINAL_HEADERS_HEADER, encoded.as_str());
    if kept.len() < block.len() {
        headers.insert(HEADERS_TRUNCATED_HEADER, block.len().to_string().as_str());
    }
    headers
}

/// Why the NATS client (async-nats 0.51, reading a delivered message) would refuse this
/// header block, or `None` when it reads it. The same steps as the client's parser: the
/// block is UTF-8, begins with `NATS/1.0` and a status it knows, and each line after that is
/// empty, a continuation of the line before (it begins with white space) or `name:value`
/// with a valid name.
fn unreadable_because(block: &[u8]) -> Option<String> {
    if block.is_empty() {
        return None;
    }
    let Ok(text) = std::str::from_utf8(block) else {
        return Some("they are not UTF-8".to_owned());
    };
    let mut lines = text.lines().peekable();
    let version = lines.next().unwrap_or_default();
    let Some(rest) = version.strip_prefix("NATS/1.0").map(str::trim) else {
        return Some("they do not begin with NATS/1.0".to_owned());
    };
    let status = rest
        .split_once(' ')
        .map_or(rest, |(status, _)| status.trim());
    if !status.is_empty() && async_nats::StatusCode::from_str(status).is_err() {
        return Some(format!("status {status:?} is not a number"));
    }
    while let Some(line) = lines.next() {
        if line.is_empty() {
            continue;
        }
        let Some((name, _)) = line.split_once(':') else {
            return Some(format!("line {:?} has no colon", short(line)));
        };
        if HeaderName::from_str(name).is_err() {
            return Some(format!("header name {:?} is not valid", short(name)));
        }
        while lines
            .next_if(|next| next.starts_with(char::is_whitespace))
            .is_some()
        {}
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
    use super::unreadable_because;

    #[test]
    fn headers_a_client_sends_are_readable() {
        for block in [
            "",
            "NATS/1.0\r\n\r\n",
            "NATS/1.0\r\nContent-Type: application/json\r\nce-id: 1\r\n\r\n",
            "NATS/1.0 503\r\n\r\n",
            "NATS/1.0\r\nLong: first\r\n second\r\n\r\n",
        ] {
            assert_eq!(unreadable_because(block.as_bytes()), None, "{block:?}");
        }
    }

    #[test]
    fn headers_the_client_cannot_parse_are_unreadable_with_the_reason() {
        for (block, reason) in [
            ("NATS/1.0\r\nBad Name: x\r\n\r\n", "header name"),
            ("NATS/1.0\r\nno colon here\r\n\r\n", "no colon"),
            ("HTTP/1.1\r\nA: b\r\n\r\n", "NATS/1.0"),
            ("NATS/1.0 abc\r\n\r\n", "status"),
        ] {
            let found = unreadable_because(block.as_bytes());
            assert!(
                found.as_deref().is_some_and(|found| found.contains(reason)),
                "{block:?}: {found:?}"
            );
        }
        assert!(unreadable_because(b"NATS/1.0\r\nA: \xff\r\n\r\n").is_some());
    }
}
