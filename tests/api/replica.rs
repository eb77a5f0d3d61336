//! Reads from a streaming replica (`TALLY_READ_DATABASE_URL`): audit pages, the usage
//! export and a reconciliation's lines read there and still include every acknowledged
//! write, wait while its replay is paused (503 `replica_lagging` past
//! `TALLY_READ_WAIT_MS`) and answer once it resumes; a read database that does not answer
//! fails only the reads sent to it.

use chrono::Duration;
use reqwest::Method;
use serde_json::{json, Value};
use tally::config::Config;
use tally::runtime::Period;
use tally::startup::Service;
use uuid::Uuid;

use crate::helpers::{mid_period_clock, Api, TestApp, TestNats, TOKEN};
use crate::pg_cluster::{free_port, ReplicatedCluster};

/// Long enough for a streaming replica to replay what was just committed (milliseconds),
/// short enough that the test's 503s come quickly.
const READ_WAIT_MS: u64 = 1_500;

/// Two lifecycle events of one container that ran two hours, ending an hour before `now`.
fn two_hours(org: &str, container: &str, now: chrono::DateTime<chrono::Utc>) -> Value {
    let at = |hours_ago| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    json!({"events": [
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": org, "container_id": container, "occurred_at": at(3)},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org, "container_id": container, "occurred_at": at(1)},
    ]})
}

/// Posts `events`; returns the highest position acknowledged and the ids.
async fn acknowledged(api: &Api, events: &Value) -> (i64, Vec<String>) {
    let (status, answer) = api.post_events(events).await;
    assert_eq!(status, 200, "{answer}");
    let results = answer["results"].as_array().unwrap();
    let position = results
        .iter()
        .map(|result| result["position"].as_i64().unwrap())
        .max()
        .unwrap();
    let ids = results
        .iter()
        .map(|result| result["id"].as_str().unwrap().to_owned())
        .collect();
    (position, ids)
}

fn page_ids(page: &Value) -> Vec<String> {
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["id"].as_str().unwrap().to_owned())
        .collect()
}

/// The usage export as JSON: its position and its rows by org.
async fn export(api: &Api, query: &str) -> (u16, Value) {
    let (status, text) = api.get_usage_export(query).await;
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

/// Reconciles a one-line provider report of container `a1`; returns the reconciliation's id.
async fn reconcile_a1(api: &Api, now: chrono::DateTime<chrono::Utc>) -> String {
    let at = |hours_ago| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let report = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory\n\
         {},{},a1,7200,Seconds,0.72,USD,\"{{\"\"org_id\"\":\"\"alpha\"\"}}\",Usage",
        at(3),
        at(1)
    );
    let (status, report) = api.post_report(report).await;
    assert_eq!(status, 201, "{report}");
    let (status, reconciliation) = api
        .post_reconciliation(&json!({"report_id": report["report_id"]}))
        .await;
    assert_eq!(status, 201, "{reconciliation}");
    reconciliation["reconciliation_id"]
        .as_str()
        .unwrap()
        .to_owned()
}

