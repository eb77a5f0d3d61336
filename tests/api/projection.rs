//! Runtime projections: the projected usage and timelines equal the pure rules
//! over the same events, whatever their arrival order, and replay reproduces them exactly.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use chrono::{DateTime, Datelike, Duration, DurationRound, TimeZone, Utc};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use uuid::Uuid;

use tally::event::canonical::timestamp;
use tally::event::EventId;
use tally::runtime::{usage, ContainerEntry, ContainerTimeline, EntryKind, Period, Window};

use crate::helpers::{eventually, TestApp, TOKEN};

/// A generated event and the entry the pure rules read from it.
#[derive(Clone)]
pub(crate) struct Generated {
    pub(crate) org: String,
    pub(crate) container: String,
    pub(crate) body: Value,
    pub(crate) occurred_at: DateTime<Utc>,
    pub(crate) kind: EntryKind,
}

fn body(id: Uuid, org: &str, container: &str, at: DateTime<Utc>, kind: EntryKind) -> Value {
    let (event_type, data) = match kind {
        EntryKind::Created => ("container.created", json!({"name": "job"})),
        EntryKind::Resumed => ("container.resumed", json!({})),
        EntryKind::Stopped => ("container.stopped", json!({"reason": "user"})),
        EntryKind::CommandRan { duration_ms } => (
            "container.command_ran",
            json!({"command_id": "c", "exit_code": 0, "duration_ms": duration_ms}),
        ),
        EntryKind::PortPublished { port } => ("container.port_published", json!({"port": port})),
    };
    json!({"id": id, "type": event_type, "org_id": org, "container_id": container,
           "occurred_at": timestamp(at), "data": data})
}

fn generated(org: &str, container: &str, at: DateTime<Utc>, kind: EntryKind) -> Generated {
    Generated {
        org: org.into(),
        container: container.into(),
        body: body(Uuid::new_v4(), org, container, at, kind),
        occurred_at: at,
        kind,
    }
}

/// A month of random histories: every kind of event at random instants, so that every
/// anomaly occurs, many events share a millisecond, and many arrive late.
pub(crate) fn month_of_events(
    rng: &mut StdRng,
    orgs: usize,
    containers: usize,
    events: usize,
) -> Vec<Generated> {
    let now = Utc::now().duration_trunc(Duration::seconds(1)).unwrap();
    let start = now - Duration::days(30);
    let span_ms = (Duration::days(30) - Duration::minutes(2)).num_milliseconds();
    let mut all = Vec::new();
    for org in 0..orgs {
        let org_id = format!("org_{org:02}");
        for container in 0..containers {
            let container_id = format!("ctr_{org:02}_{container:02}");
            // A few shared instants per container, so ties by position are common.
            let shared: Vec<i64> = (0..3).map(|_| rng.random_range(0..span_ms)).collect();
            for _ in 0..events {
                let offset = if rng.random_bool(0.2) {
                    shared[rng.random_range(0..shared.len())]
                } else {
                    rng.random_range(0..span_ms)
                };
                let kind = match rng.random_range(0..10) {
                    0..=1 => EntryKind::Created,
                    2..=3 => EntryKind::Resumed,
                    4..=5 => EntryKind::Stopped,
                    6..=8 => EntryKind::CommandRan {
                        duration_ms: rng.random_range(0..60_000),
                    },
                    _ => EntryKind::PortPublished {
                        port: rng.random_range(8000..8004),
                    },
                };
                all.push(generated(
                    &org_id,
                    &container_id,
                    start + Duration::milliseconds(offset),
                    kind,
                ));
            }
        }
    }
    all
}

