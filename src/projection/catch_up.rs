//! Reaching the ledger head from a process that runs no projector (the command line's
//! finance commands): it takes the head and projects up to it itself, with the same rounds
//! as the service's projector. When a running service's projector holds the checkpoint,
//! its rounds are the ones that move it, so this waits for them, within a bound.

use std::time::Duration;

use sqlx::PgPool;

use super::projector::{project_once, Round, CHECKPOINT_POLL_MS};
use super::store;
use crate::clock::Clock;
use crate::ledger::read;

/// Why [`to_head`] gave up.
#[derive(Debug, thiserror::Error)]
pub enum CatchUpError {
    #[error(
        "the projection is at position {checkpoint}, short of the ledger head {head}, after \
         {waited_ms} ms waiting for the projector of a running service (TALLY_READ_WAIT_MS); \
         retry later"
    )]
    Lagging {
        head: i64,
        checkpoint: i64,
        waited_ms: u128,
    },
    #[error(transparent)]
    Store(#[from] super::Error),
}

impl From<sqlx::Error> for CatchUpError {
    fn from(error: sqlx::Error) -> Self {
        CatchUpError::Store(error.into())
    }
}

/// Takes the ledger head and returns once the projection's checkpoint has reached it (the
/// checkpoint read then): projecting rounds of `batch_max` events here while the checkpoint
/// is free, waiting for the process that holds it otherwise, for at most `wait` in all.
/// Its rounds judge reservation expiry by the system clock: a command runs in real time.
pub async fn to_head(pool: &PgPool, batch_max: usize, wait: Duration) -> Result<i64, CatchUpError> {
    let head = read::head(pool).await?.position;
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let checkpoint = {
            let mut connection = pool.acquire().await?;
            store::checkpoint(&mut connection, store::LIVE).await?
        };
        if checkpoint >= head {
            return Ok(checkpoint);
        }
        // A round that projects makes progress however long the backlog; only waiting on
        // another process's rounds is bounded.
        // A process without an appender has nothing in memory to project.
        match project_once(pool, (batch_max, Clock::system()), None, None, None).await? {
            Round::Projected { .. } | Round::CaughtUp { .. } => {}
            Round::Busy if tokio::time::Instant::now() >= deadline => {
                return Err(CatchUpError::Lagging {
                    head,
                    checkpoint,
                    waited_ms: wait.as_millis(),
                })
            }
            Round::Busy => tokio::time::sleep(Duration::from_millis(CHECKPOINT_POLL_MS)).await,
        }
    }
}
