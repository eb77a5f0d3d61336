//! Dead letters: the copy on `TALLY_DLQ` of an ingest message that can never be appended,
//! with why in its headers.

use anyhow::Context as _;
use async_nats::jetstream::{self, context::PublishErrorKind};
use async_nats::HeaderMap;
use bytes::Bytes;

use super::Names;

/// Headers on a dead-lettered message.
pub const ERROR_CODE_HEADER: &str = "Tally-Error-Code";
pub const ERROR_HEADER: &str = "Tally-Error";
pub const ORIGINAL_SUBJECT_HEADER: &str = "Tally-Original-Subject";
/// On a dead letter whose payload was cut to fit the dead-letter stream: the length of the
/// message's whole payload.
pub const PAYLOAD_TRUNCATED_HEADER: &str = "Tally-Payload-Truncated";
/// A producer's JetStream control headers (`Nats-Expected-Stream`, `Nats-Msg-Id`, ...) and
/// headers named like tally's (`Tally-*`) are kept on its dead letter under this prefix.
pub const RENAMED_HEADER_PREFIX: &str = "Tally-Original-";
const JETSTREAM_HEADER_PREFIX: &str = "Nats-";
const TALLY_HEADER_PREFIX: &str = "Tally-";
/// Longest error text put in a header.
const ERROR_HEADER_LENGTH_MAX: usize = 1_024;

/// A message to dead-letter, as it was stored on the ingest stream.
pub(super) struct Original<'a> {
    pub subject: &'a str,
    /// The ingest stream's name and the message's sequence in it, when known: they make a
    /// redelivered message's dead letter a duplicate.
    pub sequence: Option<(&'a str, u64)>,
    /// The headers its dead letter keeps ([`kept_headers`]).
    pub headers: HeaderMap,
    pub payload: Bytes,
}

/// The producer's headers as a dead letter keeps them. Those a server or tally gives
/// meaning to (`Nats-*`: an expected stream or last sequence, a message id; `Tally-*`: the
/// reasons) are renamed `Tally-Original-…`, or the dead-letter stream would act on them and
/// refuse the copy, or a reader would take them for tally's.
pub(super) fn kept_headers<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> HeaderMap {
    let mut kept = HeaderMap::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value);
        let meaningful = [JETSTREAM_HEADER_PREFIX, TALLY_HEADER_PREFIX]
            .iter()
            .any(|prefix| {
                name.get(..prefix.len())
                    .is_some_and(|start| start.eq_ignore_ascii_case(prefix))
            });
        if meaningful {
            kept.append(format!("{RENAMED_HEADER_PREFIX}{name}"), value.as_ref());
        } else {
            kept.append(name, value.as_ref());
        }
    }
    kept
}

/// The largest message the dead-letter stream and the server take, headers included: the
/// stream's `max_msg_size` (when it has one) and the server's `max_payload`.
pub(super) async fn bytes_max(
    context: &jetstream::Context,
    names: &Names,
) -> anyhow::Result<usize> {
    let stream = context.get_stream(names.dlq_stream()).await?;
    let server = context.client().max_payload();
    Ok(
        match usize::try_from(stream.cached_info().config.max_message_size) {
            Ok(stream_max) if stream_max > 0 => stream_max.min(server),
            _ => server,
        },
    )
}

/// A header value cannot hold line breaks; keep it short too.
fn header_text(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    flat.chars().take(ERROR_HEADER_LENGTH_MAX).collect()
}

/// What a dead letter is made of: the message's kept headers and payload, with the reasons
/// added.
struct DeadLetter {
    headers: HeaderMap,
    payload: Bytes,
}

impl DeadLetter {
    /// The copy of a message that could never be appended. The payload is cut to what fits
    /// in `bytes_max` beside the headers, and [`PAYLOAD_TRUNCATED_HEADER`] then gives its
    /// whole length. Only headers that alone outgrow `bytes_max` (a producer's near the
    /// limit) leave a copy the stream refuses, which is then published bare.
    fn of(original: &Original<'_>, reason: (&str, &str), bytes_max: usize) -> DeadLetter {
        let mut headers = original.headers.clone();
        add_reasons(&mut headers, original, reason);
        let payload = original.payload.clone();
        if headers_size(&headers) + payload.len() <= bytes_max {
            return DeadLetter { headers, payload };
        }
        headers.insert(PAYLOAD_TRUNCATED_HEADER, payload.len().to_string().as_str());
        let room = bytes_max.saturating_sub(headers_size(&headers));
        DeadLetter {
            headers,
            payload: payload.slice(..room.min(payload.len())),
        }
    }