/// Posts `events` in batches and returns each event id's ledger position.
pub(crate) async fn post_all(app: &TestApp, events: &[Generated]) -> HashMap<Uuid, i64> {
    let mut positions = HashMap::new();
    for chunk in events.chunks(1000) {
        let bodies: Vec<&Value> = chunk.iter().map(|event| &event.body).collect();
        let (status, response) = app.post_events(&json!({"events": bodies})).await;
        assert_eq!(status, 200, "{response}");
        for result in response["results"].as_array().unwrap() {
            let id: Uuid = result["id"].as_str().unwrap().parse().unwrap();
            let position = result["position"].as_i64().unwrap();
            if let Some(before) = positions.insert(id, position) {
                assert_eq!(before, position, "a duplicate keeps its position");
            }
        }
    }
    positions
}

async fn head(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT COALESCE(max(position), 0) FROM ledger")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn projected(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT position FROM proj.checkpoint")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

async fn wait_until_projected(app: &TestApp) {
    let head = head(app).await;
    eventually(60, "the projection reaches the ledger head", || async {
        projected(app).await == head
    })
    .await;
}

/// The answer without its `position` (which names the checkpoint, not a figure).
async fn without_position(app: &TestApp, path: &str) -> Value {
    let (status, text) = app.get_text(path).await;
    assert_eq!(status, 200, "{path}: {text}");
    let mut answer: Value = serde_json::from_str(&text).unwrap();
    let position = answer.as_object_mut().unwrap().remove("position");
    assert!(
        position.is_some_and(|position| position.is_i64()),
        "{path}: {text}"
    );
    answer
}

pub(crate) fn encode(at: DateTime<Utc>) -> String {
    timestamp(at).replace(':', "%3A")
}

/// The timelines the pure rules give for the stored events, per (org, container).
pub(crate) fn expected_timelines(
    events: &[Generated],
    positions: &HashMap<Uuid, i64>,
) -> BTreeMap<(String, String), ContainerTimeline> {
    let mut entries: BTreeMap<(String, String), Vec<ContainerEntry>> = BTreeMap::new();
    for event in events {
        let id: Uuid = event.body["id"].as_str().unwrap().parse().unwrap();
        entries
            .entry((event.org.clone(), event.container.clone()))
            .or_default()
            .push(ContainerEntry {
                occurred_at: event.occurred_at,
                position: positions[&id],
                event_id: EventId::from_uuid(id).unwrap(),
                kind: event.kind,
            });
    }
    entries
        .into_iter()
        .map(|(key, entries)| (key, ContainerTimeline::fold(&entries)))
        .collect()
}

pub(crate) fn expected_container(
    org: &str,
    container: &str,
    timeline: &ContainerTimeline,
    as_of: DateTime<Utc>,
) -> Value {
    let runtime_ms = timeline.intervals().first().map_or(0, |first| {
        timeline.runtime_ms(Window::new(first.start(), first.start().max(as_of)).until(as_of))
    });
    json!({
        "container_id": container,
        "org_id": org,
        "state": if timeline.state() == tally::runtime::ContainerState::Running { "running" } else { "stopped" },
        "runtime_ms": runtime_ms,
        "intervals": timeline.intervals().iter().map(|interval| json!({
            "start": timestamp(interval.start()),
            "end": interval.end().map(timestamp),
        })).collect::<Vec<_>>(),
        "anomalies": timeline.anomalies().iter().map(|anomaly| json!({
            "kind": anomaly.kind.as_str(),
            "event_id": anomaly.event_id.to_string(),
            "occurred_at": timestamp(anomaly.occurred_at),
        })).collect::<Vec<_>>(),
        // Every container here has fewer anomalies than one page holds.
        "anomalies_total": timeline.anomalies().len(),
        "anomalies_kept": timeline.anomalies().len(),
        "anomalies_next_after": null,
    })
}

pub(crate) fn periods_around(events: &[Generated]) -> Vec<Period> {
    let first = events.iter().map(|event| event.occurred_at).min().unwrap();
    let mut period = Period::containing(first - Duration::days(31));
    let last = Period::containing(Utc::now() + Duration::days(31));
    let mut periods = Vec::new();
    while period <= last {
        periods.push(period);
        period = period.next();
    }
    periods
}

