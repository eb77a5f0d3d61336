//! Admission and reservations: decisions from the projection, and reservations
//! that grant the last slot exactly once however many requests race for it, on one
//! instance or several.

use std::time::Duration;

use futures::future::join_all;
use reqwest::Method;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::helpers::{eventually, mid_period, projected_to_head, TestApp, TOKEN};
use crate::plans::pro_plan;

async fn check(app: &TestApp, body: Value) -> Value {
    let (status, answer) = app.check_admission(&body).await;
    assert_eq!(status, 200, "{answer}");
    answer
}

async fn event(app: &TestApp, body: Value) {
    let (status, response) = app.post_events(&body).await;
    assert_eq!(status, 200, "{response}");
}

/// `org` on plan `pro` (one running slot, an hour included, overage denied), verified and
/// billing eligible.
pub async fn ready_org(app: &TestApp, org: &str) {
    let (status, plan) = app.put_plan("pro", &pro_plan()).await;
    assert!(status == 201 || status == 200, "{plan}");
    for (event_type, data) in [
        ("org.plan_changed", json!({"plan": "pro"})),
        ("org.verification_changed", json!({"verified": true})),
        ("org.billing_eligibility_changed", json!({"eligible": true})),
    ] {
        event(
            app,
            json!({"id": Uuid::new_v4(), "type": event_type, "org_id": org, "occurred_at": app.ago(600), "data": data}),
        )
        .await;
    }
}

/// A container's event `seconds_ago` before `app`'s now.
fn container_event(
    app: &TestApp,
    org: &str,
    container: &str,
    event_type: &str,
    seconds_ago: i64,
) -> Value {
    json!({"id": Uuid::new_v4(), "type": event_type, "org_id": org, "container_id": container,
           "occurred_at": app.ago(seconds_ago)})
}

async fn reservations_stored(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM admission_reservation")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn an_org_never_seen_is_refused_for_its_free_plan_verification_and_eligibility() {
    let app = TestApp::spawn().await;
    let answer = check(&app, json!({"org_id": "stranger", "action": "create"})).await;
    assert_eq!(
        answer,
        json!({"position": 0, "allowed": false, "reasons": ["plan_excludes_sandbox", "not_verified", "not_billing_eligible"],
               "plan": "free", "period": app.now().format("%Y-%m").to_string(), "runtime_used_ms": 0,
               "runtime_included_ms": 0, "overage": true, "running_containers": 0,
               "max_running_containers": 0})
    );
    app.stop().await;
}

#[tokio::test]
async fn checks_follow_the_orgs_account_plan_usage_and_containers_read_your_writes() {
    // Its history reaches 90 minutes back and is read as this period's usage: mid-period.
    let app = TestApp::spawn_mid_period().await;
    ready_org(&app, "acme").await;
    let create = json!({"org_id": "acme", "action": "create"});
    let answer = check(&app, create.clone()).await;
    assert_eq!(answer["allowed"], true, "{answer}");
    assert_eq!(answer["plan"], "pro");
    assert_eq!(answer["runtime_included_ms"], 3_600_000);

    // Acknowledged, then checked at once: the check sees it.
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 1800),
    )
    .await;
    let answer = check(&app, create.clone()).await;
    assert_eq!(answer["reasons"], json!(["concurrency_limit"]));
    assert_eq!(answer["running_containers"], 1);
    let run = check(
        &app,
        json!({"org_id": "acme", "action": "run", "container_id": "c1"}),
    )
    .await;
    assert_eq!(run["allowed"], true, "{run}");
    let run_other = check(
        &app,
        json!({"org_id": "acme", "action": "run", "container_id": "c2"}),
    )
    .await;
    assert_eq!(run_other["reasons"], json!(["container_not_running"]));

    // An hour and a half of runtime against an hour included, overage denied.
    event(
        &app,
        container_event(&app, "acme", "c0", "container.created", 5400),
    )
    .await;
    event(
        &app,
        container_event(&app, "acme", "c0", "container.stopped", 2000),
    )
    .await;
    let answer = check(
        &app,
        json!({"org_id": "acme", "action": "run", "container_id": "c1"}),
    )
    .await;
    assert_eq!(
        answer["reasons"],
        json!(["runtime_allowance_exhausted"]),
        "{answer}"
    );
    assert_eq!(answer["overage"], true);
    assert!(answer["runtime_used_ms"].as_i64().unwrap() >= 3_400_000 + 1_800_000);

    // The org moved to pro ten minutes ago; before that it was on free, where nothing is
    // included, and by the time of the move it had used more than pro's hour: every
    // millisecond so far is overage, and the plan reported is pro.
    let period = app.now().format("%Y-%m").to_string();
    let (_, usage) = app.get_usage("acme", &format!("period={period}")).await;
    assert_eq!(usage["plan"], "pro", "{usage}");
    assert_eq!(usage["overage_ms"], usage["runtime_ms"], "{usage}");
    app.stop().await;
}

