//! Corrections: a void takes an event back as if it had never been stored, while
//! both stay in the ledger and its chain; admins can add events beyond the backdate bound,
//! and the audit trail says who and why.

use chrono::{Duration, DurationRound};
use futures::future::join_all;
use serde_json::{json, Value};
use tally::http::corrections::CORRECTIONS_LOCK_KEY;
use tally::ledger::append::LEDGER_LOCK_KEY;
use uuid::Uuid;

use crate::helpers::{
    hold_advisory_lock, mid_period_clock, ok, projected_to_head, release_advisory_lock, run_verify,
    TestApp, TOKEN,
};

/// Every service here runs on this clock, mid-period, so that the last hours are all this
/// period's whatever the day.
fn now() -> chrono::DateTime<chrono::Utc> {
    mid_period_clock().now()
}

fn at(minutes_ago: i64) -> String {
    let now = now().duration_trunc(Duration::seconds(1)).unwrap();
    tally::event::canonical::timestamp(now - Duration::minutes(minutes_ago))
}

fn event(org: &str, event_type: &str, minutes_ago: i64, data: Value) -> Value {
    let mut event = json!({"id": Uuid::new_v4(), "type": event_type, "org_id": org,
                           "occurred_at": at(minutes_ago), "data": data});
    if event_type.starts_with("container.") {
        event["container_id"] = json!("box");
    }
    event
}

/// The history both orgs share: a container that runs for an hour with a command and a
/// published port.
fn shared(org: &str) -> Vec<Value> {
    vec![
        event(org, "container.created", 120, json!({})),
        event(
            org,
            "container.command_ran",
            100,
            json!({"command_id": "a", "exit_code": 0, "duration_ms": 400}),
        ),
        event(org, "container.port_published", 90, json!({"port": 443})),
        event(org, "container.stopped", 60, json!({})),
    ]
}

/// What an org's figures look like from outside as of one instant fixed for the whole
/// test (so that two reads compare the same window), with the org's name taken out.
async fn figures(app: &TestApp, org: &str) -> Value {
    static AS_OF: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let period = now().format("%Y-%m");
    let as_of = AS_OF.get_or_init(|| at(0)).replace(':', "%3A");
    let mut usage = ok(app
        .get_usage(org, &format!("period={period}&as_of={as_of}"))
        .await);
    usage["org_id"] = json!(null);
    let mut container = ok(app
        .get_container("box", &format!("org_id={org}&as_of={as_of}"))
        .await);
    container["org_id"] = json!(null);
    let (status, mut check) = app
        .check_admission(&json!({"org_id": org, "action": "create"}))
        .await;
    assert_eq!(status, 200);
    check["runtime_used_ms"] = json!(null);
    json!({"usage": usage, "container": container, "check": check})
}

#[tokio::test]
async fn account_events_voided_in_the_round_that_projects_them_count_as_never_stored() {
    let app = TestApp::spawn_mid_period().await;
    let (status, plan) = app.put_plan("pro", &crate::plans::pro_plan()).await;
    assert_eq!(status, 201, "{plan}");
    projected_to_head(&app.pool, "the plan is projected").await;
    // No round runs while the test holds the checkpoint: the events and their voids are
    // projected in one round.
    let mut held = app.pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM proj.checkpoint FOR UPDATE")
        .execute(&mut *held)
        .await
        .unwrap();
    let events = vec![
        event(
            "quick",
            "org.verification_changed",
            10,
            json!({"verified": true}),
        ),
        event(
            "quick",
            "org.billing_eligibility_changed",
            10,
            json!({"eligible": true}),
        ),
        event("quick", "org.plan_changed", 10, json!({"plan": "pro"})),
    ];
    let (status, response) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200, "{response}");
    for voided in &events {
        let (status, response) = app
            .post_void(&json!({"event_id": voided["id"], "reason": "sent to the wrong org"}))
            .await;
        assert_eq!(status, 201, "{response}");
    }
    held.commit().await.unwrap();
    projected_to_head(&app.pool, "the events and their voids are projected").await;
    // One instant for both reads: the clock moves on between them.
    let as_of = at(0);
    let org = |org: &'static str| {
        let (app, as_of) = (&app, &as_of);
        async move {
            let mut read = ok(app.get_json(&format!("/v1/orgs/{org}?as_of={as_of}")).await);
            for field in ["org_id", "position"] {
                read[field] = json!(null);
            }
            read
        }
    };
    assert_eq!(org("quick").await, org("never_seen").await);
    let (status, check) = app
        .check_admission(&json!({"org_id": "quick", "action": "create"}))
        .await;
    assert_eq!(status, 200, "{check}");
    assert_eq!(check["allowed"], false, "{check}");
    app.stop().await;
}