/// Every usage and container response, keyed by path, for the byte comparison after replay.
async fn every_response(app: &TestApp, paths: &[String]) -> BTreeMap<String, String> {
    let mut responses = BTreeMap::new();
    for path in paths {
        let (status, text) = app.get_text(path).await;
        assert_eq!(status, 200, "{path}: {text}");
        responses.insert(path.clone(), text);
    }
    responses
}

fn run_replay(database_url: &str) -> String {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("replay")
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("running tally replay");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "tally replay failed: {stdout} {}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn a_shuffled_month_with_duplicates_projects_to_the_pure_figures_and_replay_reproduces_them_byte_for_byte(
) {
    let app = TestApp::spawn().await;
    let mut rng = StdRng::seed_from_u64(3);
    let events = month_of_events(&mut rng, 50, 8, 50);
    assert!(events.len() >= 20_000);
    let mut arrivals = events.clone();
    arrivals.shuffle(&mut rng);
    // Redeliveries: a tenth of the events again, in other batches.
    let mut again = arrivals.clone();
    again.shuffle(&mut rng);
    again.truncate(events.len() / 10);
    arrivals.extend(again);
    let positions = post_all(&app, &arrivals).await;
    assert_eq!(positions.len(), events.len());
    wait_until_projected(&app).await;

    let timelines = expected_timelines(&events, &positions);
    let kinds: BTreeSet<&str> = timelines
        .values()
        .flat_map(|timeline| {
            timeline
                .anomalies()
                .iter()
                .map(|anomaly| anomaly.kind.as_str())
        })
        .collect();
    assert_eq!(kinds.len(), 5, "every anomaly kind occurs: {kinds:?}");

    let now = Utc::now()
        .duration_trunc(Duration::milliseconds(1))
        .unwrap();
    // Now (from the totals), and instants inside the month (cut from the timelines).
    let instants = [
        now,
        now - Duration::days(10),
        now - Duration::days(29) + Duration::hours(7),
    ];
    let orgs: BTreeSet<&str> = events.iter().map(|event| event.org.as_str()).collect();
    let mut paths = Vec::new();
    for org in &orgs {
        let org_timelines: Vec<&ContainerTimeline> = timelines
            .iter()
            .filter(|((owner, _), _)| owner == org)
            .map(|(_, timeline)| timeline)
            .collect();
        for period in periods_around(&events) {
            for as_of in instants {
                let path = format!(
                    "/v1/orgs/{org}/usage?period={period}&as_of={}",
                    encode(as_of)
                );
                let expected = usage(org_timelines.iter().copied(), period, as_of);
                let actual = without_position(&app, &path).await;
                assert_eq!(
                    actual,
                    json!({
                        "org_id": org, "period": period.to_string(), "as_of": timestamp(as_of),
                        "runtime_ms": expected.runtime_ms, "commands": expected.commands,
                        "command_ms": expected.command_ms, "ports_published": expected.ports_published,
                        "running_containers": expected.running_containers,
                        // On the free plan nothing is included: all runtime is overage.
                        "overage_ms": expected.runtime_ms, "plan": "free",
                        "included_ms": 0, "overage_amount": "0.00", "currency": "USD",
                    }),
                    "{path}"
                );
                paths.push(path);
            }
        }
    }
    for ((org, container), timeline) in &timelines {
        let path = format!("/v1/containers/{container}?as_of={}", encode(now));
        assert_eq!(
            without_position(&app, &path).await,
            expected_container(org, container, timeline, now),
            "{path}"
        );
        paths.push(path);
    }

    let before = every_response(&app, &paths).await;
    let printed = run_replay(&app.db.url);
    assert!(
        printed.contains(&format!("replayed {} events", events.len())),
        "{printed}"
    );
    let after = every_response(&app, &paths).await;
    assert!(before == after, "replay changed a response");

    // The live projector carries on from the replayed checkpoint.
    let later = generated(
        "org_00",
        "ctr_after_replay",
        now - Duration::minutes(1),
        EntryKind::Created,
    );
    post_all(&app, std::slice::from_ref(&later)).await;
    wait_until_projected(&app).await;
    let container = without_position(&app, "/v1/containers/ctr_after_replay").await;
    assert_eq!(container["state"], "running");
    app.stop().await;
}

