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
//! A message whose headers the client cannot take breaks the connection it is delivered on
//! instead of reaching this consumer; [`super::unreadable`] finds it on the stream.
//!
//! Batches go through three stages joined by bounded channels: fetching, appending (each
//! message parsed and checked, the batch's CloudEvents given their legacy ids in one query,
//! then the appends of the whole batch queued in one submission, so that they share a group
//! commit) and settling (waiting for the batch's commit, then its dead letters, then its
//! acknowledgements, flushed once). So the next batch is fetched while one is prepared, and
//! prepared and queued while the one before commits and is settled: the appender does not
//! wait for a batch to be parsed. Stopping lets the batches queued commit and be settled,
//! and naks the batches fetched but not queued, so that they are redelivered at once.

use std::sync::Arc;
use std::time::{Duration, Instant};

// anyhow, not a typed error, for the consumer's own failures (NATS, acks): they end at its
// loop, which logs them and consumes again; none reaches an HTTP answer. What a message's
// fate depends on is typed ([`AppendError`], [`Verdict`]).
use anyhow::Context as _;
use async_nats::jetstream::{self, consumer::pull, AckKind, Message};
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::unreadable::Suspicion;
use super::{dead_letter, Names, INGEST_ACK_PENDING_MAX, INGEST_CONSUMER};
use crate::error_code::ErrorCode;
use crate::event::cloudevent;
use crate::event::parse::{parse_envelope, BodyKind, Envelope};
use crate::event::{Event, TimeBounds};
use crate::ledger::{legacy_ids, plans, AppendError, AppendedEvent, Appender};
use sqlx::PgPool;

/// How long JetStream waits for an ack before redelivering: well above a group commit.
pub const ACK_WAIT_SECONDS: u64 = 30;
/// Fetched batches that wait for the appending stage: one, so that the next fetch runs
/// while a batch is appended, and no more, because each message waiting counts against
/// [`ACK_WAIT_SECONDS`] and [`INGEST_ACK_PENDING_MAX`] and could go to another instance instead.
const FETCHED_AHEAD_MAX: usize = 1;
/// Queued batches that wait for the settling stage: one, so that the next batch is
/// prepared and queued while one commits and is acknowledged, and no more, for the same
/// reasons.
const APPENDED_AHEAD_MAX: usize = 1;
/// How long one fetch waits for messages when the stream is idle.
const FETCH_EXPIRES_MS: u64 = 500;
/// How long past its expiry a fetch is waited for before it is ended here. The server ends
/// a fetch with a status at its expiry and delivers nothing for it afterwards; when that
/// status does not arrive, the client would wait 5 s more before ending the fetch itself,
/// and the whole pipeline with it.
const FETCH_GRACE_MS: u64 = 1_000;
/// How long a batch's acknowledgements may take to be written: as long as a dead-letter
/// publish may wait for its confirmation (the client's default request timeout).
const FLUSH_TIMEOUT_MS: u64 = 5_000;
/// A step of the pipeline (a fetch past its expiry, preparing a batch, settling it once
/// committed) that takes longer than this is logged as a warning, with the step and its
/// time: a consumer that stalls shows in the log, unless it waited for the appender.
const SLOW_STEP_MS: u64 = 1_000;
/// Delay before a message that failed for a passing reason is redelivered.
const RETRY_DELAY_MS: u64 = 1_000;

#[derive(Debug, Clone)]
pub struct IngestSettings {
    /// Where the consumer's own connection goes (`NATS_URL`).
    pub nats_url: String,
    pub fetch_max: usize,
    pub batch_events_max: usize,
    pub backdate_max: chrono::Duration,
    /// The "now" an event's time is bounded by.
    pub clock: crate::clock::Clock,
}

