//! Reads from a streaming replica (`TALLY_READ_DATABASE_URL`): audit pages and exports go to
//! the read database once it has replayed what they need; everything else reads the primary.
//!
//! A replica receives no notices (`NOTIFY` is not replayed and `LISTEN` is refused during
//! recovery), so a read that waits for it reads the replica's position after 2 ms, then
//! after pauses doubling up to [`REPLICA_POLL_MS`]. Past `TALLY_READ_WAIT_MS` the read is answered 503
//! `replica_lagging` (or `projection_lagging` when the primary's projection is itself
//! short, [`super::consistency`] tells): it never falls back to the primary (docs/decisions/0031-read-replica.md).

use std::future::Future;
use std::time::Duration;

use sqlx::PgPool;
use tokio::time::Instant;
use uuid::Uuid;

use super::error::ApiError;
use super::AppState;
use crate::error_code::ErrorCode;
use crate::ledger::read;
use crate::projection::store;

/// How often, at most, a read waiting for the replica reads how far it has replayed: one
/// single-row read per waiting request per interval, as the projection's wait reads its
/// checkpoint ([`crate::projection::projector::CHECKPOINT_POLL_MS`]).
pub const REPLICA_POLL_MS: u64 = 20;
/// The first pause, doubled after each read up to [`REPLICA_POLL_MS`]: replay on a healthy
/// replica trails a commit by a millisecond or two, so a read right after a write is
/// usually served after the first pause instead of a whole interval.
pub const REPLICA_POLL_FIRST_MS: u64 = 2;

/// The database a read of audit pages or exports uses, once it holds what the read needs.
#[derive(Clone)]
pub struct ReadPool {
    pub pool: PgPool,
    /// Whether `pool` is the read database rather than the primary.
    pub replica: bool,
}

impl ReadPool {
    /// The primary, for a service without a read database.
    pub fn primary(state: &AppState) -> ReadPool {
        ReadPool {
            pool: state.pool.clone(),
            replica: false,
        }
    }

    /// `error` as the answer of a read on this pool: a read database that cannot be
    /// reached is named as such, so that nobody goes looking at the primary.
    pub fn error(&self, error: impl Into<ApiError>) -> ApiError {
        let error = error.into();
        if self.replica && error.code == ErrorCode::DatabaseUnavailable {
            read_database_unavailable()
        } else {
            error
        }
    }
}

/// The pool to read ledger rows from, once it holds `position` (an audit page needs the
/// ledger head taken on the primary at its start).
pub async fn ledger_holding(state: &AppState, position: i64) -> Result<ReadPool, ApiError> {
    let Some(replica) = replica(state) else {
        return Ok(ReadPool::primary(state));
    };
    let found = poll(state, position, || read_head(&replica.pool)).await;
    match found.map_err(|error| replica.error(error))? {
        Replayed::Reached => Ok(replica),
        Replayed::Short(replayed) => Err(replica_lagging(state, "ledger", position, replayed)),
    }
}

/// Waits until the read database's projection checkpoint is at `position`, within
/// `TALLY_READ_WAIT_MS`, hurrying this instance's projector meanwhile (the primary may not
/// have projected it yet either). The caller tells which of the two is short when it is.
pub async fn projected(
    state: &AppState,
    replica: &ReadPool,
    position: i64,
) -> Result<Replayed, ApiError> {
    let found = poll(state, position, || {
        state.freshness.hurry();
        read_checkpoint(&replica.pool)
    })
    .await;
    found.map_err(|error| replica.error(error))
}

/// The pool to read a stored reconciliation's lines from, once it holds the reconciliation
/// (its lines commit with it). The caller has found it on the primary.
pub async fn holding_reconciliation(state: &AppState, id: Uuid) -> Result<ReadPool, ApiError> {
    let Some(replica) = replica(state) else {
        return Ok(ReadPool::primary(state));
    };
    let pool = &replica.pool;
    let found = poll(state, 1, || async move {
        let held: bool =
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM reconciliation WHERE id = $1)")
                .bind(id)
                .fetch_one(pool)
                .await?;
        Ok(i64::from(held))
    })
    .await;
    match found.map_err(|error| replica.error(error))? {
        Replayed::Reached => Ok(replica),
        Replayed::Short(_) => {
            metrics::counter!(crate::telemetry::READ_REPLICA_LAGGING).increment(1);
            Err(ApiError::unavailable(
                ErrorCode::ReplicaLagging,
                format!(
                    "the read database has not replayed reconciliation {id} after {} ms; retry later",
                    state.read_wait.as_millis()
                ),
            ))
        }
    }
}