/// Every index and constraint of the live projection's tables as the catalog defines them,
/// and each table's storage options, sorted.
async fn projection_catalog(app: &TestApp) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT d FROM ( \
           SELECT 'index ' || pg_get_indexdef(i.indexrelid) AS d \
           FROM pg_index i JOIN pg_class t ON t.oid = i.indrelid \
           WHERE t.relnamespace = $1::regnamespace \
           UNION ALL \
           SELECT 'constraint ' || t.relname || ' ' || c.conname || ' ' || c.contype::TEXT || ' ' \
                  || pg_get_constraintdef(c.oid) || ' by ' || COALESCE(x.relname, '-') \
           FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid \
           LEFT JOIN pg_class x ON x.oid = c.conindid \
           WHERE t.relnamespace = $1::regnamespace \
           UNION ALL \
           SELECT 'table ' || relname || ' ' || COALESCE(array_to_string(reloptions, ','), '') \
           FROM pg_class WHERE relnamespace = $1::regnamespace AND relkind = 'r') AS catalog \
         ORDER BY d",
    )
    .bind(tally::projection::store::LIVE)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn replay_leaves_the_projection_with_the_same_indexes_constraints_and_storage_options_as_the_migrations_made(
) {
    let app = TestApp::spawn().await;
    let made = projection_catalog(&app).await;
    assert!(
        made.iter().any(|d| d.contains(" PRIMARY KEY ")) && made.len() > 20,
        "{made:#?}"
    );
    let now = Utc::now() - Duration::minutes(30);
    let events: Vec<Generated> = (0..20)
        .map(|i| {
            let at = now + Duration::seconds(i);
            generated("org_a", &format!("ctr_{}", i % 4), at, EntryKind::Created)
        })
        .collect();
    post_all(&app, &events).await;
    wait_until_projected(&app).await;
    let printed = run_replay(&app.db.url);
    assert!(printed.contains("replayed 20 events"), "{printed}");
    assert_eq!(projection_catalog(&app).await, made);
    app.stop().await;
}

/// The start of a month between 2 and 33 days ago, so that events around it are inside the
/// backdate bound and in the past.
fn recent_month_start() -> DateTime<Utc> {
    let now = Utc::now();
    let this_month = Utc
        .with_ymd_and_hms(now.year(), now.month(), 1, 0, 0, 0)
        .unwrap();
    if now - this_month >= Duration::days(2) {
        this_month
    } else {
        Period::containing(this_month - Duration::days(1)).start()
    }
}

