//! Admission facts kept in memory between checks (`tally::admission::cache`): answered
//! from memory while nothing they were read from changed, and dropped on every instance as
//! soon as Postgres notifies a change — by another instance, by this one, or by losing the
//! connection the notices come on.

use std::time::Duration;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};

use serde_json::{json, Value};
use uuid::Uuid;

use crate::admission::ready_org;
use crate::helpers::{ago, answered, eventually, projected_to_head, Api, TestApp, TestDb, TOKEN};
use crate::plans::pro_plan;
use tally::admission::cache::{
    self, CacheStats, FactsCache, Heartbeat, HEARTBEAT_APPLICATION_NAME, LISTENER_APPLICATION_NAME,
};
use tally::admission::{
    self, Checker, Request, EVENTS_AHEAD_READ_MAX, ORG_CONTAINERS_KEPT_MAX, RECENT_INTERVALS_MAX,
};
use tally::billing::Action;
use tally::event::canonical::timestamp;
use tally::event::OrgId;
use tally::projection::Freshness;
use tally::runtime::Interval;
use tally::startup::Service;

async fn check_at(api: &Api, body: &Value) -> Value {
    answered(200, api.check_admission(body).await)
}

/// Reserves a slot of `org` for `ttl_seconds` through `api`'s instance: 201 expected.
async fn reserve_at(api: &Api, org: &str, ttl_seconds: u64) -> Value {
    let body = json!({"org_id": org, "action": "create", "ttl_seconds": ttl_seconds});
    answered(201, api.reserve(&body).await)
}

/// Releases a reservation `reserve_at` granted, through `api`'s instance.
async fn release_at(api: &Api, granted: &Value) {
    let id = granted["reservation_id"].as_str().unwrap();
    answered(200, api.release(id).await);
}

/// A new version of plan `pro` with two running slots, through `api`'s instance:
/// 201, a new version.
async fn roomier_plan(api: &Api) {
    let mut roomier = pro_plan();
    roomier["max_running_containers"] = json!(2);
    answered(201, api.put_plan("pro", &roomier).await);
}

fn stats(app: &TestApp) -> CacheStats {
    app.service.as_ref().unwrap().checker.cache().stats()
}

/// Checks `body` on the first instance until one is answered from memory.
async fn warm(app: &TestApp, body: &Value) {
    eventually(5, "a check is answered from memory", || async {
        let before = stats(app).hits;
        check_at(app, body).await;
        stats(app).hits > before
    })
    .await;
}

async fn second_instance(app: &TestApp) -> Service {
    let mut config = tally::config::Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    Service::start(config).await.unwrap()
}

fn create(container: &str) -> Value {
    json!({"org_id": "acme", "action": "create", "container_id": container})
}

fn reasons(answer: &Value) -> Vec<String> {
    serde_json::from_value(answer["reasons"].clone()).unwrap()
}

#[tokio::test]
async fn another_instances_reservations_events_and_plans_reach_the_facts_this_one_keeps() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let second = second_instance(&app).await;
    let (first, other) = (app.api.clone(), app.at(second.local_addr));
    warm(&app, &create("c9")).await;
    assert_eq!(check_at(&first, &create("c9")).await["allowed"], true);

    // A reservation granted by the other instance takes the only slot here too.
    let granted = reserve_at(&other, "acme", 300).await;
    eventually(
        2,
        "the other instance's reservation counts here",
        || async { reasons(&check_at(&first, &create("c9")).await) == ["concurrency_limit"] },
    )
    .await;

    // Released there, free here.
    release_at(&other, &granted).await;
    eventually(2, "the release counts here", || async {
        check_at(&first, &create("c9")).await["allowed"] == true
    })
    .await;

    // A container created through the other instance runs here once projected.
    warm(&app, &create("c9")).await;
    let created = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
                         "container_id": "c1", "occurred_at": ago(5)});
    answered(200, other.post_events(&created).await);
    eventually(3, "the other instance's container runs here", || async {
        let answer = check_at(&first, &create("c9")).await;
        answer["running_containers"] == 1 && reasons(&answer) == ["concurrency_limit"]
    })
    .await;

    // A plan changed through the other instance applies here once projected.
    warm(&app, &create("c9")).await;
    roomier_plan(&other).await;
    eventually(
        3,
        "the other instance's plan change applies here",
        || async {
            let answer = check_at(&first, &create("c9")).await;
            answer["max_running_containers"] == 2 && answer["allowed"] == true
        },
    )
    .await;
    second.stop().await;
    app.stop().await;
}

