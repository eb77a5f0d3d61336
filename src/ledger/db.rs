//! Database set-up: create the database named in `DATABASE_URL` when it is missing, open a
//! pool with explicit limits, apply the embedded migrations.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, PgConnection, PgPool, Postgres, Transaction};

use crate::config::Config;

/// SQLSTATE `duplicate_database`: another instance created it first, which is fine.
const DUPLICATE_DATABASE: &str = "42P04";

/// How long a session may sit idle inside a transaction that holds a lock every instance
/// waits on (the ledger's append lock, an org's admission lock, the projection's
/// checkpoint) before Postgres ends the session and rolls the transaction back. A process
/// that hangs without dying (stopped, a frozen VM) would otherwise hold the lock for as long
/// as its TCP connection looks alive. Such a transaction is never idle for more than
/// milliseconds while its process runs: it computes between statements, it does not wait.
pub const LOCK_IDLE_TIMEOUT_MS: u64 = 5_000;

/// The call that sets [`LOCK_IDLE_TIMEOUT_MS`] for the rest of the transaction, for the
/// statement that takes the lock (so it costs no round trip of its own).
pub const BOUND_LOCK_IDLE: &str = "set_config('idle_in_transaction_session_timeout', '5000', true)";

/// A connection to the server of `url` through its `postgres` database, which exists
/// whether or not the database `url` names does: for creating and dropping databases and
/// for asking the server itself.
pub async fn server_connection(url: &str) -> Result<PgConnection, sqlx::Error> {
    PgConnectOptions::from_str(url)?
        .database("postgres")
        .connect()
        .await
}

/// Creates the database of `url` unless it exists, via the server's `postgres` database.
#[tracing::instrument(skip_all)]
pub async fn ensure_database(url: &str) -> Result<(), sqlx::Error> {
    let options = PgConnectOptions::from_str(url)?;
    let name = options
        .get_database()
        .ok_or_else(|| sqlx::Error::Configuration("DATABASE_URL names no database".into()))?
        .to_owned();
    let mut admin = server_connection(url).await?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(&name)
            .fetch_one(&mut admin)
            .await?;
    if !exists {
        let statement = format!("CREATE DATABASE {}", quote_identifier(&name));
        match sqlx::query(&statement).execute(&mut admin).await {
            Ok(_) => tracing::info!(database = name, "created database"),
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some(DUPLICATE_DATABASE) => {}
            Err(e) => return Err(e),
        }
    }
    admin.close().await?;
    Ok(())
}

/// Drops a database (tests and the benchmark clean up after themselves).
pub async fn drop_database(url: &str) -> Result<(), sqlx::Error> {
    let options = PgConnectOptions::from_str(url)?;
    let name = options.get_database().unwrap_or_default().to_owned();
    let mut admin = server_connection(url).await?;
    let statement = format!(
        "DROP DATABASE IF EXISTS {} WITH (FORCE)",
        quote_identifier(&name)
    );
    sqlx::query(&statement).execute(&mut admin).await?;
    admin.close().await
}