#[tokio::test]
async fn concurrent_checks_for_many_orgs_read_together_each_get_their_own_orgs_answer() {
    let app = TestApp::spawn().await;
    // Even orgs are ready on pro with their own container running; odd orgs were never seen.
    let orgs: Vec<String> = (0..12).map(|n| format!("org{n}")).collect();
    for (n, org) in orgs.iter().enumerate() {
        if n % 2 == 0 {
            ready_org(&app, org).await;
            event(
                &app,
                container_event(&app, org, &format!("box-{org}"), "container.created", 60),
            )
            .await;
        }
    }
    let mut requests = Vec::new();
    for round in 0..20 {
        for (n, org) in orgs.iter().enumerate() {
            // Each org's own container, or the next org's: running only for the first.
            let owner = if round % 2 == 0 {
                n
            } else {
                (n + 1) % orgs.len()
            };
            let container = format!("box-{}", orgs[owner]);
            requests.push((
                n,
                round % 2 == 0,
                json!({"org_id": org, "action": "run", "container_id": container}),
            ));
        }
    }
    let answers = join_all(
        requests
            .iter()
            .map(|(_, _, body)| check(&app, body.clone())),
    )
    .await;
    for ((n, own_container, body), answer) in requests.iter().zip(&answers) {
        let expected = match (n % 2 == 0, own_container) {
            (true, true) => json!([]),
            (true, false) => json!(["container_not_running"]),
            (false, _) => json!([
                "plan_excludes_sandbox",
                "not_verified",
                "not_billing_eligible",
                "container_not_running"
            ]),
        };
        assert_eq!(answer["reasons"], expected, "{body} → {answer}");
        assert_eq!(
            answer["plan"],
            if n % 2 == 0 { "pro" } else { "free" },
            "{body} → {answer}"
        );
        assert_eq!(
            answer["running_containers"],
            i64::from(n % 2 == 0),
            "{body} → {answer}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn a_check_after_an_append_cuts_the_projectors_linger_short_instead_of_waiting_it_out() {
    // A projector that, once woken by a commit, would wait a minute for more: far past the
    // two seconds a check waits for freshness before answering 503. The check's request to
    // hurry is what ends the linger.
    let app = TestApp::spawn_with(|config| {
        config.projector_linger_ms = 60_000;
        config.projector_poll_ms = 60_000;
    })
    .await;
    ready_org(&app, "acme").await;
    let create = json!({"org_id": "acme", "action": "create"});
    for container in ["c1", "c2", "c3"] {
        event(
            &app,
            container_event(&app, "acme", container, "container.created", 60),
        )
        .await;
        let answer = check(&app, create.clone()).await;
        assert_eq!(answer["reasons"], json!(["concurrency_limit"]), "{answer}");
    }
    let answer = check(&app, create).await;
    assert_eq!(answer["running_containers"], 3, "{answer}");
    app.stop().await;
}

#[tokio::test]
async fn fifty_racing_reservations_for_the_last_slot_grant_exactly_one_and_the_slot_comes_back() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let body =
        json!({"org_id": "acme", "action": "create", "container_id": "c1", "ttl_seconds": 2});
    let answers = join_all((0..50).map(|_| app.reserve(&body))).await;
    let granted: Vec<&Value> = answers
        .iter()
        .filter(|(status, _)| *status == 201)
        .map(|(_, a)| a)
        .collect();
    assert_eq!(granted.len(), 1, "{answers:?}");
    for (status, refused) in answers.iter().filter(|(status, _)| *status != 201) {
        assert_eq!(*status, 409, "{refused}");
        assert_eq!(refused["error"]["code"], "concurrency_limit");
    }
    let refusals: i64 = sqlx::query_scalar("SELECT count(*) FROM admission_refusal")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(refusals, 49, "each refusal is recorded");

    // Expiry frees the slot without any sweeper.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let (status, kept) = app
        .reserve(&json!({"org_id": "acme", "action": "create", "container_id": "c1"}))
        .await;
    assert_eq!(status, 201, "{kept}");

    // Consumed by its container's `created`: the slot stays taken, now by the container.
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    let reservation_id = kept["reservation_id"].as_str().unwrap().to_owned();
    eventually(10, "the reservation is consumed", || async {
        let consumed: Option<Uuid> =
            sqlx::query_scalar("SELECT consumed_by FROM admission_reservation WHERE id = $1::uuid")
                .bind(&reservation_id)
                .fetch_one(&app.pool)
                .await
                .unwrap();
        consumed.is_some()
    })
    .await;
    let (status, refused) = app
        .reserve(&json!({"org_id": "acme", "action": "create"}))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (409, Some("concurrency_limit"))
    );
    let (release, _) = app.release(&reservation_id).await;
    assert_eq!(release, 409, "a consumed reservation cannot be released");

    // Stopped: free again. A released reservation frees its slot at once.
    event(
        &app,
        container_event(&app, "acme", "c1", "container.stopped", 1),
    )
    .await;
    let (status, held) = app
        .reserve(&json!({"org_id": "acme", "action": "resume", "container_id": "c1"}))
        .await;
    assert_eq!(status, 201, "{held}");
    let id = held["reservation_id"].as_str().unwrap();
    for _ in 0..2 {
        let (release, _) = app.release(id).await;
        assert_eq!(release, 200, "released, and releasing again is harmless");
    }
    let (status, again) = app
        .reserve(&json!({"org_id": "acme", "action": "create"}))
        .await;
    assert_eq!(status, 201, "{again}");
    app.stop().await;
}

#[tokio::test]
async fn a_reservation_naming_no_container_is_not_consumed_by_a_create_and_is_released_after_it() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let (status, anonymous) = app
        .reserve(&json!({"org_id": "acme", "action": "create", "ttl_seconds": 300}))
        .await;
    assert_eq!(status, 201, "{anonymous}");
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    // A check reads this instance's appends: the round that projected the create has
    // committed, and with it any reservation that round consumed.
    let answer = check(&app, json!({"org_id": "acme", "action": "create"})).await;
    assert_eq!(answer["running_containers"], 1, "{answer}");
    let id = anonymous["reservation_id"].as_str().unwrap();
    let consumed: Option<Uuid> =
        sqlx::query_scalar("SELECT consumed_by FROM admission_reservation WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        consumed, None,
        "a create takes no reservation it was not named in"
    );
    let (release, body) = app.release(id).await;
    assert_eq!(release, 200, "{body}");

    event(
        &app,
        container_event(&app, "acme", "c1", "container.stopped", 1),
    )
    .await;
    let (status, again) = app
        .reserve(&json!({"org_id": "acme", "action": "create"}))
        .await;
    assert_eq!(
        status, 201,
        "released and stopped, the slot is free: {again}"
    );
    app.stop().await;
}

