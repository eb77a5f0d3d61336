//! `tally verify` and `GET /v1/ledger/verify` find tampering and name the position.

use serde_json::json;

use crate::helpers::*;

/// Alters the ledger the only way possible: as a superuser with the guards switched off.
async fn tamper(pool: &sqlx::PgPool, statement: &str) {
    sqlx::raw_sql(&format!(
        "ALTER TABLE ledger DISABLE TRIGGER ALL;
         {statement};
         ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_update_or_delete;
         ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_truncate;
         ALTER TABLE ledger ENABLE TRIGGER ledger_record_ids;"
    ))
    .execute(pool)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_exits_one_and_names_the_position_of_an_altered_row() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(10)}))
            .await
            .0,
        200
    );

    let (code, report, _) = run_verify(&app.db.url);
    assert_eq!(code, 0, "{report}");
    assert_eq!(report["ok"], true);
    assert_eq!(report["events_checked"], 10);
    assert_eq!(report["head_position"], 10);

    tamper(
        &app.pool,
        "UPDATE ledger SET data = '{\"name\": \"forged\"}' WHERE position = 4",
    )
    .await;
    let (code, report, stderr) = run_verify(&app.db.url);
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["ok"], false);
    assert_eq!(report["first_bad_position"], 4);
    assert!(stderr.contains("position 4"), "{stderr}");

    // Row 4 is behind the checkpoint the intact pass above stored: the full pass finds it.
    let (_, http) = app.verify("full=true").await;
    assert_eq!(http["first_bad_position"], 4);
    assert_eq!(http["ok"], false);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_detects_a_deleted_row_and_a_changed_timestamp() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(6)})).await.0,
        200
    );
    tamper(
        &app.pool,
        "UPDATE ledger SET recorded_at = recorded_at + interval '1 ms' WHERE position = 6",
    )
    .await;
    let (code, report, _) = run_verify(&app.db.url);
    assert_eq!((code, report["first_bad_position"].clone()), (1, json!(6)));

    tamper(&app.pool, "DELETE FROM ledger WHERE position = 3").await;
    let (code, report, _) = run_verify(&app.db.url);
    assert_eq!(
        (code, report["first_bad_position"].clone()),
        (1, json!(4)),
        "{report}"
    );
    app.stop().await;
}

#[tokio::test]
async fn incremental_verification_checks_only_new_rows_and_the_full_pass_finds_older_tampering() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(10)}))
            .await
            .0,
        200
    );
    let first = ok(app.verify("").await);
    assert_eq!(
        (first["ok"].clone(), first["events_checked"].clone()),
        (json!(true), json!(10))
    );
    assert_eq!(
        app.post_events(&json!({"events": valid_events(5)})).await.0,
        200
    );
    let second = ok(app.verify("").await);
    assert_eq!(second["from_position"], 10, "{second}");
    assert_eq!(
        second["events_checked"], 5,
        "only the rows after the checkpoint"
    );
    assert_eq!(second["head_position"], 15);

    // Tampering behind the checkpoint: the incremental pass cannot see it, the full pass
    // names it; tampering with the checkpoint row itself is caught by either.
    tamper(
        &app.pool,
        "UPDATE ledger SET data = '{\"name\": \"forged\"}' WHERE position = 3",
    )
    .await;
    assert_eq!(ok(app.verify("").await)["ok"], true);
    let full = ok(app.verify("full=true").await);
    assert_eq!(
        (full["ok"].clone(), full["first_bad_position"].clone()),
        (json!(false), json!(3))
    );
    tamper(
        &app.pool,
        "UPDATE ledger SET hash = decode(repeat('ab', 32), 'hex') WHERE position = 15",
    )
    .await;
    let incremental = ok(app.verify("").await);
    assert_eq!(incremental["first_bad_position"], 15, "{incremental}");

    assert_eq!(app.verify("full=yes").await.0, 422);
    app.stop().await;
}
