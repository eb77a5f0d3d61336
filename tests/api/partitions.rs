//! The ledger partitioned by month of `recorded_at` (docs/decisions/0029-ledger-partitions.md):
//! rows land in their month's table, every month refuses changes, tally makes the months
//! itself, and the migration converts an unpartitioned ledger without changing a row.

use std::borrow::Cow;

use chrono::{DateTime, Duration, TimeZone, Utc};
use sqlx::PgPool;
use tally::clock::Clock;
use tally::event::canonical;
use tally::ledger::{AppendLimits, Appender, Rows};

use crate::helpers::*;

const LIMITS: AppendLimits = AppendLimits {
    queue_max: 16,
    group_events_max: 1_000,
};

fn utc(year: i32, month: u32, day: u32, hour: u32, minute: u32, second: u32) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(year, month, day, hour, minute, second)
        .unwrap()
}

/// Appends `count` events through an appender whose clock reads `instant`, then stops it.
async fn append_at(pool: &PgPool, instant: DateTime<Utc>, count: usize) {
    let (appender, _committed, task) =
        Appender::start_dated(pool.clone(), LIMITS, Clock::starting_at(instant));
    let appended = appender
        .append(parse_events(&valid_events(count)))
        .await
        .expect("the append succeeds");
    assert_eq!(appended.len(), count);
    drop(appender);
    task.await.unwrap();
}

/// Each month's table with its rows' positions, in position order.
async fn months_of_rows(pool: &PgPool) -> Vec<(String, i64)> {
    sqlx::query_as("SELECT tableoid::regclass::text, position FROM ledger ORDER BY position")
        .fetch_all(pool)
        .await
        .unwrap()
}