/// Live reservations of `org`: neither expired, released nor consumed.
async fn live_reservations(app: &TestApp, org: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM admission_reservation WHERE org_id = $1 \
         AND released_at IS NULL AND consumed_at IS NULL AND expires_at > now()",
    )
    .bind(org)
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// A second version of `pro`, with two running slots: a reservation racing a start is not
/// refused for the slot the started container takes.
async fn two_slots(app: &TestApp) {
    let mut plan = pro_plan();
    plan["max_running_containers"] = json!(2);
    let (status, plan) = app.put_plan("pro", &plan).await;
    assert_eq!(status, 201, "a second version: {plan}");
}

#[tokio::test]
async fn a_reservation_racing_its_containers_create_is_consumed_or_refused_never_left_holding_a_slot(
) {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    two_slots(&app).await;
    let mut granted = 0;
    for trial in 0..30 {
        let container = format!("c{trial}");
        let body = json!({"org_id": "acme", "action": "create", "container_id": container,
                          "ttl_seconds": 300});
        let created = container_event(&app, "acme", &container, "container.created", 5);
        let ((status, answer), ()) = tokio::join!(app.reserve(&body), event(&app, created));
        assert!(status == 201 || status == 409, "{status} {answer}");
        granted += usize::from(status == 201);
        projected_to_head(&app.pool, "the create is projected").await;
        assert_eq!(
            live_reservations(&app, "acme").await,
            0,
            "trial {trial}: the running container holds the slot, and nothing else ({answer})"
        );
        let stopped = container_event(&app, "acme", &container, "container.stopped", 4);
        event(&app, stopped).await;
    }
    let consumed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM admission_reservation WHERE consumed_at IS NOT NULL",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        consumed, granted as i64,
        "every grant was consumed by its create"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_grant_still_being_stored_when_its_containers_create_is_projected_is_consumed_by_that_round(
) {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    // Widens the window between a grant's read of its facts and its commit to a second.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_grant() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$; \
         CREATE TRIGGER slow_grant BEFORE INSERT ON admission_reservation \
           FOR EACH ROW EXECUTE FUNCTION slow_grant();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let body = json!({"org_id": "acme", "action": "create", "container_id": "c1"});
    let grant = tokio::spawn({
        let api = app.api.clone();
        async move { api.reserve(&body).await }
    });
    one_sleeping(&app, "the grant has read its facts and is storing").await;
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    let (status, granted) = grant.await.unwrap();
    assert_eq!(
        status, 201,
        "the facts it read had the slot free: {granted}"
    );
    projected_to_head(&app.pool, "the create is projected").await;
    let consumed: Option<Uuid> =
        sqlx::query_scalar("SELECT consumed_by FROM admission_reservation WHERE id = $1::uuid")
            .bind(granted["reservation_id"].as_str().unwrap())
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(
        consumed.is_some(),
        "the round that started c1 waited for the grant and consumed it"
    );
    assert_eq!(live_reservations(&app, "acme").await, 0);
    app.stop().await;
}

#[tokio::test]
async fn a_grant_while_a_lowered_plan_version_is_being_stored_waits_for_it_and_is_held_to_it() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let mut plan = pro_plan();
    plan["max_running_containers"] = json!(2);
    assert_eq!(app.put_plan("pro", &plan).await.0, 201);
    event(
        &app,
        container_event(&app, "acme", "c0", "container.created", 60),
    )
    .await;
    projected_to_head(&app.pool, "two slots, one taken").await;
    // Widens the window between a plan version's instant and its commit to a second.
    sqlx::raw_sql(
        "CREATE FUNCTION slow_plan() RETURNS trigger LANGUAGE plpgsql AS \
           $$ BEGIN PERFORM pg_sleep(1); RETURN NEW; END $$; \
         CREATE TRIGGER slow_plan BEFORE INSERT ON ledger \
           FOR EACH ROW WHEN (NEW.type = 'plan.defined') EXECUTE FUNCTION slow_plan();",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    plan["max_running_containers"] = json!(1);
    let lowered = tokio::spawn({
        let api = app.api.clone();
        async move { api.put_plan("pro", &plan).await }
    });
    one_sleeping(&app, "the lowered version is being stored").await;
    // The version is in effect from an instant already past: a grant now is held to it.
    let (status, refused) = app
        .reserve(&json!({"org_id": "acme", "action": "create", "container_id": "c1"}))
        .await;
    let (stored, version) = lowered.await.unwrap();
    assert_eq!(stored, 201, "{version}");
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (409, Some("concurrency_limit")),
        "a grant during the store of version {version}: {refused}"
    );
    assert_eq!(live_reservations(&app, "acme").await, 0);
    app.stop().await;
}