#[tokio::test]
async fn a_check_right_after_this_instances_own_reservation_release_or_event_counts_it() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let base = app.api.clone();
    warm(&app, &create("c9")).await;
    let granted = reserve_at(&base, "acme", 300).await;
    assert_eq!(
        reasons(&check_at(&base, &create("c9")).await),
        ["concurrency_limit"]
    );

    warm(&app, &create("c9")).await;
    release_at(&base, &granted).await;
    assert_eq!(check_at(&base, &create("c9")).await["allowed"], true);

    warm(&app, &create("c9")).await;
    let created = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
                         "container_id": "c1", "occurred_at": ago(5)});
    let (status, response) = app.post_events(&created).await;
    assert_eq!(status, 200, "{response}");
    let answer = check_at(&base, &create("c9")).await;
    assert_eq!(answer["running_containers"], 1, "{answer}");
    assert_eq!(reasons(&answer), ["concurrency_limit"]);

    // A plan definition is an event of no org: it counts for every org's next check.
    warm(&app, &create("c9")).await;
    roomier_plan(&base).await;
    let answer = check_at(&base, &create("c9")).await;
    assert_eq!(answer["max_running_containers"], 2, "{answer}");
    assert_eq!(answer["allowed"], true, "{answer}");
    app.stop().await;
}

#[tokio::test]
async fn a_reservation_stops_counting_in_kept_facts_when_it_expires_though_no_notice_says_so() {
    let app = TestApp::spawn().await;
    let base = app.api.clone();
    ready_org(&app, "beta").await;
    let beta = json!({"org_id": "beta", "action": "create"});
    let granted = reserve_at(&base, "beta", 1).await;
    warm(&app, &beta).await;
    assert_eq!(
        reasons(&check_at(&base, &beta).await),
        ["concurrency_limit"]
    );
    let expires_at: chrono::DateTime<chrono::Utc> =
        granted["expires_at"].as_str().unwrap().parse().unwrap();
    tokio::time::sleep(
        (expires_at - chrono::Utc::now() + chrono::Duration::milliseconds(50))
            .to_std()
            .unwrap_or_default(),
    )
    .await;
    let hits = stats(&app).hits;
    assert_eq!(check_at(&base, &beta).await["allowed"], true);
    assert_eq!(stats(&app).hits, hits + 1, "answered from memory");
    app.stop().await;
}

#[tokio::test]
async fn an_org_with_events_dated_ahead_is_answered_from_memory_with_its_runtime_up_to_now() {
    let app = TestApp::spawn_mid_period().await;
    let start = app.now().duration_trunc(TimeDelta::seconds(1)).unwrap();
    let minutes = TimeDelta::minutes;
    let event = |kind: &str, container: &str, at| {
        json!({"id": Uuid::new_v4(), "type": format!("container.{kind}"), "org_id": "acme",
               "container_id": container, "occurred_at": timestamp(at)})
    };
    // c1 ran 20 minutes; c2 ran 5 and resumes 3 minutes ahead; c3 started 40 minutes ago
    // and stops 4 minutes ahead, so it runs now.
    let events = [
        event("created", "c1", start - minutes(30)),
        event("stopped", "c1", start - minutes(10)),
        event("created", "c2", start - minutes(20)),
        event("stopped", "c2", start - minutes(15)),
        event("resumed", "c2", start + minutes(3)),
        event("created", "c3", start - minutes(40)),
        event("stopped", "c3", start + minutes(4)),
    ];
    answered(200, app.post_events(&json!({ "events": events })).await);
    projected_to_head(&app.pool, "the events are projected").await;

    let body = json!({"org_id": "acme", "action": "create"});
    warm(&app, &body).await;
    let before = app
        .now()
        .duration_trunc(TimeDelta::milliseconds(1))
        .unwrap();
    let hits = stats(&app).hits;
    let used = check_at(&app, &body).await["runtime_used_ms"]
        .as_i64()
        .unwrap();
    let after = app.now();
    assert_eq!(stats(&app).hits, hits + 1, "answered from memory");
    let done = (minutes(20) + minutes(5)).num_milliseconds();
    let c3_since = start - minutes(40);
    assert!(
        ((before - c3_since).num_milliseconds()..=(after - c3_since).num_milliseconds())
            .contains(&(used - done)),
        "{used} ms: 25 minutes, and c3's from its start to the check"
    );
    app.stop().await;
}

#[tokio::test]
async fn losing_the_listening_connection_empties_the_cache_until_it_listens_again() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let second = second_instance(&app).await;
    let (first, other) = (app.api.clone(), app.at(second.local_addr));
    warm(&app, &create("c9")).await;
    // The second instance's listener connects on its own time: wait for both.
    eventually(5, "both instances' listeners are connected", || async {
        connections(&app.pool, LISTENER_APPLICATION_NAME).await == 2
    })
    .await;
    let terminated = terminate(&app.pool, LISTENER_APPLICATION_NAME).await;
    // Both instances listen; both lose their connection.
    assert_eq!(terminated, [true, true]);
    // Granted while nobody listens (the listeners connect again 200 ms later): its notice
    // is lost. (That the cache answers nothing in that gap is a unit test's; here, that
    // listening again starts from nothing.)
    reserve_at(&other, "acme", 300).await;
    eventually(2, "the reservation counts here", || async {
        reasons(&check_at(&first, &create("c9")).await) == ["concurrency_limit"]
    })
    .await;
    // Listening again, checks are answered from memory again, still right.
    warm(&app, &create("c9")).await;
    assert_eq!(
        reasons(&check_at(&first, &create("c9")).await),
        ["concurrency_limit"]
    );
    second.stop().await;
    app.stop().await;
}

