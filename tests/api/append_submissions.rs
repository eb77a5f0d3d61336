//! `Appender::append_each`: several requests queued as one submission, as the NATS ingest
//! queues a fetched batch. Each list is appended atomically on its own and fails on its own;
//! the submission goes into one group commit, or into consecutive ones when it holds more
//! events than a group takes; a full queue refuses the whole submission and stores nothing.

use std::time::Duration;

use sqlx::{Connection, PgConnection, PgPool};
use tally::event::Event;
use tally::ledger::append::LEDGER_LOCK_KEY;
use tally::ledger::{verify, AppendError, AppendLimits, Appender};

use crate::helpers::*;

/// The transaction that wrote each stored position, in position order: rows of one group
/// commit share their `xmin`.
async fn transactions_by_position(pool: &PgPool) -> Vec<(i64, String)> {
    sqlx::query_as("SELECT position, xmin::text FROM ledger ORDER BY position")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// An appender on `pool` with these limits, and the task that ends when it stops.
fn start(
    pool: &PgPool,
    queue_max: usize,
    group_events_max: usize,
) -> (Appender, tokio::task::JoinHandle<()>) {
    let (appender, _, task) = Appender::start(
        pool.clone(),
        AppendLimits {
            queue_max,
            group_events_max,
        },
    );
    (appender, task)
}

/// `sizes.len()` lists of fresh valid events, list `n` holding `sizes[n]` events.
fn lists(sizes: &[usize]) -> Vec<Vec<Event>> {
    let events = parse_events(&valid_events(sizes.iter().sum()));
    let mut events = events.into_iter();
    sizes
        .iter()
        .map(|size| events.by_ref().take(*size).collect())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_list_of_one_submission_is_stored_in_one_group_commit_in_the_order_of_the_lists() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _task) = start(&pool, 8, 1_000);
    let sizes: Vec<usize> = (0..200).map(|n| 1 + n % 3).collect();
    let results = appender.append_each(lists(&sizes)).await;

    let mut next = 1;
    for (n, (result, size)) in results.iter().zip(&sizes).enumerate() {
        let appended = result
            .as_ref()
            .unwrap_or_else(|e| panic!("list {n} failed: {e}"));
        let positions: Vec<i64> = appended.iter().map(|event| event.position).collect();
        assert_eq!(
            positions,
            (next..next + *size as i64).collect::<Vec<_>>(),
            "list {n} is stored whole, after the lists before it"
        );
        next += *size as i64;
    }
    let transactions = transactions_by_position(&pool).await;
    assert_eq!(transactions.len(), sizes.iter().sum::<usize>());
    assert!(
        transactions
            .iter()
            .all(|(_, xmin)| *xmin == transactions[0].1),
        "one group commit wrote every row: {:?}",
        transactions
            .iter()
            .map(|(_, xmin)| xmin)
            .collect::<std::collections::BTreeSet<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_with_more_events_than_a_group_takes_is_stored_in_consecutive_group_commits_never_splitting_a_list(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _task) = start(&pool, 8, 10);
    // Seven lists of three: a group takes lists while it holds fewer than ten events, so
    // the first takes four lists (twelve events) and the second the other three.
    let sizes = [3; 7];
    let results = appender.append_each(lists(&sizes)).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");

    let transactions = transactions_by_position(&pool).await;
    let positions: Vec<i64> = transactions.iter().map(|(position, _)| *position).collect();
    assert_eq!(positions, (1..=21).collect::<Vec<_>>());
    let first = &transactions[0].1;
    let (in_first, in_second): (Vec<_>, Vec<_>) =
        transactions.iter().partition(|(_, xmin)| xmin == first);
    assert_eq!(
        in_first
            .iter()
            .map(|(position, _)| *position)
            .collect::<Vec<_>>(),
        (1..=12).collect::<Vec<_>>(),
        "the first group holds the first four lists whole"
    );
    assert!(
        in_second.iter().all(|(_, xmin)| *xmin == in_second[0].1),
        "the other three lists share the second group"
    );
    let report = verify::verify(&pool).await.unwrap();
    assert!(report.ok, "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_that_reuses_an_id_with_other_content_fails_alone_and_a_list_sent_again_is_a_duplicate(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _task) = start(&pool, 8, 1_000);
    let values = valid_events(4);
    let stored = appender
        .append(parse_events(&values[..1]))
        .await
        .expect("the first event is stored");
    assert_eq!(stored[0].position, 1);
    let mut changed = values[0].clone();
    changed["occurred_at"] = serde_json::json!(ago(10));

    let results = appender
        .append_each(vec![
            parse_events(&values[1..2]),
            // The stored event's id and another event of the same list: neither is stored.
            parse_events(&[changed, values[2].clone()]),
            parse_events(&values[..1]),
            parse_events(&values[3..4]),
        ])
        .await;

    assert_eq!(results[0].as_ref().unwrap()[0].position, 2);
    match &results[1] {
        Err(AppendError::IdempotencyConflict { index, .. }) => assert_eq!(*index, 0),
        other => panic!("expected an idempotency conflict, got {other:?}"),
    }
    let again = results[2].as_ref().unwrap();
    assert!(again[0].duplicate, "{again:?}");
    assert_eq!(again[0].position, 1);
    assert_eq!(results[3].as_ref().unwrap()[0].position, 3);
    assert_eq!(positions(&pool).await, vec![1, 2, 3]);
    let report = verify::verify(&pool).await.unwrap();
    assert!(report.ok, "{report:?}");
}

/// Holds the ledger lock in a transaction of its own, as another instance committing would.
async fn hold_ledger_lock(url: &str) -> PgConnection {
    let mut connection = PgConnection::connect(url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut connection).await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(LEDGER_LOCK_KEY)
        .execute(&mut connection)
        .await
        .unwrap();
    connection
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_submission_that_finds_the_queue_full_is_refused_as_overloaded_for_every_list_and_stores_nothing(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _task) = start(&pool, 1, 1_000);
    let mut lock = hold_ledger_lock(&db.url).await;
    // The appender takes the first request and waits for the lock with it; the second
    // submission fills the queue's one place.
    let first = tokio::spawn({
        let appender = appender.clone();
        let events = parse_events(&valid_events(1));
        async move { appender.append(events).await }
    });
    waiting_for_the_ledger_lock(&pool, 1).await;
    let second = appender.append_each(lists(&[2]));
    let refused = appender.append_each(vec![
        parse_events(&valid_events(1)),
        Vec::new(),
        parse_events(&valid_events(3)),
    ]);
    let refused = tokio::time::timeout(Duration::from_secs(5), refused)
        .await
        .expect("a refused submission is answered at once, without waiting for the lock");
    assert!(
        matches!(refused[0], Err(AppendError::Overloaded)),
        "{refused:?}"
    );
    assert!(
        matches!(&refused[1], Ok(appended) if appended.is_empty()),
        "{refused:?}"
    );
    assert!(
        matches!(refused[2], Err(AppendError::Overloaded)),
        "{refused:?}"
    );

    sqlx::query("COMMIT").execute(&mut lock).await.unwrap();
    assert_eq!(first.await.unwrap().unwrap()[0].position, 1);
    let second = second.await;
    let positions_of_second: Vec<i64> = second[0]
        .as_ref()
        .unwrap()
        .iter()
        .map(|event| event.position)
        .collect();
    assert_eq!(positions_of_second, vec![2, 3]);
    assert_eq!(
        positions(&pool).await,
        vec![1, 2, 3],
        "nothing of the refused submission is stored"
    );
}
