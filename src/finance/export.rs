//! The usage export (contract §5, §6): every org's priced row for a period, then the
//! adjustments of closed periods, or, for a closed period, the rows its close froze; all
//! in one repeatable-read snapshot, produced by a task a bounded number of batches ahead
//! of its reader, so its memory is bounded whatever the number of orgs.

use chrono::{DateTime, Utc};
use futures::Stream;
use sqlx::{PgConnection, PgPool};

use super::periods::{self, Adjustment};
use super::pricing::{orgs_after, Figures, Pricer};
use super::Error;
use crate::projection::store::{self, LIVE};
use crate::runtime::Period;

/// Batches an export's task may have produced that its reader has not taken yet: enough to
/// overlap reading the database with writing to the client, few enough that an export
/// holds at most this many batches (plus the one being priced) in memory.
const QUEUED_BATCHES_MAX: usize = 2;

/// One batch of a usage export: rows in org order, then the adjustments of closed periods.
#[derive(Debug)]
pub enum Part {
    Rows(Vec<Figures>),
    Adjustments(Vec<Adjustment>),
}

/// A usage export under way: the ledger position its figures reflect (the projection's
/// checkpoint, read in the export's snapshot before any row) and its batches.
pub struct UsageExport<S> {
    pub position: i64,
    pub parts: S,
}

/// `period`'s usage export as of `as_of`: every org's row, then the adjustments of closed
/// periods whose next open period is `period` ([`periods`]), in batches of at most
/// `batch_orgs` orgs, all read in one repeatable-read snapshot by a task that runs at most
/// [`QUEUED_BATCHES_MAX`] batches ahead of the reader. Dropping the stream stops the task.
/// With `only_org` (a token bound to that org), only that org is listed and priced. A
/// closed `period` is the rows its close stored instead, at the close's position. The
/// snapshot is taken here, with the checkpoint, so that the position is known before the
/// first byte is written.
pub async fn usage_export(
    pool: &PgPool,
    period: Period,
    as_of: DateTime<Utc>,
    batch_orgs: i64,
    only_org: Option<String>,
) -> Result<UsageExport<impl Stream<Item = Result<Part, Error>> + Send>, Error> {
    assert!(batch_orgs > 0, "a batch holds at least one org");
    let mut transaction = crate::ledger::db::read_snapshot(pool).await?;
    // The first read takes the snapshot: the close, the checkpoint and every row come
    // from it. A closed period is its snapshot, at the position it was closed at.
    let closed_at = periods::close_position(&mut *transaction, period).await?;
    let position = match closed_at {
        Some(position) => position,
        None => store::checkpoint(&mut transaction, LIVE).await?,
    };
    let (sender, receiver) = tokio::sync::mpsc::channel(QUEUED_BATCHES_MAX);
    tokio::spawn(async move {
        let only_org = only_org.as_deref();
        let produced = match closed_at {
            Some(_) => {
                produce_frozen(&mut transaction, period, batch_orgs, only_org, &sender).await
            }
            None => {
                produce(
                    &mut transaction,
                    period,
                    as_of,
                    batch_orgs,
                    only_org,
                    &sender,
                )
                .await
            }
        };
        let ended = match produced {
            Ok(()) => transaction.commit().await.map_err(Error::from),
            Err(error) => Err(error),
        };
        if let Err(error) = ended {
            let _ = sender.send(Err(error)).await;
        }
    });
    let parts = futures::stream::unfold(receiver, |mut receiver| async move {
        receiver.recv().await.map(|part| (part, receiver))
    });
    Ok(UsageExport { position, parts })
}

/// Fills `sender` with the export's batches, read in `transaction`'s snapshot; returns
/// early once the reader has gone.
async fn produce(
    transaction: &mut PgConnection,
    period: Period,
    as_of: DateTime<Utc>,
    batch_orgs: i64,
    only_org: Option<&str>,
    sender: &tokio::sync::mpsc::Sender<Result<Part, Error>>,
) -> Result<(), Error> {
    let mut pricer = Pricer::new(period, as_of);
    let mut after = String::new();
    loop {
        let orgs = match only_org {
            None => orgs_after(&mut *transaction, period, &after, batch_orgs).await?,
            Some(org) => {
                let listed = is_listed(&mut *transaction, period, org).await?;
                listed.then(|| org.to_owned()).into_iter().collect()
            }
        };
        let Some(last) = orgs.last() else { break };
        after.clone_from(last);
        let rows = pricer.price(&mut *transaction, &orgs).await?;
        if sender.send(Ok(Part::Rows(rows))).await.is_err() {
            return Ok(());
        }
        if only_org.is_some() || (orgs.len() as i64) < batch_orgs {
            break;
        }
    }
    for (affected, position) in periods::closed_into(&mut *transaction, period).await? {
        let mut pricer = Pricer::new(affected, affected.end());
        let mut after = Some(String::new());
        while let Some(from) = after {
            let (adjustments, next) = periods::adjustments_after(
                &mut *transaction,
                &mut pricer,
                position,
                &from,
                batch_orgs,
                only_org,
            )
            .await?;
            after = next;
            if !adjustments.is_empty()
                && sender
                    .send(Ok(Part::Adjustments(adjustments)))
                    .await
                    .is_err()
            {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Fills `sender` with closed period `period`'s snapshot rows, as the close stored them,
/// in batches; no adjustments (those of a closed period go to the next open one, never to
/// a closed one). Returns early once the reader has gone.
async fn produce_frozen(
    transaction: &mut PgConnection,
    period: Period,
    batch_orgs: i64,
    only_org: Option<&str>,
    sender: &tokio::sync::mpsc::Sender<Result<Part, Error>>,
) -> Result<(), Error> {
    let mut after = String::new();
    loop {
        let rows = periods::snapshot_after(&mut *transaction, period, &after, batch_orgs, only_org)
            .await?;
        let Some(last) = rows.last() else { break };
        after.clone_from(&last.org_id);
        let full = rows.len() as i64 == batch_orgs;
        if sender.send(Ok(Part::Rows(rows))).await.is_err() || !full {
            return Ok(());
        }
    }
    Ok(())
}

/// Whether the usage export of `period` lists `org_id`: it has usage in the period, or a
/// container running since it or before (as [`orgs_after`] lists orgs).
async fn is_listed(
    connection: &mut PgConnection,
    period: Period,
    org_id: &str,
) -> Result<bool, sqlx::Error> {
    sqlx::query_scalar(&format!(
        "SELECT EXISTS (SELECT 1 FROM {LIVE}.org_period WHERE period = $1 AND org_id = $2) \
             OR EXISTS (SELECT 1 FROM {LIVE}.org_open \
                        WHERE org_id = $2 AND running > 0 AND since_period <= $1)"
    ))
    .bind(period.to_string())
    .bind(org_id)
    .fetch_one(connection)
    .await
}
