//! Group checks: concurrent admission checks share one facts statement.
//!
//! A check alone is one statement, and on the two-core machine the statement's fixed cost
//! (round trip, bind, executor start-up for each of its dozen subplans) is most of it:
//! the same statement for 16 orgs at once costs about three times the one for a single org,
//! so it answers about five times as many checks a second. So, as
//! the appender does with commits, checks that arrive while a group is being read wait, and
//! go together in the next: one statement, one snapshot, one checkpoint for all of them.
//! Each caller then decides from its own row, so a check gets the answer it would have got
//! alone at that snapshot: its own org, container and request, at the freshness it asked
//! for.
//!
//! One group is read at a time, by one of its own callers (the first to find no read in
//! flight, or the first waiting when the read before ends), not by a worker task: a check
//! that finds Postgres idle goes at once, with no hand-off to another task and back, and a
//! waiting one is woken once, with its facts or with the next group to read. A worker task
//! would cost two wake-ups a check, and two groups in flight at once answer no more checks
//! than one.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use chrono::{DateTime, SubsecRound, Utc};
use sqlx::PgPool;
use tokio::sync::oneshot;

use super::cache::{record_wait, FactsCache, WAITED_FOR_CHECKPOINT};
use super::{
    answer_from, load_facts, AdmissionError, Answer, FactsRow, Prepared, Reader, Request, Wait,
};
use crate::clock::Clock;
use crate::projection::Freshness;

/// Checks in one statement at most.
pub const CHECK_GROUP_MAX: usize = 64;
/// Checks waiting for the read in flight at most; past it a check is refused with
/// [`AdmissionError::Busy`] (503) at once. The HTTP layer's concurrency limit (1 024 by
/// default) keeps a service under it.
pub const CHECK_QUEUE_MAX: usize = 1_024;

struct Pending {
    request: Request,
    reply: oneshot::Sender<Reply>,
}

/// What a waiting check is told: its facts, or that it reads the next group.
enum Reply {
    Read(Box<Result<Read, Arc<AdmissionError>>>),
    Lead,
}

/// A check's facts and the instant they were read at; each caller decides from its own.
struct Read {
    row: FactsRow,
    now: DateTime<Utc>,
}

/// Checks waiting while a group is read, and whether one is.
#[derive(Default)]
struct Queue {
    waiting: VecDeque<Pending>,
    reading: bool,
}

/// A handle to the checks of this service; cheap to clone.
#[derive(Clone)]
pub struct Checker {
    queue: Arc<Mutex<Queue>>,
    queue_max: usize,
    freshness: Freshness,
    pool: PgPool,
    cache: FactsCache,
    clock: Clock,
}

impl Checker {
    /// Checks on `pool`, fresh as `freshness` says, deciding at `clock`'s now.
    pub fn new(pool: PgPool, freshness: Freshness, clock: Clock) -> Checker {
        Checker::with_queue_max(pool, freshness, clock, CHECK_QUEUE_MAX)
    }

    /// As [`Checker::new`], with at most `queue_max` checks waiting.
    pub fn with_queue_max(
        pool: PgPool,
        freshness: Freshness,
        clock: Clock,
        queue_max: usize,
    ) -> Checker {
        Checker {
            queue: Arc::default(),
            queue_max,
            cache: FactsCache::waking(freshness.clone()),
            freshness,
            pool,
            clock,
        }
    }

    /// The clock this checker decides at; reservations are granted at the same one.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// The facts this checker keeps between checks; they are used only while
    /// [`super::cache::listen`] runs on it.
    pub fn cache(&self) -> &FactsCache {
        &self.cache
    }

    /// Checks waiting for the read in flight to end.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// `POST /v1/admission/check`: the decision now, read-your-writes for this instance.
    pub async fn check(&self, request: &Request) -> Result<Answer, AdmissionError> {
        self.check_with(request, Wait::default()).await
    }

    /// [`Checker::check`], with the facts reflecting `wait.min_position` too, waiting
    /// `wait.within` for it. From the facts kept in memory when they reflect that position
    /// and serve (see [`super::cache`]), else from a read of Postgres, whose facts are then
    /// kept.
    pub async fn check_with(
        &self,
        request: &Request,
        wait: Wait,
    ) -> Result<Answer, AdmissionError> {
        let wanted = wait.wanted(&self.freshness, &request.org_id);
        let deadline = Instant::now() + wait.within;
        if let Some(answer) = self.answer_kept(request, wanted)? {
            return Ok(answer);
        }
        // Facts kept that only lack appends not projected yet: the rounds that project
        // them advance the facts (on the instance that projects them), so wait for their
        // notices rather than read Postgres, which would wait for the same rounds.
        if self.cache.kept(request).is_some()
            && self
                .cache
                .heard(wanted, deadline, || self.freshness.hurry())
                .await
        {
            if let Some(answer) = self.answer_kept(request, wanted)? {
                return Ok(answer);
            }
        }
        self.cache.count(false);
        let ticket = self.cache.ticket(request.org_id.as_str());
        loop {
            let read = self.read(request).await?;
            if read.row.projected >= wanted {
                let facts = Arc::new(Prepared::from_row(read.row, request, read.now)?);
                if let Some(ticket) = ticket {
                    self.cache.keep(ticket, request, Arc::clone(&facts));
                }
                let reader = Reader::Pool(&self.pool);
                return answer_from(reader, request, &facts, read.now).await;
            }
            let waiting = Instant::now();
            let caught_up = wait
                .catch_up(&self.pool, &self.freshness, wanted, deadline)
                .await;
            record_wait(WAITED_FOR_CHECKPOINT, waiting);
            caught_up?;
        }
    }

