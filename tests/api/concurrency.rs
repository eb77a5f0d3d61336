//! Many writers, several instances, one order: positions are gap-free and commit in order,
//! so a reader tailing by position sees every event exactly once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use sqlx::{Connection, PgConnection};
use tally::ledger::{verify, AppendLimits, Appender};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::helpers::*;

const WRITERS: usize = 32;
const INSTANCES: usize = 4;
const REQUESTS_PER_WRITER: usize = 25;

/// How this provokes out-of-order commits: the test installs a deferred constraint trigger
/// that sleeps a random 0–3 ms per row *at commit time*, after positions are assigned but
/// before the transaction becomes visible, and spreads 32 writers over 4 appenders with
/// separate pools (four "instances" that share nothing but the database). Had positions
/// come from a plain BIGSERIAL taken outside the lock, transaction A could take position
/// n, B take n+1, B commit first, the reader advance past n+1, and A's row at n become
/// visible only after the reader had moved on: the reader would miss it, and this test
/// would fail on the "saw every event exactly once" assertion. With positions assigned
/// under `pg_advisory_xact_lock`, which is held until commit, n+1 cannot exist before n is
/// visible. (`a_plain_bigserial_tail_misses_a_row_that_commits_late` shows the failure
/// the lock prevents.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_writers_on_four_instances_yield_a_gap_free_chain_that_a_tailing_reader_sees_exactly_once(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    sqlx::raw_sql(
        "CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN PERFORM pg_sleep(random() * 0.003); RETURN NULL; END $$;
         CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON ledger
         DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();",
    )
    .execute(&pool)
    .await
    .unwrap();

    let mut appenders = Vec::new();
    for _ in 0..INSTANCES {
        let instance_pool = db.pool().await;
        let (appender, _, _task) = Appender::start(
            instance_pool,
            AppendLimits {
                queue_max: 1024,
                group_events_max: 64,
            },
        );
        appenders.push(appender);
    }

    let acked = Arc::new(Mutex::new(Vec::<(Uuid, i64)>::new()));
    let writers: Vec<_> = (0..WRITERS)
        .map(|writer| {
            let appender = appenders[writer % INSTANCES].clone();
            let acked = acked.clone();
            tokio::spawn(async move {
                for request in 0..REQUESTS_PER_WRITER {
                    let size = 1 + (writer + request) % 3;
                    let events = parse_events(&valid_events(size));
                    let appended = appender.append(events).await.expect("append succeeds");
                    let mut acked = acked.lock().await;
                    acked.extend(appended.iter().map(|a| (a.id.as_uuid(), a.position)));
                }
            })
        })
        .collect();

    let reader_pool = db.pool().await;
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader_done = done.clone();
    let reader = tokio::spawn(async move {
        let mut seen: Vec<(i64, Uuid)> = Vec::new();
        let mut last = 0i64;
        loop {
            let finished = reader_done.load(std::sync::atomic::Ordering::SeqCst);
            let rows: Vec<(i64, Uuid)> = sqlx::query_as(
                "SELECT position, id FROM ledger WHERE position > $1 ORDER BY position LIMIT 100",
            )
            .bind(last)
            .fetch_all(&reader_pool)
            .await
            .unwrap();
            if let Some((position, _)) = rows.last() {
                last = *position;
            }
            let empty = rows.is_empty();
            seen.extend(rows);
            if finished && empty {
                return seen;
            }
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    });

    for writer in writers {
        writer.await.unwrap();
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let seen = reader.await.unwrap();
    let acked = acked.lock().await.clone();

    let total = acked.len();
    assert!(total >= WRITERS * REQUESTS_PER_WRITER);
    let seen_positions: Vec<i64> = seen.iter().map(|(p, _)| *p).collect();
    assert_eq!(
        seen_positions,
        (1..=total as i64).collect::<Vec<_>>(),
        "the reader saw every position once, in order, without gaps"
    );
    let seen_ids: HashSet<Uuid> = seen.iter().map(|(_, id)| *id).collect();
    let acked_ids: HashSet<Uuid> = acked.iter().map(|(id, _)| *id).collect();
    assert_eq!(
        seen_ids, acked_ids,
        "the reader saw exactly the acknowledged events"
    );
    let acked_positions: HashSet<i64> = acked.iter().map(|(_, p)| *p).collect();
    assert_eq!(
        acked_positions.len(),
        total,
        "no two events share a position"
    );

    let report = verify::verify(&pool).await.unwrap();
    assert!(report.ok, "{report:?}");
    assert_eq!(report.events_checked, total as u64);
}

/// The control experiment: without the lock, a row that commits late is skipped by a
/// reader tailing by position. Deterministic: A takes position 1 and holds its
/// transaction open while B takes 2 and commits.
#[tokio::test]
async fn a_plain_bigserial_tail_misses_a_row_that_commits_late() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    sqlx::query("CREATE TABLE naive (position BIGSERIAL PRIMARY KEY, note TEXT)")
        .execute(&pool)
        .await
        .unwrap();
    let mut a = PgConnection::connect(&db.url).await.unwrap();
    let mut b = PgConnection::connect(&db.url).await.unwrap();
    let mut tx_a = a.begin().await.unwrap();
    sqlx::query("INSERT INTO naive (note) VALUES ('a')")
        .execute(&mut *tx_a)
        .await
        .unwrap();
    sqlx::query("INSERT INTO naive (note) VALUES ('b')")
        .execute(&mut b)
        .await
        .unwrap();

    let tail = |after: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT position FROM naive WHERE position > $1 ORDER BY position",
            )
            .bind(after)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    let first = tail(0).await;
    assert_eq!(first, vec![2], "B's row is visible before A's");
    tx_a.commit().await.unwrap();
    let second = tail(*first.last().unwrap()).await;
    assert!(
        second.is_empty(),
        "the reader, now past 2, never sees A's row at 1"
    );
    assert_eq!(tail(0).await, vec![1, 2], "yet row 1 exists");
}

