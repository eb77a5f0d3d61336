//! Reconciliations run as jobs: one that outlasts half the request's deadline answers 202
//! and is read done later with the figures a quick one answers; one whose process stops
//! reads as failed and leaves nothing; past four running on an instance, a fifth is refused
//! and changes nothing.

use chrono::{Duration, DurationRound, Utc};
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::helpers::{answered, ok, projected_to_head, TestApp};

/// A request deadline whose half, the longest a reconciliation is waited for, is short
/// (and still long enough for the quick runs of a busy machine).
const REQUEST_TIMEOUT_MS: u64 = 3_000;

async fn spawn() -> TestApp {
    TestApp::spawn_with(|config| config.request_timeout_ms = REQUEST_TIMEOUT_MS).await
}

/// A stored report of one matched line and one the ledger does not know; its id.
async fn report(app: &TestApp) -> Value {
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let events = json!({"events": [
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme", "container_id": "c_1", "occurred_at": at(5)},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme", "container_id": "c_1", "occurred_at": at(3)},
    ]});
    ok(app.post_events(&events).await);
    projected_to_head(&app.pool, "the events are projected").await;
    let (start, end) = (at(6), at(2));
    let csv = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory\n\
         {start},{end},c_1,7200,Seconds,1.44,USD,\"{{\"\"org_id\"\":\"\"acme\"\"}}\",Usage\n\
         {start},{end},c_ghost,60,Seconds,0.01,USD,\"{{\"\"org_id\"\":\"\"acme\"\"}}\",Usage"
    );
    answered(201, app.post_report(csv).await)["report_id"].clone()
}

/// A session that keeps every reconciliation from being stored (reads go on) until it is
/// let go.
async fn hold_stores(app: &TestApp) -> PgConnection {
    let mut connection = PgConnection::connect(&app.db.url).await.unwrap();
    sqlx::query("BEGIN").execute(&mut connection).await.unwrap();
    sqlx::query("LOCK TABLE reconciliation IN EXCLUSIVE MODE")
        .execute(&mut connection)
        .await
        .unwrap();
    connection
}

async fn let_go(mut connection: PgConnection) {
    sqlx::query("ROLLBACK")
        .execute(&mut connection)
        .await
        .unwrap();
    connection.close().await.unwrap();
}

/// POST /v1/reconciliations: status, `Location`, `Retry-After`, body.
async fn post(app: &TestApp, body: &Value) -> (u16, Option<String>, Option<String>, Value) {
    let reply = app
        .send(Method::POST, "/v1/reconciliations", Some(body))
        .await;
    (
        reply.status,
        reply.header("location"),
        reply.header("retry-after"),
        reply.json(),
    )
}

/// The reconciliation at `location` once its job has ended (bounded: 30 s).
async fn ended(app: &TestApp, location: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let state = ok(app.get_json(location).await);
        if state["status"] != "running" {
            return state;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running: {state}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The value of `series` in the service's /metrics.
async fn metric(app: &TestApp, series: &str) -> f64 {
    let text = app.without_token().get("/metrics").await.text;
    let prefix = format!("{series} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {series} in /metrics"))
}

async fn stored(app: &TestApp, id: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM reconciliation WHERE id = $1::UUID")
        .bind(id)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_reconciliation_that_outlasts_half_the_request_deadline_answers_202_and_is_read_done_later(
) {
    let app = spawn().await;
    let report_id = report(&app).await;
    let asked = json!({"report_id": report_id, "tolerance_ms": 1000});

    let held = hold_stores(&app).await;
    let (status, location, retry_after, job) = post(&app, &asked).await;
    assert_eq!(status, 202, "{job}");
    let id = job["reconciliation_id"].as_str().unwrap().to_owned();
    assert_eq!(
        location.as_deref(),
        Some(format!("/v1/reconciliations/{id}").as_str())
    );
    assert_eq!(retry_after.as_deref(), Some("2"));
    assert_eq!(
        (
            &job["status"],
            &job["report_id"],
            &job["tolerance_ms"],
            &job["tolerance_ratio"]
        ),
        (&json!("running"), &report_id, &json!(1000), &json!("0.005")),
        "{job}"
    );
    assert_eq!(job["finished_at"], Value::Null);
    let location = location.unwrap();
    let running = ok(app.get_json(&location).await);
    assert_eq!(running["status"], "running", "{running}");
    assert!(
        running.get("counts").is_none(),
        "no figures before they are stored: {running}"
    );
    for lines in [format!("{location}/lines.csv"), format!("{location}/lines")] {
        let (status, refusal) = app.get_json(&lines).await;
        assert_eq!(
            (status, refusal["error"]["code"].as_str()),
            (409, Some("reconciliation_running")),
            "{lines}: {refusal}"
        );
    }
    let (_, listed) = app.get_json("/v1/reconciliations").await;
    assert_eq!(
        listed["reconciliations"],
        json!([]),
        "the list holds stored ones only"
    );

    let_go(held).await;
    let done = ended(&app, &location).await;
    assert_eq!(
        (&done["status"], &done["reconciliation_id"], &done["lines"]),
        (&json!("done"), &json!(id), &json!(2)),
        "{done}"
    );
    // The same request answered within the wait: the same figures, stored apart.
    let (status, _, _, quick) = post(&app, &asked).await;
    assert_eq!(status, 201, "{quick}");
    assert_ne!(quick["reconciliation_id"], done["reconciliation_id"]);
    assert_eq!(
        (&done["counts"], &done["totals"], &done["position"]),
        (&quick["counts"], &quick["totals"], &quick["position"])
    );
    assert_eq!(done["counts"]["matched"], 1);
    assert_eq!(done["counts"]["missing_in_ledger"], 1);
    let (status, csv) = app.get_lines(&id).await;
    assert_eq!((status, csv.lines().count()), (200, 3), "{csv}");
    app.stop().await;
}

#[tokio::test]
async fn a_reconciliation_whose_process_stops_reads_as_failed_and_nothing_of_it_is_stored() {
    let app = spawn().await;
    let report_id = report(&app).await;
    let held = hold_stores(&app).await;
    let (status, location, _, job) = post(&app, &json!({"report_id": report_id})).await;
    assert_eq!(status, 202, "{job}");
    let (location, id) = (
        location.unwrap(),
        job["reconciliation_id"].as_str().unwrap(),
    );

    // The session running it ends as a crashed process's would.
    let ended_sessions: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' \
           AND granted AND classid::BIGINT = x'7265636f'::BIGINT AND objsubid = 2 \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        ended_sessions,
        [true],
        "one session runs the reconciliation"
    );
    let failed = ended(&app, &location).await;
    assert_eq!(
        (failed["status"].as_str(), failed["error"]["code"].as_str()),
        (Some("failed"), Some("reconciliation_abandoned")),
        "{failed}"
    );
    let_go(held).await;
    assert_eq!(stored(&app, id).await, 0, "nothing of it is stored");
    let lines: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM reconciliation_line WHERE reconciliation_id = $1::UUID",
    )
    .bind(id)
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(lines, 0);
    let (status, refusal) = app.get_json(&format!("{location}/lines")).await;
    assert_eq!(status, 404, "{refusal}");
    let message = refusal["error"]["message"].as_str().unwrap();
    assert!(message.contains("reconciliation_abandoned"), "{message}");

    let (status, _, _, again) = post(&app, &json!({"report_id": report_id})).await;
    assert_eq!(status, 201, "asked again, it runs: {again}");
    app.stop().await;
}

