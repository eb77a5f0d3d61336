//! Admission and plans name what they read (contract §8): an admission check is
//! read-your-writes for the instance asked, and `min_position` (query parameter or
//! `Tally-Min-Position`) makes it count a write acknowledged by another instance; every
//! admission answer names the position its facts reflect, and so do plan answers. `tally
//! audit` names the ledger head it read at.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};
use tally::config::Config;
use tally::startup::Service;
use uuid::Uuid;

use crate::helpers::{ago, eventually, projected_to_head, TestApp, TOKEN};

/// Running slots of the plan the tests put their org on.
const SLOTS: u64 = 3;

/// A plan with [`SLOTS`] running slots and an allowance no test uses up.
fn team_plan() -> Value {
    json!({
        "sandbox_runtime": true, "included_runtime_seconds": 360_000, "overage": "deny",
        "overage_price_per_hour": "0.125", "currency": "USD",
        "max_running_containers": SLOTS, "max_published_ports": 2,
    })
}

/// Appends `events` through `app`; the highest position acknowledged.
async fn append(app: &TestApp, events: Vec<Value>) -> i64 {
    let (status, answer) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200, "{answer}");
    answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|result| result["position"].as_i64().unwrap())
        .max()
        .unwrap()
}

/// `org` on the team plan, verified and billing eligible, through `app`; the position of
/// the last of those events.
async fn ready_org(app: &TestApp, org: &str) -> i64 {
    let (status, plan) = app.put_plan("team", &team_plan()).await;
    assert!(status == 201 || status == 200, "{plan}");
    let account = [
        ("org.plan_changed", json!({"plan": "team"})),
        ("org.verification_changed", json!({"verified": true})),
        ("org.billing_eligibility_changed", json!({"eligible": true})),
    ]
    .into_iter()
    .map(|(event_type, data)| {
        json!({"id": Uuid::new_v4(), "type": event_type, "org_id": org,
               "occurred_at": ago(600), "data": data})
    })
    .collect();
    append(app, account).await
}

fn created(org: &str, container: &str) -> Value {
    json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org,
           "container_id": container, "occurred_at": ago(20), "data": {"name": "job"}})
}

