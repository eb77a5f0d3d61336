//! The relay: carries the committed ledger to `TALLY_LEDGER`, in position order, each event
//! exactly once.
//!
//! The stream itself is the relay's checkpoint: consecutive positions go to consecutive
//! sequences, so at start (and after any error) the relay continues after the position its
//! last sequence holds. It never takes a position from a message it did not write: before
//! resuming it checks the stream's first message (once; it fixes how sequences map to
//! positions, see `bus::check`) and the messages it has not itself seen stored (after an
//! error, those after the last acknowledged publish; at start, the last `batch_max`, one
//! burst of publishes) against the ledger rows they should be. A message that differs (one
//! published by anyone else) halts the relay for good: it stops relaying, `/readyz` turns
//! false and names the message, and the `tally_relay_halted` gauge and an error log line
//! give the position; only an operator can repair a deny-delete stream.
//! Every publish carries `Nats-Expected-Last-Sequence`, so the
//! stream refuses a message unless everything before it is stored: a publish that failed
//! can never be skipped over by a later one that succeeded, and a second relay that
//! raced this one is refused rather than duplicating. `Nats-Msg-Id` (the event id) adds
//! the server's duplicate window on top. Only one instance relays at a time, elected by a
//! Postgres session advisory lock, held on a connection of the relay's own. The leader
//! touches that session every [`HEARTBEAT_MS`] and the session ends itself after
//! [`LOCK_SESSION_IDLE_TIMEOUT_MS`] without a statement (`idle_session_timeout`), so a leader
//! that hangs without dying (stopped, frozen, cut off) loses the lock within that bound
//! rather than holding it for as long as its TCP connection looks alive; if it wakes, its
//! next heartbeat fails and it waits to lead again, and its publishes in between are
//! refused by `Nats-Expected-Last-Sequence` once the new leader has published.
//!
//! The rows of this instance's own commits are handed over by the appender in memory
//! ([`Committed`]), so the relay does not read back what was just written; whatever does
//! not continue exactly where the stream ends (another instance's appends, a batch too
//! large to hand over, rows dropped while the relay was busy) it reads from the ledger.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishAckFuture};
use async_nats::HeaderMap;
use sqlx::{Connection as _, PgConnection, PgPool};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::check::{self, Mismatch};
use super::{Names, StreamFailure, HASH_HEADER, POSITION_HEADER};
use crate::ledger::{self, read, Committed, LedgerRow};

/// The session advisory lock that elects the one relaying instance.
pub const RELAY_LOCK_KEY: i64 = 0x7461_6c6c_7972;
/// After being woken by a commit, the relay waits this long before reading, so that one
/// round (a query, a burst of publishes, their acks) carries several group commits rather
/// than one each. At 5 ms a round carries a commit or two of single events; at 20 ms a
/// dozen, which makes `tally-bench` single-event ingest about 8 % faster for 15 ms more
/// relay lag.
const LINGER_MS: u64 = 20;
/// Pause after an error before re-synchronizing with the stream.
const RETRY_DELAY_MS: u64 = 500;
/// How long the lock's session may go without a statement before Postgres ends it, which
/// releases the lock: the bound on how long a hung leader keeps the others from relaying.
pub const LOCK_SESSION_IDLE_TIMEOUT_MS: u64 = 5_000;
/// How often the leader proves its session alive, well inside the idle timeout.
const HEARTBEAT_MS: u64 = 1_000;

#[derive(Debug, Clone)]
pub struct RelaySettings {
    pub batch_max: usize,
    pub poll: Duration,
}

/// Whether the relay halted on a stream message that is not the ledger, and why; shared
/// with `/readyz`. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct RelayStatus(Arc<Mutex<Option<Mismatch>>>);

impl RelayStatus {
    /// The reason the relay halted, if it did.
    pub fn halted(&self) -> Option<Mismatch> {
        self.0.lock().expect("the relay status lock").clone()
    }

    fn halt(&self, mismatch: Mismatch) {
        *self.0.lock().expect("the relay status lock") = Some(mismatch);
    }
}