/// Runs until `shutdown`, finishing the batch being appended; errors are logged and retried.
///
/// The consumer has a NATS connection of its own, made again when its client dies, and
/// `context` (the instance's shared connection) serves only the watch for messages it cannot
/// read ([`super::unreadable`]): such a message drops the connection it is delivered on, or
/// leaves its client dead for good, and neither must reach the relay's or the HTTP
/// handlers' connection.
pub async fn run(
    context: jetstream::Context,
    names: Names,
    pool: PgPool,
    appender: Appender,
    settings: IngestSettings,
    streams: super::StreamHealth,
    shutdown: CancellationToken,
) {
    // At start-up, too: the instance before this one may have stopped on such a message.
    let suspicion = Suspicion::raised();
    let watching =
        super::unreadable::watch(context, names.clone(), suspicion.clone(), shutdown.clone());
    let consuming = async {
        let mut client: Option<async_nats::Client> = None;
        while !shutdown.is_cancelled() {
            let consumed = async {
                let client = match &client {
                    Some(alive) => alive.clone(),
                    None => client.insert(connect(&settings, &suspicion).await?).clone(),
                };
                let context = super::jetstream(client);
                consume(
                    &context,
                    &names,
                    (&pool, &appender, &settings),
                    &streams,
                    (&shutdown, &suspicion),
                )
                .await
            };
            if let Err(error) = consumed.await {
                suspicion.raise();
                tracing::warn!(
                    error = format!("{error:#}"),
                    "ingest consumer interrupted; will resume"
                );
                if let Some(dead) = &client {
                    if is_dead(dead).await {
                        tracing::warn!("the ingest consumer's NATS client died; connecting again");
                        client = None;
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(RETRY_DELAY_MS)) => {}
                    _ = shutdown.cancelled() => {}
                }
            }
        }
    };
    tokio::join!(watching, consuming);
    tracing::info!("ingest consumer stopped");
}

/// The consumer's own connection, which raises `suspicion` whenever it drops.
async fn connect(
    settings: &IngestSettings,
    suspicion: &Suspicion,
) -> anyhow::Result<async_nats::Client> {
    let options = suspicion.on_disconnect(async_nats::ConnectOptions::new());
    Ok(super::connect_as(&settings.nats_url, "tally-ingest", options).await?)
}

/// Whether `client` is dead for good: its connection task has ended (it panicked on a
/// message it could not read), so it takes no command. A client that is only disconnected
/// takes them and waits.
async fn is_dead(client: &async_nats::Client) -> bool {
    let flushed = tokio::time::timeout(Duration::from_millis(100), client.flush()).await;
    matches!(flushed, Ok(Err(error)) if error.kind() == async_nats::client::FlushErrorKind::SendError)
}

/// Consumes as a pipeline of three stages joined by bounded channels: fetching, appending
/// and settling, so that the appender is not idle while the next batch is fetched or while
/// the last one's acknowledgements go out.
async fn consume(
    context: &jetstream::Context,
    names: &Names,
    (pool, appender, settings): (&PgPool, &Appender, &IngestSettings),
    streams: &super::StreamHealth,
    (shutdown, suspicion): (&CancellationToken, &Suspicion),
) -> anyhow::Result<()> {
    streams
        .apply(context, names, &["TALLY_INGEST", "TALLY_DLQ"])
        .await?;
    let consumer = ingest_consumer(context, names).await?;
    let dead_letter_max = dead_letter::bytes_max(context, names).await?;
    let (fetched_sender, fetched) = mpsc::channel(FETCHED_AHEAD_MAX);
    let (appended_sender, appended) = mpsc::channel(APPENDED_AHEAD_MAX);
    // Each stage ends when the one before it ends (its sender is dropped) or the one after it
    // does (its receiver is dropped), so a failure anywhere stops all three.
    let (fetching, (), settling) = tokio::join!(
        fetch_batches(&consumer, settings.fetch_max, fetched_sender, suspicion),
        append_batches(
            context,
            fetched,
            appended_sender,
            (pool, appender, settings),
            shutdown
        ),
        settle_batches(context, names, appended, dead_letter_max),
    );
    settling.and(fetching)
}

async fn ingest_consumer(
    context: &jetstream::Context,
    names: &Names,
) -> anyhow::Result<jetstream::consumer::PullConsumer> {
    let stream = context.get_stream(names.ingest_stream()).await?;
    stream
        .get_or_create_consumer(
            INGEST_CONSUMER,
            pull::Config {
                durable_name: Some(INGEST_CONSUMER.to_owned()),
                // Not AckAll: there an ack acknowledges every earlier message as well,
                // including one nak'ed for a retry or still being appended elsewhere.
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(ACK_WAIT_SECONDS),
                max_ack_pending: INGEST_ACK_PENDING_MAX,
                ..Default::default()
            },
        )
        .await
        .context("cannot create the ingest consumer")
}