/// A second service on the first one's database and NATS, waiting as long as it must: the
/// guarantee is the wait, not its budget.
async fn second_instance(first: &TestApp) -> Service {
    let mut config = Config::new(&first.db.url, &first.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    config.read_wait_ms = 60_000;
    Service::start(config).await.unwrap()
}

fn position_of(answer: &Value) -> i64 {
    answer["position"]
        .as_i64()
        .unwrap_or_else(|| panic!("no position in {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_check_on_another_instance_with_min_position_counts_every_slot_taken_through_the_first() {
    let first = TestApp::spawn().await;
    let second = second_instance(&first).await;
    let ready = ready_org(&first, "acme").await;
    let check = json!({"org_id": "acme", "action": "create"});

    // The second instance answers once it has the account, and keeps the facts it read:
    // the answer below must not come from them.
    let cache = second.checker.cache().clone();
    eventually(5, "the second instance's cache listens", || async {
        cache.is_listening()
    })
    .await;
    let path = format!("/v1/admission/check?min_position={ready}");
    eventually(5, "the second instance keeps the facts it read", || async {
        let (status, _, answer) = first
            .at(second.local_addr)
            .send(Method::POST, &path, Some(&check))
            .await
            .with_retry_after();
        assert_eq!(status, 200, "{answer}");
        !cache.is_empty()
    })
    .await;
    let (status, _, before) = first
        .at(second.local_addr)
        .send(Method::POST, &path, Some(&check))
        .await
        .with_retry_after();
    assert_eq!(status, 200, "{before}");
    assert_eq!(
        (&before["allowed"], &before["running_containers"]),
        (&json!(true), &json!(0)),
        "{before}"
    );
    assert!(position_of(&before) >= ready, "{before}");

    // Every slot taken through the first instance, then asked of the second at once, with
    // no sleep or retry.
    let acknowledged = append(
        &first,
        (0..SLOTS)
            .map(|n| created("acme", &format!("c{n}")))
            .collect(),
    )
    .await;
    let path = format!("/v1/admission/check?min_position={acknowledged}");
    let (status, _, mut after) = first
        .at(second.local_addr)
        .send(Method::POST, &path, Some(&check))
        .await
        .with_retry_after();
    assert_eq!(status, 200, "{after}");
    let position = after.as_object_mut().unwrap().remove("position").unwrap();
    assert!(position.as_i64().unwrap() >= acknowledged, "{position}");
    let runtime_used_ms = after["runtime_used_ms"].clone();
    assert_eq!(
        after,
        json!({"allowed": false, "reasons": ["concurrency_limit"], "plan": "team",
               "period": before["period"], "runtime_used_ms": runtime_used_ms,
               "runtime_included_ms": 360_000_000, "overage": false,
               "running_containers": SLOTS, "max_running_containers": SLOTS})
    );

    // A reservation through the second instance, told by header, is refused the same way,
    // and its refusal names the position too.
    let (status, refused) = first
        .at(second.local_addr)
        .with_min_position(Some(&acknowledged.to_string()))
        .reserve(&json!({"org_id": "acme", "action": "create", "container_id": "c9"}))
        .await;
    assert_eq!(status, 409, "{refused}");
    assert_eq!(refused["error"]["code"], "concurrency_limit");
    let detail = &refused["error"]["details"][0];
    assert!(position_of(detail) >= acknowledged, "{refused}");

    second.stop().await;
    first.stop().await;
}

/// While the projection cannot move (the test holds its checkpoint row, which a projector
/// skips when locked), a check or reservation naming the position of another org's new
/// event waits and is 503; one naming a position past the ledger's head, which no wait
/// would reach, is the caller's mistake: 422 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_check_for_a_position_the_projection_lacks_is_503_after_the_wait() {
    const WAIT_MS: u64 = 300;
    let app = TestApp::spawn_with(|config| config.read_wait_ms = WAIT_MS).await;
    ready_org(&app, "acme").await;
    let head = projected_to_head(&app.pool, "the account is projected").await;
    let check = json!({"org_id": "acme", "action": "create"});
    let reservation = json!({"org_id": "acme", "action": "create", "container_id": "c1"});

    let mut hold = app.pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM proj.checkpoint FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let lacking = append(&app, vec![created("other", "c9")]).await.to_string();
    let past_head = (head + 1_000).to_string();
    for (position, status_code, code) in [
        (&lacking, 503, "projection_lagging"),
        (&past_head, 422, "invalid_min_position"),
    ] {
        for (path, header, body) in [
            (
                format!("/v1/admission/check?min_position={position}"),
                None,
                &check,
            ),
            (
                "/v1/admission/check".to_owned(),
                Some(position.as_str()),
                &check,
            ),
            (
                format!("/v1/admission/reservations?min_position={position}"),
                None,
                &reservation,
            ),
        ] {
            let started = Instant::now();
            let (status, retry_after, answer) = app
                .with_min_position(header)
                .send(Method::POST, &path, Some(body))
                .await
                .with_retry_after();
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (status_code, Some(code)),
                "{path} {header:?}: {answer}"
            );
            if status == 503 {
                assert!(retry_after.is_some(), "{path}: a 503 says when to retry");
                assert!(
                    started.elapsed() >= Duration::from_millis(WAIT_MS),
                    "{path}: answered before the wait was over"
                );
            }
        }
    }
    hold.rollback().await.unwrap();

    // A position reached is answered at once, and so is `consistency=eventual`, which for
    // admission is the default: this instance's own appends, nothing more.
    for path in [
        format!("/v1/admission/check?min_position={head}"),
        "/v1/admission/check?consistency=eventual".to_owned(),
    ] {
        let (status, _, answer) = app
            .send(Method::POST, &path, Some(&check))
            .await
            .with_retry_after();
        assert_eq!(status, 200, "{path}: {answer}");
        assert!(position_of(&answer) >= head, "{path}: {answer}");
    }
    let (status, _, granted) = app
        .send(
            Method::POST,
            &format!("/v1/admission/reservations?min_position={head}"),
            Some(&reservation),
        )
        .await
        .with_retry_after();
    assert_eq!(status, 201, "{granted}");
    assert!(position_of(&granted) >= head, "{granted}");
    app.stop().await;
}

/// While the projection cannot move (the test holds its checkpoint row, which a projector
/// skips when locked), a check that names a new event's position is 503, where the default
/// check of an instance that did not write it answers at once and says it is short of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_check_naming_an_unprojected_write_of_another_instance_waits_for_it() {
    const WAIT_MS: u64 = 300;
    let app = TestApp::spawn_with(|config| config.read_wait_ms = WAIT_MS).await;
    let mut config = Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.read_wait_ms = WAIT_MS;
    let second = Service::start(config).await.unwrap();
    ready_org(&app, "acme").await;
    let projected = projected_to_head(&app.pool, "the account is projected").await;
    let check = json!({"org_id": "acme", "action": "create"});

    let mut hold = app.pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM proj.checkpoint FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let acknowledged = append(&app, vec![created("acme", "c0")]).await;

    let (status, _, answer) = app
        .at(second.local_addr)
        .send(Method::POST, "/v1/admission/check", Some(&check))
        .await
        .with_retry_after();
    assert_eq!(status, 200, "{answer}");
    assert_eq!(position_of(&answer), projected, "{answer}");
    assert_eq!(answer["running_containers"], 0, "{answer}");
    let path = format!("/v1/admission/check?min_position={acknowledged}");
    let (status, _, answer) = app
        .at(second.local_addr)
        .send(Method::POST, &path, Some(&check))
        .await
        .with_retry_after();
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (503, Some("projection_lagging")),
        "{answer}"
    );

    hold.rollback().await.unwrap();
    let (status, _, answer) = app
        .at(second.local_addr)
        .send(Method::POST, &path, Some(&check))
        .await
        .with_retry_after();
    assert_eq!(status, 200, "{answer}");
    assert!(position_of(&answer) >= acknowledged, "{answer}");
    assert_eq!(answer["running_containers"], 1, "{answer}");
    second.stop().await;
    app.stop().await;
}

