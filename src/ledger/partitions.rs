//! The ledger's months: it is partitioned by month of `recorded_at` (UTC), one table per
//! month (see migrations/20261202002900_ledger_partitions.sql and
//! docs/decisions/0029-ledger-partitions.md). A row whose month has no table cannot be
//! stored, so tally makes the months itself, three ways:
//! - `tally serve` makes sure of this month and [`MONTHS_AHEAD`] more at start-up and
//!   then every [`UPKEEP_INTERVAL_MS`] ([`upkeep`]);
//! - the appender makes sure of the month it is about to date rows in before it writes
//!   them, whenever that month is not the one it last made sure of ([`Dating`]), so that
//!   an append never fails for a missing month, whatever the upkeep did or did not do
//!   (a clock that jumped, an instance started after a long pause);
//! - the migration made every month the ledger had rows in, and three ahead.
//!
//! All three call `ledger_ensure_partitions(from, until)`, which is idempotent and safe to
//! call from several instances at once.

use std::time::Duration;

use chrono::{DateTime, Months, SubsecRound, Utc};
use sqlx::{PgConnection, PgExecutor, PgPool};
use tokio_util::sync::CancellationToken;

use crate::clock::Clock;
use crate::runtime::Period;

/// Months past the current one that the upkeep keeps made: a quarter, so that a service
/// stopped or failing for weeks still finds its months made when it returns, while the
/// empty tables cost next to nothing.
pub const MONTHS_AHEAD: u32 = 3;

/// How often `tally serve` makes sure of the months ahead: hourly is far more often than a
/// month turns, and each call that finds every month made costs one catalog lookup per
/// month.
pub const UPKEEP_INTERVAL_MS: u64 = 3_600_000;

/// How soon the upkeep tries again after a failure (a lock it did not get, the database
/// down).
pub const UPKEEP_RETRY_MS: u64 = 60_000;

/// How long the upkeep waits for the locks that attaching a month takes (SHARE UPDATE
/// EXCLUSIVE on the ledger) before giving up until its next try: an upkeep queued behind a
/// long-running statement that holds a conflicting lock would make every later statement
/// on the ledger queue behind it in turn.
pub const UPKEEP_LOCK_TIMEOUT_MS: u64 = 5_000;

/// Makes sure the ledger has a month for every month from `from` to `until`; returns how
/// many it made.
#[tracing::instrument(skip_all)]
pub async fn ensure(
    executor: impl PgExecutor<'_>,
    from: DateTime<Utc>,
    until: DateTime<Utc>,
) -> Result<i32, sqlx::Error> {
    sqlx::query_scalar("SELECT ledger_ensure_partitions($1, $2)")
        .bind(from)
        .bind(until)
        .fetch_one(executor)
        .await
}

/// Makes sure of the month of `now` and the [`MONTHS_AHEAD`] after it, waiting at most
/// [`UPKEEP_LOCK_TIMEOUT_MS`] for locks.
pub async fn ensure_ahead(pool: &PgPool, now: DateTime<Utc>) -> Result<i32, sqlx::Error> {
    let until = now
        .checked_add_months(Months::new(MONTHS_AHEAD))
        .expect("a clock within chrono's range");
    let mut transaction = crate::ledger::db::begin(pool).await?;
    sqlx::query(&format!(
        "SET LOCAL lock_timeout = '{UPKEEP_LOCK_TIMEOUT_MS}ms'"
    ))
    .execute(&mut *transaction)
    .await?;
    let created = ensure(&mut *transaction, now, until).await?;
    transaction.commit().await?;
    if created > 0 {
        tracing::info!(created, "made the ledger's months ahead");
    }
    Ok(created)
}

/// One round of upkeep: makes sure of the months ahead of `now`; returns how long to wait
/// before the next round, [`UPKEEP_INTERVAL_MS`], or [`UPKEEP_RETRY_MS`] after a failure,
/// which is logged and not fatal (the appender makes its own month anyway).
pub async fn upkeep_once(pool: &PgPool, now: DateTime<Utc>) -> Duration {
    match ensure_ahead(pool, now).await {
        Ok(_) => Duration::from_millis(UPKEEP_INTERVAL_MS),
        Err(error) => {
            tracing::warn!(error = %error, "could not make the ledger's months ahead; will try again");
            Duration::from_millis(UPKEEP_RETRY_MS)
        }
    }
}

/// Keeps the months ahead made until `shutdown`, a round after `wait` and then as each
/// round says.
pub async fn upkeep(pool: PgPool, clock: Clock, mut wait: Duration, shutdown: CancellationToken) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        wait = upkeep_once(&pool, clock.now()).await;
    }
}

/// How the appender dates the rows it writes (`recorded_at`: its clock, to the
/// millisecond), making sure first that the month of that date has its table. It
/// remembers the month it last made sure of, so this costs a round trip only when the
/// month changes (or the clock jumps).
#[derive(Debug)]
pub struct Dating {
    clock: Clock,
    made: Option<Period>,
}

impl Dating {
    pub fn new(clock: Clock) -> Dating {
        Dating { clock, made: None }
    }

    /// The `recorded_at` of rows written now; its month exists in the ledger.
    pub async fn now(
        &mut self,
        connection: &mut PgConnection,
    ) -> Result<DateTime<Utc>, sqlx::Error> {
        let now = self.clock.now().trunc_subsecs(3);
        let month = Period::containing(now);
        if self.made != Some(month) {
            ensure(&mut *connection, now, now).await?;
            self.made = Some(month);
        }
        Ok(now)
    }

    /// Makes the next call make sure of its month again, whatever it last made.
    pub fn forget(&mut self) {
        self.made = None;
    }
}