/// Fetches a batch whenever the channel has room for it, until the appending stage stops
/// taking them. A fetch is not cut short before the server can deliver nothing more for it
/// ([`FETCH_GRACE_MS`] past its expiry), and then every message already received is taken,
/// so that every message delivered reaches the appending stage, which appends it or hands
/// it back.
async fn fetch_batches(
    consumer: &jetstream::consumer::PullConsumer,
    fetch_max: usize,
    fetched: mpsc::Sender<Vec<Message>>,
    suspicion: &Suspicion,
) -> anyhow::Result<()> {
    // The slot is reserved before the fetch, so at most one fetched batch waits.
    while let Ok(slot) = fetched.reserve().await {
        let started = Instant::now();
        let batch = consumer
            .fetch()
            .max_messages(fetch_max)
            .expires(Duration::from_millis(FETCH_EXPIRES_MS))
            .messages()
            .await?;
        // From when the request is sent: the server's expiry runs from when it has it.
        let deadline =
            tokio::time::Instant::now() + Duration::from_millis(FETCH_EXPIRES_MS + FETCH_GRACE_MS);
        let (messages, ended) = take_until(batch, deadline)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
        if ended {
            // A fetch ends when the server says so, at its expiry or once it delivered all it
            // was asked for. One that ended well before either may have met a message whose
            // status the client took for the server's.
            if messages.len() < fetch_max
                && started.elapsed() < Duration::from_millis(FETCH_EXPIRES_MS / 2)
            {
                suspicion.raise();
            }
            slow_step(
                "fetching a batch",
                started,
                FETCH_EXPIRES_MS,
                messages.len(),
            );
        } else {
            tracing::warn!(
                messages = messages.len(),
                "a fetch did not end by its expiry; ended here {FETCH_GRACE_MS} ms after it"
            );
        }
        if !messages.is_empty() {
            slot.send(messages);
        }
    }
    Ok(())
}

/// The items of `stream` until it ends (then `true`), or until `deadline` once it has
/// nothing at hand (then `false`); an item that is an error ends it with that error.
/// Whatever the stream has received by the deadline is taken, however many items that is
/// (`timeout_at` polls the stream before its clock, and a task's spent budget holds both
/// back alike).
async fn take_until<T, E>(
    mut stream: impl futures::Stream<Item = Result<T, E>> + Unpin,
    deadline: tokio::time::Instant,
) -> Result<(Vec<T>, bool), E> {
    let mut taken = Vec::new();
    loop {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(item)) => taken.push(item?),
            Ok(None) => return Ok((taken, true)),
            Err(_) => return Ok((taken, false)),
        }
    }
}

/// Queues each fetched batch's appends and passes it on to be settled once they have
/// committed, until `shutdown` or until a neighbouring stage stops; then hands back the
/// batches fetched but not queued. While one batch commits, the next is prepared and queued
/// behind it, so the appender does not wait for its messages to be parsed.
async fn append_batches(
    context: &jetstream::Context,
    mut fetched: mpsc::Receiver<Vec<Message>>,
    appended: mpsc::Sender<Appending>,
    (pool, appender, settings): (&PgPool, &Appender, &IngestSettings),
    shutdown: &CancellationToken,
) {
    loop {
        let messages = tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            messages = fetched.recv() => match messages {
                Some(messages) => messages,
                None => return,
            },
        };
        // The batch in hand is finished even when stopping: it is queued, and the settling
        // stage waits for its commit.
        let started = Instant::now();
        let appending = append_batch(pool, appender, settings, messages).await;
        slow_step("preparing a batch", started, 0, appending.messages.len());
        if appended.send(appending).await.is_err() {
            break;
        }
    }
    hand_back(context, fetched).await;
}