#[tokio::test]
async fn bad_min_positions_and_unknown_parameters_on_admission_are_refused_with_422() {
    let app = TestApp::spawn().await;
    let check = json!({"org_id": "acme", "action": "create"});
    let reservation = json!({"org_id": "acme", "action": "create", "container_id": "c1"});
    for (route, body) in [
        ("/v1/admission/check", &check),
        ("/v1/admission/reservations", &reservation),
    ] {
        for (query, header, code) in [
            ("?min_position=-1", None, "invalid_min_position"),
            ("?min_position=abc", None, "invalid_min_position"),
            ("?min_position=1e3", None, "invalid_min_position"),
            ("?min_position=%2B1", None, "invalid_min_position"),
            ("", Some("+1"), "invalid_min_position"),
            ("", Some("-5"), "invalid_min_position"),
            ("", Some("five"), "invalid_min_position"),
            ("?min_position=3", Some("4"), "invalid_min_position"),
            ("?consistency=strong", None, "invalid_consistency"),
            (
                "?consistency=eventual&min_position=3",
                None,
                "invalid_consistency",
            ),
            ("?color=red", None, "unknown_parameter"),
            ("?org_id=acme", None, "unknown_parameter"),
        ] {
            let path = format!("{route}{query}");
            let (status, _, answer) = app
                .with_min_position(header)
                .send(Method::POST, &path, Some(body))
                .await
                .with_retry_after();
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (422, Some(code)),
                "{path} {header:?}: {answer}"
            );
        }
    }
    let reservations: i64 = sqlx::query_scalar("SELECT count(*) FROM admission_reservation")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(reservations, 0, "nothing refused was granted");
    app.stop().await;
}

async fn plans(app: &TestApp) -> Value {
    let (status, listed) = app.get_plans().await;
    assert_eq!(status, 200, "{listed}");
    listed
}

async fn stored_plan_position(app: &TestApp, id: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT max(position) FROM ledger WHERE type = 'plan.defined' AND data->>'id' = $1",
    )
    .bind(id)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn plan_answers_name_the_ledger_position_of_the_definitions_they_show() {
    let app = TestApp::spawn().await;
    let listed = plans(&app).await;
    assert_eq!(listed["position"], 0, "an empty ledger: {listed}");

    let (status, defined) = app.put_plan("team", &team_plan()).await;
    assert_eq!(status, 201, "{defined}");
    let stored = stored_plan_position(&app, "team").await;
    assert_eq!(position_of(&defined), stored, "{defined}");
    let (status, same) = app.put_plan("team", &team_plan()).await;
    assert_eq!(status, 200, "{same}");
    assert_eq!(position_of(&same), stored, "the version found: {same}");

    let listed = plans(&app).await;
    assert!(position_of(&listed) >= stored, "{listed}");
    assert_eq!(listed["plans"][1]["id"], "team", "{listed}");
    // Events after the plan move the head the list names, not the plan's own position.
    let head = ready_org(&app, "acme").await;
    let listed = plans(&app).await;
    assert_eq!(position_of(&listed), head, "{listed}");
    let (status, changed) = app
        .put_plan(
            "team",
            &json!({
                "sandbox_runtime": true, "included_runtime_seconds": 60, "overage": "deny",
                "overage_price_per_hour": "0.125", "currency": "USD",
                "max_running_containers": 1, "max_published_ports": 2,
            }),
        )
        .await;
    assert_eq!(status, 201, "{changed}");
    assert_eq!(
        position_of(&changed),
        stored_plan_position(&app, "team").await
    );
    assert!(position_of(&changed) > head);
    app.stop().await;
}

#[tokio::test]
async fn tally_audit_names_the_ledger_head_it_read_at() {
    let app = TestApp::spawn().await;
    let head = ready_org(&app, "acme").await;
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["audit", "--org", "acme"])
        .env("DATABASE_URL", &app.db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let notes = String::from_utf8(output.stderr).unwrap();
    assert_eq!(
        notes.lines().next(),
        Some(format!("# ledger head {head}").as_str()),
        "{notes}"
    );
    let printed = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        printed.lines().count(),
        1 + 3,
        "a header and the org's three events"
    );
    app.stop().await;
}