/// The read database, when one is set.
pub fn replica(state: &AppState) -> Option<ReadPool> {
    state.read_pool.clone().map(|pool| ReadPool {
        pool,
        replica: true,
    })
}

/// How a wait for the replica ended.
pub enum Replayed {
    Reached,
    /// Still short after the wait: how far it had replayed.
    Short(i64),
}

/// Reads `replayed` until it is at least `wanted`, for at most `TALLY_READ_WAIT_MS`.
async fn poll<Read, Found>(
    state: &AppState,
    wanted: i64,
    mut replayed: Read,
) -> Result<Replayed, sqlx::Error>
where
    Read: FnMut() -> Found,
    Found: Future<Output = Result<i64, sqlx::Error>>,
{
    let deadline = Instant::now() + state.read_wait;
    let mut pause_ms = REPLICA_POLL_FIRST_MS;
    loop {
        let found = not_yet_replayed_is_zero(replayed().await)?;
        if found >= wanted {
            return Ok(Replayed::Reached);
        }
        if Instant::now() >= deadline {
            return Ok(Replayed::Short(found));
        }
        let pause = Instant::now() + Duration::from_millis(pause_ms);
        tokio::time::sleep_until(pause.min(deadline)).await;
        pause_ms = (pause_ms * 2).min(REPLICA_POLL_MS);
    }
}

/// SQLSTATE `invalid_catalog_name`: the database does not exist (yet) on the replica.
const NO_SUCH_DATABASE: &str = "3D000";
/// SQLSTATE `undefined_table`: the migrations have not been replayed (yet).
const NO_SUCH_TABLE: &str = "42P01";

/// A replica that has not yet replayed the creation of the database or of its tables (a
/// replica made before tally first started) has replayed nothing of the ledger: its
/// reads wait, and past the wait are answered `replica_lagging`, not a 500.
fn not_yet_replayed_is_zero(found: Result<i64, sqlx::Error>) -> Result<i64, sqlx::Error> {
    match found {
        Err(sqlx::Error::Database(error))
            if matches!(
                error.code().as_deref(),
                Some(NO_SUCH_DATABASE | NO_SUCH_TABLE)
            ) =>
        {
            Ok(0)
        }
        found => found,
    }
}

async fn read_head(pool: &PgPool) -> Result<i64, sqlx::Error> {
    Ok(read::head(pool).await?.position)
}

async fn read_checkpoint(pool: &PgPool) -> Result<i64, sqlx::Error> {
    let mut connection = pool.acquire().await?;
    store::checkpoint(&mut connection, store::LIVE).await
}

/// 503 `replica_lagging`: the read database's `what` had replayed only up to `replayed`.
pub fn replica_lagging(state: &AppState, what: &str, wanted: i64, replayed: i64) -> ApiError {
    metrics::counter!(crate::telemetry::READ_REPLICA_LAGGING).increment(1);
    ApiError::unavailable(
        ErrorCode::ReplicaLagging,
        format!(
            "the read database's {what} is at position {replayed}, short of {wanted} after {} ms; retry later",
            state.read_wait.as_millis()
        ),
    )
}

fn read_database_unavailable() -> ApiError {
    ApiError::unavailable(
        ErrorCode::ReadDatabaseUnavailable,
        "the read database (TALLY_READ_DATABASE_URL) is unavailable; retry later",
    )
}

/// Looks at the read database once at start, for the log: a replica that does not answer
/// fails only the reads sent to it, so the service starts anyway and says so here.
pub async fn probe(pool: PgPool) {
    let standby: Result<bool, sqlx::Error> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(&pool)
        .await;
    match standby {
        Ok(true) => tracing::info!("the read database answers and is a standby"),
        Ok(false) => tracing::warn!(
            "the read database answers but is not in recovery: it is a primary, not a replica"
        ),
        Err(error) => tracing::error!(
            error = %error,
            "the read database does not answer: audit pages and exports answer 503 read_database_unavailable until it does"
        ),
    }
}