/// Nothing fetched is lost by stopping: a message not appended is nak'ed, so that this or
/// another instance gets it again at once rather than after [`ACK_WAIT_SECONDS`].
async fn hand_back(context: &jetstream::Context, mut fetched: mpsc::Receiver<Vec<Message>>) {
    // Closed, the channel takes no new batch, but the one a fetch in progress reserved room
    // for still arrives, so the loop below waits for that fetch to end.
    fetched.close();
    while let Some(messages) = fetched.recv().await {
        for message in &messages {
            // A nak lost is a redelivery after ACK_WAIT_SECONDS instead.
            let _ = message.ack_with(AckKind::Nak(None)).await;
        }
    }
    let _ = flush(context).await;
}

/// Waits until what was queued on the connection is written to it. Bounded, because a flush
/// waits for a lost connection to come back, and stopping must not wait for that.
async fn flush(context: &jetstream::Context) -> anyhow::Result<()> {
    tokio::time::timeout(
        Duration::from_millis(FLUSH_TIMEOUT_MS),
        context.client().flush(),
    )
    .await
    .context("the connection to NATS is not writable")?
    .context("cannot send the acknowledgements")
}

/// Settles each batch in turn once its appends have committed or failed; an error stops
/// the pipeline.
async fn settle_batches(
    context: &jetstream::Context,
    names: &Names,
    mut appended: mpsc::Receiver<Appending>,
    dead_letter_max: usize,
) -> anyhow::Result<()> {
    while let Some(appending) = appended.recv().await {
        // Not timed: a batch of large messages is several group commits, seconds of them.
        let (messages, verdicts) = appending.verdicts().await;
        let started = Instant::now();
        settle(context, names, &messages, verdicts, dead_letter_max).await?;
        slow_step("settling a batch", started, 0, messages.len());
    }
    Ok(())
}

/// Logs a step that began at `started` and took more than [`SLOW_STEP_MS`] past the
/// `expected_ms` it may take.
fn slow_step(step: &str, started: Instant, expected_ms: u64, messages: usize) {
    let took = started.elapsed();
    if took > Duration::from_millis(expected_ms + SLOW_STEP_MS) {
        tracing::warn!(
            step,
            seconds = took.as_secs_f64(),
            messages,
            "an ingest step was slow"
        );
    }
}

/// What to do with one message once its append has been tried.
enum Verdict {
    Stored(usize),
    DeadLetter { code: &'static str, message: String },
    Retry(AppendError),
}

/// A batch whose appends are queued: each message with its verdict when it was not
/// appended, and how its appends end.
struct Appending {
    messages: Vec<Message>,
    /// Per message, its verdict if it was not appended, else how many events it appended.
    prepared: Vec<Result<usize, Verdict>>,
    appended: BoxFuture<'static, Vec<Result<Vec<AppendedEvent>, AppendError>>>,
}

impl Appending {
    /// The batch's messages and the verdict on each, once every append has committed or
    /// failed.
    async fn verdicts(self) -> (Vec<Message>, Vec<Verdict>) {
        let mut appended = self.appended.await.into_iter();
        let verdicts = self
            .prepared
            .into_iter()
            .map(|prepared| match prepared {
                Ok(count) => {
                    let result = appended.next().expect("one result for each list appended");
                    appended_verdict(count, result)
                }
                Err(verdict) => verdict,
            })
            .collect();
        (self.messages, verdicts)
    }
}

/// Prepares each message of a batch and queues the appends of those that can be appended,
/// each message's events atomically on their own and all of them in one submission, so that
/// the batch goes into one group commit rather than a few messages at a time.
async fn append_batch(
    pool: &PgPool,
    appender: &Appender,
    settings: &IngestSettings,
    messages: Vec<Message>,
) -> Appending {
    let bounds = TimeBounds {
        now: settings.clock.now(),
        backdate_max: settings.backdate_max,
    };
    let mut prepared = futures::future::join_all(
        messages
            .iter()
            .map(|message| prepare(message, pool, settings, bounds)),
    )
    .await;
    adopt_legacy_ids(pool, &mut prepared).await;
    let mut lists = Vec::with_capacity(prepared.len());
    let prepared = prepared
        .into_iter()
        .map(|prepared| {
            prepared.map(|events| {
                let count = events.len();
                lists.push(events);
                count
            })
        })
        .collect();
    Appending {
        messages,
        prepared,
        appended: appender.append_each(lists).boxed(),
    }
}

/// One message's events, parsed and checked (all but their legacy ids, which
/// [`adopt_legacy_ids`] looks up for the whole batch); or its verdict when it cannot be
/// appended (dead letter) or cannot be checked now (retry).
async fn prepare(
    message: &Message,
    pool: &PgPool,
    settings: &IngestSettings,
    bounds: TimeBounds,
) -> Result<Vec<Event>, Verdict> {
    let headers = message_headers(message);
    let content_type = headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        .and_then(|(_, value)| std::str::from_utf8(value).ok());
    let events = Envelope::select(
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
    })
    .map_err(|error| Verdict::DeadLetter {
        code: error.code().as_str(),
        message: error.describe(),
    })?;
    match plans::unknown_reference(pool, &events).await {
        Ok(None) => {}
        Ok(Some((index, plan))) => {
            return Err(Verdict::DeadLetter {
                code: ErrorCode::UnknownPlan.as_str(),
                message: format!("event {index}: plan {plan:?} is not defined"),
            })
        }
        Err(error) => return Err(unreadable(Arc::new(error))),
    }
    Ok(events)
}