#[tokio::test]
async fn a_late_stop_moves_runtime_between_periods_exactly_as_if_it_had_arrived_in_order() {
    let app = TestApp::spawn().await;
    let boundary = recent_month_start();
    let hours = |h: i64| boundary + Duration::hours(h);
    let history = |org: &str| {
        vec![
            generated(org, "ctr", hours(-2), EntryKind::Created),
            generated(
                org,
                "ctr",
                hours(-1),
                EntryKind::CommandRan { duration_ms: 500 },
            ),
            generated(org, "ctr", hours(1), EntryKind::Stopped),
            generated(
                org,
                "ctr",
                hours(2),
                EntryKind::CommandRan { duration_ms: 700 },
            ),
            generated(org, "ctr", hours(3), EntryKind::Resumed),
            generated(org, "ctr", hours(4), EntryKind::PortPublished { port: 443 }),
        ]
    };
    let in_order = history("org_in_order");
    let late = history("org_late");
    for event in &in_order {
        post_all(&app, std::slice::from_ref(event)).await;
    }
    // Everything but the stop, one event at a time; then the stop.
    for (index, event) in late.iter().enumerate() {
        if index != 2 {
            post_all(&app, std::slice::from_ref(event)).await;
            wait_until_projected(&app).await;
        }
    }
    let as_of = hours(6);
    let before = Period::containing(hours(-1));
    let after = Period::containing(hours(1));
    let usage_of = |org: &'static str, period: Period| {
        format!(
            "/v1/orgs/{org}/usage?period={period}&as_of={}",
            encode(as_of)
        )
    };
    let without_stop = without_position(&app, &usage_of("org_late", after)).await;
    assert_eq!(
        without_stop["runtime_ms"],
        6 * 3_600_000,
        "running since the boundary"
    );
    post_all(&app, std::slice::from_ref(&late[2])).await;
    wait_until_projected(&app).await;

    for period in [before, after] {
        let mut in_order_usage = without_position(&app, &usage_of("org_in_order", period)).await;
        let mut late_usage = without_position(&app, &usage_of("org_late", period)).await;
        in_order_usage["org_id"] = json!(null);
        late_usage["org_id"] = json!(null);
        assert_eq!(late_usage, in_order_usage, "{period}");
    }
    let after_usage = without_position(&app, &usage_of("org_late", after)).await;
    assert_eq!(after_usage["runtime_ms"], 3_600_000 + 3 * 3_600_000);
    assert_eq!(after_usage["commands"], 1);
    let before_usage = without_position(&app, &usage_of("org_late", before)).await;
    assert_eq!(before_usage["runtime_ms"], 2 * 3_600_000);

    let path = |org: &str| format!("/v1/containers/ctr?org_id={org}&as_of={}", encode(as_of));
    let late_container = without_position(&app, &path("org_late")).await;
    let in_order_container = without_position(&app, &path("org_in_order")).await;
    assert_eq!(late_container["intervals"], in_order_container["intervals"]);
    assert_eq!(
        late_container["runtime_ms"],
        in_order_container["runtime_ms"]
    );
    let kinds = |container: &Value| -> Vec<Value> {
        container["anomalies"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["kind"].clone())
            .collect()
    };
    assert_eq!(
        kinds(&late_container),
        vec![json!("command_while_not_running")]
    );
    assert_eq!(kinds(&late_container), kinds(&in_order_container));
    app.stop().await;
}

#[tokio::test]
async fn usage_of_an_unknown_org_is_zero_and_bad_parameters_are_refused_with_422() {
    let app = TestApp::spawn().await;
    let zero = without_position(
        &app,
        "/v1/orgs/nobody/usage?period=2026-11&as_of=2026-11-15T00:00:00Z",
    )
    .await;
    assert_eq!(
        zero,
        json!({"org_id": "nobody", "period": "2026-11", "as_of": "2026-11-15T00:00:00.000Z",
               "runtime_ms": 0, "commands": 0, "command_ms": 0, "ports_published": 0,
               "running_containers": 0, "overage_ms": 0, "plan": "free",
               "included_ms": 0, "overage_amount": "0.00", "currency": "USD"})
    );
    let cases = [
        ("/v1/orgs/acme/usage", 422, "invalid_period"),
        ("/v1/orgs/acme/usage?period=2026-13", 422, "invalid_period"),
        ("/v1/orgs/acme/usage?period=2026-1", 422, "invalid_period"),
        ("/v1/orgs/acme/usage?period=0000-01", 422, "invalid_period"),
        (
            "/v1/orgs/acme/usage?period=2026-11&as_of=yesterday",
            422,
            "invalid_as_of",
        ),
        (
            "/v1/orgs/acme/usage?period=2026-11&as_of=2026-11-15T00:00:00",
            422,
            "invalid_as_of",
        ),
        ("/v1/orgs/ac.me/usage?period=2026-11", 422, "invalid_org_id"),
        ("/v1/containers/nothing-here", 404, "container_not_found"),
        ("/v1/containers/bad%20id", 422, "invalid_container_id"),
        (
            "/v1/containers/x?as_of=2026-02-30T00:00:00Z",
            422,
            "invalid_as_of",
        ),
    ];
    for (path, status, code) in cases {
        let (actual, text) = app.get_text(path).await;
        assert_eq!(actual, status, "{path}: {text}");
        let body: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["code"], code, "{path}");
    }
    let unauthorized = app
        .without_token()
        .get_usage("acme", "period=2026-11")
        .await;
    assert_eq!(unauthorized.0, 401);
    app.stop().await;
}