#[tokio::test]
async fn voided_events_count_as_never_stored_and_stay_in_the_ledger_and_its_chain() {
    let app = TestApp::spawn_mid_period().await;
    let extra = vec![
        // A stop in the middle: shortens the interval and strands the command.
        event("real", "container.stopped", 110, json!({})),
        event(
            "real",
            "container.command_ran",
            80,
            json!({"command_id": "b", "exit_code": 1, "duration_ms": 900}),
        ),
        event(
            "real",
            "container.port_published",
            70,
            json!({"port": 8080}),
        ),
        event("real", "container.port_published", 95, json!({"port": 443})),
        event(
            "real",
            "org.verification_changed",
            130,
            json!({"verified": true}),
        ),
    ];
    let mut real = shared("real");
    real.extend(extra.clone());
    for (org, events) in [("twin", shared("twin")), ("real", real)] {
        let (status, response) = app.post_events(&json!({"events": events})).await;
        assert_eq!(status, 200, "{org}: {response}");
    }
    projected_to_head(&app.pool, "the events are projected").await;
    assert_ne!(
        figures(&app, "real").await,
        figures(&app, "twin").await,
        "the extra events count"
    );

    for voided in &extra {
        let (status, response) = app
            .post_void(&json!({"event_id": voided["id"], "reason": "sent by a faulty agent"}))
            .await;
        assert_eq!(status, 201, "{response}");
    }
    projected_to_head(&app.pool, "the events are projected").await;
    let after_voids = figures(&app, "real").await;
    assert_eq!(
        after_voids,
        figures(&app, "twin").await,
        "as if never stored"
    );

    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE org_id = 'real'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, 4 + 5 + 5, "the events and their voids all stay");
    let (code, report, _) = run_verify(&app.db.url);
    assert_eq!(code, 0, "{report}");

    // Replay takes the voids into account the same way.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("replay")
        .env("DATABASE_URL", &app.db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(figures(&app, "real").await, after_voids);

    // Audit shows the void, why and by whom.
    let page = ok(app.get_events("org_id=real&type=ledger.event_voided").await);
    assert_eq!(page["events"].as_array().unwrap().len(), 5);
    assert_eq!(
        page["events"][0]["data"]["reason"],
        "sent by a faulty agent"
    );
    assert_eq!(page["events"][0]["data"]["by"], "bootstrap");
    app.stop().await;
}