async fn months(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = 'ledger'::regclass ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn appends_across_a_month_boundary_land_in_the_month_each_was_recorded_in() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    // The last second of 2025 and the first of 2026: months the migration did not make
    // (it makes the current month and three ahead), so the appender makes them too.
    append_at(&pool, utc(2025, 12, 31, 23, 59, 59), 3).await;
    append_at(&pool, utc(2026, 1, 1, 0, 0, 0), 2).await;

    let rows = months_of_rows(&pool).await;
    let expected: Vec<(String, i64)> = (1..=5)
        .map(|position| {
            let month = if position <= 3 {
                "ledger_y2025m12"
            } else {
                "ledger_y2026m01"
            };
            (month.to_owned(), position)
        })
        .collect();
    assert_eq!(rows, expected);
    let ids: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger_ids")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(ids, 5, "every row has its ids");
    let (code, report, stderr) = run_verify(&db.url);
    assert_eq!(code, 0, "{report} {stderr}");
    assert_eq!(report["events_checked"], 5);
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_month_and_the_ids_table_refuse_update_delete_and_truncate_even_in_replica_mode() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    append_at(&pool, utc(2026, 3, 10, 12, 0, 0), 3).await;

    let statements = [
        "UPDATE ledger_y2026m03 SET org_id = 'evil' WHERE position = 1",
        "UPDATE ledger_y2026m03 SET org_id = 'evil' WHERE false",
        "DELETE FROM ledger_y2026m03 WHERE position = 2",
        "TRUNCATE ledger_y2026m03",
        "UPDATE ledger_ids SET position = 9 WHERE position = 1",
        "DELETE FROM ledger_ids",
        "TRUNCATE ledger_ids",
    ];
    let mut connection = pool.acquire().await.unwrap();
    for replica in [false, true] {
        let role = if replica { "replica" } else { "origin" };
        sqlx::query(&format!("SET session_replication_role = {role}"))
            .execute(&mut *connection)
            .await
            .unwrap();
        for statement in statements {
            let error = sqlx::query(statement)
                .execute(&mut *connection)
                .await
                .expect_err(statement);
            assert!(
                error.to_string().contains("append-only"),
                "{role}: {statement}: {error}"
            );
        }
    }
    drop(connection);
    assert_eq!(ledger_count(&pool).await, 3);
    let (code, report, stderr) = run_verify(&db.url);
    assert_eq!(code, 0, "{report} {stderr}");
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_makes_the_months_ahead_and_an_append_far_past_them_makes_its_own() {
    let start = utc(2031, 5, 20, 8, 0, 0);
    let app = TestApp::spawn_with(|config| config.ledger_clock = Clock::starting_at(start)).await;
    let made = months(&app.pool).await;
    for month in [
        "ledger_y2031m05",
        "ledger_y2031m06",
        "ledger_y2031m07",
        "ledger_y2031m08",
    ] {
        assert!(made.iter().any(|m| m == month), "{month} in {made:?}");
    }
    assert!(!made.iter().any(|m| m == "ledger_y2031m09"), "{made:?}");
    let (status, _) = app
        .post_events(&serde_json::json!({"events": valid_events(2)}))
        .await;
    assert_eq!(status, 200);

    // An appender whose clock is years past every month made: its append still succeeds.
    append_at(&app.pool, utc(2035, 2, 3, 4, 5, 6), 2).await;
    let rows = months_of_rows(&app.pool).await;
    let last: Vec<&str> = rows[2..].iter().map(|(month, _)| month.as_str()).collect();
    assert_eq!(last, ["ledger_y2035m02", "ledger_y2035m02"]);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn making_months_refuses_a_range_past_600_months_and_makes_none_of_it() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let before = months(&pool).await;
    let from = utc(2040, 1, 1, 0, 0, 0);
    let error = tally::ledger::partitions::ensure(&pool, from, from + Duration::days(601 * 31))
        .await
        .expect_err("past the limit");
    assert!(error.to_string().contains("600 months"), "{error}");
    assert_eq!(months(&pool).await, before);
    // Idempotent: making months that exist makes none.
    let made = tally::ledger::partitions::ensure(&pool, from, from + Duration::days(40))
        .await
        .unwrap();
    assert_eq!(made, 2);
    let made = tally::ledger::partitions::ensure(&pool, from, from + Duration::days(40))
        .await
        .unwrap();
    assert_eq!(made, 0);
    pool.close().await;
}

/// The migration that partitions the ledger, by its version.
const PARTITIONS_MIGRATION: i64 = 20261202002900;
/// Events in the unpartitioned ledger the migration converts.
const MIGRATED_EVENTS: usize = 100_000;

/// A chained ledger of `count` events written straight into the unpartitioned schema, one
/// minute apart in `recorded_at` from 2026-08-01 (so over three months).
async fn fill_unpartitioned(pool: &PgPool, count: usize) {
    let first = utc(2026, 8, 1, 0, 0, 0);
    let mut prev_hash = canonical::GENESIS_HASH;
    let mut position = 0_i64;
    while (position as usize) < count {
        let mut rows = Rows::default();
        for event in parse_events(&valid_events(1_000)) {
            position += 1;
            let data = event.data_json();
            let digest = canonical::content_digest(&event.record_fields(&data));
            let recorded_at = first + Duration::minutes(position);
            prev_hash = rows.push(&event, data, digest, position, recorded_at, &prev_hash);
        }
        rows.insert_into(pool, "ledger").await.unwrap();
    }
}

/// Every column of every row, in position order, as one digest.
async fn ledger_digest(pool: &PgPool) -> String {
    sqlx::query_scalar("SELECT md5(string_agg(l::text, '|' ORDER BY position)) FROM ledger l")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_partitions_a_ledger_of_100_000_events_without_changing_a_row() {
    let db = TestDb::new().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let every = sqlx::migrate!("./migrations");
    // Today's schema: every migration before the partitioning one. (`migrations` is
    // public for the macro's sake; sqlx marks it semver-exempt.)
    let before = sqlx::migrate::Migrator {
        migrations: Cow::Owned(
            every
                .migrations
                .iter()
                .filter(|m| m.version < PARTITIONS_MIGRATION)
                .cloned()
                .collect(),
        ),
        ..sqlx::migrate!("./migrations")
    };
    before.run(&pool).await.unwrap();
    fill_unpartitioned(&pool, MIGRATED_EVENTS).await;
    let digest = ledger_digest(&pool).await;

    every.run(&pool).await.unwrap();

    assert_eq!(ledger_digest(&pool).await, digest, "every row as it was");
    let per_month: Vec<(String, i64)> = sqlx::query_as(
        "SELECT tableoid::regclass::text, count(*) FROM ledger GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(
        per_month,
        [
            ("ledger_y2026m08".to_owned(), 44_639),
            ("ledger_y2026m09".to_owned(), 43_200),
            ("ledger_y2026m10".to_owned(), 12_161),
        ]
    );
    let ids: (i64, i64) =
        sqlx::query_as("SELECT count(*), count(*) FILTER (WHERE l.position IS NULL) FROM ledger_ids i LEFT JOIN ledger l USING (position, recorded_at, id)")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        ids,
        (MIGRATED_EVENTS as i64, 0),
        "one ids row per ledger row"
    );
    let (code, report, stderr) = run_verify(&db.url);
    assert_eq!(code, 0, "{report} {stderr}");
    assert_eq!(report["events_checked"], MIGRATED_EVENTS);

    // The appender continues the chain on the converted ledger.
    append_at(&pool, Utc::now(), 3).await;
    let (code, report, stderr) = run_verify(&db.url);
    assert_eq!(code, 0, "{report} {stderr}");
    assert_eq!(report["head_position"], MIGRATED_EVENTS + 3);
    pool.close().await;
}

/// Sequential scans so far of `ledger_ids` and of the months that hold rows (a scan of an
/// empty month ahead is its best plan).
async fn sequential_scans(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT coalesce(sum(seq_scan), 0)::bigint FROM pg_stat_user_tables \
         WHERE relname = 'ledger_ids' \
            OR (relname LIKE 'ledger\\_y%' AND n_live_tup > 0)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_appender_that_began_on_an_empty_ledger_appends_through_the_indexes_once_it_holds_a_hundred_thousand_events(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _committed, task) = Appender::start_dated(pool.clone(), LIMITS, Clock::system());
    // Its session's first calls plan every statement on tables the migrations analyzed
    // empty: more than the five after which Postgres would keep a generic plan.
    for _ in 0..10 {
        appender
            .append(parse_events(&valid_events(1)))
            .await
            .expect("a small append");
    }
    for _ in 0..100 {
        appender
            .append(parse_events(&valid_events(1_000)))
            .await
            .expect("a group of a thousand");
    }
    // (A group of a thousand ids is looked up with one scan of `ledger_ids`, which at this
    // size is the cheaper plan.) A session sends its statistics when it goes idle at
    // least a second after it last sent them; one more append after a pause sends those
    // of everything before it.
    let flushed = || async {
        tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
        appender
            .append(parse_events(&valid_events(1)))
            .await
            .expect("a single event");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        sequential_scans(&pool).await
    };
    let before = flushed().await;
    for _ in 0..20 {
        appender
            .append(parse_events(&valid_events(1)))
            .await
            .expect("a single event");
    }
    let after = flushed().await;
    drop(appender);
    task.await.unwrap();
    assert_eq!(
        after - before,
        0,
        "20 appends to a ledger of 100 010 events scanned ledger_ids or a month whole"
    );
}

/// Sequential and index scans of `ledger_ids` Postgres has counted, and the rows inserted
/// into it; each backend's counts reach the statistics within seconds of its commits.
async fn ids_table_scans(pool: &PgPool) -> (i64, i64, i64) {
    sqlx::query_as(
        "SELECT seq_scan, idx_scan, n_tup_ins FROM pg_stat_user_tables \
         WHERE relname = 'ledger_ids'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn the_duplicate_check_of_a_large_group_finds_its_ids_by_index_not_by_reading_the_ids_table_whole(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let now = Utc::now();
    // Large enough that the planner, told its size, would rather read the table whole
    // than look a thousand ids up one by one (a few milliseconds either way here, but the
    // whole read grows with the ledger).
    for _ in 0..20 {
        append_at(&pool, now, 1_000).await;
    }
    sqlx::query("ANALYZE ledger_ids")
        .execute(&pool)
        .await
        .unwrap();
    eventually(30, "the statistics count the rows", || async {
        ids_table_scans(&pool).await.2 == 20_000
    })
    .await;
    let (sequential_before, by_index_before, _) = ids_table_scans(&pool).await;
    append_at(&pool, now, 1_000).await;
    eventually(30, "the statistics count the group's rows", || async {
        ids_table_scans(&pool).await.2 == 21_000
    })
    .await;
    let (sequential, by_index, _) = ids_table_scans(&pool).await;
    assert_eq!(
        sequential, sequential_before,
        "the group's append read ledger_ids whole"
    );
    assert!(by_index > by_index_before, "{by_index} index scans");
}
