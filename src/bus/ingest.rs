//! The NATS ingest path: a durable pull consumer on `TALLY_INGEST` feeding the same
//! appender as HTTP.
//!
//! A message is acknowledged only after the transaction that appends its events has
//! committed; if tally dies first, JetStream redelivers it and the event id makes the
//! second append a duplicate, so nothing is counted twice. A message that can never be
//! appended (invalid, an id reused with other content, content the database refuses —
//! anything [`AppendError::is_retryable`] says will fail again) is copied to `TALLY_DLQ`
//! with the error in headers and then acknowledged, so it cannot loop. Only a message that
//! failed for a passing reason (database down, queue full) is nak'ed and retried later.

use std::time::Duration;

// anyhow, not a typed error, for the consumer's own failures (NATS, acks): they end at its
// loop, which logs them and consumes again; none reaches an HTTP answer. What a message's
// fate depends on is typed ([`AppendError`], [`Verdict`]).
use anyhow::Context as _;
use async_nats::jetstream::{self, consumer::pull, AckKind, Message};
use async_nats::HeaderMap;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::Names;
use crate::error_code::ErrorCode;
use crate::event::cloudevent;
use crate::event::parse::{parse_envelope, BodyKind, Envelope};
use crate::event::TimeBounds;
use crate::ledger::{legacy_ids, plans, AppendError, Appender};
use sqlx::PgPool;

/// The durable consumer's name.
pub const CONSUMER_NAME: &str = "tally-ingest";
/// Headers on a dead-lettered message.
pub const ERROR_CODE_HEADER: &str = "Tally-Error-Code";
pub const ERROR_HEADER: &str = "Tally-Error";
pub const ORIGINAL_SUBJECT_HEADER: &str = "Tally-Original-Subject";
/// How long JetStream waits for an ack before redelivering: well above a group commit.
pub const ACK_WAIT_SECONDS: u64 = 30;
/// Unacknowledged messages the server lets this consumer hold: two full fetches.
const MAX_ACK_PENDING: i64 = 20_000;
/// How long one fetch waits for messages when the stream is idle.
const FETCH_EXPIRES_MS: u64 = 500;
/// Delay before a message that failed for a passing reason is redelivered.
const RETRY_DELAY_MS: u64 = 1_000;
/// Longest error text put in a header.
const ERROR_HEADER_LENGTH_MAX: usize = 1_024;

#[derive(Debug, Clone)]
pub struct IngestSettings {
    pub fetch_max: usize,
    pub batch_events_max: usize,
    pub backdate_max: chrono::Duration,
    /// The "now" an event's time is bounded by.
    pub clock: crate::clock::Clock,
}

/// Runs until `shutdown`, finishing the batch in hand; errors are logged and retried.
pub async fn run(
    context: jetstream::Context,
    names: Names,
    pool: PgPool,
    appender: Appender,
    settings: IngestSettings,
    streams: super::StreamHealth,
    shutdown: CancellationToken,
) {
    while !shutdown.is_cancelled() {
        let consumed = consume(
            &context, &names, &pool, &appender, &settings, &streams, &shutdown,
        );
        if let Err(error) = consumed.await {
            tracing::warn!(
                error = format!("{error:#}"),
                "ingest consumer interrupted; will resume"
            );
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(RETRY_DELAY_MS)) => {}
                _ = shutdown.cancelled() => {}
            }
        }
    }
    tracing::info!("ingest consumer stopped");
}