#[tokio::test]
async fn a_release_waits_for_the_orgs_grant_in_progress_and_is_stamped_after_it() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let (status, granted) = app
        .reserve(&json!({"org_id": "acme", "action": "create"}))
        .await;
    assert_eq!(status, 201, "{granted}");
    let id = granted["reservation_id"].as_str().unwrap().to_owned();
    // A grant of the org in progress holds this lock from before it reads the clock to
    // its commit.
    let key: i64 = sqlx::query_scalar("SELECT hashtextextended('tally.admission.' || 'acme', 0)")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let held = crate::helpers::hold_advisory_lock(&app.db.url, key).await;
    let release = tokio::spawn({
        let api = app.api.clone();
        let id = id.clone();
        async move { api.release(&id).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!release.is_finished(), "the release waits for the grant");
    let let_go = chrono::Utc::now();
    crate::helpers::release_advisory_lock(held, key).await;
    let (status, released) = release.await.unwrap();
    assert_eq!(status, 200, "{released}");
    let released_at: chrono::DateTime<chrono::Utc> =
        sqlx::query_scalar("SELECT released_at FROM admission_reservation WHERE id = $1::uuid")
            .bind(&id)
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert!(
        released_at >= let_go - chrono::Duration::milliseconds(1),
        "stamped when it could go: {released_at} against {let_go}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_grant_takes_the_plan_versions_lock_then_the_orgs_then_the_consuming_lock() {
    use tally::admission::PLAN_VERSION_LOCK_KEY as PLANS;
    use tally::projection::store::CONSUME_LOCK_KEY as CONSUMING;

    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let org: i64 = sqlx::query_scalar("SELECT hashtextextended('tally.admission.' || 'acme', 0)")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let org_held = crate::helpers::hold_advisory_lock(&app.db.url, org).await;
    let body = json!({"org_id": "acme", "action": "create"});
    let grant = tokio::spawn({
        let api = app.api.clone();
        async move { api.reserve(&body).await }
    });
    // Stopped at the org's lock: holding the plan versions' lock, not yet the consuming one.
    let (grant_pid, locks) = waiting_for_advisory_lock(&app, org).await;
    let expected = [(PLANS, "ShareLock", true), (org, "ExclusiveLock", false)];
    assert_eq!(locks, advisory_locks(&expected));

    // Stopped at the consuming lock (as a projector round that starts containers holds it),
    // holding the two before it.
    let consuming_held = crate::helpers::hold_advisory_lock(&app.db.url, CONSUMING).await;
    crate::helpers::release_advisory_lock(org_held, org).await;
    let (pid, locks) = waiting_for_advisory_lock(&app, CONSUMING).await;
    assert_eq!(pid, grant_pid, "the grant waits for the consuming lock");
    let expected = [
        (PLANS, "ShareLock", true),
        (org, "ExclusiveLock", true),
        (CONSUMING, "ShareLock", false),
    ];
    assert_eq!(locks, advisory_locks(&expected));

    crate::helpers::release_advisory_lock(consuming_held, CONSUMING).await;
    let (status, granted) = grant.await.unwrap();
    assert_eq!(status, 201, "{granted}");
    app.stop().await;
}

/// An advisory lock as [`waiting_for_advisory_lock`] lists it: key, mode, granted.
type AdvisoryLock = (i64, String, bool);

/// `locks` in the order [`waiting_for_advisory_lock`] lists them (by key).
fn advisory_locks(locks: &[(i64, &str, bool)]) -> Vec<AdvisoryLock> {
    let mut locks: Vec<AdvisoryLock> = locks
        .iter()
        .map(|&(key, mode, granted)| (key, mode.to_owned(), granted))
        .collect();
    locks.sort();
    locks
}

/// Once a backend of `app`'s database waits for advisory lock `key` (for the consuming lock,
/// only in share mode, as grants take it: the projector's rounds wait for it alone), that
/// backend and every advisory lock it holds or waits for, by key.
async fn waiting_for_advisory_lock(app: &TestApp, key: i64) -> (i32, Vec<AdvisoryLock>) {
    const LOCKS: &str = "WITH advisory AS ( \
           SELECT pid, (classid::BIGINT << 32) | objid::BIGINT AS key, mode, granted \
           FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1 \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())) \
         SELECT pid, key, mode, granted FROM advisory WHERE pid = ( \
           SELECT min(pid) FROM advisory WHERE key = $1 AND NOT granted \
             AND (key <> $2 OR mode = 'ShareLock')) \
         ORDER BY key, mode, granted";
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let rows: Vec<(i32, i64, String, bool)> = sqlx::query_as(LOCKS)
            .bind(key)
            .bind(tally::projection::store::CONSUME_LOCK_KEY)
            .fetch_all(&app.pool)
            .await
            .unwrap();
        if let Some(&(pid, ..)) = rows.first() {
            let locks = rows
                .into_iter()
                .map(|(_, key, mode, granted)| (key, mode, granted));
            return (pid, locks.collect());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no backend waits for lock {key}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until one statement of `app`'s database sleeps in a trigger the test installed
/// (`pg_sleep`): `what` is then held open.
async fn one_sleeping(app: &TestApp, what: &str) {
    eventually(10, what, || async {
        let sleeping: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE wait_event = 'PgSleep' AND datname = current_database()",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        sleeping == 1
    })
    .await;
}

/// The reservations of `org`'s `container`, with the event that consumed each, if any.
async fn consumed_by(app: &TestApp, org: &str, container: &str) -> Vec<Option<Uuid>> {
    sqlx::query_scalar(
        "SELECT consumed_by FROM admission_reservation WHERE org_id = $1 AND container_id = $2 \
         ORDER BY created_at",
    )
    .bind(org)
    .bind(container)
    .fetch_all(&app.pool)
    .await
    .unwrap()
}

#[tokio::test]
async fn a_start_dated_ahead_of_the_clock_leaves_its_reservation_holding_the_slot_until_then() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    two_slots(&app).await;
    let reserve = |container: &str| {
        json!({"org_id": "acme", "action": "create", "container_id": container,
               "ttl_seconds": 300})
    };
    let (status, early) = app.reserve(&reserve("g1")).await;
    assert_eq!(status, 201, "{early}");
    // Dated 3 s ahead (up to 5 minutes are accepted): g1 counts as running from then on.
    event(
        &app,
        container_event(&app, "acme", "g1", "container.created", -3),
    )
    .await;
    let answer = check(&app, json!({"org_id": "acme", "action": "create"})).await;
    assert_eq!(answer["running_containers"], 0, "{answer}");
    assert_eq!(consumed_by(&app, "acme", "g1").await.len(), 1);
    assert!(consumed_by(&app, "acme", "g1").await[0].is_some());
    // A retried grant for g1 would hold a second slot that no start would consume.
    let (status, retried) = app.reserve(&reserve("g1")).await;
    assert_eq!(
        (status, retried["error"]["code"].as_str()),
        (409, Some("container_running")),
        "{retried}"
    );
    let (status, second) = app.reserve(&reserve("g2")).await;
    assert_eq!(status, 201, "g1's slot and g2's make two: {second}");
    event(
        &app,
        container_event(&app, "acme", "g2", "container.created", 0),
    )
    .await;
    let (status, third) = app.reserve(&reserve("g3")).await;
    assert_eq!(
        (status, third["error"]["code"].as_str()),
        (409, Some("concurrency_limit")),
        "g1's consumed reservation still holds its slot: {third}"
    );

    // Once g1's start has come, g1 holds the slot and its reservation no longer does.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    event(
        &app,
        container_event(&app, "acme", "g2", "container.stopped", 0),
    )
    .await;
    let answer = check(&app, json!({"org_id": "acme", "action": "create"})).await;
    assert_eq!(answer["running_containers"], 1, "{answer}");
    let (status, third) = app.reserve(&reserve("g3")).await;
    assert_eq!(status, 201, "the slot is counted once: {third}");
    app.stop().await;
}

#[tokio::test]
async fn a_start_dated_ahead_and_voided_before_it_comes_frees_the_slot_its_reservation_held() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    two_slots(&app).await;
    let reserve =
        |container: &str| json!({"org_id": "acme", "action": "create", "container_id": container});
    let (status, held) = app.reserve(&reserve("g1")).await;
    assert_eq!(status, 201, "{held}");
    let created = container_event(&app, "acme", "g1", "container.created", -120);
    event(&app, created.clone()).await;
    eventually(10, "the start consumes g1's reservation", || async {
        consumed_by(&app, "acme", "g1").await[0].is_some()
    })
    .await;
    let (status, voided) = app
        .post_void(&json!({"event_id": created["id"], "reason": "sent by mistake"}))
        .await;
    assert_eq!(status, 201, "{voided}");
    for container in ["g2", "g3"] {
        let (status, granted) = app.reserve(&reserve(container)).await;
        assert_eq!(status, 201, "g1 never starts and holds nothing: {granted}");
    }
    app.stop().await;
}

#[tokio::test]
async fn a_late_start_that_history_has_stopped_since_leaves_the_reservation_for_the_next_start() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    for (kind, seconds_ago) in [
        ("container.created", 60),
        ("container.stopped", 50),
        ("container.stopped", 10),
    ] {
        event(&app, container_event(&app, "acme", "x", kind, seconds_ago)).await;
    }
    let resume = json!({"org_id": "acme", "action": "resume", "container_id": "x"});
    let (status, held) = app.reserve(&resume).await;
    assert_eq!(status, 201, "{held}");
    // The resume of 30 s ago arrives late: it fills in history; x stays stopped. So does a
    // second `created`.
    for (kind, seconds_ago) in [("container.resumed", 30), ("container.created", 20)] {
        event(&app, container_event(&app, "acme", "x", kind, seconds_ago)).await;
    }
    let (status, other) = app
        .reserve(&json!({"org_id": "acme", "action": "create", "container_id": "y"}))
        .await;
    assert_eq!(
        (status, other["error"]["code"].as_str()),
        (409, Some("concurrency_limit")),
        "x's reservation still holds the one slot: {other}"
    );
    assert_eq!(consumed_by(&app, "acme", "x").await, [None]);
    app.stop().await;
}

