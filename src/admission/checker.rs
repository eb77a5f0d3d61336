//! Group checks: concurrent admission checks share one facts statement.
//!
//! A check alone is one statement, and on the two-core machine the statement's fixed cost
//! (round trip, bind, executor start-up for each of its dozen subplans) is most of it:
//! Postgres alone ran that statement about 9 400 times a second from 16 connections, and
//! the same statement for 16 orgs at once about 3 000 times a second, 48 000 checks. So, as
//! the appender does with commits, checks that arrive while others are being read wait in
//! a bounded queue and go together: the worker takes every check waiting (up to
//! `CHECK_GROUP_MAX`) and reads all their facts in one statement, one snapshot, then hands
//! each caller its row and goes on to the next group; each caller decides from its own
//! row. So a check gets the answer it would have got alone at that snapshot: its own org,
//! container and request, at the freshness it asked for.
//!
//! One worker: with two or four, a check at moderate load found a worker idle and went
//! alone, which cost Postgres more per check and lengthened the tail (`tally bench`: p99
//! 3.9–6.5 ms at half load with four or two workers, 3.2–3.9 ms with one, and more checks a
//! second too).

use std::time::{Duration, Instant};

use chrono::{DateTime, SubsecRound, Utc};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot};

use super::{
    answer, load_facts, AdmissionError, Answer, FactsRow, Reader, Request, FRESHNESS_POLL_MS,
    FRESHNESS_WAIT_MS,
};
use crate::projection::Freshness;

/// Checks in one statement at most.
pub const CHECK_GROUP_MAX: usize = 64;
/// Checks waiting for the worker at most; a caller past it waits for room, and the HTTP
/// layer's concurrency limit and request timeout bound that wait.
pub const CHECK_QUEUE_MAX: usize = 1_024;

struct Pending {
    request: Request,
    reply: oneshot::Sender<anyhow::Result<Read>>,
}

/// A check's facts and the instant they were read at; the caller decides from them, so
/// that the worker is free for the next group at once.
struct Read {
    row: FactsRow,
    now: DateTime<Utc>,
}

/// A handle to the check worker; cheap to clone. The worker ends when every handle is
/// dropped.
#[derive(Clone)]
pub struct Checker {
    sender: mpsc::Sender<Pending>,
    freshness: Freshness,
    pool: PgPool,
}

impl Checker {
    pub fn start(pool: PgPool, freshness: Freshness) -> Checker {
        let (sender, receiver) = mpsc::channel(CHECK_QUEUE_MAX);
        tokio::spawn(work(pool.clone(), receiver));
        Checker {
            sender,
            freshness,
            pool,
        }
    }

    /// `POST /v1/admission/check`: the decision now, read-your-writes for this instance.
    pub async fn check(&self, request: &Request) -> Result<Answer, AdmissionError> {
        let wanted = self.freshness.wanted();
        let deadline = Instant::now() + Duration::from_millis(FRESHNESS_WAIT_MS);
        loop {
            let (reply, facts) = oneshot::channel();
            let pending = Pending {
                request: request.clone(),
                reply,
            };
            self.sender
                .send(pending)
                .await
                .map_err(|_| anyhow::anyhow!("the admission worker has stopped"))?;
            let read = facts
                .await
                .map_err(|_| anyhow::anyhow!("an admission worker stopped"))??;
            if read.row.projected >= wanted {
                let reader = Reader::Pool(&self.pool);
                return Ok(answer(reader, request, &read.row, read.now).await?);
            }
            if Instant::now() >= deadline {
                return Err(AdmissionError::Stale(FRESHNESS_WAIT_MS));
            }
            self.freshness.hurry();
            tokio::time::sleep(Duration::from_millis(FRESHNESS_POLL_MS)).await;
        }
    }
}

async fn work(pool: PgPool, mut receiver: mpsc::Receiver<Pending>) {
    while let Some(first) = receiver.recv().await {
        let mut group = vec![first];
        while group.len() < CHECK_GROUP_MAX {
            match receiver.try_recv() {
                Ok(pending) => group.push(pending),
                Err(_) => break,
            }
        }
        metrics::histogram!("tally_admission_check_group").record(group.len() as f64);
        match read_group(&pool, &group).await {
            Ok((rows, now)) => {
                for (pending, row) in group.into_iter().zip(rows) {
                    let _ = pending.reply.send(Ok(Read { row, now }));
                }
            }
            Err(error) => {
                // The statement failed for all of them; each caller gets the error.
                for pending in group {
                    let _ = pending.reply.send(Err(anyhow::anyhow!("{error:#}")));
                }
            }
        }
    }
}

/// The facts of every check of the group, from one statement, and when they were read.
async fn read_group(
    pool: &PgPool,
    group: &[Pending],
) -> anyhow::Result<(Vec<FactsRow>, DateTime<Utc>)> {
    let mut connection = pool.acquire().await?;
    let now = Utc::now().trunc_subsecs(3);
    let requests: Vec<&Request> = group.iter().map(|pending| &pending.request).collect();
    let rows = load_facts(&mut connection, &requests, now).await?;
    Ok((rows, now))
}
