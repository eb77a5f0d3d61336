//! Writes that must be checked and stored one at a time across every instance: corrections
//! (decision 0042) and plan definitions (decision 0045). Each kind has an advisory lock of
//! its own and, on each instance, one permit, so that at most one connection per instance
//! waits for the lock and the writes queued behind it hold none.

use std::sync::Arc;

use tokio::sync::Semaphore;

use super::error::ApiError;
use super::AppState;
use crate::error_code::ErrorCode;

/// One kind of write stored in turn: its instance's permit and its deployment-wide lock.
#[derive(Clone, Copy)]
pub(super) struct Queue {
    pub lock_key: i64,
    /// The 503's message when no turn came in time.
    pub busy: &'static str,
    pub permit: fn(&AppState) -> &Arc<Semaphore>,
}

/// A write's turn: this instance's one permit, then the kind's lock, held in a transaction
/// of its own until the turn ends or is dropped (its rollback releases the lock).
struct Turn {
    _permit: tokio::sync::OwnedSemaphorePermit,
    lock: sqlx::Transaction<'static, sqlx::Postgres>,
}

impl Turn {
    /// Waits for a turn, at most `TALLY_READ_WAIT_MS` for the permit and as long again for
    /// the lock; past either, 503 `overloaded` with `Retry-After`.
    async fn take(state: &AppState, queue: Queue) -> Result<Turn, ApiError> {
        let busy = || ApiError::unavailable(ErrorCode::Overloaded, queue.busy);
        let permit = super::take_turn(state, (queue.permit)(state), queue.busy).await?;
        let mut lock = crate::ledger::db::begin(&state.pool).await?;
        let wait_ms = state.read_wait.as_millis();
        sqlx::query(&format!("SET LOCAL lock_timeout = '{wait_ms}ms'"))
            .execute(&mut *lock)
            .await?;
        let locked = sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(queue.lock_key)
            .execute(&mut *lock)
            .await;
        match locked {
            Ok(_) => Ok(Turn {
                _permit: permit,
                lock,
            }),
            // lock_not_available: lock_timeout ran out.
            Err(sqlx::Error::Database(error)) if error.code().as_deref() == Some("55P03") => {
                Err(busy())
            }
            Err(error) => Err(error.into()),
        }
    }

    /// Ends the turn at once rather than when the connection next goes back to the pool.
    async fn end(self) {
        if let Err(error) = self.lock.rollback().await {
            tracing::warn!(%error, "a turn did not end cleanly; its connection drops it");
        }
    }
}

/// Runs `work` (a write's check and append) in a turn of `queue`, on a task of its own: the
/// turn lasts until `work` has answered even when the request is dropped first (its
/// timeout, a client gone), so no other write of the kind checks the ledger while `work`'s
/// append may still be stored.
pub(super) async fn in_turn<T, F>(state: &AppState, queue: Queue, work: F) -> Result<T, ApiError>
where
    F: std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
    T: Send + 'static,
{
    let turn = Turn::take(state, queue).await?;
    let task = tokio::spawn(async move {
        let done = work.await;
        turn.end().await;
        done
    });
    task.await.map_err(|error| ApiError::internal(&error))?
}
