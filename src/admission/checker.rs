//! Group checks: concurrent admission checks share one facts statement.
//!
//! A check alone is one statement, and on the two-core machine the statement's fixed cost
//! (round trip, bind, executor start-up for each of its dozen subplans) is most of it:
//! Postgres alone ran that statement about 9 400 times a second from 16 connections, and
//! the same statement for 16 orgs at once about 3 000 times a second, 48 000 orgs. So, as
//! the appender does with commits, checks that arrive while others are being read wait in
//! a bounded queue and go together: each of `CHECK_WORKERS` workers takes every check
//! waiting (up to `CHECK_GROUP_MAX`) and reads all their facts in one statement, one
//! snapshot. Each check still gets the answer it would have got alone at that snapshot:
//! its own org, container and request, and the freshness it asked for.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::{SubsecRound, Utc};
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Mutex};

use super::{
    answer, load_facts, AdmissionError, Answer, Request, FRESHNESS_POLL_MS, FRESHNESS_WAIT_MS,
};
use crate::projection::Freshness;

/// Workers reading facts at once: while one waits for Postgres, the next gathers the checks
/// that arrive meanwhile. Few, so that each group is large under load and a connection
/// of the pool is left for everything else.
pub const CHECK_WORKERS: usize = 2;
/// Checks in one statement at most.
pub const CHECK_GROUP_MAX: usize = 64;
/// Checks waiting for a worker at most; a caller past it waits for room, and the HTTP
/// layer's concurrency limit and request timeout bound that wait.
pub const CHECK_QUEUE_MAX: usize = 1_024;

struct Pending {
    request: Request,
    /// The projection position the answer must reflect (read-your-writes).
    wanted: i64,
    /// `None` when the snapshot did not reach `wanted` yet.
    reply: oneshot::Sender<anyhow::Result<Option<Answer>>>,
}

/// A handle to the check workers; cheap to clone. The workers end when every handle is
/// dropped.
#[derive(Clone)]
pub struct Checker {
    sender: mpsc::Sender<Pending>,
    freshness: Freshness,
}

impl Checker {
    pub fn start(pool: PgPool, freshness: Freshness) -> Checker {
        let (sender, receiver) = mpsc::channel(CHECK_QUEUE_MAX);
        let receiver = Arc::new(Mutex::new(receiver));
        for _ in 0..CHECK_WORKERS {
            tokio::spawn(work(pool.clone(), receiver.clone()));
        }
        Checker { sender, freshness }
    }

    /// `POST /v1/admission/check`: the decision now, read-your-writes for this instance.
    pub async fn check(&self, request: &Request) -> Result<Answer, AdmissionError> {
        let wanted = self.freshness.wanted();
        let deadline = Instant::now() + Duration::from_millis(FRESHNESS_WAIT_MS);
        loop {
            let (reply, answer) = oneshot::channel();
            let pending = Pending {
                request: request.clone(),
                wanted,
                reply,
            };
            self.sender
                .send(pending)
                .await
                .map_err(|_| anyhow::anyhow!("the admission workers have stopped"))?;
            let answer = answer
                .await
                .map_err(|_| anyhow::anyhow!("an admission worker stopped"))??;
            if let Some(answer) = answer {
                return Ok(answer);
            }
            if Instant::now() >= deadline {
                return Err(AdmissionError::Stale(FRESHNESS_WAIT_MS));
            }
            self.freshness.hurry();
            tokio::time::sleep(Duration::from_millis(FRESHNESS_POLL_MS)).await;
        }
    }
}

async fn work(pool: PgPool, receiver: Arc<Mutex<mpsc::Receiver<Pending>>>) {
    loop {
        let group = {
            let mut receiver = receiver.lock().await;
            let Some(first) = receiver.recv().await else {
                return;
            };
            let mut group = vec![first];
            while group.len() < CHECK_GROUP_MAX {
                match receiver.try_recv() {
                    Ok(pending) => group.push(pending),
                    Err(_) => break,
                }
            }
            group
        };
        metrics::histogram!("tally_admission_check_group").record(group.len() as f64);
        match answer_group(&pool, &group).await {
            Ok(answers) => {
                for (pending, answer) in group.into_iter().zip(answers) {
                    let _ = pending.reply.send(answer);
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

/// One answer a check, from one statement; a check whose snapshot is short of what it
/// wanted gets `None`, and one whose own answer fails gets its own error.
async fn answer_group(
    pool: &PgPool,
    group: &[Pending],
) -> anyhow::Result<Vec<anyhow::Result<Option<Answer>>>> {
    let mut connection = pool.acquire().await?;
    let now = Utc::now().trunc_subsecs(3);
    let requests: Vec<&Request> = group.iter().map(|pending| &pending.request).collect();
    let rows = load_facts(&mut connection, &requests, now).await?;
    let mut answers = Vec::with_capacity(group.len());
    for (pending, row) in group.iter().zip(&rows) {
        answers.push(if row.projected < pending.wanted {
            Ok(None)
        } else {
            answer(&mut connection, &pending.request, row, now)
                .await
                .map(Some)
        });
    }
    Ok(answers)
}