#[tokio::test]
async fn a_start_consumes_every_live_reservation_of_its_container() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    two_slots(&app).await;
    let body = json!({"org_id": "acme", "action": "create", "container_id": "x1"});
    for _ in 0..2 {
        // A retried request: both granted, two slots held for one container.
        let (status, granted) = app.reserve(&body).await;
        assert_eq!(status, 201, "{granted}");
    }
    event(
        &app,
        container_event(&app, "acme", "x1", "container.created", 1),
    )
    .await;
    let answer = check(&app, json!({"org_id": "acme", "action": "create"})).await;
    assert_eq!(answer["allowed"], true, "x1 holds one slot: {answer}");
    let consumed = consumed_by(&app, "acme", "x1").await;
    assert_eq!(consumed.len(), 2);
    assert!(
        consumed.iter().all(|by| by.is_some() && *by == consumed[0]),
        "{consumed:?}"
    );
    assert_eq!(live_reservations(&app, "acme").await, 0);
    app.stop().await;
}

#[tokio::test]
async fn on_a_full_plan_a_reservation_for_its_running_container_is_refused_for_running_alone() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    let (status, refused) = app
        .reserve(&json!({"org_id": "acme", "action": "create", "container_id": "c1"}))
        .await;
    assert_eq!(status, 409, "{refused}");
    let reasons: Vec<&Value> = refused["error"]["details"]
        .as_array()
        .unwrap()
        .iter()
        .map(|detail| &detail["code"])
        .collect();
    assert_eq!(
        reasons,
        [&json!("container_running")],
        "the slot it holds is its own: {refused}"
    );
    let (status, other) = app
        .reserve(&json!({"org_id": "acme", "action": "create", "container_id": "c2"}))
        .await;
    assert_eq!(
        (status, other["error"]["code"].as_str()),
        (409, Some("concurrency_limit")),
        "{other}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_reservation_for_a_container_that_runs_is_refused_while_a_check_for_it_is_answered() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    two_slots(&app).await;
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    for action in ["create", "resume"] {
        let body = json!({"org_id": "acme", "action": action, "container_id": "c1"});
        let (status, refused) = app.reserve(&body).await;
        assert_eq!(
            (status, refused["error"]["code"].as_str()),
            (409, Some("container_running")),
            "{refused}"
        );
        let answer = check(&app, body).await;
        assert_eq!(answer["allowed"], true, "a check holds nothing: {answer}");
    }
    assert_eq!(live_reservations(&app, "acme").await, 0);
    let reasons: Vec<Vec<String>> =
        sqlx::query_scalar("SELECT reasons FROM admission_refusal ORDER BY id")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(reasons, [["container_running"], ["container_running"]]);

    // Stopped, it may be resumed; another container still has its slot to take.
    event(
        &app,
        container_event(&app, "acme", "c1", "container.stopped", 1),
    )
    .await;
    let (status, held) = app
        .reserve(&json!({"org_id": "acme", "action": "resume", "container_id": "c1"}))
        .await;
    assert_eq!(status, 201, "{held}");
    app.stop().await;
}