/// Gives the CloudEvents of a batch's prepared messages that the ledger holds under their
/// legacy id that id ([`legacy_ids::adopt`]), with one query for the whole batch rather than
/// one for each message. When the query fails, each message that holds a CloudEvent is
/// retried; the others need no answer from it.
async fn adopt_legacy_ids(pool: &PgPool, prepared: &mut [Result<Vec<Event>, Verdict>]) {
    let cloudevent = |event: &Event| event.origin.is_some();
    if !prepared.iter().flatten().flatten().any(cloudevent) {
        return;
    }
    let lengths: Vec<usize> = prepared
        .iter()
        .map(|events| events.as_ref().map_or(0, Vec::len))
        .collect();
    let mut all: Vec<Event> = prepared
        .iter_mut()
        .filter_map(|events| events.as_mut().ok())
        .flat_map(std::mem::take)
        .collect();
    let adopted = legacy_ids::adopt(pool, &mut all).await.map_err(Arc::new);
    let mut all = all.into_iter();
    for (message, length) in prepared.iter_mut().zip(lengths) {
        let Ok(events) = message else { continue };
        events.extend(all.by_ref().take(length));
        if let Err(error) = &adopted {
            if events.iter().any(cloudevent) {
                *message = Err(unreadable(Arc::clone(error)));
            }
        }
    }
}

/// The verdict on a message that could not be checked because the database did not answer:
/// redelivered later.
fn unreadable(error: Arc<sqlx::Error>) -> Verdict {
    Verdict::Retry(AppendError::Store(error))
}