/// Runs until `shutdown`; errors are logged and retried, never fatal, except a stream
/// message that is not the ledger: then the relay halts until the process stops.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    pool: PgPool,
    context: jetstream::Context,
    names: Names,
    settings: RelaySettings,
    mut head: watch::Receiver<i64>,
    mut committed: Option<Committed>,
    status: RelayStatus,
    streams: super::StreamHealth,
    shutdown: CancellationToken,
) {
    let mut verified = Verified::default();
    while !shutdown.is_cancelled() {
        let committed = committed.as_mut();
        if let Err(error) = lead(
            &pool,
            &context,
            &names,
            &settings,
            &mut head,
            committed,
            &mut verified,
            &streams,
            &shutdown,
        )
        .await
        {
            if let Error::Halted(mismatch) = &error {
                tracing::error!(
                    position = mismatch.position,
                    sequence = mismatch.sequence,
                    reason = %mismatch,
                    "relay halted: the ledger stream holds a message the relay did not write"
                );
                metrics::gauge!(crate::telemetry::RELAY_HALTED).set(1.0);
                metrics::gauge!(crate::telemetry::RELAY_HALTED_POSITION)
                    .set(mismatch.position as f64);
                status.halt(mismatch.clone());
                shutdown.cancelled().await;
                break;
            }
            tracing::warn!(
                error = crate::telemetry::cause_chain(&error),
                "relay interrupted; will resume"
            );
            metrics::counter!(crate::telemetry::RELAY_ERRORS).increment(1);
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(RETRY_DELAY_MS)) => {}
                _ = shutdown.cancelled() => {}
            }
        }
    }
    tracing::info!("relay stopped");
}

/// Waits to become the relaying instance, then relays until an error or shutdown.
#[allow(clippy::too_many_arguments)]
async fn lead(
    pool: &PgPool,
    context: &jetstream::Context,
    names: &Names,
    settings: &RelaySettings,
    head: &mut watch::Receiver<i64>,
    mut committed: Option<&mut Committed>,
    verified: &mut Verified,
    streams: &super::StreamHealth,
    shutdown: &CancellationToken,
) -> Result<(), Error> {
    let mut connection = lock_connection(pool).await?;
    loop {
        if let Some(committed) = committed.as_deref_mut() {
            committed.discard();
        }
        let leader: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(RELAY_LOCK_KEY)
            .fetch_one(&mut connection)
            .await?;
        if leader {
            sqlx::query(&format!(
                "SET idle_session_timeout = {LOCK_SESSION_IDLE_TIMEOUT_MS}"
            ))
            .execute(&mut connection)
            .await?;
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep(settings.poll * 4) => {}
            _ = shutdown.cancelled() => return Ok(()),
        }
    }
    let result = tokio::select! {
        result = relay(pool, context, names, settings, head, committed, verified, streams, shutdown) => result,
        lost = heartbeat(&mut connection) => Err(lost.into()),
    };
    // Ending the session releases leadership, whatever state the heartbeat left it in.
    let _ = connection.close().await;
    result
}

/// The lock's own connection, with the pool's settings: not one of the pool's, because the
/// session's idle timeout must not outlive leadership on a connection handed to others.
async fn lock_connection(pool: &PgPool) -> Result<PgConnection, sqlx::Error> {
    crate::ledger::db::connect_one(&pool.connect_options()).await
}

/// Touches the lock's session every [`HEARTBEAT_MS`]; returns when it fails, which means
/// the session (and with it the lock) is gone.
async fn heartbeat(connection: &mut PgConnection) -> sqlx::Error {
    loop {
        tokio::time::sleep(Duration::from_millis(HEARTBEAT_MS)).await;
        if let Err(error) = sqlx::query("SELECT 1").execute(&mut *connection).await {
            return error;
        }
    }
}