    /// The answer from the facts kept for `request`, when they reflect `wanted` and serve
    /// now; counted as a check answered from memory.
    fn answer_kept(
        &self,
        request: &Request,
        wanted: i64,
    ) -> Result<Option<Answer>, AdmissionError> {
        let Some((facts, position)) = self.cache.get(request, wanted) else {
            return Ok(None);
        };
        let now = self.clock.now().trunc_subsecs(3);
        if !facts.serves(now) {
            return Ok(None);
        }
        let Some(runtime_used_ms) = facts.runtime_used_ms(now) else {
            return Ok(None);
        };
        self.cache.count(true);
        let answer = facts.answer(request, now, runtime_used_ms)?;
        Ok(Some(Answer { position, ..answer }))
    }

    /// The facts of `request`: read by this caller together with every check waiting when
    /// no group is being read; else by whoever reads the next group.
    async fn read(&self, request: &Request) -> Result<Read, AdmissionError> {
        let replied = {
            let mut queue = self.lock();
            if queue.reading {
                if queue.waiting.len() >= self.queue_max {
                    return Err(AdmissionError::Busy(self.queue_max));
                }
                let (reply, replied) = oneshot::channel();
                queue.waiting.push_back(Pending {
                    request: request.clone(),
                    reply,
                });
                Some(replied)
            } else {
                queue.reading = true;
                None
            }
        };
        if let Some(replied) = replied {
            if let Some(read) = self.reply(replied).await {
                return read;
            }
        }
        // This caller reads its own check and those waiting, as one group.
        let mut lead = Lead {
            checker: self,
            group: {
                let mut queue = self.lock();
                let taken = queue.waiting.len().min(CHECK_GROUP_MAX - 1);
                queue.waiting.drain(..taken).collect()
            },
        };
        metrics::histogram!(crate::telemetry::ADMISSION_GROUP_CHECKS)
            .record((lead.group.len() + 1) as f64);
        let requests: Vec<&Request> = std::iter::once(request)
            .chain(lead.group.iter().map(|pending| &pending.request))
            .collect();
        let result = read_group(&self.pool, &requests, self.clock).await;
        drop(requests);
        let group = std::mem::take(&mut lead.group);
        // The next group may start while this one's answers go out.
        drop(lead);
        match result {
            Ok((rows, now)) => {
                let mut rows = rows.into_iter();
                let own = rows.next().ok_or_else(|| {
                    AdmissionError::Corrupt("the facts statement returned no rows".to_owned())
                })?;
                for (pending, row) in group.into_iter().zip(rows) {
                    let read = Read { row, now };
                    let _ = pending.reply.send(Reply::Read(Box::new(Ok(read))));
                }
                Ok(Read { row: own, now })
            }
            Err(error) => {
                // The statement failed for all of them; each caller gets the error.
                let error = Arc::new(error);
                for pending in group {
                    let _ = pending
                        .reply
                        .send(Reply::Read(Box::new(Err(Arc::clone(&error)))));
                }
                Err(AdmissionError::Group(error))
            }
        }
    }

    /// Waits for what the check reading a group tells this one: its facts, or `None` when it
    /// is to read the next group itself.
    async fn reply(
        &self,
        replied: oneshot::Receiver<Reply>,
    ) -> Option<Result<Read, AdmissionError>> {
        let mut waiting = Waiting {
            checker: self,
            replied: Some(replied),
        };
        let replied = waiting.replied.as_mut().expect("set above");
        let reply = replied.await;
        waiting.replied = None;
        match reply {
            Ok(Reply::Read(read)) => Some((*read).map_err(AdmissionError::Group)),
            Ok(Reply::Lead) => None,
            Err(_) => Some(Err(AdmissionError::LeadStopped)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue
            .lock()
            .expect("the check queue is never held across a panic")
    }

    /// Passes the reading on to the first check still waiting, or ends it.
    fn hand_off(queue: &mut Queue) {
        while let Some(next) = queue.waiting.pop_front() {
            if next.reply.send(Reply::Lead).is_ok() {
                return;
            }
            // That caller has gone (its request was cancelled): the one after it.
        }
        queue.reading = false;
    }
}

/// The caller reading a group. Dropped when the read is done, or when the caller is
/// cancelled mid-read (a client gone, a request past its deadline): then the checks it had
/// taken wait again, first in line, and the next caller reads them.
struct Lead<'a> {
    checker: &'a Checker,
    group: Vec<Pending>,
}

impl Drop for Lead<'_> {
    fn drop(&mut self) {
        let mut queue = self.checker.lock();
        for pending in self.group.drain(..).rev() {
            queue.waiting.push_front(pending);
        }
        Checker::hand_off(&mut queue);
    }
}

/// A caller waiting for its facts. Cancelled after it was told to read the next group but
/// before it began, it passes that on, so that the checks behind it are not left waiting.
struct Waiting<'a> {
    checker: &'a Checker,
    replied: Option<oneshot::Receiver<Reply>>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let Some(mut replied) = self.replied.take() else {
            return;
        };
        replied.close();
        if let Ok(Reply::Lead) = replied.try_recv() {
            Checker::hand_off(&mut self.checker.lock());
        }
    }
}

/// The facts of every check of the group, from one statement, and when they were read.
async fn read_group(
    pool: &PgPool,
    requests: &[&Request],
    clock: Clock,
) -> Result<(Vec<FactsRow>, DateTime<Utc>), AdmissionError> {
    let mut connection = pool.acquire().await?;
    let now = clock.now().trunc_subsecs(3);
    let rows = load_facts(&mut connection, requests, now).await?;
    Ok((rows, now))
}