/// With the ledger lock, an append waits for an in-flight append of another instance, so
/// the later position cannot become visible first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_waits_for_another_instance_holding_the_ledger_lock() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let mut other = PgConnection::connect(&db.url).await.unwrap();
    let mut tx = other.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(tally::ledger::append::LEDGER_LOCK_KEY)
        .execute(&mut *tx)
        .await
        .unwrap();

    let (appender, _, _task) = Appender::start(
        pool.clone(),
        AppendLimits {
            queue_max: 8,
            group_events_max: 8,
        },
    );
    let pending =
        tokio::spawn(async move { appender.append(parse_events(&valid_events(1))).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !pending.is_finished(),
        "the append is blocked by the other instance's lock"
    );
    assert_eq!(ledger_count(&pool).await, 0);
    tx.commit().await.unwrap();
    let appended = pending.await.unwrap().unwrap();
    assert_eq!(appended[0].position, 1);
}

/// The locked path: an append whose fast attempts both find the ledger other than they
/// assumed reads the head and the stored ids under the lock itself. Forced here without
/// timing: the test holds the ledger lock while this instance's append and then another
/// instance's queue behind it (granted in the order they asked). Released, the first
/// attempt finds the request's first id stored; the other instance then appends, so the
/// second attempt finds the head moved; the locked path must still find the stored id
/// and answer it as a duplicate, appending only the new event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_whose_fast_attempts_both_fail_finds_a_stored_id_under_the_lock_and_answers_it_as_a_duplicate(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let limits = AppendLimits {
        queue_max: 8,
        group_events_max: 8,
    };
    let (appender, _, _task) = Appender::start(db.pool().await, limits);
    let (other, _, _other_task) = Appender::start(db.pool().await, limits);
    let events = valid_events(2);
    let stored = appender
        .append(parse_events(&events[..1]))
        .await
        .expect("the first event is appended");
    assert_eq!(stored[0].position, 1);

    let mut holder = PgConnection::connect(&db.url).await.unwrap();
    let mut held = holder.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(tally::ledger::append::LEDGER_LOCK_KEY)
        .execute(&mut *held)
        .await
        .unwrap();
    let again = parse_events(&events);
    let pending = tokio::spawn(async move { appender.append(again).await });
    waiting_for_the_ledger_lock(&pool, 1).await;
    let meanwhile = parse_events(&valid_events(1));
    let other_pending = tokio::spawn(async move { other.append(meanwhile).await });
    waiting_for_the_ledger_lock(&pool, 2).await;
    held.commit().await.unwrap();

    let other_appended = other_pending
        .await
        .unwrap()
        .expect("the other append succeeds");
    assert_eq!(
        other_appended[0].position, 2,
        "the other instance appended between the two fast attempts"
    );
    let appended = pending.await.unwrap().expect("the append succeeds");
    assert_eq!(
        appended
            .iter()
            .map(|event| (event.position, event.duplicate))
            .collect::<Vec<_>>(),
        vec![(1, true), (3, false)],
        "the stored event answered as a duplicate, the new one after the other instance's"
    );
    assert_eq!(positions(&pool).await, vec![1, 2, 3]);
    let report = verify::verify(&pool).await.unwrap();
    assert!(report.ok, "{report:?}");
}