#[tokio::test]
async fn past_four_running_reconciliations_a_fifth_is_refused_with_retry_after_and_changes_nothing()
{
    let app = spawn().await;
    let report_id = report(&app).await;
    let asked = json!({"report_id": report_id});
    let held = hold_stores(&app).await;
    let mut locations = Vec::new();
    for _ in 0..4 {
        let (status, location, _, job) = post(&app, &asked).await;
        assert_eq!(status, 202, "{job}");
        locations.push(location.unwrap());
    }
    // The recorder is the test process's: other tests count too, so counts must grow.
    let running = metric(&app, "tally_reconciliations_running").await;
    assert!(running >= 4.0, "{running} running");
    let refused = "tally_reconciliations_total{outcome=\"refused\"}";
    let refused_before = metric(&app, refused).await;
    let (status, _, retry_after, refusal) = post(&app, &asked).await;
    assert_eq!(
        (
            status,
            refusal["error"]["code"].as_str(),
            retry_after.as_deref()
        ),
        (503, Some("reconciliations_busy"), Some("2")),
        "{refusal}"
    );
    let unknown = json!({"report_id": Uuid::new_v4()});
    let (status, _, _, refusal) = post(&app, &unknown).await;
    assert_eq!(
        (status, refusal["error"]["code"].as_str()),
        (404, Some("report_not_found")),
        "an unknown report is 404 whatever runs: {refusal}"
    );
    let refused_after = metric(&app, refused).await;
    assert!(
        refused_after > refused_before,
        "{refused_before} before, {refused_after} after"
    );
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM reconciliation_job")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 4, "the refused one left no job");

    let_go(held).await;
    for location in &locations {
        let done = ended(&app, location).await;
        assert_eq!(done["status"], "done", "{done}");
    }
    // A run's permit goes a moment after it is stored done.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, _, _, fifth) = post(&app, &asked).await;
        if status == 201 {
            break;
        }
        assert_eq!(fifth["error"]["code"], "reconciliations_busy", "{fifth}");
        assert!(std::time::Instant::now() < deadline, "{fifth}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    app.stop().await;
}

#[tokio::test]
async fn a_job_lock_is_seen_held_whatever_the_sign_of_its_key_and_only_while_held() {
    const CLASS: i32 = 0x7265_636f;
    let db = crate::helpers::TestDb::new().await;
    let mut reader = PgConnection::connect(&db.url).await.unwrap();
    for key in [-1, i32::MIN, 1, i32::MAX] {
        let mut holder = PgConnection::connect(&db.url).await.unwrap();
        sqlx::query("SELECT pg_advisory_lock($1, $2)")
            .bind(CLASS)
            .bind(key)
            .execute(&mut holder)
            .await
            .unwrap();
        assert!(
            tally::finance::jobs::lock_held(&mut reader, CLASS, key)
                .await
                .unwrap(),
            "{key} is held"
        );
        let other = key.wrapping_add(1);
        assert!(
            !tally::finance::jobs::lock_held(&mut reader, CLASS, other)
                .await
                .unwrap(),
            "{other} is not"
        );
        holder.close().await.unwrap();
        // The server lets the lock go as the closed session's backend exits.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while tally::finance::jobs::lock_held(&mut reader, CLASS, key)
            .await
            .unwrap()
        {
            assert!(std::time::Instant::now() < deadline, "{key} never let go");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
    reader.close().await.unwrap();
}