fn runtime_of(export: &Value, org: &str) -> Option<i64> {
    export["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|row| row["org_id"] == org)
        .map(|row| row["runtime_ms"].as_i64().unwrap())
}

#[tokio::test]
async fn audit_pages_and_exports_on_a_replica_hold_every_acknowledged_event_and_wait_while_its_replay_is_paused(
) {
    let cluster = ReplicatedCluster::start().await;
    let nats = TestNats::start();
    let mut config = Config::new(cluster.primary_url("tally"), &nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    config.clock = mid_period_clock();
    config.read_wait_ms = READ_WAIT_MS;
    config.read_database_url = Some(cluster.replica_url("tally"));
    let service = Service::start(config).await.expect("starting the service");
    let api = Api::new(reqwest::Client::new(), service.local_addr);
    let now = service.clock.now();
    let period = Period::containing(now);

    // Acknowledged on the primary, read at once from the replica: nothing missing.
    let (first, alpha_ids) = acknowledged(&api, &two_hours("alpha", "a1", now)).await;
    let (status, page) = api.get_events("org_id=alpha").await;
    assert_eq!(status, 200, "{page}");
    assert_eq!(page_ids(&page), alpha_ids);
    let (status, figures) = export(&api, &format!("period={period}&format=json")).await;
    assert_eq!(status, 200, "{figures}");
    assert!(figures["position"].as_i64().unwrap() >= first, "{figures}");
    assert_eq!(runtime_of(&figures, "alpha"), Some(7_200_000));

    // The replica receives the next writes but does not apply them: the events, and a
    // reconciliation stored on the primary.
    cluster.pause_replay().await;
    let (late, beta_ids) = acknowledged(&api, &two_hours("beta", "b1", now)).await;
    let reconciliation = reconcile_a1(&api, now).await;
    // Each waits out TALLY_READ_WAIT_MS: all at once.
    let lines_path = format!("/v1/reconciliations/{reconciliation}/lines.csv");
    let export_path =
        format!("/v1/exports/usage.csv?period={period}&format=json&min_position={late}");
    let (page, lines, figures) = tokio::join!(
        api.get("/v1/events?org_id=beta"),
        api.get(&lines_path),
        api.get(&export_path),
    );
    for (what, reply) in [("page", page), ("lines", lines), ("export", figures)] {
        let (status, retry_after, body) = reply.with_retry_after();
        assert_eq!(
            (
                status,
                retry_after.as_deref(),
                body["error"]["code"].as_str()
            ),
            (503, Some("1"), Some("replica_lagging")),
            "{what}: {body}"
        );
    }
    // `eventual` answers from the replica as it stands, and its position says so.
    let (status, stale) = export(
        &api,
        &format!("period={period}&format=json&consistency=eventual"),
    )
    .await;
    assert_eq!(status, 200, "{stale}");
    assert!(stale["position"].as_i64().unwrap() < late, "{stale}");
    assert_eq!(runtime_of(&stale, "beta"), None);

    // A page asked for while replay is paused answers once it resumes, with the events.
    let waiting = tokio::spawn({
        let api = api.clone();
        async move { api.get_events("org_id=beta").await }
    });
    cluster.resume_replay().await;
    let (status, page) = waiting.await.unwrap();
    assert_eq!(status, 200, "{page}");
    assert_eq!(page_ids(&page), beta_ids);
    let (status, figures) = export(
        &api,
        &format!("period={period}&format=json&min_position={late}"),
    )
    .await;
    assert_eq!(status, 200, "{figures}");
    assert!(figures["position"].as_i64().unwrap() >= late, "{figures}");
    assert_eq!(runtime_of(&figures, "beta"), Some(7_200_000));
    assert_eq!(runtime_of(&figures, "alpha"), Some(7_200_000));
    let (status, lines) = api.get_lines(&reconciliation).await;
    assert_eq!(status, 200, "{lines}");
    assert!(
        lines.lines().nth(1).unwrap().starts_with("alpha,a1,"),
        "{lines}"
    );
    service.stop().await;
}

#[tokio::test]
async fn a_read_database_that_does_not_answer_fails_only_the_reads_sent_to_it() {
    let nowhere = format!("postgres://postgres@127.0.0.1:{}/tally", free_port());
    let app = TestApp::spawn_with(|config| {
        config.read_database_url = Some(nowhere);
        config.clock = mid_period_clock();
        // How long a read waits for a connection before it is answered 503.
        config.db_acquire_timeout_ms = 300;
    })
    .await;
    let now = app.now();
    let period = Period::containing(now);
    let (position, _) = acknowledged(&app.api, &two_hours("alpha", "a1", now)).await;
    for path in [
        "/v1/events".to_string(),
        "/v1/containers/a1/events".to_string(),
        format!("/v1/exports/usage.csv?period={period}"),
    ] {
        let (status, retry_after, body) = app.get(&path).await.with_retry_after();
        assert_eq!(
            (
                status,
                retry_after.as_deref(),
                body["error"]["code"].as_str()
            ),
            (503, Some("1"), Some("read_database_unavailable")),
            "{path}: {body}"
        );
    }
    // Reads of the primary are served as ever.
    let (status, usage) = app.get_usage("alpha", &format!("period={period}")).await;
    assert_eq!(status, 200, "{usage}");
    assert!(usage["position"].as_i64().unwrap() >= position, "{usage}");
    let reply = app.send(Method::GET, "/v1/plans", None).await;
    assert_eq!(reply.status, 200, "{}", reply.text);
    app.stop().await;
}

#[tokio::test]
async fn a_read_database_url_that_does_not_parse_fails_the_start_naming_the_setting() {
    // Nothing answers on these: the URL is refused before either is tried.
    let mut config = Config::new(
        "postgres://postgres@127.0.0.1:1/tally",
        "nats://127.0.0.1:1",
    );
    config.read_database_url = Some("postgres://127.0.0.1:notaport/tally".into());
    let error = Service::start(config).await.err().expect("the start fails");
    let message = format!("{error:#}");
    assert!(message.contains("TALLY_READ_DATABASE_URL"), "{message}");
}
