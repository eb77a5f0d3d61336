//! A known month of events for one org: the service's clock is in the middle of the next
//! month, so the month is finished and its figures no longer move.

use chrono::{DateTime, Duration, Utc};
use serde_json::{json, Value};
use uuid::Uuid;

use tally::event::canonical::timestamp;
use tally::runtime::Period;

use crate::helpers::{answered, mid_period, ok, projected_to_head, TestApp};

pub const ORG: &str = "org_console";
pub const OTHER_ORG: &str = "org_elsewhere";
/// Two intervals (one across midnight), three commands (exit 0, 1 and one while stopped),
/// a port, and three planted anomalies.
pub const ALPHA: &str = "ctr_alpha";
/// One interval across two midnights, a command that was killed (exit 137).
pub const BETA: &str = "ctr_beta";
/// Created three days before the month's end and still running.
pub const GAMMA: &str = "ctr_gamma";
/// The plan: 10 hours included, overage billed at 0.125 USD an hour.
pub const PLAN: &str = "team";

/// What was planted on [`ALPHA`], for the container page's counts.
pub const ALPHA_INTERVALS: usize = 2;
pub const ALPHA_COMMANDS: usize = 3;
pub const ALPHA_ANOMALIES: usize = 3;
pub const ALPHA_PORTS: usize = 1;

/// A service whose clock stands at the middle of last month, and which takes events back
/// to the start of the month before (the month the tests read).
pub async fn service() -> TestApp {
    TestApp::spawn_with(|config| {
        config.clock = tally::clock::Clock::starting_at(mid_period());
        config.backdate_days = 62;
    })
    .await
}

/// The finished month the tests read: the one before the service's clock's month.
pub fn period() -> Period {
    Period::containing(Period::containing(mid_period()).start() - Duration::days(1))
}

pub fn period_text() -> String {
    period().start().format("%Y-%m").to_string()
}

/// `day` (1-based) of the month at `hour`:`minute` UTC.
fn at(day: i64, hour: i64, minute: i64) -> DateTime<Utc> {
    period().start() + Duration::days(day - 1) + Duration::hours(hour) + Duration::minutes(minute)
}

fn event(kind: &str, container: Option<&str>, when: DateTime<Utc>, data: Value) -> Value {
    let mut event = json!({
        "id": Uuid::new_v4(), "type": kind, "org_id": ORG,
        "occurred_at": timestamp(when),
    });
    if let Some(container) = container {
        event["container_id"] = json!(container);
    }
    if !data.is_null() {
        event["data"] = data;
    }
    event
}

fn command(container: &str, when: DateTime<Utc>, id: &str, exit: i64, ms: i64) -> Value {
    event(
        "container.command_ran",
        Some(container),
        when,
        json!({"command_id": id, "exit_code": exit, "duration_ms": ms}),
    )
}

/// The month's events, in time order.
pub fn events() -> Vec<Value> {
    let lifecycle =
        |kind: &str, container: &str, when| event(kind, Some(container), when, Value::Null);
    vec![
        event("org.plan_changed", None, at(1, 0, 0), json!({"plan": PLAN})),
        event(
            "org.verification_changed",
            None,
            at(1, 0, 1),
            json!({"verified": true}),
        ),
        event(
            "org.billing_eligibility_changed",
            None,
            at(1, 0, 2),
            json!({"eligible": true}),
        ),
        // ALPHA: 22:00 on the 3rd to 02:00 on the 4th (across midnight), then the 10th
        // 10:00-18:00; a second stop, a command while stopped, a resume while running.
        event(
            "container.created",
            Some(ALPHA),
            at(3, 22, 0),
            json!({"name": "alpha", "image": "python:3.12"}),
        ),
        command(ALPHA, at(3, 23, 0), "a-1", 0, 1200),
        command(ALPHA, at(4, 0, 30), "a-2", 1, 300),
        lifecycle("container.stopped", ALPHA, at(4, 2, 0)),
        lifecycle("container.stopped", ALPHA, at(5, 9, 0)),
        command(ALPHA, at(6, 12, 0), "a-3", 0, 50),
        lifecycle("container.resumed", ALPHA, at(10, 10, 0)),
        event(
            "container.port_published",
            Some(ALPHA),
            at(10, 10, 5),
            json!({"port": 8080, "url": "https://alpha.example.com/"}),
        ),
        lifecycle("container.resumed", ALPHA, at(10, 12, 0)),
        lifecycle("container.stopped", ALPHA, at(10, 18, 0)),
        // BETA: 20:00 on the 15th to 04:00 on the 17th.
        event(
            "container.created",
            Some(BETA),
            at(15, 20, 0),
            json!({"name": "beta", "image": "node:22"}),
        ),
        command(BETA, at(16, 8, 0), "b-1", 137, 90_000),
        lifecycle("container.stopped", BETA, at(17, 4, 0)),
        // GAMMA: from 23:30 three days before the month's last day, still running.
        event(
            "container.created",
            Some(GAMMA),
            period().end() - Duration::days(3) - Duration::minutes(30),
            json!({"name": "gamma", "image": "rust:1"}),
        ),
    ]
}

/// Loads the plan and the month into `app` and waits until they are projected.
pub async fn load(app: &TestApp) {
    let plan = json!({
        "sandbox_runtime": true, "included_runtime_seconds": 36_000, "overage": "bill",
        "overage_price_per_hour": "0.125", "currency": "USD",
        "max_running_containers": 50, "max_published_ports": 10,
    });
    let (status, body) = app.put_plan(PLAN, &plan).await;
    assert!(status == 200 || status == 201, "{status} {body}");
    ok(app.post_events(&json!({ "events": events() })).await);
    // Another org, for the org-bound token to be refused.
    let other = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": OTHER_ORG,
        "container_id": "ctr_other", "occurred_at": timestamp(at(2, 9, 0))});
    ok(app.post_events(&json!({ "events": [other] })).await);
    projected_to_head(&app.pool, "the month is projected").await;
}

/// The API's usage of [`ORG`] for the month, per day.
pub async fn usage(app: &TestApp) -> Value {
    ok(app
        .get_usage(ORG, &format!("period={}&window=day", period_text()))
        .await)
}

/// A token with `scopes`, bound to `org` when given; returns its secret.
pub async fn token(app: &TestApp, scopes: &[&str], org: Option<&str>) -> String {
    let mut body = json!({ "scopes": scopes });
    if let Some(org) = org {
        body["org_id"] = json!(org);
    }
    let created = answered(201, app.post_token(&body).await);
    created["token"]
        .as_str()
        .unwrap_or_else(|| panic!("a token secret in {created}"))
        .to_owned()
}