#[tokio::test]
async fn two_instances_racing_for_the_last_slot_grant_exactly_one() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let mut config = tally::config::Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    let second = tally::startup::Service::start(config).await.unwrap();
    let instances = [app.api.clone(), app.at(second.local_addr)];
    let body = json!({"org_id": "acme", "action": "create", "ttl_seconds": 60});
    let answers = join_all((0..40).map(|n| {
        let instance = instances[n % 2].clone();
        let body = body.clone();
        async move { instance.reserve(&body).await }
    }))
    .await;
    let granted = answers.iter().filter(|(status, _)| *status == 201).count();
    assert_eq!(granted, 1, "{answers:?}");
    assert!(answers
        .iter()
        .all(|(status, _)| *status == 201 || *status == 409));
    assert_eq!(reservations_stored(&app).await, 1);
    second.stop().await;
    app.stop().await;
}

#[tokio::test]
async fn bad_admission_requests_get_a_4xx_and_change_nothing() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let cases = [
        (
            "/v1/admission/check",
            json!({"org_id": "acme", "action": "teleport"}),
            422,
            "invalid_action",
        ),
        (
            "/v1/admission/check",
            json!({"org_id": "ac me", "action": "create"}),
            422,
            "invalid_org_id",
        ),
        (
            "/v1/admission/check",
            json!({"action": "create"}),
            422,
            "invalid_org_id",
        ),
        (
            "/v1/admission/check",
            json!({"org_id": "acme", "action": "run"}),
            422,
            "missing_container_id",
        ),
        (
            "/v1/admission/check",
            json!({"org_id": "acme", "action": "run", "container_id": "a.b"}),
            422,
            "invalid_container_id",
        ),
        (
            "/v1/admission/check",
            json!({"org_id": "acme", "action": "create", "extra": 1}),
            422,
            "unknown_field",
        ),
        (
            "/v1/admission/check",
            json!(["org_id"]),
            422,
            "invalid_body",
        ),
        (
            "/v1/admission/reservations",
            json!({"org_id": "acme", "action": "create", "ttl_seconds": 0}),
            422,
            "invalid_ttl",
        ),
        (
            "/v1/admission/reservations",
            json!({"org_id": "acme", "action": "create", "ttl_seconds": 301}),
            422,
            "invalid_ttl",
        ),
        (
            "/v1/admission/reservations",
            json!({"org_id": "acme", "action": "create", "ttl_seconds": "60"}),
            422,
            "invalid_ttl",
        ),
        (
            "/v1/admission/reservations",
            json!({"org_id": "acme", "action": "create", "ttl_seconds": null}),
            422,
            "invalid_ttl",
        ),
        (
            "/v1/admission/reservations",
            json!({"org_id": "acme", "action": "run", "container_id": "c"}),
            422,
            "invalid_action",
        ),
    ];
    for (path, body, status, code) in cases {
        let (actual, error) = app.post_json(path, &body).await;
        assert_eq!(actual, status, "{path} {body}: {error}");
        assert_eq!(error["error"]["code"], code, "{path} {body}");
    }
    let response = app
        .request(Method::POST, "/v1/admission/check")
        .header("content-type", "text/plain")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 415);
    assert_eq!(app.release("not-a-uuid").await.0, 422);
    assert_eq!(app.release(&Uuid::new_v4().to_string()).await.0, 404);
    assert_eq!(reservations_stored(&app).await, 0);
    app.stop().await;
}

/// Moves the projection's checkpoint by `by` (committed) and keeps the projector off it
/// until the returned transaction ends: that transaction holds the checkpoint row, and a
/// projector round skips a locked one.
async fn move_checkpoint_and_hold_it(
    pool: &sqlx::PgPool,
    by: i64,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut mover = pool.begin().await.unwrap();
    sqlx::query("UPDATE proj.checkpoint SET position = position + $1")
        .bind(by)
        .execute(&mut *mover)
        .await
        .unwrap();
    // Queued behind the update's row lock, so it holds the row from the update's commit on.
    let holder = {
        let pool = pool.clone();
        tokio::spawn(async move {
            let mut holder = pool.begin().await.unwrap();
            sqlx::query("SELECT position FROM proj.checkpoint FOR SHARE")
                .execute(&mut *holder)
                .await
                .unwrap();
            holder
        })
    };
    eventually(5, "the holder queues behind the update", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE NOT granted \
             AND locktype IN ('transactionid', 'tuple')",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        waiting > 0
    })
    .await;
    mover.commit().await.unwrap();
    holder.await.unwrap()
}

