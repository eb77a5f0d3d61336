//! `tally replay`: rebuilds every projection from the ledger.
//!
//! It builds into a fresh schema next to the live one — reading the ledger up to the head
//! it finds at the start, folding each container's whole history in memory (on every
//! core), writing the results in bulk with the checkpoint at that head — then, in one
//! transaction that locks the live checkpoint (so no projector round is half-way), swaps
//! the schemas and drops the old one. Readers see the old projection until the commit and
//! the whole new one after it; a running projector continues from the new checkpoint. Only
//! one replay runs at a time.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection};

use super::gather::{gather, Gathered};
use super::model::Changes;
use super::store::{self, BUILD, LIVE};
use super::Error;

/// The session advisory lock that lets one replay run at a time: `'replay'` in ASCII.
pub const REPLAY_LOCK_KEY: i64 = 0x7265_706c_6179;
/// The schema the live projection is moved to while it is dropped.
const RETIRED: &str = "proj_retired";

#[derive(Debug, Clone, Copy)]
pub struct ReplayReport {
    /// Events read from the ledger (every type).
    pub events: u64,
    pub containers: usize,
    /// The ledger position the new projection holds.
    pub position: i64,
    pub elapsed: Duration,
}

impl ReplayReport {
    pub fn events_per_second(&self) -> f64 {
        self.events as f64 / self.elapsed.as_secs_f64().max(f64::EPSILON)
    }
}

/// Rebuilds the projection on `connection` (a connection of its own: it holds the replay
/// lock for the session), with `helper`, a second connection, building indexes beside it.
pub async fn replay(
    connection: &mut PgConnection,
    helper: &mut PgConnection,
) -> Result<ReplayReport, Error> {
    let started = Instant::now();
    let locked: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(REPLAY_LOCK_KEY)
        .fetch_one(&mut *connection)
        .await?;
    if !locked {
        return Err(Error::ReplayRunning);
    }
    // Reading a large ledger and building the indexes of its projection are long
    // statements; the service's per-statement bound is for requests, not for these.
    for session in [&mut *connection, &mut *helper] {
        sqlx::query("SET statement_timeout = 0")
            .execute(&mut *session)
            .await?;
    }
    let result = build_and_swap(connection, helper, started).await;
    for session in [&mut *connection, &mut *helper] {
        sqlx::query("RESET statement_timeout")
            .execute(&mut *session)
            .await?;
    }
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(REPLAY_LOCK_KEY)
        .execute(&mut *connection)
        .await?;
    result
}

async fn build_and_swap(
    connection: &mut PgConnection,
    helper: &mut PgConnection,
    started: Instant,
) -> Result<ReplayReport, Error> {
    sqlx::query(&format!("DROP SCHEMA IF EXISTS {BUILD} CASCADE"))
        .execute(&mut *connection)
        .await?;
    sqlx::query("SELECT tally_create_projection_schema($1)")
        .bind(BUILD)
        .execute(&mut *connection)
        .await?;
    // Positions commit in order, so every position up to the head seen now is committed.
    let head: i64 = sqlx::query_scalar("SELECT COALESCE(max(position), 0) FROM ledger")
        .fetch_one(&mut *connection)
        .await?;
    let prepared = started.elapsed();
    let (changes, events, containers, read) = changes_up_to(connection, helper, head).await?;
    let folded = started.elapsed();

    let write = store::write_fresh(&mut *connection, helper, BUILD, changes, head).await?;
    let written = started.elapsed();

    swap(connection, head).await?;
    // Where the time went, for whoever tunes replay (the bench reads the printed line).
    tracing::info!(
        prepare_ms = prepared.as_millis(),
        read_ms = read.as_millis(),
        fold_ms = (folded - prepared - read).as_millis(),
        write_ms = (written - folded).as_millis(),
        rows_ms = write.rows.as_millis(),
        indexes_ms = write.indexes.as_millis(),
        swap_ms = (started.elapsed() - written).as_millis(),
        "replay's phases"
    );
    Ok(ReplayReport {
        events,
        containers,
        position: head,
        elapsed: started.elapsed(),
    })
}

/// Everything the ledger holds up to `head`, voided events left out, as the changes that
/// build the projection from nothing; with the number of events read, of containers, and
/// how long reading them took.
async fn changes_up_to(
    connection: &mut PgConnection,
    helper: &mut PgConnection,
    head: i64,
) -> Result<(Changes, u64, usize, Duration), Error> {
    let started = Instant::now();
    let Gathered {
        mut histories,
        mut accounts,
        voided,
        events,
    } = gather(connection, helper, head).await?;
    let read = started.elapsed();
    // Voided events are left out as if they had never been stored; a container with
    // nothing left has no row.
    let voided_ids: HashSet<uuid::Uuid> = voided.iter().map(|(id, _)| *id).collect();
    if !voided_ids.is_empty() {
        for entries in histories.values_mut() {
            entries.retain(|entry| !voided_ids.contains(&entry.event_id.as_uuid()));
        }
        histories.retain(|_, entries| !entries.is_empty());
        accounts.retain(|(_, entry)| !voided_ids.contains(&entry.event_id.as_uuid()));
    }
    let containers = histories.len();
    let mut changes = tokio::task::spawn_blocking(move || {
        Changes::from_histories_in_parts(histories, accounts, fold_parts())
    })
    .await
    .expect("a fold does not panic");
    changes.voided = voided;
    Ok((changes, events, containers, read))
}

/// How many parts replay folds at once: one for each core it may run on.
pub fn fold_parts() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// Swaps the built schema in for the live one, in one transaction that locks the live
/// checkpoint first, and tells the instances' admission caches.
async fn swap(connection: &mut PgConnection, head: i64) -> Result<(), Error> {
    let mut transaction = connection.begin().await?;
    sqlx::query(&format!(
        "LOCK TABLE {LIVE}.checkpoint IN ACCESS EXCLUSIVE MODE"
    ))
    .execute(&mut *transaction)
    .await?;
    let live: i64 = store::checkpoint(&mut transaction, LIVE).await?;
    tracing::info!(live, replayed = head, "swapping in the replayed projection");
    for statement in [
        format!("ALTER SCHEMA {LIVE} RENAME TO {RETIRED}"),
        format!("ALTER SCHEMA {BUILD} RENAME TO {LIVE}"),
        format!("DROP SCHEMA {RETIRED} CASCADE"),
    ] {
        sqlx::query(&statement)
            .execute(&mut *transaction)
            .await
            .map_err(|source| Error::Statement {
                statement: statement.clone(),
                source,
            })?;
    }
    // Admission facts kept in memory were read from the projection swapped out.
    let notice = super::notice::Notice::of_round(head, [], true, None);
    super::notice::notify(&mut *transaction, &notice).await?;
    transaction.commit().await?;
    Ok(())
}