#[tokio::test]
async fn a_container_id_used_by_two_orgs_is_two_containers_and_needs_an_org_to_be_read() {
    let app = TestApp::spawn().await;
    let at = Utc::now().duration_trunc(Duration::seconds(1)).unwrap() - Duration::hours(1);
    post_all(
        &app,
        &[
            generated("org_a", "shared", at, EntryKind::Created),
            generated(
                "org_b",
                "shared",
                at + Duration::minutes(10),
                EntryKind::Stopped,
            ),
        ],
    )
    .await;
    wait_until_projected(&app).await;
    let (status, text) = app.get_text("/v1/containers/shared").await;
    assert_eq!(status, 409, "{text}");
    assert!(text.contains("ambiguous_container"), "{text}");
    let a = without_position(&app, "/v1/containers/shared?org_id=org_a").await;
    assert_eq!(a["state"], "running");
    assert_eq!(a["anomalies"], json!([]));
    let b = without_position(&app, "/v1/containers/shared?org_id=org_b").await;
    assert_eq!(b["intervals"], json!([]));
    assert_eq!(b["anomalies"][0]["kind"], "stop_while_not_running");
    app.stop().await;
}

#[tokio::test]
async fn events_appended_while_no_projector_runs_are_projected_once_it_starts() {
    let app = TestApp::spawn().await;
    let url = app.db.url.clone();
    let nats_url = app.nats.url.clone();
    let TestApp {
        service,
        nats,
        db,
        pool,
        ..
    } = app;
    service.unwrap().stop().await;

    // Appended by an appender alone: no projector is running.
    let (appender, _, task) = tally::ledger::Appender::start(
        pool.clone(),
        tally::ledger::AppendLimits {
            queue_max: 16,
            group_events_max: 1000,
        },
    );
    let at = Utc::now().duration_trunc(Duration::seconds(1)).unwrap() - Duration::hours(2);
    let events: Vec<tally::event::Event> = (0..3)
        .flat_map(|n| {
            let container = format!("offline_{n}");
            [
                generated("org_offline", &container, at, EntryKind::Created),
                generated(
                    "org_offline",
                    &container,
                    at + Duration::hours(1),
                    EntryKind::Stopped,
                ),
            ]
        })
        .map(|event| {
            tally::event::parse::parse_body(
                tally::event::parse::BodyKind::Native,
                event.body.to_string().as_bytes(),
                tally::event::TimeBounds {
                    now: Utc::now(),
                    backdate_max: Duration::days(35),
                },
                1000,
            )
            .unwrap()
            .remove(0)
        })
        .collect();
    appender.append(events).await.unwrap();
    drop(appender);
    task.await.unwrap();
    let checkpoint: i64 = sqlx::query_scalar("SELECT position FROM proj.checkpoint")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(checkpoint, 0, "nothing projected yet");

    let mut config = tally::config::Config::new(&url, &nats_url);
    config.bootstrap_token = Some(TOKEN.to_string());
    let service = tally::startup::Service::start(config).await.unwrap();
    let app = TestApp::of(service, pool, nats, db);
    wait_until_projected(&app).await;
    // Two hours after `at`: now, or a moment before (figures are never read ahead of now).
    let as_of = at + Duration::hours(2);
    let usage = without_position(
        &app,
        &format!(
            "/v1/orgs/org_offline/usage?period={}&as_of={}",
            Period::containing(at + Duration::minutes(30)),
            encode(as_of)
        ),
    )
    .await;
    let expected: i64 = (0..3)
        .map(|_| {
            let window = Period::containing(at + Duration::minutes(30))
                .window()
                .until(as_of);
            tally::runtime::Interval::new(at, Some(at + Duration::hours(1))).overlap_ms(window)
        })
        .sum();
    assert_eq!(usage["runtime_ms"], expected);
    let metrics = reqwest::get(app.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("tally_projection_lag_seconds"),
        "{metrics}"
    );
    assert!(metrics.contains("tally_projection_lag_positions"));
    app.stop().await;
}