/// A listener with `heartbeat` on a prepared database where nothing else runs (no
/// service, so no notice but what the test sends); its cache and the token that stops it.
fn own_listener(
    pool: &sqlx::PgPool,
    heartbeat: Heartbeat,
) -> (FactsCache, tokio_util::sync::CancellationToken) {
    let cache = FactsCache::default();
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::spawn(cache::listen_with(
        pool.clone(),
        cache.clone(),
        heartbeat,
        shutdown.clone(),
    ));
    (cache, shutdown)
}

/// Notifies with empty notices every 50 ms until `stop`.
fn notices_until(pool: &sqlx::PgPool, stop: tokio_util::sync::CancellationToken) {
    let pool = pool.clone();
    tokio::spawn(async move {
        while !stop.is_cancelled() {
            tally::projection::notice::notify(&pool, "{}")
                .await
                .unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
}

/// No heartbeat of its own: it hears only what the test sends.
const SILENT: Heartbeat = Heartbeat {
    interval: None,
    deadline: Duration::from_millis(300),
};

/// Heartbeats ten times a deadline, so that a test sees several deadlines in seconds.
const QUICK: Heartbeat = Heartbeat {
    interval: Some(Duration::from_millis(100)),
    deadline: Duration::from_millis(900),
};

/// A [`QUICK`] listener on `pool`'s database, once it listens.
async fn listening(pool: &sqlx::PgPool) -> (FactsCache, tokio_util::sync::CancellationToken) {
    let (cache, shutdown) = own_listener(pool, QUICK);
    eventually(5, "it listens", || async { cache.is_listening() }).await;
    (cache, shutdown)
}

/// After `wait`, `cache` still answers, on the connection it first listened on.
async fn on_its_first_connection_after(cache: &FactsCache, wait: Duration, when: &str) {
    tokio::time::sleep(wait).await;
    assert!(
        cache.is_listening(),
        "it still answers from memory {when}: {:?}",
        cache.stats()
    );
    assert_eq!(
        cache.stats().listens,
        1,
        "it kept its first connection {when}"
    );
}

/// Connections named `application_name` open to `pool`'s database.
async fn connections(pool: &sqlx::PgPool, application_name: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE application_name = $1 AND datname = current_database()",
    )
    .bind(application_name)
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Terminates the connections named `application_name` to `pool`'s database: one `true` for
/// each.
async fn terminate(pool: &sqlx::PgPool, application_name: &str) -> Vec<bool> {
    sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE application_name = $1 AND datname = current_database()",
    )
    .bind(application_name)
    .fetch_all(pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_listener_that_hears_nothing_within_its_deadline_takes_its_connection_for_lost_and_listens_again(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (cache, shutdown) = own_listener(&pool, SILENT);
    let talking = tokio_util::sync::CancellationToken::new();
    notices_until(&pool, talking.clone());
    eventually(5, "it listens", || async { cache.is_listening() }).await;
    assert_eq!(cache.stats().listens, 1);
    // A connection dropped without a reset looks just like this from the listening side.
    talking.cancel();
    eventually(5, "it gave up on the silent connection", || async {
        !cache.is_listening()
    })
    .await;
    notices_until(&pool, shutdown.clone());
    eventually(5, "it listens again, on a new connection", || async {
        cache.is_listening() && cache.stats().listens == 2
    })
    .await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_listener_that_never_hears_a_notice_never_answers_from_memory() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    // As behind a pooler in transaction mode: `LISTEN` succeeds and nothing arrives.
    let (cache, shutdown) = own_listener(&pool, SILENT);
    for _ in 0..20 {
        assert!(!cache.is_listening(), "it answers only once it has heard");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(cache.stats().listens, 0);
    // Heard at last, it answers.
    notices_until(&pool, shutdown.clone());
    eventually(5, "it listens", || async { cache.is_listening() }).await;
    shutdown.cancel();
}

#[tokio::test]
async fn heartbeats_keep_a_listener_listening_while_nothing_else_is_notified() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (cache, shutdown) = listening(&pool).await;
    on_its_first_connection_after(&cache, Duration::from_secs(4), "for four deadlines").await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_listener_keeps_listening_while_every_connection_of_the_services_pool_is_busy() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (cache, shutdown) = listening(&pool).await;
    // As under a flood of reads: every connection of the pool taken, for four deadlines.
    let mut busy = Vec::new();
    for _ in 0..pool.options().get_max_connections() {
        busy.push(pool.acquire().await.unwrap());
    }
    assert_eq!(pool.num_idle(), 0, "the whole pool is held");
    on_its_first_connection_after(&cache, Duration::from_secs(4), "while the pool was busy").await;
    drop(busy);
    shutdown.cancel();
}

#[tokio::test]
async fn a_lost_heartbeat_connection_is_replaced_while_the_listener_keeps_listening() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (cache, shutdown) = listening(&pool).await;
    assert_eq!(connections(&pool, HEARTBEAT_APPLICATION_NAME).await, 1);
    assert_eq!(terminate(&pool, HEARTBEAT_APPLICATION_NAME).await, [true]);
    // Terminated between two heartbeats or in one; either way the next one connects again.
    eventually(5, "the heartbeats connected again", || async {
        connections(&pool, HEARTBEAT_APPLICATION_NAME).await == 1
    })
    .await;
    on_its_first_connection_after(
        &cache,
        Duration::from_secs(2),
        "when its heartbeats' connection was lost",
    )
    .await;
    shutdown.cancel();
}

#[tokio::test]
async fn a_reservation_granted_or_released_here_counts_in_the_next_check_here_before_any_notice() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    // A checker whose cache takes itself to be listening but never hears a notice: only
    // what this instance drops itself changes what it keeps.
    let (_, head) = tokio::sync::watch::channel(0);
    let freshness = Freshness::new(head, Default::default());
    let checker = Checker::new(app.pool.clone(), freshness.clone(), app.clock);
    // It does not wait for the app's appends to be projected: wait here.
    let head = projected_to_head(&app.pool, "the app's appends are projected").await;
    checker.cache().listening(head);
    let request = Request {
        org_id: OrgId::parse("acme").unwrap(),
        action: Action::Create,
        container_id: None,
    };
    let reasons_now = || async {
        let answer = checker.check(&request).await.unwrap();
        let reasons: Vec<&str> = answer.decision.reasons.iter().map(|r| r.as_str()).collect();
        reasons.join(",")
    };
    assert_eq!(reasons_now().await, "");
    assert_eq!(reasons_now().await, "");
    assert_eq!(checker.cache().stats().hits, 1, "the second from memory");

    let (_, reservation) = admission::reserve(
        &app.pool,
        &freshness,
        checker.cache(),
        app.clock,
        &request,
        60,
        "test",
    )
    .await
    .unwrap();
    let reservation = reservation.expect("the free slot is granted");
    assert_eq!(reasons_now().await, "concurrency_limit");
    assert_eq!(reasons_now().await, "concurrency_limit");
    assert_eq!(
        checker.cache().stats().hits,
        2,
        "kept again after the grant"
    );

    let released = admission::release(
        &app.pool,
        checker.cache(),
        checker.clock(),
        reservation.id,
        "test",
    )
    .await
    .unwrap();
    assert_eq!(released, admission::Released::Released);
    assert_eq!(reasons_now().await, "");
    app.stop().await;
}

/// A small deterministic generator for the histories below (xorshift64*).
struct Draws(u64);

impl Draws {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

/// A container event of a drawn type for `org`, dated between two minutes ahead of `app`'s
/// now (after the instant facts were read at) and an hour before it (late for a container
/// with later events, which refolds it).
fn drawn_event(app: &TestApp, draws: &mut Draws, org: &str) -> Value {
    let container = format!("c{}", draws.below(5));
    let seconds_ago = draws.below(3_720) as i64 - 120;
    let mut event = json!({"id": Uuid::new_v4(), "org_id": org, "container_id": container,
                           "occurred_at": app.ago(seconds_ago)});
    let (kind, data) = match draws.below(5) {
        0 => (
            "container.created",
            json!({"name": "task", "image": "python:3.12"}),
        ),
        1 => ("container.stopped", json!({"reason": "idle"})),
        2 => ("container.resumed", Value::Null),
        3 => (
            "container.command_ran",
            json!({"command_id": Uuid::new_v4(), "exit_code": 0, "duration_ms": draws.below(5_000)}),
        ),
        _ => (
            "container.port_published",
            json!({"port": 8000 + draws.below(3), "url": "https://p.example.com/x"}),
        ),
    };
    event["type"] = json!(kind);
    if !data.is_null() {
        event["data"] = data;
    }
    event
}

/// The checks whose facts the test below keeps: one per way facts are keyed. Of an org
/// with few containers, the facts hold them all and answer every check; of a larger one, a
/// create shares its org's facts whatever container it names, a run keeps its container's.
fn kept_requests(org: &str) -> Vec<(Value, Request)> {
    let request = |action: Action, name: &str, container: Option<&str>| {
        let mut body = json!({"org_id": org, "action": name});
        if let Some(container) = container {
            body["container_id"] = json!(container);
        }
        let request = Request {
            org_id: OrgId::parse(org).unwrap(),
            action,
            container_id: container.map(|c| tally::event::ContainerId::parse(c).unwrap()),
        };
        (body, request)
    };
    vec![
        request(Action::Create, "create", Some("c0")),
        request(Action::Run, "run", Some("c1")),
        request(Action::PublishPort, "publish_port", Some("c3")),
    ]
}

/// Waits until this instance's listener has heard every round up to the projection's head.
async fn notices_heard(app: &TestApp, what: &str) {
    let head = projected_to_head(&app.pool, what).await;
    let cache = app.service.as_ref().unwrap().checker.cache().clone();
    eventually(5, what, || {
        let cache = cache.clone();
        async move { cache.projected() == Some(head) }
    })
    .await;
}

#[tokio::test]
async fn facts_this_instances_rounds_advance_equal_facts_read_afresh_at_the_instant_they_were_read()
{
    // Histories reach an hour back: mid-period, so that they stay in this period.
    let app = TestApp::spawn_mid_period().await;
    for org in ["acme", "other", "crowded"] {
        ready_org(&app, org).await;
    }
    // More containers than facts hold, so that crowded's are kept per container asked about.
    let crowded: Vec<Value> = (0..=admission::ORG_CONTAINERS_KEPT_MAX)
        .map(|n| {
            json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "crowded",
                   "container_id": format!("c{n}"), "occurred_at": app.ago(5_400)})
        })
        .collect();
    answered(200, app.post_events(&json!({ "events": crowded })).await);
    // Every set-up round heard before the first check. A check reads once the projection
    // holds its org's events, which may be before their rounds' notices arrive; a notice
    // of a round with an account event then drops the facts kept (such orgs are read
    // again, whatever the facts hold), which the round would take for a fact lost.
    notices_heard(&app, "the set-up's notices are heard").await;
    let cache = app.service.as_ref().unwrap().checker.cache().clone();
    let seed = 0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id());
    let mut draws = Draws(seed);
    let (mut compared, mut rounds_advancing) = (0, 0);
    for round in 0..40 {
        // From before the first check of the round: a reconnection while the later checks
        // wait drops the facts the earlier ones kept.
        let listens_before = cache.stats().listens;
        // Checked until kept (a read that a notice overtook is not); events dated after
        // now leave the answers to Postgres, but the facts are kept all the same.
        let requests: Vec<(Value, Request)> = ["acme", "crowded"]
            .into_iter()
            .flat_map(kept_requests)
            .collect();
        for (body, request) in &requests {
            eventually(5, "the check's facts are kept", || async {
                check_at(&app, body).await;
                cache.kept(request).is_some()
            })
            .await;
        }
        // Lost (the cache is off and empty until it listens again) or listening anew: either
        // drops every fact kept, so from then on the round has nothing to compare.
        let reconnected = || !cache.is_listening() || cache.stats().listens != listens_before;
        // Each check waits for its org's own events first, so no round touches acme or
        // crowded once their facts are kept: every fact is still kept when the round's
        // events are posted.
        for (body, request) in &requests {
            assert!(
                cache.kept(request).is_some() || reconnected(),
                "seed {seed:#x}, round {round}: {body} dropped before the round's events were posted; {:?}",
                cache.stats()
            );
        }
        let advanced_before = cache.stats().advanced;
        // Each round has events of both orgs whose facts are kept, so that it advances
        // both (facts it does not touch stay at their own checkpoint).
        let count = 2 + draws.below(8);
        let mut events: Vec<Value> = (0..count)
            .map(|n| {
                let org = ["acme", "crowded", "other", "acme"][n as usize % 4];
                drawn_event(&app, &mut draws, org)
            })
            .collect();
        // Now and then an account event, after which acme's facts are read again.
        let account = draws.below(8) == 0;
        if account {
            events.push(
                json!({"id": Uuid::new_v4(), "type": "org.verification_changed",
                               "org_id": "acme", "occurred_at": app.ago(30),
                               "data": {"verified": true}}),
            );
        }
        answered(200, app.post_events(&json!({ "events": events })).await);
        notices_heard(&app, "the round's notice is heard").await;
        if reconnected() {
            // The listener lost its connection (a machine too busy to hear a heartbeat
            // within its deadline) and dropped every fact, as it must: nothing to compare.
            continue;
        }
        for (body, request) in &requests {
            let acme = request.org_id.as_str() == "acme";
            let Some(kept) = cache.kept(request) else {
                if reconnected() {
                    break;
                }
                assert!(
                    account && acme,
                    "seed {seed:#x}, round {round}: {body} dropped; {:?}",
                    cache.stats()
                );
                continue;
            };
            assert!(
                !(account && acme),
                "seed {seed:#x}, round {round}: {body} kept past an account event"
            );
            assert_eq!(kept.whole(), acme, "seed {seed:#x}, round {round}: {body}");
            let fresh = admission::read_facts(&app.pool, request, kept.read_at())
                .await
                .unwrap();
            assert_eq!(kept, fresh, "seed {seed:#x}, round {round}: {body}");
            compared += 1;
        }
        rounds_advancing += u64::from(cache.stats().advanced > advanced_before);
    }
    assert!(compared >= 150, "{compared} facts compared");
    assert!(
        rounds_advancing >= 20,
        "{rounds_advancing} rounds advanced facts"
    );
    app.stop().await;
}

