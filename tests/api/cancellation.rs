//! Requests cut off midway (the request deadline, a client gone) leave the pool's
//! connections as they found them: no transaction left open on a pooled connection, no
//! session out of step with Postgres after an import cut off mid-copy.

use std::time::Duration;

use sqlx::postgres::PgPoolOptions;

use crate::helpers::{answered, TestApp, TestDb};

#[tokio::test]
async fn a_transaction_whose_caller_went_away_while_it_began_is_not_left_on_the_pooled_connection()
{
    let db = TestDb::new().await;
    // One connection, so that every begin and the checks below share it.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    // Seen from another session: the pool's connection is never idle inside a
    // transaction once its borrower is gone.
    let mut watcher = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
        .await
        .unwrap();
    let mut left_open = 0;
    for attempt in 0..100u64 {
        let cut = Duration::from_micros(attempt % 20 * 25);
        if attempt % 2 == 0 {
            let _ = tokio::time::timeout(cut, tally::ledger::db::begin(&pool)).await;
        } else {
            let _ = tokio::time::timeout(cut, tally::ledger::db::read_snapshot(&pool)).await;
        }
        // The connection back in the pool, whatever the cut begin left on it.
        let _: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&pool)
            .await
            .unwrap();
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state LIKE 'idle in transaction%'",
        )
        .fetch_one(&mut watcher)
        .await
        .unwrap();
        left_open += open;
    }
    assert_eq!(
        left_open, 0,
        "transactions left open on the pooled connection"
    );
    // And a read-only one left open would refuse the write.
    sqlx::query("CREATE TABLE written (n INT)")
        .execute(&pool)
        .await
        .expect("the pooled connection writes");
    pool.close().await;
}

#[tokio::test]
async fn an_import_cut_off_by_the_request_deadline_leaves_every_other_request_answered_right() {
    let app = TestApp::spawn_with(|config| {
        config.request_timeout_ms = 300;
        config.db_pool_max = 2;
    })
    .await;
    let header = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory";
    let line = |n: usize| {
        format!("2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c_{n},3600,Seconds,0.50,USD,Usage")
    };
    let small = format!("{header}\n{}", line(0));
    let stored = answered(201, app.post_report(small).await);

    for round in 0..3 {
        let big: String = std::iter::once(header.to_owned())
            .chain((0..60_000).map(|n| line(n + round * 100_000)))
            .collect::<Vec<_>>()
            .join("\n");
        let (status, answer) = app.post_report(big).await;
        assert_eq!(status, 503, "the import outlasts the deadline: {answer}");
        for _ in 0..20 {
            let (status, listed) = app.get_json("/v1/provider-reports").await;
            assert_eq!(status, 200, "{listed}");
            assert_eq!(
                listed["reports"][0]["report_id"], stored["report_id"],
                "{listed}"
            );
        }
    }
    let (status, again) = app.post_report(format!("{header}\n{}", line(1))).await;
    assert_eq!(status, 201, "{again}");
    let reports: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_report")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(reports, 2, "nothing of the cut imports is stored");
    app.stop().await;
}
