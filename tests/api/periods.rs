//! Period close: figures frozen in a hashed snapshot, which is the closed period's export;
//! a late event leaves it untouched and shows as an adjustment in the next open period's
//! export.

use chrono::Duration;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tally::finance::pricing::USAGE_CSV_HEADER;
use tally::runtime::Period;
use uuid::Uuid;

use crate::helpers::{projected_to_head, TestApp};

#[tokio::test]
async fn an_adjustment_names_the_late_start_dated_before_its_period_that_runs_into_it() {
    let app = TestApp::spawn_mid_period().await;
    let current = Period::containing(app.now());
    let closed = Period::containing(current.start() - Duration::days(1));
    let event = |kind: &str, container: &str, at: chrono::DateTime<chrono::Utc>| {
        json!({"id": Uuid::new_v4(), "type": kind, "org_id": "acme", "container_id": container,
               "occurred_at": tally::event::canonical::timestamp(at)})
    };
    let inside = json!({"events": [
        event("container.created", "c1", closed.end() - Duration::hours(5)),
        event("container.stopped", "c1", closed.end() - Duration::hours(2)),
    ]});
    assert_eq!(app.post_events(&inside).await.0, 200);
    projected_to_head(&app.pool, "the events are projected").await;
    let (status, _, job) = app.close_period(&closed.to_string()).await;
    assert_eq!(status, 202, "{job}");
    loop {
        let (_, job) = app.get_close(&closed.to_string()).await;
        if job["status"] != "running" {
            assert_eq!(job["status"], "done", "{job}");
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    // Past the producers' bound, so added by a correction: a start a day before the
    // closed period, a stop an hour into it.
    let start = event(
        "container.created",
        "c3",
        closed.start() - Duration::days(1),
    );
    let stop = event(
        "container.stopped",
        "c3",
        closed.start() + Duration::hours(1),
    );
    let (status, added) = app
        .post_corrections(&json!({"events": [start, stop], "reason": "provider confirms"}))
        .await;
    assert_eq!(status, 201, "{added}");
    projected_to_head(&app.pool, "the correction is projected").await;
    let (_, exported) = app
        .get_usage_export(&format!("period={current}&format=json"))
        .await;
    let exported: Value = serde_json::from_str(&exported).unwrap();
    let adjustment = &exported["adjustments"][0];
    assert_eq!(adjustment["runtime_ms"], 3_600_000, "{exported}");
    assert_eq!(
        adjustment["caused_by"],
        json!([start["id"], stop["id"]]),
        "the start dated before the period is a cause too: {exported}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_closed_period_stays_frozen_and_a_late_event_becomes_an_adjustment_next_period() {
    let app = TestApp::spawn_mid_period().await;
    let current = tally::runtime::Period::containing(app.now());
    let closed = tally::runtime::Period::containing(current.start() - Duration::days(1));
    let at = |hours_before_end: i64| {
        tally::event::canonical::timestamp(closed.end() - Duration::hours(hours_before_end))
    };
    let run = |container: &str, from: i64, to: i64| {
        json!({"events": [
            {"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme", "container_id": container, "occurred_at": at(from)},
            {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme", "container_id": container, "occurred_at": at(to)},
        ]})
    };
    assert_eq!(app.post_events(&run("c1", 5, 2)).await.0, 200);
    projected_to_head(&app.pool, "the events are projected").await;

    let closed_name = closed.to_string();
    // A close is a job: accepted, then done with the closed period.
    let (status, _, job) = app.close_period(&closed_name).await;
    assert_eq!(status, 202, "{job}");
    let snapshot = loop {
        let (_, job) = app.get_close(&closed_name).await;
        if job["status"] != "running" {
            assert_eq!(job["status"], "done", "{job}");
            break job["closed"].clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(
        (snapshot["orgs"].clone(), snapshot["verified"].clone()),
        (json!(1), json!(true))
    );
    let (status, _, again) = app.close_period(&closed_name).await;
    assert_eq!(
        (status, again["status"].as_str(), &again["closed"]["sha256"]),
        (200, Some("done"), &snapshot["sha256"])
    );
    let (status, _, running) = app.close_period(&current.to_string()).await;
    assert_eq!(
        (status, running["error"]["code"].as_str()),
        (409, Some("period_running"))
    );
    // Year 0000 holds no event: a close of it would be a typo kept for ever.
    let (status, _, typo) = app.close_period("0000-01").await;
    assert_eq!(
        (status, typo["error"]["code"].as_str()),
        (422, Some("invalid_period")),
        "{typo}"
    );

    // Late: another two hours in the closed period.
    let late = run("c2", 3, 1);
    assert_eq!(app.post_events(&late).await.0, 200);
    projected_to_head(&app.pool, "the events are projected").await;

    let (_, stored) = app.get_period(&closed_name).await;
    assert_eq!(
        stored["sha256"], snapshot["sha256"],
        "the snapshot is untouched"
    );
    assert_eq!(stored["verified"], true, "and still verifies");
    let frozen: i64 =
        sqlx::query_scalar("SELECT runtime_ms FROM period_snapshot WHERE org_id = 'acme'")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(frozen, 3 * 3_600_000);
    assert!(sqlx::query("UPDATE period_snapshot SET runtime_ms = 0")
        .execute(&app.pool)
        .await
        .is_err());

    let (_, csv) = app.get_usage_export(&format!("period={current}")).await;
    let adjustment = format!("acme,free,{closed},7200000,0,7200000,0.00,USD,0,0");
    assert!(csv.lines().any(|line| line == adjustment), "{csv}");
    let (_, exported) = app
        .get_usage_export(&format!("period={current}&format=json"))
        .await;
    let exported: Value = serde_json::from_str(&exported).unwrap();
    let caused_by = exported["adjustments"][0]["caused_by"].as_array().unwrap();
    let late_ids: Vec<&Value> = late["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| &event["id"])
        .collect();
    assert_eq!(caused_by.iter().collect::<Vec<_>>(), late_ids);
    // The closed period's own export is its snapshot, byte for byte the bytes its hash
    // covers, at the position it was closed at: the late hours are in the adjustment
    // above only, never in both.
    let (status, closed_csv) = app.get_usage_export(&format!("period={closed}")).await;
    assert_eq!(status, 200, "{closed_csv}");
    assert_eq!(
        closed_csv,
        format!("{USAGE_CSV_HEADER}\nacme,free,{closed},10800000,0,10800000,0.00,USD,0,0\n")
    );
    assert_eq!(
        json!(hex::encode(Sha256::digest(closed_csv.as_bytes()))),
        snapshot["sha256"]
    );
    // Its consistency parameters have nothing to wait for, but are checked: no event was
    // acknowledged past the head.
    let (status, past) = app
        .get_usage_export(&format!("period={closed}&min_position=99999"))
        .await;
    assert_eq!(status, 422, "{past}");
    assert!(past.contains("invalid_min_position"), "{past}");
    let (_, closed_json) = app
        .get_usage_export(&format!("period={closed}&format=json"))
        .await;
    let closed_json: Value = serde_json::from_str(&closed_json).unwrap();
    assert_eq!(closed_json["position"], snapshot["position"]);
    assert_eq!(closed_json["rows"][0]["runtime_ms"], 3 * 3_600_000);
    assert_eq!(closed_json["adjustments"], json!([]));
    // A token bound to an org reads its own row of the snapshot, and nothing of others'.
    for (org, rows) in [("acme", 1), ("other", 0)] {
        let token = app
            .post_token(&json!({"scopes": ["finance"], "org_id": org}))
            .await;
        let token = token.1["token"].as_str().unwrap().to_owned();
        let (status, bound_csv) = app
            .with_token(&token)
            .get_usage_export(&format!("period={closed}"))
            .await;
        assert_eq!(status, 200, "{bound_csv}");
        let expected: Vec<&str> = closed_csv.lines().take(1 + rows).collect();
        assert_eq!(bound_csv.lines().collect::<Vec<_>>(), expected, "{org}");
    }
    // Nothing to wait for: with the projection held behind an acknowledged event, the
    // closed period is answered at once, frozen (a period still open would wait, then be
    // 503 projection_lagging).
    let mut hold = app.pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM proj.checkpoint FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    assert_eq!(app.post_events(&run("c3", 4, 3)).await.0, 200);
    let (status, held) = app.get_usage_export(&format!("period={closed}")).await;
    assert_eq!((status, &held), (200, &closed_csv));
    hold.rollback().await.unwrap();
    assert_eq!(app.get_period("2026-13").await.0, 422);
    assert_eq!(app.get_period(&current.to_string()).await.0, 404);
    app.stop().await;
}

#[tokio::test]
async fn a_close_of_year_0000_stored_before_periods_began_at_0001_is_still_read() {
    let app = TestApp::spawn().await;
    sqlx::query(
        "INSERT INTO period_close (period, closed_at, closed_by, ledger_position, orgs, sha256) \
         VALUES ('0000-01', now(), 'test', 0, 0, sha256(''::BYTEA))",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let (status, listed) = app.get_json("/v1/periods").await;
    assert_eq!(status, 200, "{listed}");
    let current = Period::containing(app.now());
    let (status, csv) = app.get_usage_export(&format!("period={current}")).await;
    assert_eq!(status, 200, "{csv}");
    app.stop().await;
}