#[tokio::test]
async fn checks_right_after_this_instances_own_events_are_answered_from_memory_and_count_them() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let body = json!({"org_id": "acme", "action": "run", "container_id": "c0"});
    let created = |n: i64| {
        json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
               "container_id": format!("c{n}"), "occurred_at": ago(60 - n)})
    };
    answered(200, app.post_events(&created(0)).await);
    warm(&app, &body).await;
    for n in 1..10 {
        // No wait for the projection: the check waits for the round's notice, which
        // advances the facts kept, rather than reading Postgres.
        answered(200, app.post_events(&created(n)).await);
        let before = stats(&app);
        let answer = check_at(&app, &body).await;
        let after = stats(&app);
        assert_eq!(answer["running_containers"], n + 1, "{answer}");
        assert_eq!(
            (after.hits - before.hits, after.misses - before.misses),
            (1, 0),
            "the check after container {n} was created answered from memory"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn checks_naming_other_containers_of_a_small_org_are_answered_from_the_facts_one_check_kept()
{
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let event = |kind: &str, container: &str, seconds_ago: i64| {
        json!({"id": Uuid::new_v4(), "type": kind, "org_id": "acme",
               "container_id": container, "occurred_at": ago(seconds_ago)})
    };
    let events = json!({"events": [
        event("container.created", "c0", 120),
        event("container.created", "c1", 110),
        event("container.stopped", "c1", 100),
    ]});
    answered(200, app.post_events(&events).await);
    let run =
        |container: &str| json!({"org_id": "acme", "action": "run", "container_id": container});
    warm(&app, &run("c0")).await;
    // Running, stopped, never created: each answered from the facts c0's check kept.
    for (container, running) in [("c0", true), ("c1", false), ("c9", false)] {
        let before = stats(&app);
        let answer = check_at(&app, &run(container)).await;
        let after = stats(&app);
        assert_eq!(answer["allowed"], running, "{container}: {answer}");
        if !running {
            assert_eq!(
                reasons(&answer),
                ["container_not_running"],
                "{container}: {answer}"
            );
        }
        assert_eq!(
            (after.hits - before.hits, after.misses - before.misses),
            (1, 0),
            "the check of {container} answered from memory"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn facts_name_the_containers_whose_last_event_is_after_the_instant_and_no_other() {
    let app = TestApp::spawn_mid_period().await;
    ready_org(&app, "acme").await;
    // The facts are read at half past an hour two hours back: containers whose last event
    // is on both sides of the instant and of the hours around it.
    let hour = app.now().duration_trunc(TimeDelta::hours(1)).unwrap() - TimeDelta::hours(2);
    let read_at = hour + TimeDelta::minutes(30);
    let last_events = [
        ("hour_before", -20),
        ("same_hour_before", 10),
        ("at_the_instant", 30),
        ("same_hour_after", 40),
        ("next_hour", 65),
    ];
    let events: Vec<Value> = last_events
        .iter()
        .map(|(container, minutes)| {
            json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
                   "container_id": container,
                   "occurred_at": timestamp(hour + TimeDelta::minutes(*minutes))})
        })
        .collect();
    answered(200, app.post_events(&json!({ "events": events })).await);
    // A container whose one event after the instant is voided: the ledger still holds it.
    let voided_stop = lifecycle_event(
        "acme",
        "stopped",
        "voided_after",
        read_at + TimeDelta::minutes(5),
    );
    let created = lifecycle_event(
        "acme",
        "created",
        "voided_after",
        read_at - TimeDelta::minutes(5),
    );
    answered(
        200,
        app.post_events(&json!({ "events": [created, &voided_stop] }))
            .await,
    );
    let void = json!({"event_id": voided_stop["id"], "reason": "sent twice"});
    answered(201, app.post_void(&void).await);
    // skewed sends more commands dated after the instant than the statement reads of the
    // ledger, all of one container, and has another whose last event is before it.
    let command = |n: usize| {
        json!({"id": Uuid::new_v4(), "type": "container.command_ran", "org_id": "skewed",
               "container_id": "busy",
               "occurred_at": timestamp(read_at + TimeDelta::milliseconds(1 + n as i64)),
               "data": {"command_id": format!("c{n}"), "exit_code": 0, "duration_ms": 1}})
    };
    let mut skewed = vec![
        lifecycle_event("skewed", "created", "busy", read_at - TimeDelta::minutes(1)),
        lifecycle_event("skewed", "created", "idle", read_at - TimeDelta::minutes(1)),
    ];
    skewed.extend((0..=EVENTS_AHEAD_READ_MAX).map(command));
    for batch in skewed.chunks(1_000) {
        answered(200, app.post_events(&json!({ "events": batch })).await);
    }
    projected_to_head(&app.pool, "the containers are projected").await;
    let named_ahead = |org: &str| {
        let request = Request {
            org_id: OrgId::parse(org).unwrap(),
            action: Action::Create,
            container_id: None,
        };
        let pool = app.pool.clone();
        async move {
            let facts = admission::read_facts(&pool, &request, read_at)
                .await
                .unwrap();
            facts
                .future_containers()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(named_ahead("acme").await, ["next_hour", "same_hour_after"]);
    assert_eq!(named_ahead("skewed").await, ["busy"]);
    app.stop().await;
}

/// The answer to `body`, and instants before and after it was asked (the first cut to the
/// millisecond, as the check's instant is).
async fn timed_check(app: &TestApp, body: &Value) -> (Value, DateTime<Utc>, DateTime<Utc>) {
    let from = app
        .now()
        .duration_trunc(TimeDelta::milliseconds(1))
        .unwrap();
    let answer = check_at(app, body).await;
    (answer, from, app.now())
}

/// An event of `kind` of `org`'s `container` at `at`.
fn lifecycle_event(org: &str, kind: &str, container: &str, at: DateTime<Utc>) -> Value {
    json!({"id": Uuid::new_v4(), "type": format!("container.{kind}"), "org_id": org,
           "container_id": container, "occurred_at": timestamp(at)})
}

#[tokio::test]
async fn facts_hold_of_each_container_how_many_intervals_it_has_and_only_those_ending_after_their_read(
) {
    let app = TestApp::spawn_mid_period().await;
    let read_at = app.now().duration_trunc(TimeDelta::seconds(1)).unwrap() - TimeDelta::hours(1);
    let at = |minutes: i64, seconds: i64| {
        read_at + TimeDelta::minutes(minutes) + TimeDelta::seconds(seconds)
    };
    let mut events = Vec::new();
    // In calm and in crowded, `long` runs from 50 minutes before the read, stops and
    // resumes 40 times before it (30 s apart) and then after it (a minute apart, the last
    // resume still running) as often as leaves the most intervals after the read that facts
    // keep; `quiet` runs 10 minutes and stops 20 minutes before it.
    let after_read = RECENT_INTERVALS_MAX as i64 - 1;
    for org in ["calm", "crowded"] {
        events.push(lifecycle_event(org, "created", "long", at(-50, 0)));
        for k in 0..40 {
            events.push(lifecycle_event(
                org,
                "stopped",
                "long",
                at(-50, 60 * k + 30),
            ));
            events.push(lifecycle_event(
                org,
                "resumed",
                "long",
                at(-50, 60 * k + 60),
            ));
        }
        for k in 0..after_read {
            events.push(lifecycle_event(org, "stopped", "long", at(2 * k + 1, 0)));
            events.push(lifecycle_event(org, "resumed", "long", at(2 * k + 2, 0)));
        }
        events.push(lifecycle_event(org, "created", "quiet", at(-30, 0)));
        events.push(lifecycle_event(org, "stopped", "quiet", at(-20, 0)));
    }
    // crowded has more containers than facts hold whole: they hold the one named.
    for n in 0..ORG_CONTAINERS_KEPT_MAX {
        events.push(lifecycle_event(
            "crowded",
            "created",
            &format!("c{n}"),
            at(-40, 0),
        ));
    }
    // noisy's `churn` stops and resumes twice before the read and then once more than
    // facts keep after it.
    events.push(lifecycle_event("noisy", "created", "churn", at(-5, 0)));
    for k in 0..2 {
        events.push(lifecycle_event(
            "noisy",
            "stopped",
            "churn",
            at(-4 + 2 * k, 0),
        ));
        events.push(lifecycle_event(
            "noisy",
            "resumed",
            "churn",
            at(-3 + 2 * k, 0),
        ));
    }
    for k in 0..RECENT_INTERVALS_MAX as i64 {
        events.push(lifecycle_event(
            "noisy",
            "stopped",
            "churn",
            at(0, 20 * k + 10),
        ));
        events.push(lifecycle_event(
            "noisy",
            "resumed",
            "churn",
            at(0, 20 * k + 20),
        ));
    }
    answered(200, app.post_events(&json!({ "events": events })).await);
    projected_to_head(&app.pool, "the containers are projected").await;
    let read = |org: &str, container: Option<&str>| {
        let request = Request {
            org_id: OrgId::parse(org).unwrap(),
            action: container.map_or(Action::Create, |_| Action::Run),
            container_id: container.map(|c| tally::event::ContainerId::parse(c).unwrap()),
        };
        let pool = app.pool.clone();
        async move {
            admission::read_facts(&pool, &request, read_at)
                .await
                .unwrap()
        }
    };
    // The interval running at the read, and one for each resume after it.
    let long_after_read: Vec<Interval> = (0..=after_read)
        .map(|k| {
            let start = if k == 0 { at(-10, 0) } else { at(2 * k, 0) };
            let end = (k < after_read).then(|| at(2 * k + 1, 0));
            Interval::new(start, end)
        })
        .collect();
    assert_eq!(long_after_read.len(), RECENT_INTERVALS_MAX);
    let long = Some((1 + 40 + after_read as usize, &long_after_read[..]));
    let quiet = Some((1, &[][..]));

    let calm = read("calm", None).await;
    assert!(calm.whole() && calm.keepable());
    assert_eq!(
        (calm.intervals_of("long"), calm.intervals_of("quiet")),
        (long, quiet)
    );
    // Named, and among the containers with events after the read.
    let named = read("crowded", Some("long")).await;
    assert!(!named.whole() && named.keepable());
    assert_eq!(named.intervals_of("long"), long);
    let other = read("crowded", Some("quiet")).await;
    assert_eq!(other.future_containers().collect::<Vec<_>>(), ["long"]);
    assert_eq!(
        (other.intervals_of("long"), other.intervals_of("quiet")),
        (long, quiet)
    );

    let noisy = read("noisy", None).await;
    let (total, held) = noisy.intervals_of("churn").unwrap();
    assert_eq!(
        (total, held.len()),
        (RECENT_INTERVALS_MAX + 3, RECENT_INTERVALS_MAX + 1)
    );
    assert!(!noisy.keepable());
    app.stop().await;
}

#[tokio::test]
async fn an_org_whose_container_stops_and_resumes_over_and_over_ahead_is_answered_right_from_postgres(
) {
    let app = TestApp::spawn_mid_period().await;
    let start = app.now().duration_trunc(TimeDelta::seconds(1)).unwrap();
    let seconds = TimeDelta::seconds;
    // steady's container stopped and resumed 40 times before now and stops two minutes
    // ahead; restless's runs from ten minutes ago and stops and resumes from a minute
    // ahead, once more than facts keep.
    let mut events = vec![lifecycle_event(
        "steady",
        "created",
        "c",
        start - TimeDelta::hours(1),
    )];
    for k in 0..40 {
        events.push(lifecycle_event(
            "steady",
            "stopped",
            "c",
            start - seconds(3000 - 60 * k),
        ));
        events.push(lifecycle_event(
            "steady",
            "resumed",
            "c",
            start - seconds(2970 - 60 * k),
        ));
    }
    events.push(lifecycle_event(
        "steady",
        "stopped",
        "c",
        start + TimeDelta::minutes(2),
    ));
    let since = start - TimeDelta::minutes(10);
    events.push(lifecycle_event("restless", "created", "c", since));
    for k in 0..RECENT_INTERVALS_MAX as i64 {
        events.push(lifecycle_event(
            "restless",
            "stopped",
            "c",
            start + seconds(60 + 10 * k),
        ));
        events.push(lifecycle_event(
            "restless",
            "resumed",
            "c",
            start + seconds(65 + 10 * k),
        ));
    }
    answered(200, app.post_events(&json!({ "events": events })).await);
    projected_to_head(&app.pool, "the events are projected").await;

    // A long history before now does not keep facts from being kept; they hold the one
    // interval that ends after their read, and from it and the totals the runtime is 600 s,
    // 39 runs of 30 s, and the last run from 630 s before the start up to the check.
    let steady = json!({"org_id": "steady", "action": "create"});
    warm(&app, &steady).await;
    let before = stats(&app);
    let (answer, checked_from, checked_to) = timed_check(&app, &steady).await;
    assert_eq!(stats(&app).hits, before.hits + 1, "from memory");
    let (done, last_run) = (600_000 + 39 * 30_000, start - seconds(630));
    let used = answer["runtime_used_ms"].as_i64().unwrap() - done;
    assert!(
        ((checked_from - last_run).num_milliseconds()..=(checked_to - last_run).num_milliseconds())
            .contains(&used),
        "{used} ms of the last run up to the check"
    );

    let body = json!({"org_id": "restless", "action": "create"});
    for _ in 0..3 {
        let before = stats(&app);
        let (answer, checked_from, checked_to) = timed_check(&app, &body).await;
        let after = stats(&app);
        assert_eq!(
            (after.hits, after.misses),
            (before.hits, before.misses + 1),
            "from Postgres"
        );
        assert_eq!(answer["running_containers"], 1, "{answer}");
        let used = answer["runtime_used_ms"].as_i64().unwrap();
        assert!(
            ((checked_from - since).num_milliseconds()..=(checked_to - since).num_milliseconds())
                .contains(&used),
            "{used} ms: from the start to the check"
        );
    }
    app.stop().await;
}