/// Updates of `proj.container` Postgres has counted, and how many of them were HOT (the
/// row's new version on its page, no index touched); the counts reach the statistics
/// within seconds of each round's commit.
async fn container_updates(app: &TestApp) -> (i64, i64) {
    sqlx::query_as(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables \
         WHERE schemaname = 'proj' AND relname = 'container'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn commands_of_running_containers_within_the_hour_update_their_rows_without_touching_an_index(
) {
    let app = TestApp::spawn().await;
    let hour = Utc::now().duration_trunc(Duration::hours(1)).unwrap() - Duration::hours(2);
    let containers = ["a", "b", "c", "d", "e"];
    let round = |kind: EntryKind, minute: i64| -> Value {
        let events: Vec<Value> = containers
            .iter()
            .map(|c| {
                body(
                    Uuid::new_v4(),
                    "acme",
                    c,
                    hour + Duration::minutes(minute),
                    kind,
                )
            })
            .collect();
        json!({ "events": events })
    };
    // Created (inserts), then three rounds of one command each, each round projected
    // before the next is posted, so that each updates every container's row once.
    let (status, answer) = app.post_events(&round(EntryKind::Created, 1)).await;
    assert_eq!(status, 200, "{answer}");
    wait_until_projected(&app).await;
    for minute in [2, 3, 4] {
        let command = EntryKind::CommandRan { duration_ms: 10 };
        let (status, answer) = app.post_events(&round(command, minute)).await;
        assert_eq!(status, 200, "{answer}");
        wait_until_projected(&app).await;
    }
    let expected = 3 * containers.len() as i64;
    eventually(30, "the statistics count every update", || async {
        container_updates(&app).await.0 >= expected
    })
    .await;
    assert_eq!(container_updates(&app).await, (expected, expected));
    // A stop changes the intervals, which the running and stopped indexes are partial on:
    // those updates are not HOT, and the statistics say so (they can tell the two apart).
    let (status, answer) = app.post_events(&round(EntryKind::Stopped, 5)).await;
    assert_eq!(status, 200, "{answer}");
    wait_until_projected(&app).await;
    let stopped = expected + containers.len() as i64;
    eventually(30, "the statistics count the stops", || async {
        container_updates(&app).await.0 >= stopped
    })
    .await;
    assert_eq!(container_updates(&app).await, (stopped, expected));
    app.stop().await;
}

/// The projector runs on a thread of its own, with a pool of its own. Like the service's
/// tasks, it stops with the runtime that started the service even when the service was
/// never stopped, so that it does not go on projecting (and holding a session) for a
/// service that no longer exists.
#[test]
fn a_service_whose_runtime_ends_without_a_stop_leaves_no_session_open_on_its_database() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (service, db, nats) = runtime.block_on(async {
        let app = TestApp::spawn().await;
        let (status, _) = app
            .post_events(&json!({"events": [crate::helpers::valid_event("org_a", "box", 0)]}))
            .await;
        assert_eq!(status, 200);
        crate::helpers::projected_to_head(&app.pool, "the event is projected").await;
        let mut app = app;
        app.pool.close().await;
        let service = app.service.take().expect("the service runs");
        (service, app.db, app.nats)
    });
    drop(service);
    drop(runtime);

    let checker = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    checker.block_on(async {
        // One connection, so that the only session left of this test's is the one asking.
        let mut connection = <sqlx::PgConnection as sqlx::Connection>::connect(&db.url)
            .await
            .unwrap();
        let mut sessions = i64::MAX;
        for _ in 0..100 {
            sessions = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
            )
            .fetch_one(&mut connection)
            .await
            .unwrap();
            if sessions == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(sessions, 0, "every session of the service has ended");
    });
    drop(nats);
    drop(db);
}