#[tokio::test]
async fn an_admin_adds_an_event_beyond_the_backdate_bound_and_bad_corrections_change_nothing() {
    let app = TestApp::spawn_mid_period().await;
    let old = json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme",
                     "container_id": "box", "occurred_at": at(40 * 24 * 60)});
    let (status, refused) = app.post_events(&old).await;
    assert_eq!(status, 422, "producers are bound: {refused}");
    let (status, added) = app
        .post_corrections(&json!({"events": [old.clone()], "reason": "provider confirms the stop"}))
        .await;
    assert_eq!(status, 201, "{added}");
    assert_eq!(added["results"][0]["id"], old["id"]);
    let record = ok(app.get_events("type=ledger.events_added").await);
    assert_eq!(record["events"][0]["data"]["event_ids"], json!([old["id"]]));
    assert_eq!(
        record["events"][0]["data"]["reason"],
        "provider confirms the stop"
    );
    let before: i64 = app.ledger_count().await;

    let created = event("acme", "container.created", 5, json!({}));
    assert_eq!(app.post_events(&created).await.0, 200);
    let before = before + 1;
    let void = |event_id: Value, reason: Value| json!({"event_id": event_id, "reason": reason});
    let (status, first) = app
        .post_void(&void(created["id"].clone(), json!("dup")))
        .await;
    assert_eq!(status, 201, "{first}");
    let before = before + 1;
    let cases = [
        (
            void(created["id"].clone(), json!("again")),
            409,
            "already_voided",
        ),
        (
            void(json!(Uuid::new_v4()), json!("x")),
            404,
            "event_not_found",
        ),
        (void(first["id"].clone(), json!("x")), 422, "not_voidable"),
        (
            void(json!("not-a-uuid"), json!("x")),
            422,
            "invalid_event_id",
        ),
        (
            void(created["id"].clone(), json!("")),
            422,
            "invalid_reason",
        ),
        (
            json!({"event_id": created["id"], "reason": "x", "extra": 1}),
            422,
            "unknown_field",
        ),
    ];
    for (body, status, code) in cases {
        let (actual, error) = app.post_void(&body.clone()).await;
        assert_eq!(
            (actual, error["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}: {error}"
        );
    }
    let (status, _) = app
        .post_corrections(&json!({"events": [old], "reason": ""}))
        .await;
    assert_eq!(status, 422);
    assert_eq!(
        app.ledger_count().await,
        before,
        "nothing stored by the refused corrections"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_correction_that_gives_an_event_twice_stores_and_names_it_once_and_events_null_is_refused(
) {
    let app = TestApp::spawn_mid_period().await;
    let old = json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme",
                     "container_id": "box", "occurred_at": at(40 * 24 * 60)});
    let before = app.ledger_count().await;
    let (status, added) = app
        .post_corrections(&json!({"events": [old.clone(), old.clone()], "reason": "twice"}))
        .await;
    assert_eq!(status, 201, "{added}");
    let record = ok(app.get_events("type=ledger.events_added").await);
    assert_eq!(record["events"][0]["data"]["event_ids"], json!([old["id"]]));
    assert_eq!(
        app.ledger_count().await,
        before + 2,
        "the event and its record"
    );
    let (status, refused) = app
        .post_corrections(&json!({"events": null, "reason": "nothing"}))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (422, Some("invalid_body")),
        "{refused}"
    );
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("events: an array"),
        "{refused}"
    );
    assert_eq!(app.ledger_count().await, before + 2);
    app.stop().await;
}

/// Replay reads the ledger with a binary `COPY` in two halves and decodes it itself; the
/// projector reads rows through sqlx. Over a ledger with every event type the projection
/// reads, voids among them, and a container whose history spans both halves, both reads
/// must give each container the same history, each org the same entries, and the same
/// voids.
#[tokio::test]
async fn replays_binary_read_gathers_every_event_exactly_as_the_projectors_row_read_decodes_it() {
    use sqlx::Connection;
    use std::collections::BTreeMap;
    use tally::projection::{gather, model::ContainerKey, store};

    let app = TestApp::spawn_mid_period().await;
    let mut events = shared("real");
    events.extend([
        event(
            "real",
            "container.command_ran",
            50,
            json!({"command_id": "b", "exit_code": 1, "duration_ms": 900}),
        ),
        event("real", "org.plan_changed", 40, json!({"plan": "free"})),
        event(
            "real",
            "org.verification_changed",
            35,
            json!({"verified": true}),
        ),
        event(
            "real",
            "org.billing_eligibility_changed",
            30,
            json!({"eligible": false}),
        ),
        event("real", "container.resumed", 20, json!({})),
    ]);
    events.extend(shared("twin"));
    let (status, response) = app.post_events(&json!({"events": events})).await;
    assert_eq!(status, 200, "{response}");
    let (status, response) = app
        .post_void(&json!({"event_id": events[1]["id"], "reason": "a duplicate command"}))
        .await;
    assert_eq!(status, 201, "{response}");

    let mut first = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    let mut second = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    let head: i64 = sqlx::query_scalar("SELECT max(position) FROM ledger")
        .fetch_one(&mut first)
        .await
        .unwrap();
    let gathered = gather::gather(&mut first, &mut second, head).await.unwrap();
    let read = store::read_events(&mut first, 0, 1_000).await.unwrap();
    assert_eq!(read.len(), usize::try_from(head).unwrap());

    let mut histories = BTreeMap::new();
    let mut accounts = Vec::new();
    let mut voided = Vec::new();
    for event in read {
        if let Some((container_id, entry)) = event.container {
            histories
                .entry(ContainerKey {
                    org_id: event.org_id.clone(),
                    container_id,
                })
                .or_insert_with(Vec::new)
                .push(entry);
        }
        if let Some(entry) = event.account {
            accounts.push((event.org_id, entry));
        }
        if let Some(target) = event.voids {
            voided.push((target, event.position));
        }
    }
    assert_eq!(gathered.events, u64::try_from(head).unwrap());
    assert_eq!(
        gathered.histories.into_iter().collect::<BTreeMap<_, _>>(),
        histories
    );
    assert_eq!(gathered.accounts, accounts);
    assert_eq!(gathered.voided, voided);
    // What the comparison covered: both orgs' containers, the three org events, the void.
    assert_eq!(histories.len(), 2);
    assert_eq!(accounts.len(), 3);
    assert_eq!(voided.len(), 1);
}