#[tokio::test]
async fn a_grant_that_finds_the_projection_moved_back_under_the_orgs_lock_waits_for_it_again() {
    use std::sync::{Arc, Mutex};
    use tally::admission::{self, cache::FactsCache, Request};
    use tally::billing::Action;
    use tally::event::OrgId;
    use tally::ledger::Acknowledged;
    use tally::projection::Freshness;

    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let head = projected_to_head(&app.pool, "the app's appends are projected").await;
    // This instance acknowledged acme's events up to the head.
    let acknowledged = Arc::new(Mutex::new(Acknowledged::default()));
    acknowledged.lock().unwrap().record("acme", head, false);
    let freshness = Freshness::new(tokio::sync::watch::channel(head).1, acknowledged);

    // The org's grant lock, held so that the grant stops there, after its freshness wait.
    let mut org_lock = app.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('tally.admission.' || $1, 0))")
        .bind("acme")
        .execute(&mut *org_lock)
        .await
        .unwrap();
    let grant = {
        let pool = app.pool.clone();
        let clock = app.clock;
        tokio::spawn(async move {
            let request = Request {
                org_id: OrgId::parse("acme").unwrap(),
                action: Action::Create,
                container_id: None,
            };
            admission::reserve(
                &pool,
                &freshness,
                &FactsCache::default(),
                clock,
                &request,
                60,
                "test",
            )
            .await
        })
    };
    eventually(5, "the grant waits for the org's lock", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        waiting == 1
    })
    .await;
    // A replay's swap, as the waiting grant sees it: the projection one event behind what
    // this instance acknowledged.
    let holder = move_checkpoint_and_hold_it(&app.pool, -1).await;
    org_lock.commit().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !grant.is_finished(),
        "the grant waits for the projection to reach what it waited for before"
    );
    // The projection catches up again.
    let mut holder = holder;
    sqlx::query("UPDATE proj.checkpoint SET position = position + 1")
        .execute(&mut *holder)
        .await
        .unwrap();
    holder.commit().await.unwrap();
    let (answer, reservation) = grant.await.unwrap().expect("the grant is answered");
    assert!(answer.decision.allowed, "{:?}", answer.decision.reasons);
    assert!(reservation.is_some(), "the free slot is granted");
    app.stop().await;
}

#[tokio::test]
async fn an_event_projected_again_after_a_replay_consumes_no_second_reservation() {
    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    // Reservations for the same container, the second stored after the first was consumed
    // (the plan's one slot would refuse its grant, so the rows are written directly).
    let reservations: Vec<Uuid> = (0..2).map(|_| Uuid::now_v7()).collect();
    let reserve = |id: Uuid| {
        let pool = app.pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO admission_reservation \
                     (id, org_id, container_id, action, reserved_by, created_at, expires_at) \
                 VALUES ($1, 'acme', 'c1', 'create', 'test', now(), now() + interval '5 minutes')",
            )
            .bind(id)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    reserve(reservations[0]).await;
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    let consumed_by = |id: Uuid| {
        let pool = app.pool.clone();
        async move {
            sqlx::query_scalar::<_, Option<Uuid>>(
                "SELECT consumed_by FROM admission_reservation WHERE id = $1",
            )
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap()
        }
    };
    eventually(5, "the first reservation is consumed", || async {
        consumed_by(reservations[0]).await.is_some()
    })
    .await;
    reserve(reservations[1]).await;
    // As after a replay's swap: the checkpoint one event back, so the projector projects
    // the `created` again.
    sqlx::query("UPDATE proj.checkpoint SET position = position - 1")
        .execute(&app.pool)
        .await
        .unwrap();
    projected_to_head(&app.pool, "the event is projected again").await;
    assert_eq!(
        consumed_by(reservations[1]).await,
        None,
        "the newer reservation is still live"
    );
    app.stop().await;
}