/// Why the relay stops leading: a stream message it did not write (it halts), or a failure
/// it leads again after.
#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Halted(#[from] Mismatch),
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Bus(#[from] super::Error),
    #[error("cannot check the ledger stream against the ledger")]
    Check(#[from] check::Error),
    #[error(transparent)]
    Stream(#[from] StreamFailure),
}

/// What this process knows of the stream without reading it again.
#[derive(Debug, Clone, Copy, Default)]
struct Verified {
    /// The last stream sequence this process saw acknowledged or checked.
    sequence: u64,
    /// Sequence `s` holds position `s + offset`; known once the first message was checked.
    offset: Option<i64>,
}

/// Where the stream ends, checked: (the last position in it, its last sequence). The first
/// message is checked once, the messages after `verified` (but no more than one burst,
/// `batch_max`) each time; a difference is returned as a [`Mismatch`] error.
async fn resume(
    pool: &PgPool,
    context: &jetstream::Context,
    names: &Names,
    batch_max: usize,
    verified: &mut Verified,
) -> Result<(i64, u64), Error> {
    let (stream, state) = check::ledger_stream(context, names).await?;
    let last_sequence = state.last_sequence;
    let stored = verified.sequence;
    let position_of = |sequence: u64, offset: i64| -> Result<i64, Error> {
        Ok(i64::try_from(sequence).map_err(StreamFailure::doing("a stream sequence"))? + offset)
    };
    if last_sequence < stored {
        return Err(Mismatch {
            sequence: stored,
            position: position_of(stored, verified.offset.unwrap_or(0))?,
            difference: format!("the stream ends at message {last_sequence}"),
        }
        .into());
    }
    if last_sequence == 0 {
        return Ok((0, 0));
    }
    let offset = match verified.offset {
        Some(offset) => offset,
        None => check::offset(pool, &stream, state.first_sequence).await??,
    };
    verified.offset = Some(offset);
    if last_sequence > stored {
        // A burst is at most `batch_max` publishes, so a message anyone slipped in between
        // the relay's own lies within the last `batch_max` sequences.
        let window = u64::try_from(batch_max.max(1)).unwrap_or(u64::MAX);
        let from = (stored + 1)
            .max(last_sequence.saturating_sub(window - 1))
            .max(state.first_sequence);
        if let Some(mismatch) =
            check::check_range(pool, &stream, from, last_sequence, offset).await?
        {
            return Err(mismatch.into());
        }
        verified.sequence = last_sequence;
    }
    Ok((position_of(last_sequence, offset)?, last_sequence))
}

#[allow(clippy::too_many_arguments)]
async fn relay(
    pool: &PgPool,
    context: &jetstream::Context,
    names: &Names,
    settings: &RelaySettings,
    head: &mut watch::Receiver<i64>,
    mut committed: Option<&mut Committed>,
    verified: &mut Verified,
    streams: &super::StreamHealth,
    shutdown: &CancellationToken,
) -> Result<(), Error> {
    streams.apply(context, names, &["TALLY_LEDGER"]).await?;
    let (mut published, mut sequence) =
        resume(pool, context, names, settings.batch_max, verified).await?;
    // Set here rather than at spawn, when the metrics recorder may not be installed yet.
    metrics::gauge!(crate::telemetry::RELAY_HALTED).set(0.0);
    tracing::info!(position = published, sequence, "relay resuming");
    // Whether the relay is following this instance's commits: it was woken by one, or has
    // just published rows handed over. Then a miss at or past this instance's head has
    // nothing to read; other instances' appends are read when the poll wakes it.
    let mut following = false;
    loop {
        // Checked between batches too, not only when caught up: a relay far behind (a
        // restored ledger, a long NATS outage) would otherwise hold the service's stop until
        // it had published the whole backlog. What it has not published, it publishes on
        // its next start.
        if shutdown.is_cancelled() {
            return Ok(());
        }
        let own_head = following.then(|| *head.borrow());
        let (rows, handed) = next_rows(
            pool,
            committed.as_deref_mut(),
            (published, own_head),
            settings.batch_max,
        )
        .await?;
        if rows.is_empty() {
            metrics::gauge!(crate::telemetry::RELAY_LAG_EVENTS).set(0.0);
            tokio::select! {
                _ = head.changed() => {
                    following = true;
                    tokio::time::sleep(Duration::from_millis(LINGER_MS)).await;
                }
                _ = tokio::time::sleep(settings.poll) => following = false,
                _ = shutdown.cancelled() => return Ok(()),
            }
            continue;
        }
        following = handed;
        (published, sequence) =
            publish(context, names, &rows, published, sequence, verified).await?;
        metrics::counter!(crate::telemetry::RELAY_PUBLISHED).increment(rows.len() as u64);
        metrics::gauge!(crate::telemetry::RELAY_PUBLISHED_POSITION).set(published as f64);
        // This instance's head; appends by other instances show up at the next round.
        let head_position = *head.borrow();
        metrics::gauge!(crate::telemetry::RELAY_LAG_EVENTS)
            .set((head_position - published).max(0) as f64);
    }
}

/// The rows to publish after `published`, and whether they were handed over: this
/// instance's own commits from memory when they continue the stream; anything else
/// (another instance's appends, a gap) from the ledger, unless `own_head` (this
/// instance's head, given while the relay follows its commits) says there is nothing of
/// this instance's to read ([`ledger::committed_after`]).
async fn next_rows(
    pool: &PgPool,
    committed: Option<&mut Committed>,
    (published, own_head): (i64, Option<i64>),
    batch_max: usize,
) -> Result<(Vec<LedgerRow>, bool), Error> {
    if let Some(committed) = committed {
        if let Some(rows) = committed.take_after(published, batch_max) {
            metrics::counter!(crate::telemetry::RELAY_ROWS, "from" => "memory")
                .increment(rows.len() as u64);
            return Ok((rows, true));
        }
        if own_head.is_some_and(|head| !ledger::committed_after(head, published)) {
            return Ok((Vec::new(), false));
        }
    }
    let rows = read::read_after(pool, published, batch_max).await?;
    metrics::counter!(crate::telemetry::RELAY_ROWS, "from" => "ledger")
        .increment(rows.len() as u64);
    Ok((rows, false))
}

/// Publishes `rows` (which continue `published`) after stream sequence `sequence`, each
/// expecting the sequence before it, and awaits every acknowledgement; the position and
/// sequence published last.
async fn publish(
    context: &jetstream::Context,
    names: &Names,
    rows: &[LedgerRow],
    mut published: i64,
    mut sequence: u64,
    verified: &mut Verified,
) -> Result<(i64, u64), Error> {
    let mut acks: Vec<(i64, PublishAckFuture)> = Vec::with_capacity(rows.len());
    for row in rows {
        assert_eq!(
            row.position,
            published + acks.len() as i64 + 1,
            "relay reads in order"
        );
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", row.id.hyphenated().to_string().as_str());
        headers.insert(
            "Nats-Expected-Last-Sequence",
            (sequence + acks.len() as u64).to_string().as_str(),
        );
        headers.insert(POSITION_HEADER, row.position.to_string().as_str());
        headers.insert(HASH_HEADER, hex::encode(&row.hash).as_str());
        let payload = serde_json::to_vec(&row.to_message()).map_err(StreamFailure::doing(
            format!("encoding position {}", row.position),
        ))?;
        let subject = names.ledger_subject(&row.org_id, &row.event_type);
        let ack = context
            .publish_with_headers(subject, headers, payload.into())
            .await
            .map_err(StreamFailure::doing(format!(
                "publishing position {}",
                row.position
            )))?;
        acks.push((row.position, ack));
    }
    for (position, ack) in acks {
        let ack = ack.await.map_err(StreamFailure::doing(format!(
            "publishing position {position}"
        )))?;
        if ack.duplicate || ack.sequence != sequence + 1 {
            return Err(StreamFailure::new(format!(
                "position {position} landed at sequence {} (duplicate: {}), expected {}",
                ack.sequence,
                ack.duplicate,
                sequence + 1
            ))
            .into());
        }
        sequence = ack.sequence;
        verified.sequence = sequence;
        // Its own acknowledged publish fixes the numbering as well as a checked one.
        verified.offset.get_or_insert(
            position
                - i64::try_from(sequence).map_err(StreamFailure::doing("a stream sequence"))?,
        );
        published = position;
    }
    Ok((published, sequence))
}