/// Ledger rows of `kind`.
async fn stored_of(app: &TestApp, kind: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE type = $1")
        .bind(kind)
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

/// The positions of a corrections answer's results.
fn positions(answer: &Value) -> Vec<Value> {
    answer["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|result| result["position"].clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrections_sent_ten_times_at_once_to_two_instances_are_stored_once_and_retries_store_nothing(
) {
    // Five corrections queue on each instance: a slow machine must not turn a wait into
    // a 503.
    const WAIT_MS: u64 = 30_000;
    let app = TestApp::spawn_with(|config| {
        config.clock = mid_period_clock();
        config.read_wait_ms = WAIT_MS;
    })
    .await;
    let mut config = tally::config::Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.clock = app.clock;
    config.read_wait_ms = WAIT_MS;
    let second = tally::startup::Service::start(config).await.unwrap();
    let instances = [app.api.clone(), app.at(second.local_addr)];
    let history = shared("acme");
    assert_eq!(app.post_events(&json!({"events": history})).await.0, 200);

    // Ten voids of one event at once: one is stored, the others are 409.
    let void = json!({"event_id": history[1]["id"], "reason": "a duplicate command"});
    let voids = join_all((0..10).map(|n| {
        let (instance, void) = (instances[n % 2].clone(), void.clone());
        async move { instance.post_void(&void).await }
    }))
    .await;
    let count = |status: u16| voids.iter().filter(|(s, _)| *s == status).count();
    assert_eq!((count(201), count(409)), (1, 9), "{voids:?}");
    assert_eq!(stored_of(&app, "ledger.event_voided").await, 1);
    // The command counts as never stored: as an org that sent the rest at the same
    // instants and never sent it.
    let clean: Vec<Value> = history
        .iter()
        .enumerate()
        .filter(|(index, _)| *index != 1)
        .map(|(_, event)| {
            let mut event = event.clone();
            event["id"] = json!(Uuid::new_v4());
            event["org_id"] = json!("clean");
            event
        })
        .collect();
    assert_eq!(app.post_events(&json!({"events": clean})).await.0, 200);
    projected_to_head(&app.pool, "the void and the clean org are projected").await;
    assert_eq!(figures(&app, "acme").await, figures(&app, "clean").await);

    // Ten identical corrections at once: the events and one record naming them are
    // stored; every answer names that record and the events' positions.
    let added = vec![
        event("acme", "container.resumed", 50, json!({})),
        event("acme", "container.stopped", 45, json!({})),
    ];
    let body = json!({"events": added, "reason": "provider confirms the run"});
    let answers = join_all((0..10).map(|n| {
        let (instance, body) = (instances[n % 2].clone(), body.clone());
        async move { instance.post_corrections(&body).await }
    }))
    .await;
    let created: Vec<&Value> = answers
        .iter()
        .filter(|(status, _)| *status == 201)
        .map(|(_, answer)| answer)
        .collect();
    assert_eq!(created.len(), 1, "{answers:?}");
    let (record, stored_at) = (&created[0]["record_id"], positions(created[0]));
    for (status, answer) in &answers {
        assert!(*status == 201 || *status == 200, "{answer}");
        assert_eq!(
            (&answer["record_id"], positions(answer)),
            (record, stored_at.clone()),
            "{answer}"
        );
    }
    assert_eq!(stored_of(&app, "ledger.events_added").await, 1);
    // A retry later stores nothing either.
    let before = app.ledger_count().await;
    let (status, retried) = app.post_corrections(&body).await;
    assert_eq!((status, &retried["record_id"]), (200, record), "{retried}");
    assert_eq!(app.ledger_count().await, before);

    // Events the producers sent: nothing stored, and no record names them.
    let (status, sent) = app
        .post_corrections(&json!({"events": clean, "reason": "sent already"}))
        .await;
    assert_eq!((status, &sent["record_id"]), (200, &Value::Null), "{sent}");
    assert_eq!(app.ledger_count().await, before);
    // One added before and one new: the record names the new one only, and a retry of
    // the same batch answers with that record, not the one that added the first.
    let new = event("acme", "container.resumed", 30, json!({}));
    let mixed_body = json!({"events": [added[0], new], "reason": "one more run"});
    let (status, mixed) = app.post_corrections(&mixed_body).await;
    assert_eq!(status, 201, "{mixed}");
    let records = ok(app.get_events("type=ledger.events_added").await);
    assert_eq!(records["events"][1]["id"], mixed["record_id"]);
    assert_eq!(
        records["events"][1]["data"]["event_ids"],
        json!([new["id"]])
    );
    assert_eq!(stored_of(&app, "ledger.events_added").await, 2);
    let before = app.ledger_count().await;
    let (status, retried) = app.post_corrections(&mixed_body).await;
    assert_eq!(
        (status, &retried["record_id"]),
        (200, &mixed["record_id"]),
        "{retried}"
    );
    assert_eq!(app.ledger_count().await, before);
    // A voided event is not added again: 409, nothing stored.
    let (status, refused) = app
        .post_corrections(&json!({"events": [history[1]], "reason": "undo the void"}))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (409, Some("already_voided")),
        "{refused}"
    );
    assert_eq!(app.ledger_count().await, before);
    second.stop().await;
    app.stop().await;
}

#[tokio::test]
async fn a_correction_waiting_past_the_read_wait_for_another_is_503_and_stores_nothing() {
    let app = TestApp::spawn_with(|config| config.read_wait_ms = 300).await;
    let history = shared("acme");
    assert_eq!(app.post_events(&json!({"events": history})).await.0, 200);
    // Another instance's correction, as far as this one can tell, holds the turn.
    let other = hold_advisory_lock(&app.db.url, CORRECTIONS_LOCK_KEY).await;
    let before = app.ledger_count().await;
    let void = json!({"event_id": history[1]["id"], "reason": "a duplicate command"});
    let added = json!({"events": [event("acme", "container.resumed", 50, json!({}))],
                       "reason": "provider confirms the run"});
    let (status, busy) = app.post_void(&void).await;
    assert_eq!(
        (status, busy["error"]["code"].as_str()),
        (503, Some("overloaded")),
        "{busy}"
    );
    let (status, busy) = app.post_corrections(&added).await;
    assert_eq!(
        (status, busy["error"]["code"].as_str()),
        (503, Some("overloaded"))
    );
    assert_eq!(app.ledger_count().await, before);
    release_advisory_lock(other, CORRECTIONS_LOCK_KEY).await;
    assert_eq!(app.post_void(&void).await.0, 201);
    assert_eq!(app.post_corrections(&added).await.0, 201);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_void_whose_request_timed_out_keeps_its_turn_until_its_append_is_stored() {
    let app = TestApp::spawn_with(|config| {
        config.clock = mid_period_clock();
        config.request_timeout_ms = 1_000;
    })
    .await;
    let history = shared("acme");
    assert_eq!(app.post_events(&json!({"events": history})).await.0, 200);
    // The ledger held, as a slow commit holds it: the void's append waits behind it.
    let holder = hold_advisory_lock(&app.db.url, LEDGER_LOCK_KEY).await;
    let void = json!({"event_id": history[1]["id"], "reason": "a duplicate command"});
    let (status, first) = app.post_void(&void).await;
    assert_ne!(
        status, 201,
        "the first request ends before its append: {first}"
    );
    // A retry, while the first void is still on its way to the ledger.
    let retry = tokio::spawn({
        let (api, void) = (app.api.clone(), void.clone());
        async move { api.post_void(&void).await }
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    release_advisory_lock(holder, LEDGER_LOCK_KEY).await;
    let (status, retried) = retry.await.unwrap();
    assert_eq!(
        (status, retried["error"]["code"].as_str()),
        (409, Some("already_voided")),
        "{retried}"
    );
    assert_eq!(stored_of(&app, "ledger.event_voided").await, 1);
    app.stop().await;
}