/// What becomes of a message whose `count` events were appended with `result`.
fn appended_verdict(count: usize, result: Result<Vec<AppendedEvent>, AppendError>) -> Verdict {
    match result {
        Ok(_) => Verdict::Stored(count),
        Err(AppendError::IdempotencyConflict { index, id }) => Verdict::DeadLetter {
            code: ErrorCode::IdempotencyConflict.as_str(),
            message: format!(
                "event {index}: id {id} was stored before, or given earlier in this batch, \
                 with different content"
            ),
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

/// Acknowledges each message of a batch as its verdict says: stored, dead-lettered, or
/// redelivered later.
///
/// `Message::ack` (async-nats 0.51) does not wait for the server: it only queues the
/// acknowledgement on the connection, waiting at most for room in the client's command
/// channel. So the batch's acknowledgements are queued one after the other and one flush
/// puts them on the wire; none costs a round trip. An acknowledgement lost on the way is a
/// redelivery, which the event id makes a duplicate.
async fn settle(
    context: &jetstream::Context,
    names: &Names,
    messages: &[Message],
    verdicts: Vec<Verdict>,
    bytes_max: usize,
) -> anyhow::Result<()> {
    // Every copy on the dead-letter stream is confirmed before its message is acknowledged;
    // they are published together, so the batch waits for one round trip, not one each.
    let dead_letters = messages
        .iter()
        .zip(&verdicts)
        .filter_map(|(message, verdict)| {
            let Verdict::DeadLetter {
                code,
                message: text,
            } = verdict
            else {
                return None;
            };
            Some(dead_letter(
                context,
                names,
                message,
                (code, text),
                bytes_max,
            ))
        });
    futures::future::try_join_all(dead_letters).await?;
    let (mut stored, mut dead_lettered) = (0, 0);
    for (message, verdict) in messages.iter().zip(verdicts) {
        let kind = match verdict {
            Verdict::Stored(count) => {
                stored += count;
                AckKind::Ack
            }
            Verdict::DeadLetter {
                code,
                message: text,
            } => {
                dead_lettered += 1;
                tracing::info!(subject = %message.subject, code, error = text, "ingest message dead-lettered");
                AckKind::Ack
            }
            Verdict::Retry(error) => {
                tracing::warn!(error = %error, "ingest message will be redelivered");
                AckKind::Nak(Some(Duration::from_millis(RETRY_DELAY_MS)))
            }
        };
        message
            .ack_with(kind)
            .await
            .map_err(|e| anyhow::anyhow!(e))?;
    }
    flush(context).await?;
    // Only outcomes that happened, so that /metrics shows no series before its first event.
    if stored > 0 {
        metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "nats", "outcome" => "stored")
            .increment(stored as u64);
    }
    if dead_lettered > 0 {
        metrics::counter!(crate::telemetry::INGEST_EVENTS, "source" => "nats", "outcome" => "dead_lettered")
            .increment(dead_lettered);
    }
    Ok(())
}

/// Publishes the dead letter of `message` and waits for the dead-letter stream to confirm
/// it.
async fn dead_letter(
    context: &jetstream::Context,
    names: &Names,
    message: &Message,
    reason: (&str, &str),
    bytes_max: usize,
) -> anyhow::Result<()> {
    let info = message.info().ok();
    let original = dead_letter::Original {
        subject: message.subject.as_str(),
        sequence: info
            .as_ref()
            .map(|info| (info.stream, info.stream_sequence)),
        headers: dead_letter::kept_headers(message_headers(message)),
        payload: message.payload.clone(),
    };
    dead_letter::publish(context, names, &original, reason, bytes_max).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use futures::{stream, StreamExt};
    use tokio::time::{Duration, Instant};

    use super::take_until;

    #[tokio::test]
    async fn a_fetch_that_ends_gives_every_message_and_says_it_ended() {
        let messages = stream::iter((0..5).map(Ok::<_, Infallible>));
        let deadline = Instant::now() + Duration::from_secs(60);
        assert_eq!(
            take_until(messages, deadline).await.unwrap(),
            ((0..5).collect(), true)
        );
    }

    #[tokio::test]
    async fn a_fetch_whose_end_never_comes_is_ended_at_the_deadline_with_what_it_delivered() {
        let messages = stream::iter((0..5).map(Ok::<_, Infallible>)).chain(stream::pending());
        let deadline = Instant::now() + Duration::from_millis(100);
        let (taken, ended) = take_until(messages, deadline).await.unwrap();
        assert_eq!((taken, ended), ((0..5).collect(), false));
        assert!(Instant::now() >= deadline);
    }

    #[tokio::test]
    async fn every_message_received_by_the_deadline_is_taken_past_the_tasks_budget() {
        // Received and waiting, more than a task may take from a channel in one turn; the
        // sender stays, so the fetch does not end.
        let (sender, receiver) = tokio::sync::mpsc::unbounded_channel();
        for n in 0..1_000 {
            sender.send(Ok::<_, Infallible>(n)).unwrap();
        }
        let messages = Box::pin(stream::unfold(receiver, |mut receiver| async {
            receiver.recv().await.map(|message| (message, receiver))
        }));
        let (taken, ended) = take_until(messages, Instant::now()).await.unwrap();
        assert_eq!((taken.len(), ended), (1_000, false));
        drop(sender);
    }

    #[tokio::test]
    async fn an_error_in_a_fetch_is_its_outcome() {
        let messages = stream::iter([Ok(1), Err("lost"), Ok(2)]);
        let deadline = Instant::now() + Duration::from_secs(60);
        assert_eq!(take_until(messages, deadline).await, Err("lost"));
    }
}
