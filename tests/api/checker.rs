//! The admission checker's queue: checks that wait while a group is read, its limit, and
//! callers that go away (a client gone, a request past its deadline) at every point.

use std::time::Duration;

use rand::Rng;
use sqlx::{Postgres, Transaction};
use tally::admission::{AdmissionError, Answer, Checker, Request};
use tally::billing::Action;
use tally::event::OrgId;
use tally::projection::Freshness;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::admission::ready_org;
use crate::helpers::{eventually, TestApp};

/// A checker of its own on the app's database, at most `queue_max` checks waiting; what
/// the app has appended is projected before it is made, so it never waits for freshness.
fn checker(app: &TestApp, queue_max: usize) -> Checker {
    let (_, head) = watch::channel(0);
    Checker::with_queue_max(
        app.pool.clone(),
        Freshness::new(head, Default::default()),
        app.clock,
        queue_max,
    )
}

fn create(org: &str) -> Request {
    Request {
        org_id: OrgId::parse(org).unwrap(),
        action: Action::Create,
        container_id: None,
    }
}

/// Holds the projection's checkpoint, which the facts statement reads first, so that a
/// group's read waits in Postgres until the transaction ends.
async fn hold_checkpoint(app: &TestApp) -> Transaction<'static, Postgres> {
    let mut transaction = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE proj.checkpoint IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *transaction)
        .await
        .unwrap();
    transaction
}

/// (`pg_stat_activity` keeps the first kilobyte of the statement's text.)
async fn a_facts_statement_waits_for_the_lock(app: &TestApp) {
    eventually(
        10,
        "a facts statement waits for the checkpoint's lock",
        || async {
            let waiting: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event_type = 'Lock' AND query LIKE '%AS projected%'",
            )
            .fetch_one(&app.pool)
            .await
            .unwrap();
            waiting > 0
        },
    )
    .await;
}

/// A check of acme on its own task.
fn spawn_check(checker: &Checker) -> JoinHandle<Result<Answer, AdmissionError>> {
    let checker = checker.clone();
    tokio::spawn(async move { checker.check(&create("acme")).await })
}

/// A check whose group's read waits in Postgres until the returned transaction ends.
async fn a_read_held_in_postgres(
    app: &TestApp,
    checker: &Checker,
) -> (
    Transaction<'static, Postgres>,
    JoinHandle<Result<Answer, AdmissionError>>,
) {
    let lock = hold_checkpoint(app).await;
    let reader = spawn_check(checker);
    a_facts_statement_waits_for_the_lock(app).await;
    (lock, reader)
}

/// The spawned check answers, allowed, within 10 s (never, if it was left waiting).
async fn allowed_in_time(check: JoinHandle<Result<Answer, AdmissionError>>, what: &str) {
    let answer = tokio::time::timeout(Duration::from_secs(10), check)
        .await
        .unwrap_or_else(|_| panic!("{what}"))
        .unwrap()
        .unwrap();
    assert!(answer.decision.allowed, "{:?}", answer.decision);
}

async fn nothing_waits_and_the_next_check_is_answered(checker: &Checker) {
    assert_eq!(checker.waiting(), 0);
    let answer = checker.check(&create("acme")).await.unwrap();
    assert!(answer.decision.allowed, "{:?}", answer.decision);
}

/// A service with acme ready and projected, and a checker of its own on its database.
async fn acme_with_checker(queue_max: usize) -> (TestApp, Checker) {
    let app = TestApp::spawn().await;
    ready_acme(&app).await;
    let checker = checker(&app, queue_max);
    (app, checker)
}

async fn ready_acme(app: &TestApp) {
    ready_org(app, "acme").await;
    eventually(10, "the projection holds acme", || async {
        let projected: i64 = sqlx::query_scalar("SELECT position FROM proj.checkpoint")
            .fetch_one(&app.pool)
            .await
            .unwrap();
        projected >= 4
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_queue_limit_a_check_is_refused_at_once_and_a_cancelled_reader_leaves_no_one_waiting(
) {
    let (app, checker) = acme_with_checker(2).await;
    // The first check reads (and waits in Postgres); the next two wait for it.
    let (lock, reader) = a_read_held_in_postgres(&app, &checker).await;
    let waiters: Vec<_> = (0..2).map(|_| spawn_check(&checker)).collect();
    eventually(10, "two checks wait", || async { checker.waiting() == 2 }).await;

    // A third would wait past the limit: refused, without waiting for the read.
    let refused = tokio::time::timeout(Duration::from_secs(5), checker.check(&create("acme")))
        .await
        .expect("a check past the limit is refused at once");
    assert!(
        matches!(refused, Err(AdmissionError::Busy(2))),
        "{:?}",
        refused.map(|answer| answer.decision.allowed)
    );

    // The reader goes away mid-read: the two it had taken are read by one of them.
    reader.abort();
    assert!(reader.await.unwrap_err().is_cancelled());
    lock.rollback().await.unwrap();
    for waiter in waiters {
        allowed_in_time(
            waiter,
            "a waiting check is answered after its reader went away",
        )
        .await;
    }
    nothing_waits_and_the_next_check_is_answered(&checker).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_cancelled_at_random_moments_never_leave_the_others_waiting() {
    let (app, checker) = acme_with_checker(1_024).await;
    // Every third check is dropped after 0–2 ms: some while waiting, some while reading
    // their group, some just after being told to read the next one.
    let mut tasks = Vec::new();
    for serial in 0..600 {
        let checker = checker.clone();
        let cancel_after =
            (serial % 3 == 0).then(|| Duration::from_micros(rand::rng().random_range(0..2_000)));
        tasks.push(tokio::spawn(async move {
            let request = create("acme");
            let check = checker.check(&request);
            match cancel_after {
                Some(after) => tokio::time::timeout(after, check).await.ok(),
                None => Some(check.await),
            }
        }));
    }
    let mut answered = 0;
    for (serial, task) in tasks.into_iter().enumerate() {
        let outcome = tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("no check is left waiting")
            .unwrap();
        match outcome {
            Some(answer) => {
                let answer = answer.unwrap();
                assert!(answer.decision.allowed, "{:?}", answer.decision);
                answered += 1;
            }
            None => assert_eq!(serial % 3, 0, "only the cancelled ones have no answer"),
        }
    }
    assert!(answered >= 400, "{answered} answered");
    nothing_waits_and_the_next_check_is_answered(&checker).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_check_gone_after_being_told_to_read_the_next_group_passes_the_reading_on() {
    let (app, checker) = acme_with_checker(1_024).await;
    let (lock, reader) = a_read_held_in_postgres(&app, &checker).await;
    // The next check waits first in line, polled once here and then never again.
    let request = create("acme");
    let mut told = Box::pin(checker.check(&request));
    assert!(futures::poll!(&mut told).is_pending());
    assert_eq!(checker.waiting(), 1);
    let last = spawn_check(&checker);
    eventually(10, "two checks wait", || async { checker.waiting() == 2 }).await;
    // The read ends and tells the first in line to read the next group; it is gone before
    // it can, and the one behind it must not be left waiting.
    lock.rollback().await.unwrap();
    let answer = reader.await.unwrap().unwrap();
    assert!(answer.decision.allowed, "{:?}", answer.decision);
    eventually(10, "the first in line was told", || async {
        checker.waiting() == 1
    })
    .await;
    drop(told);
    allowed_in_time(last, "the check behind a gone one is answered").await;
    nothing_waits_and_the_next_check_is_answered(&checker).await;
    app.stop().await;
}