/// After a replay's swap the projection can lack a container whose `created` was projected
/// live before the swap (appended during the build, by any instance) and consumed its
/// reservation then. Until the projection passes that `created` again, the consumed
/// reservation holds the slot: otherwise neither it nor the container counts.
#[tokio::test]
async fn a_reservation_consumed_by_an_event_a_swap_took_out_of_the_projection_still_holds_its_slot()
{
    use std::sync::{Arc, Mutex};
    use tally::admission::{self, cache::FactsCache, Request};
    use tally::billing::Action;
    use tally::event::{ContainerId, OrgId};
    use tally::ledger::Acknowledged;
    use tally::projection::Freshness;

    let app = TestApp::spawn().await;
    ready_org(&app, "acme").await;
    let mut two_slots = pro_plan();
    two_slots["max_running_containers"] = json!(2);
    let (status, plan) = app.put_plan("pro", &two_slots).await;
    assert_eq!(status, 201, "{plan}");
    // One slot held by a live reservation for c0, the other taken by c1 as it is created.
    let mut granted = Vec::new();
    for container in ["c0", "c1"] {
        let (status, answer) = app
            .reserve(&json!({"org_id": "acme", "action": "create", "container_id": container}))
            .await;
        assert_eq!(status, 201, "{answer}");
        granted.push(answer["reservation_id"].as_str().unwrap().to_owned());
    }
    event(
        &app,
        container_event(&app, "acme", "c1", "container.created", 5),
    )
    .await;
    let head = projected_to_head(&app.pool, "the created is projected").await;
    let (created, consumed_position): (i64, Option<i64>) = sqlx::query_as(
        "SELECT l.position, r.consumed_position FROM ledger l \
         JOIN admission_reservation r ON r.consumed_by = l.id WHERE l.container_id = 'c1'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap();
    assert_eq!(
        consumed_position,
        Some(created),
        "the consuming event's position is kept"
    );
    assert_eq!(head, created, "nothing after the created");

    // The swapped-in projection, as of the position before the `created`: c1 is not in it.
    sqlx::raw_sql(
        "DELETE FROM proj.container WHERE org_id = 'acme'; \
         DELETE FROM proj.org_open WHERE org_id = 'acme';",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let holder = move_checkpoint_and_hold_it(&app.pool, created - 1 - head).await;

    // Another instance (nothing of acme acknowledged, so nothing to wait for) asks for a
    // slot.
    let elsewhere = Freshness::new(
        tokio::sync::watch::channel(0).1,
        Arc::new(Mutex::new(Acknowledged::default())),
    );
    let grant = |container: &'static str| {
        let pool = app.pool.clone();
        let clock = app.clock;
        let elsewhere = elsewhere.clone();
        async move {
            let request = Request {
                org_id: OrgId::parse("acme").unwrap(),
                action: Action::Create,
                container_id: Some(ContainerId::parse(container).unwrap()),
            };
            admission::reserve(
                &pool,
                &elsewhere,
                &FactsCache::default(),
                clock,
                &request,
                60,
                "test",
            )
            .await
            .expect("the grant is answered")
        }
    };
    let (answer, reservation) = grant("c2").await;
    assert_eq!(
        answer.running_containers, 0,
        "the projection does not count c1"
    );
    assert!(
        !answer.decision.allowed && reservation.is_none(),
        "c0's reservation and c1 take both slots while the projection lacks c1"
    );

    // c0's reservation is released (nothing appended: the head stays the `created`), and
    // the projection passes the `created` again: c1 counts once, by itself.
    sqlx::query("UPDATE admission_reservation SET released_at = now(), released_by = 'test' WHERE id = $1::uuid")
        .bind(&granted[0])
        .execute(&app.pool)
        .await
        .unwrap();
    holder.rollback().await.unwrap();
    assert_eq!(
        projected_to_head(&app.pool, "the created is projected again").await,
        created
    );
    let (answer, reservation) = grant("c3").await;
    assert_eq!(answer.running_containers, 1);
    assert!(
        answer.decision.allowed && reservation.is_some(),
        "c1 counts once: {:?}",
        answer.decision.reasons
    );
    app.stop().await;
}

/// The period whose runtime counts towards an org's allowance is the one the service's clock
/// is in: ten minutes into a period, a run that began before it counts its minutes since the
/// period began; mid-period, all of them.
#[tokio::test]
async fn a_check_counts_the_runtime_of_the_period_the_services_clock_is_in() {
    let middle = mid_period();
    let period = tally::runtime::Period::containing(middle);
    let minutes = chrono::Duration::minutes;
    let start = period.start();
    for (now, created, stopped, used_ms) in [
        (
            start + minutes(10),
            start - minutes(10),
            start + minutes(5),
            5 * 60_000,
        ),
        (
            middle,
            middle - minutes(20),
            middle - minutes(5),
            15 * 60_000,
        ),
    ] {
        let app = TestApp::spawn_at(now).await;
        let at = tally::event::canonical::timestamp;
        let run = json!({"events": [
            {"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
             "container_id": "c1", "occurred_at": at(created)},
            {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme",
             "container_id": "c1", "occurred_at": at(stopped)},
        ]});
        event(&app, run).await;
        let answer = check(&app, json!({"org_id": "acme", "action": "create"})).await;
        assert_eq!(
            (
                answer["period"].as_str(),
                answer["runtime_used_ms"].as_i64()
            ),
            (Some(period.to_string().as_str()), Some(used_ms)),
            "at {now}: {answer}"
        );
        app.stop().await;
    }
}

#[tokio::test]
async fn a_release_right_after_its_containers_start_was_acknowledged_finds_it_consumed() {
    // Rounds that wait a while after each commit: the start is acknowledged well before
    // it is projected.
    let app = TestApp::spawn_with(|config| config.projector_linger_ms = 400).await;
    ready_org(&app, "acme").await;
    two_slots(&app).await;
    event(
        &app,
        container_event(&app, "acme", "base", "container.created", 60),
    )
    .await;
    projected_to_head(&app.pool, "the running container is projected").await;
    let reserve = |container: &str| json!({"org_id": "acme", "action": "create", "container_id": container, "ttl_seconds": 300});
    let (status, granted) = app.reserve(&reserve("z")).await;
    assert_eq!(status, 201, "{granted}");
    // The start, dated a minute ahead, then at once the release.
    event(
        &app,
        container_event(&app, "acme", "z", "container.created", -60),
    )
    .await;
    let id = granted["reservation_id"].as_str().unwrap();
    let (status, released) = app.release(id).await;
    assert_eq!(
        (status, released["error"]["code"].as_str()),
        (409, Some("reservation_consumed")),
        "{released}"
    );
    // So the slot is z's from its start, and no third container is let in.
    let (status, refused) = app.reserve(&reserve("w")).await;
    assert_eq!(status, 409, "{refused}");
    app.stop().await;
}