/// Double-quotes an SQL identifier.
pub fn quote_identifier(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Every session plans each statement with parameters for its values and the tables' size
/// at that moment (`plan_cache_mode`), instead of switching to a generic plan after five
/// runs. tally's sessions live as long as the process and its tables grow from empty; a
/// generic plan made on a young ledger or projection (a sequential scan and a sort cost
/// nothing on an empty table, and the migrations analyze the tables empty) would be kept
/// until an `ANALYZE` replaced it, and without autovacuum for ever. Planning costs tens of
/// microseconds a statement.
const PLAN_CACHE_MODE: (&str, &str) = ("plan_cache_mode", "force_custom_plan");

/// A pool with every limit set here rather than left to library defaults. Its sessions are
/// named `tally` in `pg_stat_activity` unless the URL (`?application_name=`) or `PGAPPNAME`
/// names them otherwise: with several instances, a name each tells whose session holds
/// what (the relay's lock, for one).
pub async fn connect(config: &Config) -> Result<PgPool, sqlx::Error> {
    let statement_timeout = format!("{}ms", config.db_statement_timeout_ms);
    let options = PgConnectOptions::from_str(&config.database_url)?;
    let application_name = options.get_application_name().unwrap_or("tally").to_owned();
    let options = options.application_name(&application_name).options([
        ("statement_timeout", statement_timeout.as_str()),
        PLAN_CACHE_MODE,
    ]);
    Ok(PgPoolOptions::new()
        .max_connections(config.db_pool_max)
        .min_connections(0)
        .acquire_timeout(Duration::from_millis(config.db_acquire_timeout_ms))
        .idle_timeout(Duration::from_secs(300))
        // No ping before handing a connection out: it doubled the round trips of every
        // short read (an admission check is one statement). A connection broken since its
        // last use fails that statement, is closed, and the caller's error is a 503.
        .test_before_acquire(false)
        .connect_lazy_with(options))
}

/// The pool of the read database (`TALLY_READ_DATABASE_URL`), when one is set: the
/// primary's limits but its own size (`TALLY_READ_DB_POOL_MAX`). Lazy, like the primary's:
/// a replica that does not answer fails the reads sent to it, not the start.
pub fn connect_read(config: &Config) -> Result<Option<PgPool>, sqlx::Error> {
    let Some(url) = config.read_database() else {
        return Ok(None);
    };
    let statement_timeout = format!("{}ms", config.db_statement_timeout_ms);
    let options = PgConnectOptions::from_str(url)?
        .application_name("tally-read")
        .options([
            ("statement_timeout", statement_timeout.as_str()),
            PLAN_CACHE_MODE,
        ]);
    Ok(Some(
        PgPoolOptions::new()
            .max_connections(config.read_db_pool_max)
            .min_connections(0)
            .acquire_timeout(Duration::from_millis(config.db_acquire_timeout_ms))
            .idle_timeout(Duration::from_secs(300))
            .test_before_acquire(false)
            .connect_lazy_with(options),
    ))
}

/// How long a connection of its own (the appender's, the relay lock's) may take to make,
/// at start and after an error dropped the last one: the pool's acquire timeout.
const CONNECT_TIMEOUT_MS: u64 = crate::config::DB_ACQUIRE_TIMEOUT_MS;

/// One connection outside the pool, with the pool's settings (`options`), made within
/// [`CONNECT_TIMEOUT_MS`].
pub async fn connect_one(options: &PgConnectOptions) -> Result<PgConnection, sqlx::Error> {
    let timeout = Duration::from_millis(CONNECT_TIMEOUT_MS);
    match tokio::time::timeout(timeout, options.connect()).await {
        Ok(connected) => connected,
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no connection within {CONNECT_TIMEOUT_MS} ms"),
        ))),
    }
}

/// Creates the database if needed, connects, migrates.
pub async fn prepare(config: &Config) -> Result<PgPool, super::Error> {
    ensure_database(&config.database_url).await?;
    let pool = connect(config).await?;
    migrate(&pool).await?;
    Ok(pool)
}

pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    sqlx::migrate!("./migrations").run(pool).await
}

/// A read-only transaction whose statements all see one snapshot: figures that agree with
/// each other and with the position (checkpoint or head) read in it. Cancel-safe, as
/// [`begin`].
pub async fn read_snapshot(pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
    begun(
        pool,
        Some("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"),
    )
    .await
}

/// `pool.begin()` that a caller dropped on the way (a client that went away, the request
/// deadline) cannot cut short. sqlx 0.8 counts a transaction as open only once `BEGIN` is
/// answered, so a `begin` dropped while waiting for that answer returned its connection to
/// the pool inside a transaction nothing would end: the next borrowers' statements ran in
/// it (writes refused as read-only, reads of an old snapshot). Here the connection is waited
/// for by the caller, and the round trip runs in a task of its own that always finishes; a
/// transaction nobody takes is then dropped there and rolled back as any other.
pub async fn begin(pool: &PgPool) -> sqlx::Result<Transaction<'static, Postgres>> {
    begun(pool, None).await
}

async fn begun(
    pool: &PgPool,
    statement: Option<&'static str>,
) -> sqlx::Result<Transaction<'static, Postgres>> {
    // Waiting for a connection may be cut short; the round trip may not.
    let connection = pool.acquire().await?;
    let begin = tokio::spawn(Transaction::begin(
        connection,
        statement.map(std::borrow::Cow::Borrowed),
    ));
    match begin.await {
        Ok(begun) => begun,
        Err(error) if error.is_panic() => std::panic::resume_unwind(error.into_panic()),
        // Only a runtime shutting down cancels the task.
        Err(_) => Err(sqlx::Error::PoolClosed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_idle_bound_sets_the_timeout_it_names() {
        assert!(BOUND_LOCK_IDLE.contains(&format!("'{LOCK_IDLE_TIMEOUT_MS}'")));
    }
}
