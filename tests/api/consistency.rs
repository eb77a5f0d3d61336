//! Reading what was written (contract §8): a read of usage or a container reflects
//! every event acknowledged before it began, by any instance, and names the position it
//! reflects; `min_position` waits only for that position, `consistency=eventual` not at
//! all, and a projection that does not catch up within the wait is a 503, never stale
//! figures.

use std::collections::BTreeSet;
use std::time::{Duration as StdDuration, Instant};

use chrono::{Duration, DurationRound, Utc};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde_json::{json, Value};
use tally::config::Config;
use tally::event::canonical::timestamp;
use tally::runtime::{usage, ContainerTimeline, Period};
use tally::startup::Service;

use crate::helpers::{mid_period_clock, projected_to_head, TestApp, TOKEN};
use crate::projection::{
    encode, expected_container, expected_timelines, month_of_events, post_all,
};

/// The answer's `position`, taken out so that the rest compares with the pure figures.
fn take_position(answer: &mut Value) -> i64 {
    answer
        .as_object_mut()
        .unwrap()
        .remove("position")
        .and_then(|position| position.as_i64())
        .unwrap_or_else(|| panic!("no position in {answer}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_month_posted_to_one_instance_reads_at_once_from_another_as_the_pure_fold() {
    let first = TestApp::spawn().await;
    let mut config = Config::new(&first.db.url, &first.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    // The guarantee is the wait, not its budget: a loaded machine must not turn it into 503s.
    config.read_wait_ms = 60_000;
    let second = Service::start(config).await.unwrap();

    let mut rng = StdRng::seed_from_u64(18);
    let mut events = month_of_events(&mut rng, 20, 4, 30);
    events.shuffle(&mut rng);
    let positions = post_all(&first, &events).await;
    let acknowledged = positions.values().copied().max().unwrap();

    // At once, with no sleep or retry: every org's usage and a sample of containers.
    let now = Utc::now()
        .duration_trunc(Duration::milliseconds(1))
        .unwrap();
    let timelines = expected_timelines(&events, &positions);
    let orgs: BTreeSet<&str> = events.iter().map(|event| event.org.as_str()).collect();
    let periods = [
        Period::containing(now - Duration::days(31)),
        Period::containing(now),
    ];
    for org in &orgs {
        let org_timelines: Vec<&ContainerTimeline> = timelines
            .iter()
            .filter(|((owner, _), _)| owner == org)
            .map(|(_, timeline)| timeline)
            .collect();
        for period in periods {
            let path = format!("/v1/orgs/{org}/usage?period={period}&as_of={}", encode(now));
            let (status, _, mut answer) = first
                .at(second.local_addr)
                .get(&path)
                .await
                .with_retry_after();
            assert_eq!(status, 200, "{path}: {answer}");
            assert!(take_position(&mut answer) >= acknowledged, "{path}");
            let expected = usage(org_timelines.iter().copied(), period, now);
            assert_eq!(
                answer,
                json!({
                    "org_id": org, "period": period.to_string(), "as_of": timestamp(now),
                    "runtime_ms": expected.runtime_ms, "commands": expected.commands,
                    "command_ms": expected.command_ms, "ports_published": expected.ports_published,
                    "running_containers": expected.running_containers,
                    "overage_ms": expected.runtime_ms, "plan": "free",
                    "included_ms": 0, "overage_amount": "0.00", "currency": "USD",
                }),
                "{path}"
            );
        }
    }
    for ((org, container), timeline) in timelines.iter().step_by(5) {
        let path = format!("/v1/containers/{container}?as_of={}", encode(now));
        let (status, _, mut answer) = first
            .at(second.local_addr)
            .get(&path)
            .await
            .with_retry_after();
        assert_eq!(status, 200, "{path}: {answer}");
        assert!(take_position(&mut answer) >= acknowledged, "{path}");
        assert_eq!(
            answer,
            expected_container(org, container, timeline, now),
            "{path}"
        );
    }

    second.stop().await;
    first.stop().await;
}

/// Appends `event` through `app`: its position.
async fn append_one(app: &TestApp, event: Value) -> i64 {
    let (status, answer) = app.post_events(&json!({ "events": [event] })).await;
    assert_eq!(status, 200, "{answer}");
    answer["results"][0]["position"].as_i64().unwrap()
}

/// A command `app`'s container ran 30 seconds before its now.
fn command(app: &TestApp, org: &str, container: &str) -> Value {
    json!({"id": uuid::Uuid::new_v4(), "type": "container.command_ran", "org_id": org,
           "container_id": container, "occurred_at": app.ago(30),
           "data": {"command_id": "c", "exit_code": 0, "duration_ms": 5}})
}

/// While the projection cannot move (the test holds its checkpoint row, which a projector
/// skips when locked), a default read and a `min_position` read of the new event are 503
/// `projection_lagging` after the wait, and `consistency=eventual` answers the projection
/// as it stands, saying which position that is.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_past_the_projection_is_503_after_the_wait_and_an_eventual_read_answers_at_once() {
    const WAIT_MS: u64 = 300;
    // Mid-period, so that the minute before now is all this period's.
    let app = TestApp::spawn_with(|config| {
        config.read_wait_ms = WAIT_MS;
        config.clock = mid_period_clock();
    })
    .await;
    let period = Period::containing(app.now() - Duration::seconds(30));
    let usage = format!("/v1/orgs/org_c/usage?period={period}");
    let container = "/v1/containers/ctr_c";
    append_one(
        &app,
        json!({"id": uuid::Uuid::new_v4(), "type": "container.created", "org_id": "org_c",
               "container_id": "ctr_c", "occurred_at": app.ago(60), "data": {"name": "job"}}),
    )
    .await;
    let projected = projected_to_head(&app.pool, "the created event is projected").await;

    let mut hold = app.pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM proj.checkpoint FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();
    let acknowledged = append_one(&app, command(&app, "org_c", "ctr_c")).await;

    for (path, header) in [
        (usage.clone(), None),
        (format!("{usage}&min_position={acknowledged}"), None),
        (usage.clone(), Some(acknowledged.to_string())),
        (container.to_owned(), None),
    ] {
        let started = Instant::now();
        let (status, retry_after, answer) = app
            .with_min_position(header.as_deref())
            .get(&path)
            .await
            .with_retry_after();
        assert_eq!(status, 503, "{path} {header:?}: {answer}");
        assert_eq!(answer["error"]["code"], "projection_lagging", "{answer}");
        assert!(retry_after.is_some(), "{path}: a 503 says when to retry");
        assert!(
            started.elapsed() >= StdDuration::from_millis(WAIT_MS),
            "{path}: answered before the wait was over"
        );
    }
    // A position the projection has reached is answered; so is an eventual read, from the
    // projection as it stands, and its position says the command is not in it.
    for path in [
        format!("{usage}&min_position={projected}"),
        format!("{usage}&consistency=eventual"),
    ] {
        let (status, _, answer) = app.get(&path).await.with_retry_after();
        assert_eq!(status, 200, "{path}: {answer}");
        assert_eq!(answer["position"], projected, "{path}");
        assert_eq!(answer["commands"], 0, "{path}");
    }
    let (status, _, answer) = app
        .get(&format!("{container}?consistency=eventual"))
        .await
        .with_retry_after();
    assert_eq!((status, &answer["position"]), (200, &json!(projected)));

    hold.rollback().await.unwrap();
    let (status, _, answer) = app.get(&usage).await.with_retry_after();
    assert_eq!(status, 200, "{answer}");
    assert!(answer["position"].as_i64().unwrap() >= acknowledged);
    assert_eq!(answer["commands"], 1);
    // Past the head nothing was acknowledged and no wait would reach it: the caller's
    // mistake, refused at once, on reads and on admission checks alike.
    let past = acknowledged + 1_000;
    let (status, retry_after, answer) = app
        .get(&format!("{usage}&min_position={past}"))
        .await
        .with_retry_after();
    assert_eq!(
        (status, &answer["error"]["code"], retry_after),
        (422, &json!("invalid_min_position"), None),
        "{answer}"
    );
    // The head itself is waited for.
    for (position, expected) in [(past, 422), (acknowledged, 200)] {
        let (status, answer) = app
            .post_json(
                &format!("/v1/admission/check?min_position={position}"),
                &json!({"org_id": "org_c", "action": "create"}),
            )
            .await;
        assert_eq!(status, expected, "min_position {position}: {answer}");
        if expected == 422 {
            assert_eq!(answer["error"]["code"], "invalid_min_position", "{answer}");
        }
    }
    app.stop().await;
}

#[tokio::test]
async fn bad_consistency_parameters_and_unknown_ones_are_refused_with_422() {
    let app = TestApp::spawn().await;
    let period = Period::containing(Utc::now());
    let usage = format!("/v1/orgs/org_c/usage?period={period}");
    let container = "/v1/containers/ctr_c?as_of=2026-11-01T00:00:00Z";
    let export = format!("/v1/exports/usage.csv?period={period}");
    for base in [usage.as_str(), container, export.as_str()] {
        for (query, header, code) in [
            ("&min_position=-1", None, "invalid_min_position"),
            ("&min_position=abc", None, "invalid_min_position"),
            ("&min_position=1e3", None, "invalid_min_position"),
            ("", Some("-5"), "invalid_min_position"),
            ("&min_position=3", Some("4"), "invalid_min_position"),
            ("&consistency=strong", None, "invalid_consistency"),
            (
                "&consistency=eventual&min_position=3",
                None,
                "invalid_consistency",
            ),
            ("&color=red", None, "unknown_parameter"),
        ] {
            let path = format!("{base}{query}");
            let (status, _, answer) = app
                .with_min_position(header)
                .get(&path)
                .await
                .with_retry_after();
            assert_eq!(
                (status, answer["error"]["code"].as_str()),
                (422, Some(code)),
                "{path} {header:?}: {answer}"
            );
        }
    }
    app.stop().await;
}
