//! Verification: walk the ledger in position order, recompute every hash from the stored
//! columns and name the first position where the chain or the numbering breaks.
//!
//! A full pass starts from the genesis hash. An incremental pass starts from the stored
//! checkpoint (the last position a pass found intact, and its hash): it checks that the row
//! there still has that hash and walks only the rows after it. Each intact pass moves the
//! checkpoint to the head. What an incremental pass cannot see is a change to a row before
//! the checkpoint made after it was verified; the full pass, on demand, sees everything.

use futures::TryStreamExt;
use serde::Serialize;
use sqlx::PgPool;

use super::read::{LedgerRow, ROW_COLUMNS};
use crate::event::canonical::{self, GENESIS_HASH};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    pub ok: bool,
    pub events_checked: u64,
    pub head_position: i64,
    /// The stored hash of the last row, hex; the genesis hash (zeros) for an empty ledger.
    pub head_hash: String,
    pub first_bad_position: Option<i64>,
    /// Where the pass started: 0 for a full pass, the checkpoint for an incremental one.
    pub from_position: i64,
    /// What was wrong at `first_bad_position`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
    /// The comparison with the `TALLY_LEDGER` copy, when asked for (`--stream`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamReport>,
}

/// Every ledger row compared with its `TALLY_LEDGER` message (see `bus::check`): a
/// superuser who rewrites rows and recomputes the chain passes the chain's check, but the
/// stream, in another system and append-only, still holds what was relayed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamReport {
    pub ok: bool,
    /// Messages found equal to their rows (id, position, hash and content).
    pub messages_checked: u64,
    /// The stream's last sequence when the pass began.
    pub last_sequence: u64,
    /// The ledger position of the stream's first message: 1, unless the stream was seeded
    /// with a later one (as `tally-bench` does); 0 for an empty stream.
    pub first_position: i64,
    /// Rows after `last_sequence`, not relayed yet when the pass began.
    pub rows_not_in_stream: u64,
    /// The first position whose message differs from its row.
    pub first_bad_position: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

impl VerifyReport {
    /// Adds the stream's comparison: the report is `ok` only when both are, and names the
    /// earlier of the two first bad positions.
    pub fn with_stream(mut self, stream: StreamReport) -> VerifyReport {
        if let Some(position) = stream.first_bad_position {
            if self.first_bad_position.is_none_or(|chain| position < chain) {
                self.first_bad_position = Some(position);
                self.problem = stream.problem.clone();
            }
        }
        self.ok = self.ok && stream.ok;
        self.stream = Some(stream);
        self
    }
}

/// A full pass over the ledger. Streams rows, so memory stays flat however long it is.
#[tracing::instrument(skip_all)]
pub async fn verify(pool: &PgPool) -> Result<VerifyReport, sqlx::Error> {
    let report = verify_from(pool, 0, GENESIS_HASH).await?;
    save_checkpoint(pool, &report).await?;
    Ok(report)
}

/// A pass from the stored checkpoint (a full pass when there is none).
#[tracing::instrument(skip_all)]
pub async fn verify_incremental(pool: &PgPool) -> Result<VerifyReport, sqlx::Error> {
    let checkpoint: Option<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT position, hash FROM verify_checkpoint")
            .fetch_optional(pool)
            .await?;
    let (position, hash) = match checkpoint {
        Some((position, hash)) => (
            position,
            hash.try_into().expect("the schema checks 32 bytes"),
        ),
        None => (0, GENESIS_HASH),
    };
    if position > 0 {
        let stored: Option<Vec<u8>> =
            sqlx::query_scalar("SELECT hash FROM ledger WHERE position = $1")
                .bind(position)
                .fetch_optional(pool)
                .await?;
        if stored.as_deref() != Some(&hash[..]) {
            return Ok(VerifyReport {
                ok: false,
                events_checked: 0,
                head_position: position,
                head_hash: hex::encode(hash),
                first_bad_position: Some(position),
                from_position: position,
                problem: Some(format!(
                    "the row at the verified checkpoint {position} is missing or no longer has hash {}",
                    hex::encode(hash)
                )),
                stream: None,
            });
        }
    }
    let report = verify_from(pool, position, hash).await?;
    save_checkpoint(pool, &report).await?;
    Ok(report)
}

/// Moves the checkpoint to an intact pass's head (never backwards).
async fn save_checkpoint(pool: &PgPool, report: &VerifyReport) -> Result<(), sqlx::Error> {
    if !report.ok || report.head_position == 0 {
        return Ok(());
    }
    let hash = hex::decode(&report.head_hash).expect("the report's hash is hex");
    sqlx::query(
        "INSERT INTO verify_checkpoint (position, hash, verified_at) VALUES ($1, $2, now()) \
         ON CONFLICT (singleton) DO UPDATE SET position = EXCLUDED.position, \
             hash = EXCLUDED.hash, verified_at = EXCLUDED.verified_at \
         WHERE verify_checkpoint.position < EXCLUDED.position",
    )
    .bind(report.head_position)
    .bind(hash)
    .execute(pool)
    .await?;
    Ok(())
}

/// Walks the rows after `from` (whose hash is `from_hash`). Runs in a transaction of its
/// own with no statement timeout: a pass over a long ledger is one long statement.
async fn verify_from(
    pool: &PgPool,
    from: i64,
    from_hash: [u8; 32],
) -> Result<VerifyReport, sqlx::Error> {
    let mut transaction = crate::ledger::db::begin(pool).await?;
    sqlx::query("SET LOCAL statement_timeout = 0")
        .execute(&mut *transaction)
        .await?;
    let query = format!("SELECT {ROW_COLUMNS} FROM ledger WHERE position > $1 ORDER BY position");
    let mut rows = sqlx::query_as::<_, LedgerRow>(&query)
        .bind(from)
        .fetch(&mut *transaction);
    let mut prev_hash = from_hash;
    let mut expected_position = from + 1;
    let mut checked = 0;
    let mut head_position = from;
    let mut head_hash = from_hash.to_vec();
    let mut first_bad = None;
    while let Some(row) = rows.try_next().await? {
        checked += 1;
        head_position = row.position;
        head_hash.clone_from(&row.hash);
        if first_bad.is_some() {
            continue;
        }
        let problem = if row.position != expected_position {
            Some(format!(
                "expected position {expected_position}, found {}",
                row.position
            ))
        } else {
            let bytes = canonical::record_bytes(&row.fields(), row.position, row.recorded_at);
            let hash = canonical::chain_hash(&prev_hash, &bytes);
            if hash.as_slice() != row.hash.as_slice() {
                Some(format!(
                    "stored hash {} does not match recomputed {}",
                    hex::encode(&row.hash),
                    hex::encode(hash)
                ))
            } else {
                None
            }
        };
        match problem {
            Some(problem) => first_bad = Some((row.position, problem)),
            None => {
                prev_hash = row.hash.as_slice().try_into().expect("hashes are 32 bytes");
                expected_position += 1;
            }
        }
    }
    drop(rows);
    transaction.commit().await?;
    let (first_bad_position, problem) = match first_bad {
        Some((position, problem)) => (Some(position), Some(problem)),
        None => (None, None),
    };
    Ok(VerifyReport {
        ok: first_bad_position.is_none(),
        events_checked: checked,
        head_position,
        head_hash: hex::encode(head_hash),
        first_bad_position,
        from_position: from,
        problem,
        stream: None,
    })
}
