//! Verification: walk the ledger in position order, recompute every hash from the stored
//! columns and name the first position where the chain or the numbering breaks.

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
    /// What was wrong at `first_bad_position`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// A full pass over the ledger. Streams rows, so memory stays flat however long it is.
#[tracing::instrument(skip_all)]
pub async fn verify(pool: &PgPool) -> Result<VerifyReport, sqlx::Error> {
    let query = format!("SELECT {ROW_COLUMNS} FROM ledger ORDER BY position");
    let mut rows = sqlx::query_as::<_, LedgerRow>(&query).fetch(pool);
    let mut prev_hash = GENESIS_HASH;
    let mut expected_position = 1;
    let mut checked = 0;
    let mut head_position = 0;
    let mut head_hash = GENESIS_HASH.to_vec();
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
        problem,
    })
}