    /// The same dead letter with none of the message's own headers and no payload: what is
    /// published when the dead-letter stream refuses the full copy for a reason this
    /// instance did not foresee (a stream whose limit was lowered since it was read), so
    /// that one message can never stop the consumer.
    fn bare(original: &Original<'_>, reason: (&str, &str)) -> DeadLetter {
        let mut headers = HeaderMap::new();
        add_reasons(&mut headers, original, reason);
        headers.insert(
            PAYLOAD_TRUNCATED_HEADER,
            original.payload.len().to_string().as_str(),
        );
        DeadLetter {
            headers,
            payload: Bytes::new(),
        }
    }
}

/// Adds why the message was dead-lettered, where it came from, and the id that makes a
/// redelivered message's dead letter a duplicate.
fn add_reasons(headers: &mut HeaderMap, original: &Original<'_>, (code, text): (&str, &str)) {
    headers.insert(ERROR_CODE_HEADER, code);
    headers.insert(ERROR_HEADER, header_text(text).as_str());
    headers.insert(ORIGINAL_SUBJECT_HEADER, original.subject);
    // A redelivered message (its ack was lost) must not be dead-lettered twice. Without its
    // stream sequence there is no id that is its own: better twice than another's dropped.
    if let Some((stream, sequence)) = original.sequence {
        let id = format!("ingest-{stream}-{sequence}");
        headers.insert("Nats-Msg-Id", id.as_str());
    }
}

/// Whether a publish was refused for its size, by the client (the server's `max_payload`)
/// or by the stream (its `max_msg_size`).
fn too_large(error: &async_nats::jetstream::context::PublishError) -> bool {
    error.kind() == PublishErrorKind::MaxPayloadExceeded
        || std::error::Error::source(error)
            .and_then(|source| source.downcast_ref::<jetstream::Error>())
            .is_some_and(|refusal| {
                refusal.error_code() == jetstream::ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
            })
}

/// The bytes `headers` take on the wire: the version line, a line per value, the blank line.
fn headers_size(headers: &HeaderMap) -> usize {
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(|value| name.len() + value.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum();
    "NATS/1.0\r\n".len() + lines + 2
}

/// Publishes the dead letter of `original` and waits for the dead-letter stream to confirm
/// it; refused as it is, it is published bare ([`DeadLetter::bare`]). Whether the stream
/// held it already (a duplicate of its id).
pub(super) async fn publish(
    context: &jetstream::Context,
    names: &Names,
    original: &Original<'_>,
    reason: (&str, &str),
    bytes_max: usize,
) -> anyhow::Result<bool> {
    // A subject the client would stumble on (white space, bytes the stream API showed as
    // U+FFFD) must not become the dead letter's: it is kept in a header only.
    let suffix = original
        .subject
        .strip_prefix(&names.ingest_prefix())
        .filter(|suffix| {
            !suffix.contains(|c: char| c.is_whitespace() || c == char::REPLACEMENT_CHARACTER)
        })
        .unwrap_or("unknown");
    let subject = format!("{}{suffix}", names.dlq_prefix());
    let letter = DeadLetter::of(original, reason, bytes_max);
    let published = async {
        context
            .publish_with_headers(subject.clone(), letter.headers, letter.payload)
            .await?
            .await
    };
    match published.await {
        Ok(ack) => return Ok(ack.duplicate),
        // Too large for the stream or the server: another try would be refused again. Any
        // other failure (a leader election, a lost connection) may pass, and the message
        // is redelivered whole.
        Err(error) if too_large(&error) => {
            tracing::warn!(error = %error, subject = %original.subject, "dead letter refused; publishing it bare");
        }
        Err(error) => return Err(error).context("cannot publish to the dead-letter stream"),
    }
    let bare = DeadLetter::bare(original, reason);
    let ack = context
        .publish_with_headers(subject, bare.headers, bare.payload)
        .await?
        .await
        .context("cannot publish to the dead-letter stream")?;
    Ok(ack.duplicate)
}
