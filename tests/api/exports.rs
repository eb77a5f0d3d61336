//! The usage export: one row per org, priced with its plan, overage rounded
//! half-up to the currency's minor unit; the CLI prints the same.

use chrono::{Duration, DurationRound};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::helpers::{projected_to_head, run_tally, run_tally_exit, TestApp};

#[tokio::test]
async fn the_usage_export_prices_each_orgs_overage_with_its_plan() {
    // Mid-period, so that the history of the last four hours is all this period's.
    let app = TestApp::spawn_mid_period().await;
    let now = app.now().duration_trunc(Duration::minutes(1)).unwrap();
    let period = tally::runtime::Period::containing(now);
    let plan = json!({
        "sandbox_runtime": true, "included_runtime_seconds": 3600, "overage": "bill",
        "overage_price_per_hour": "0.125", "currency": "USD",
        "max_running_containers": 5, "max_published_ports": 5,
    });
    assert_eq!(app.put_plan("pro", &plan).await.0, 201);
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let before_period = tally::event::canonical::timestamp(period.start() - Duration::days(1));
    let events = json!({"events": [
        {"id": Uuid::new_v4(), "type": "org.plan_changed", "org_id": "paid", "occurred_at": before_period, "data": {"plan": "pro"}},
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": "paid", "container_id": "p1", "occurred_at": at(4)},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "paid", "container_id": "p1", "occurred_at": at(1)},
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": "thrifty", "container_id": "t1", "occurred_at": at(3)},
        {"id": Uuid::new_v4(), "type": "container.command_ran", "org_id": "thrifty", "container_id": "t1", "occurred_at": at(3),
         "data": {"command_id": "c", "exit_code": 0, "duration_ms": 5}},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "thrifty", "container_id": "t1", "occurred_at": at(2)},
    ]});
    let (status, response) = app.post_events(&events).await;
    assert_eq!(status, 200, "{response}");
    projected_to_head(&app.pool, "the events are projected").await;

    let (_, csv) = app.get_usage_export(&format!("period={period}")).await;
    let expected = format!(
        "org_id,plan,period,runtime_ms,included_ms,overage_ms,overage_amount,currency,commands,ports_published\n\
         paid,pro,{period},10800000,3600000,7200000,0.25,USD,0,0\n\
         thrifty,free,{period},3600000,0,3600000,0.00,USD,1,0\n"
    );
    assert_eq!(csv, expected);
    let (_, json_rows) = app
        .get_usage_export(&format!("period={period}&format=json"))
        .await;
    let json_rows: Value = serde_json::from_str(&json_rows).unwrap();
    assert_eq!(json_rows["rows"][0]["overage_amount"], "0.25");
    assert_eq!(json_rows["rows"].as_array().unwrap().len(), 2);

    let (ok, stdout, stderr) = run_tally(
        &app.db.url,
        &["export", "usage", "--period", &period.to_string()],
    );
    assert!(ok, "{stderr}");
    assert_eq!(stdout, expected);

    let (bad, _) = app.get_usage_export("period=2026-13").await;
    assert_eq!(bad, 422);

    // A period still to come has no usage: refused, where it listed every org with a
    // container running into it, with zeros.
    let running = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "running",
                         "container_id": "r1", "occurred_at": at(1)});
    assert_eq!(app.post_events(&running).await.0, 200);
    projected_to_head(&app.pool, "the running container is projected").await;
    let (status, refused) = app
        .get_usage_export(&format!("period={}", period.next()))
        .await;
    let refused: Value = serde_json::from_str(&refused).unwrap();
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (422, Some("invalid_period")),
        "{refused}"
    );
    // The command line reads the system clock.
    let next = tally::runtime::Period::containing(chrono::Utc::now()).next();
    for (args, why) in [
        (["--period", &next.to_string()], "has not begun"),
        (["--period", "2026-13"], "--period \"2026-13\""),
    ] {
        let (code, stdout, stderr) =
            run_tally_exit(&app.db.url, &[&["export", "usage"][..], &args[..]].concat());
        assert_eq!(code, Some(1), "a caller's mistake: {stderr}");
        assert!(stderr.contains(why), "{stderr}");
        assert!(stdout.is_empty(), "{stdout}");
    }
    app.stop().await;
}

#[tokio::test]
async fn an_org_whose_usage_later_events_take_back_entirely_is_not_listed_as_replay_would_not_list_it(
) {
    let app = TestApp::spawn_mid_period().await;
    let now = app.now().duration_trunc(Duration::seconds(1)).unwrap();
    let period = tally::runtime::Period::containing(now);
    let at =
        |seconds_ago: i64| tally::event::canonical::timestamp(now - Duration::seconds(seconds_ago));
    let event = |kind: &str, org: &str, seconds_ago: i64| {
        json!({"id": Uuid::new_v4(), "type": kind, "org_id": org, "container_id": "k",
               "occurred_at": at(seconds_ago)})
    };
    let mut voided_command = event("container.command_ran", "voided", 7_000);
    voided_command["data"] = json!({"command_id": "c", "exit_code": 0, "duration_ms": 5});
    let first = json!({"events": [
        event("container.created", "late_stop", 7_200),
        event("container.stopped", "late_stop", 3_600),
        voided_command.clone(),
    ]});
    assert_eq!(app.post_events(&first).await.0, 200);
    projected_to_head(&app.pool, "the first round").await;
    // In later rounds: a stop at the very instant of the start leaves an interval of no
    // length; a void takes the only command back.
    let late = event("container.stopped", "late_stop", 7_200);
    assert_eq!(app.post_events(&late).await.0, 200);
    let (status, voided) = app
        .post_void(&json!({"event_id": voided_command["id"], "reason": "sent twice"}))
        .await;
    assert_eq!(status, 201, "{voided}");
    projected_to_head(&app.pool, "the later rounds").await;
    let listed = || async {
        let (status, csv) = app.get_usage_export(&format!("period={period}")).await;
        assert_eq!(status, 200, "{csv}");
        csv.lines()
            .skip(1)
            .map(|line| line.split(',').next().unwrap().to_owned())
            .collect::<Vec<_>>()
    };
    assert_eq!(listed().await, Vec::<String>::new(), "no usage, no row");
    let (replayed, _, stderr) = run_tally(&app.db.url, &["replay"]);
    assert!(replayed, "{stderr}");
    assert_eq!(listed().await, Vec::<String>::new(), "as after a replay");
    app.stop().await;
}