async fn consume(
    context: &jetstream::Context,
    names: &Names,
    pool: &PgPool,
    appender: &Appender,
    settings: &IngestSettings,
    streams: &super::StreamHealth,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    streams
        .apply(context, names, &["TALLY_INGEST", "TALLY_DLQ"])
        .await?;
    let stream = context.get_stream(names.ingest_stream()).await?;
    let consumer = stream
        .get_or_create_consumer(
            CONSUMER_NAME,
            pull::Config {
                durable_name: Some(CONSUMER_NAME.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(ACK_WAIT_SECONDS),
                max_ack_pending: MAX_ACK_PENDING,
                ..Default::default()
            },
        )
        .await
        .context("cannot create the ingest consumer")?;
    while !shutdown.is_cancelled() {
        let fetch = async {
            let mut batch = consumer
                .fetch()
                .max_messages(settings.fetch_max)
                .expires(Duration::from_millis(FETCH_EXPIRES_MS))
                .messages()
                .await?;
            let mut messages = Vec::new();
            while let Some(message) = batch.next().await {
                messages.push(message.map_err(|e| anyhow::anyhow!(e))?);
            }
            anyhow::Ok(messages)
        };
        // Nothing fetched is lost by stopping here: unacknowledged messages are redelivered.
        let messages = tokio::select! {
            messages = fetch => messages?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        if !messages.is_empty() {
            handle_batch(context, names, pool, appender, settings, messages).await?;
        }
    }
    Ok(())
}

/// What to do with one message once its append has been tried.
enum Verdict {
    Stored(usize),
    DeadLetter { code: &'static str, message: String },
    Retry(AppendError),
}

async fn handle_batch(
    context: &jetstream::Context,
    names: &Names,
    pool: &PgPool,
    appender: &Appender,
    settings: &IngestSettings,
    messages: Vec<Message>,
) -> anyhow::Result<()> {
    let bounds = TimeBounds {
        now: settings.clock.now(),
        backdate_max: settings.backdate_max,
    };
    // All appends are queued before any is awaited, so the batch shares group commits.
    let verdicts = futures::future::join_all(
        messages
            .iter()
            .map(|message| verdict(message, pool, appender, settings, bounds)),
    )
    .await;
    for (message, verdict) in messages.iter().zip(verdicts) {
        settle(context, names, message, verdict).await?;
    }
    Ok(())
}

/// What becomes of one message: its events parsed, checked and appended.
async fn verdict(
    message: &Message,
    pool: &PgPool,
    appender: &Appender,
    settings: &IngestSettings,
    bounds: TimeBounds,
) -> Verdict {
    let headers = message_headers(message);
    let content_type = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .and_then(|(_, value)| std::str::from_utf8(value).ok());
    let parsed = Envelope::select(
        content_type,
        cloudevent::has_ce_header(headers.iter().map(|(name, _)| *name)),
        Some(BodyKind::Native),
    )
    .and_then(|envelope| {
        parse_envelope(
            envelope,
            headers.iter().copied(),
            content_type,
            &message.payload,
            bounds,
            settings.batch_events_max,
        )
    });
    let mut events = match parsed {
        Ok(events) => events,
        Err(error) => {
            return Verdict::DeadLetter {
                code: error.code().as_str(),
                message: error.describe(),
            }
        }
    };
    match plans::unknown_reference(pool, &events).await {
        Ok(None) => {}
        Ok(Some((index, plan))) => {
            return Verdict::DeadLetter {
                code: ErrorCode::UnknownPlan.as_str(),
                message: format!("event {index}: plan {plan:?} is not defined"),
            }
        }
        Err(error) => return Verdict::Retry(AppendError::Store(std::sync::Arc::new(error))),
    }
    if let Err(error) = legacy_ids::adopt(pool, &mut events).await {
        return Verdict::Retry(AppendError::Store(std::sync::Arc::new(error)));
    }
    let count = events.len();
    match appender.append(events).await {
        Ok(_) => Verdict::Stored(count),
        Err(AppendError::IdempotencyConflict { index, id }) => Verdict::DeadLetter {
            code: ErrorCode::IdempotencyConflict.as_str(),
            message: format!("event {index}: id {id} was stored before with different content"),
        },
        // Redelivered, it would fail the same way for ever.
        Err(error) if !error.is_retryable() => Verdict::DeadLetter {
            code: error.code().as_str(),
            message: error.to_string(),
        },
        Err(error) => Verdict::Retry(error),
    }
}

/// Every header of a message as (name, value) pairs, each value of a repeated name once.
/// NATS header names are case-insensitive, but the client keeps them as sent: readers
/// compare names with `eq_ignore_ascii_case`.
fn message_headers(message: &Message) -> Vec<(&str, &[u8])> {
    let Some(headers) = &message.headers else {
        return Vec::new();
    };
    headers
        .iter()
        .flat_map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(move |value| (name, value.as_str().as_bytes()))
        })
        .collect()
}

/// Acknowledges a message as its verdict says: stored, dead-lettered, or redelivered later.
async fn settle(
    context: &jetstream::Context,
    names: &Names,
    message: &Message,
    verdict: Verdict,
) -> anyhow::Result<()> {
    match verdict {
        Verdict::Stored(count) => {
            message.ack().await.map_err(|e| anyhow::anyhow!(e))?;
            metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "nats", "outcome" => "stored")
                .increment(count as u64);
        }
        Verdict::DeadLetter {
            code,
            message: text,
        } => {
            dead_letter(context, names, message, code, &text).await?;
            message.ack().await.map_err(|e| anyhow::anyhow!(e))?;
            metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "nats", "outcome" => "dead_lettered")
                .increment(1);
            tracing::info!(subject = %message.subject, code, error = text, "ingest message dead-lettered");
        }
        Verdict::Retry(error) => {
            tracing::warn!(error = %error, "ingest message will be redelivered");
            message
                .ack_with(AckKind::Nak(Some(Duration::from_millis(RETRY_DELAY_MS))))
                .await
                .map_err(|e| anyhow::anyhow!(e))?;
        }
    }
    Ok(())
}

/// A header value cannot hold line breaks; keep it short too.
fn header_text(text: &str) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    flat.chars().take(ERROR_HEADER_LENGTH_MAX).collect()
}

async fn dead_letter(
    context: &jetstream::Context,
    names: &Names,
    message: &Message,
    code: &str,
    text: &str,
) -> anyhow::Result<()> {
    let suffix = message
        .subject
        .as_str()
        .strip_prefix(&names.ingest_prefix())
        .unwrap_or("unknown");
    let subject = format!("{}{suffix}", names.dlq_prefix());
    let mut headers = HeaderMap::new();
    if let Some(original) = &message.headers {
        for (name, values) in original.iter() {
            for value in values {
                headers.append(name.clone(), value.clone());
            }
        }
    }
    headers.insert(ERROR_CODE_HEADER, code);
    headers.insert(ERROR_HEADER, header_text(text).as_str());
    headers.insert(ORIGINAL_SUBJECT_HEADER, message.subject.as_str());
    // A redelivered message (its ack was lost) must not be dead-lettered twice.
    let sequence = message.info().map(|i| i.stream_sequence).unwrap_or(0);
    headers.insert("Nats-Msg-Id", format!("ingest-{sequence}").as_str());
    context
        .publish_with_headers(subject, headers, message.payload.clone())
        .await?
        .await
        .context("cannot publish to the dead-letter stream")?;
    Ok(())
}
