//! The org-side reads the console needs (issue 21, decision 0026): whoami, an org's account
//! and history, usage split by day with its price, an org's containers a page at a time,
//! and the service's status.

use chrono::{DateTime, Duration, Utc};
use serde_json::{json, Value};
use tally::clock::Clock;
use tally::event::canonical::timestamp;
use tally::projection::org::{ContainerListSql, StateFilter};
use tally::runtime::Period;
use uuid::Uuid;

use crate::helpers::{
    answered, eventually, mid_period, ok, projected_to_head, stream_messages, TestApp,
};

const ORG: &str = "org_console";
const HOUR_MS: i64 = 3_600_000;

/// The service with its clock at [`mid_period`] (the 15th of last month), accepting events
/// back to the start of the month before: a whole past period to split by day.
async fn spawn() -> TestApp {
    TestApp::spawn_with(|config| {
        config.clock = Clock::starting_at(mid_period());
        config.backdate_days = 90;
    })
    .await
}

/// The whole period before the service's: every day of it is in the past.
fn past_period(app: &TestApp) -> Period {
    let current = Period::containing(app.now());
    Period::containing(current.start() - Duration::milliseconds(1))
}

fn container_event(container: &str, event_type: &str, at: DateTime<Utc>) -> Value {
    let data = match event_type {
        "container.created" => json!({"name": "job"}),
        "container.stopped" => json!({"reason": "user"}),
        _ => json!({}),
    };
    json!({"id": Uuid::new_v4(), "type": event_type, "org_id": ORG, "container_id": container,
           "occurred_at": timestamp(at), "data": data})
}

fn command(container: &str, at: DateTime<Utc>, duration_ms: i64) -> Value {
    json!({"id": Uuid::new_v4(), "type": "container.command_ran", "org_id": ORG,
           "container_id": container, "occurred_at": timestamp(at),
           "data": {"command_id": "c", "exit_code": 0, "duration_ms": duration_ms}})
}

fn org_event(org: &str, event_type: &str, at: DateTime<Utc>, data: Value) -> Value {
    json!({"id": Uuid::new_v4(), "type": event_type, "org_id": org,
           "occurred_at": timestamp(at), "data": data})
}

async fn post(app: &TestApp, events: Vec<Value>) {
    for chunk in events.chunks(1_000) {
        let (status, body) = app.post_events(&json!({ "events": chunk })).await;
        assert_eq!(status, 200, "{body}");
    }
    projected_to_head(&app.pool, "the events are projected").await;
}

/// The error code of a refusal with `status`.
#[track_caller]
fn refused(expected: u16, answer: (u16, Value)) -> String {
    let body = answered(expected, answer);
    body["error"]["code"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn whoami_names_the_bootstrap_a_scoped_and_an_org_bound_token() {
    let app = TestApp::spawn().await;
    let whoami = ok(app.get_json("/v1/whoami").await);
    assert_eq!(
        whoami,
        json!({"token_id": "bootstrap", "scopes": ["admin"], "org_id": null})
    );

    let token = answered(
        201,
        app.post_token(&json!({"scopes": ["audit", "finance"]}))
            .await,
    );
    let whoami = ok(app
        .with_token(token["token"].as_str().unwrap())
        .get_json("/v1/whoami")
        .await);
    assert_eq!(
        whoami,
        json!({"token_id": token["id"], "scopes": ["finance", "audit"], "org_id": null})
    );

    // Any valid token, whatever its scopes: one with only events:write, bound to an org.
    let bound = answered(
        201,
        app.post_token(&json!({"scopes": ["events:write"], "org_id": ORG}))
            .await,
    );
    let whoami = ok(app
        .with_token(bound["token"].as_str().unwrap())
        .get_json("/v1/whoami")
        .await);
    assert_eq!(
        whoami,
        json!({"token_id": bound["id"], "scopes": ["events:write"], "org_id": ORG})
    );

    let (status, _) = app.without_token().get_json("/v1/whoami").await;
    assert_eq!(status, 401);
    let (status, _) = app
        .with_token("tly_not-a-token")
        .get_json("/v1/whoami")
        .await;
    assert_eq!(status, 401);
    assert_eq!(
        refused(422, app.get_json("/v1/whoami?verbose=1").await),
        "unknown_parameter"
    );
    app.stop().await;
}

#[tokio::test]
async fn an_org_shows_its_account_as_of_an_instant_and_its_history_newest_first() {
    let app = spawn().await;
    answered(201, app.put_plan("pro", &crate::plans::pro_plan()).await);
    let now = app.now();
    let (t1, t2, t3) = (
        now - Duration::hours(3),
        now - Duration::hours(2),
        now - Duration::hours(1),
    );
    post(
        &app,
        vec![
            org_event(ORG, "org.plan_changed", t1, json!({"plan": "pro"})),
            org_event(
                ORG,
                "org.verification_changed",
                t2,
                json!({"verified": true}),
            ),
            org_event(
                ORG,
                "org.billing_eligibility_changed",
                t3,
                json!({"eligible": true}),
            ),
        ],
    )
    .await;
    let head = projected_to_head(&app.pool, "projected").await;

    let org = ok(app.get_json(&format!("/v1/orgs/{ORG}")).await);
    assert_eq!(org["position"], head);
    assert_eq!(org["org_id"], ORG);
    assert!(
        org["as_of"].as_str().unwrap() >= timestamp(now).as_str(),
        "{org}"
    );
    assert_eq!(org["plan"]["id"], "pro");
    assert_eq!(org["plan"]["included_runtime_seconds"], 3600);
    assert_eq!(org["plan"]["overage_price_per_hour"], "0.125");
    assert_eq!(org["plan"]["version"], 1);
    assert_eq!(
        (org["verified"].clone(), org["billing_eligible"].clone()),
        (json!(true), json!(true))
    );
    let changes: Vec<(String, Value, String)> = org["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            (
                entry["change"].as_str().unwrap().to_owned(),
                entry["value"].clone(),
                entry["occurred_at"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        changes,
        [
            ("billing_eligible".to_owned(), json!(true), timestamp(t3)),
            ("verified".to_owned(), json!(true), timestamp(t2)),
            ("plan".to_owned(), json!("pro"), timestamp(t1)),
        ]
    );
    assert_eq!(org["history_total"], 3);
    for entry in org["history"].as_array().unwrap() {
        assert!(entry["position"].as_i64().unwrap() > 0, "{entry}");
        assert!(Uuid::parse_str(entry["event_id"].as_str().unwrap()).is_ok());
    }

    // As of between the plan change and the verification: on pro, not yet verified.
    let between = timestamp(t1 + Duration::minutes(30));
    let org = ok(app
        .get_json(&format!("/v1/orgs/{ORG}?as_of={between}"))
        .await);
    assert_eq!(org["as_of"], between);
    assert_eq!(org["plan"]["id"], "pro");
    assert_eq!(
        (org["verified"].clone(), org["billing_eligible"].clone()),
        (json!(false), json!(false))
    );
    assert_eq!(org["history_total"], 3, "the history is every event: {org}");

    // An org with no event: free, unverified, not eligible, no history; not a 404.
    let unknown = ok(app.get_json("/v1/orgs/org_nobody").await);
    assert_eq!(unknown["plan"]["id"], "free");
    assert_eq!(
        (
            unknown["verified"].clone(),
            unknown["billing_eligible"].clone()
        ),
        (json!(false), json!(false))
    );
    assert_eq!(
        (unknown["history"].clone(), unknown["history_total"].clone()),
        (json!([]), json!(0))
    );

    for (query, code) in [
        ("as_of=yesterday", "invalid_as_of"),
        ("colour=red", "unknown_parameter"),
        ("consistency=strong", "invalid_consistency"),
    ] {
        let path = format!("/v1/orgs/{ORG}?{query}");
        assert_eq!(refused(422, app.get_json(&path).await), code, "{query}");
    }
    assert_eq!(
        refused(422, app.get_json("/v1/orgs/bad%20org").await),
        "invalid_org_id"
    );
    app.stop().await;
}

#[tokio::test]
async fn an_orgs_history_lists_the_newest_500_of_its_account_events_and_counts_them_all() {
    let app = spawn().await;
    let start = app.now() - Duration::days(20);
    let events: Vec<Value> = (0..502)
        .map(|n| {
            org_event(
                ORG,
                "org.verification_changed",
                start + Duration::minutes(n),
                json!({"verified": n % 2 == 1}),
            )
        })
        .collect();
    post(&app, events).await;
    let org = ok(app.get_json(&format!("/v1/orgs/{ORG}")).await);
    let history = org["history"].as_array().unwrap();
    assert_eq!(history.len(), 500);
    assert_eq!(org["history_total"], 502);
    assert_eq!(
        history[0]["occurred_at"],
        timestamp(start + Duration::minutes(501))
    );
    assert_eq!(history[0]["value"], true);
    assert_eq!(
        history[499]["occurred_at"],
        timestamp(start + Duration::minutes(2))
    );
    let instants: Vec<&str> = history
        .iter()
        .map(|entry| entry["occurred_at"].as_str().unwrap())
        .collect();
    assert!(
        instants.windows(2).all(|pair| pair[0] > pair[1]),
        "newest first"
    );
    assert_eq!(org["verified"], true);
    app.stop().await;
}

/// A plan that bills overage past one hour, and `ORG` on it from before `period`.
async fn billed_org(app: &TestApp, period: Period) {
    let plan = json!({
        "sandbox_runtime": true, "included_runtime_seconds": 3600, "overage": "bill",
        "overage_price_per_hour": "0.10", "currency": "USD",
        "max_running_containers": 100, "max_published_ports": 100,
    });
    answered(201, app.put_plan("metered", &plan).await);
    let before = period.start() - Duration::hours(1);
    post(
        app,
        vec![org_event(
            ORG,
            "org.plan_changed",
            before,
            json!({"plan": "metered"}),
        )],
    )
    .await;
}

/// A month of `ORG`'s history in `period`: intervals within a day and over midnight, one
/// running from before the period, one running past its end, commands on several days,
/// one on the period's last millisecond and one just after it.
fn month_of_history(period: Period) -> Vec<Value> {
    let day = |n: i64| period.start() + Duration::days(n);
    let at = |n: i64, hours: i64| day(n) + Duration::hours(hours);
    vec![
        // From the month before into day 0 (2 h of it).
        container_event(
            "c_before",
            "container.created",
            period.start() - Duration::hours(5),
        ),
        container_event("c_before", "container.stopped", at(0, 2)),
        // Within day 2: 3 h.
        container_event("c_day", "container.created", at(2, 9)),
        container_event("c_day", "container.stopped", at(2, 12)),
        // Over midnight from day 9 to day 10: 2 h and 3 h.
        container_event("c_night", "container.created", at(9, 22)),
        container_event("c_night", "container.stopped", at(10, 3)),
        // Resumed on day 10 at 05:00, still running at and past the period's end.
        container_event("c_night", "container.resumed", at(10, 5)),
        // From the last day's 20:00 on: 4 h of this period.
        container_event(
            "c_last",
            "container.created",
            period.end() - Duration::hours(4),
        ),
        command("c_day", at(2, 10), 1_500),
        command("c_night", at(9, 23), 250),
        command("c_night", at(10, 1), 750),
        command("c_night", at(10, 1), 5),
        command("c_last", period.end() - Duration::milliseconds(1), 40),
        // The next period's first instant: not counted in this one.
        command("c_last", period.end(), 999),
    ]
}

fn days_of(usage: &Value) -> Vec<(String, i64, i64, i64)> {
    usage["days"]
        .as_array()
        .unwrap_or_else(|| panic!("days: {usage}"))
        .iter()
        .map(|day| {
            (
                day["date"].as_str().unwrap().to_owned(),
                day["runtime_ms"].as_i64().unwrap(),
                day["commands"].as_i64().unwrap(),
                day["command_ms"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[track_caller]
fn assert_days_add_up(usage: &Value) {
    let days = days_of(usage);
    let sum = |pick: fn(&(String, i64, i64, i64)) -> i64| days.iter().map(pick).sum::<i64>();
    assert_eq!(
        sum(|day| day.1),
        usage["runtime_ms"].as_i64().unwrap(),
        "{usage}"
    );
    assert_eq!(
        sum(|day| day.2),
        usage["commands"].as_i64().unwrap(),
        "{usage}"
    );
    assert_eq!(
        sum(|day| day.3),
        usage["command_ms"].as_i64().unwrap(),
        "{usage}"
    );
}

#[tokio::test]
async fn usage_by_day_adds_up_exactly_over_a_month_with_intervals_over_midnight_and_one_running_past_its_end(
) {
    let app = spawn().await;
    let period = past_period(&app);
    billed_org(&app, period).await;
    post(&app, month_of_history(period)).await;

    let usage = ok(app
        .get_usage(ORG, &format!("period={period}&window=day"))
        .await);
    let days = days_of(&usage);
    let month_days = (period.end() - period.start()).num_days();
    assert_eq!(days.len() as i64, month_days, "one entry per day: {usage}");
    let date = |n: i64| {
        (period.start() + Duration::days(n))
            .date_naive()
            .to_string()
    };
    for (index, day) in days.iter().enumerate() {
        assert_eq!(day.0, date(index as i64), "in date order");
    }
    // c_night runs from day 10 at 05:00 to the period's end; c_last its last 4 hours.
    let running_from_day_10 = |n: i64| match n {
        10 => 19 * HOUR_MS,
        n if n > 10 => 24 * HOUR_MS,
        _ => 0,
    };
    for (n, day) in days.iter().enumerate() {
        let n = n as i64;
        let (runtime_ms, commands, command_ms) = match n {
            0 => (2 * HOUR_MS, 0, 0),
            2 => (3 * HOUR_MS, 1, 1_500),
            9 => (2 * HOUR_MS, 1, 250),
            10 => (3 * HOUR_MS + running_from_day_10(10), 2, 755),
            n if n == month_days - 1 => (running_from_day_10(n) + 4 * HOUR_MS, 1, 40),
            n => (running_from_day_10(n), 0, 0),
        };
        assert_eq!(
            (day.1, day.2, day.3),
            (runtime_ms, commands, command_ms),
            "{}",
            day.0
        );
    }
    assert_days_add_up(&usage);
    // The totals themselves, and their price: 1 h included, the rest billed at 0.10 an hour.
    let runtime_ms = usage["runtime_ms"].as_i64().unwrap();
    assert_eq!(
        runtime_ms,
        (2 + 3 + 5 + 19 + 4) * HOUR_MS + (month_days - 11) * 24 * HOUR_MS
    );
    assert_eq!(usage["included_ms"], HOUR_MS);
    assert_eq!(usage["overage_ms"], runtime_ms - HOUR_MS);
    let hours_over =
        rust_decimal::Decimal::from(runtime_ms - HOUR_MS) / rust_decimal::Decimal::from(HOUR_MS);
    let expected = (hours_over * rust_decimal::Decimal::new(10, 2)).round_dp(2);
    assert_eq!(usage["overage_amount"], format!("{expected:.2}"));
    assert_eq!(usage["currency"], "USD");
    assert_eq!(usage["plan"], "metered");

    // The same figures without `window`, and no days.
    let plain = ok(app.get_usage(ORG, &format!("period={period}")).await);
    assert!(plain.get("days").is_none(), "{plain}");
    for field in [
        "runtime_ms",
        "commands",
        "command_ms",
        "overage_amount",
        "included_ms",
        "currency",
        "position",
    ] {
        assert_eq!(plain[field], usage[field], "{field}");
    }
    app.stop().await;
}

#[tokio::test]
async fn usage_as_of_mid_day_cuts_the_last_day_and_a_window_other_than_day_is_refused() {
    let app = spawn().await;
    let period = past_period(&app);
    billed_org(&app, period).await;
    post(&app, month_of_history(period)).await;

    // Day 10 at 06:00: eleven days, the last cut at 06:00 (3 h of c_night's first interval
    // and 1 h of its second), the command at 01:00 counted, none after.
    let as_of = period.start() + Duration::days(10) + Duration::hours(6);
    let query = format!("period={period}&window=day&as_of={}", timestamp(as_of));
    let usage = ok(app.get_usage(ORG, &query).await);
    let days = days_of(&usage);
    assert_eq!(days.len(), 11, "{usage}");
    assert_eq!(
        (days[10].1, days[10].2, days[10].3),
        (4 * HOUR_MS, 2, 755),
        "{usage}"
    );
    assert_eq!(usage["runtime_ms"], (2 + 3 + 2 + 4) * HOUR_MS);
    assert_days_add_up(&usage);
    assert_eq!(usage["overage_ms"], 10 * HOUR_MS);
    assert_eq!(usage["overage_amount"], "1.00");

    // as_of at a midnight: the day that starts then is not listed.
    let midnight = period.start() + Duration::days(3);
    let query = format!("period={period}&window=day&as_of={}", timestamp(midnight));
    let usage = ok(app.get_usage(ORG, &query).await);
    assert_eq!(days_of(&usage).len(), 3, "{usage}");
    assert_days_add_up(&usage);

    // as_of before the period: no day, zeros.
    let before = timestamp(period.start() - Duration::days(1));
    let usage = ok(app
        .get_usage(ORG, &format!("period={period}&window=day&as_of={before}"))
        .await);
    assert_eq!(usage["days"], json!([]));
    assert_eq!(usage["runtime_ms"], 0);

    for window in ["hour", "DAY", "", "month"] {
        let answer = app
            .get_usage(ORG, &format!("period={period}&window={window}"))
            .await;
        assert_eq!(refused(422, answer), "invalid_window", "{window:?}");
    }
    app.stop().await;
}

fn page_ids(page: &Value) -> Vec<String> {
    page["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|container| container["container_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Every page of `state` with `limit`, following `next_after`: the ids, page by page.
async fn all_pages(app: &TestApp, org: &str, state: &str, limit: usize) -> Vec<Vec<String>> {
    let mut pages = Vec::new();
    let mut after = String::new();
    loop {
        let path = format!("/v1/orgs/{org}/containers?state={state}&limit={limit}{after}");
        let page = ok(app.get_json(&path).await);
        pages.push(page_ids(&page));
        match page["next_after"].as_str() {
            None => return pages,
            Some(next) => {
                assert_eq!(Some(next), pages.last().unwrap().last().map(String::as_str));
                after = format!("&after={next}");
            }
        }
        assert!(pages.len() <= 10_001, "the pages end");
    }
}

#[tokio::test]
async fn an_orgs_containers_are_paged_in_id_order_and_filtered_by_state() {
    let app = spawn().await;
    let start = app.now() - Duration::days(2);
    let mut events = Vec::new();
    // c1..c7: the odd ones stopped, the even ones running; `Z_upper` sorts before the
    // lower-case ids bytewise.
    for (n, id) in ["c3", "c1", "c2", "c5", "c4", "c7", "c6", "Z_upper"]
        .iter()
        .enumerate()
    {
        let created = start + Duration::minutes(n as i64);
        events.push(container_event(id, "container.created", created));
        if id.ends_with(['1', '3', '5', '7']) {
            events.push(container_event(
                id,
                "container.stopped",
                created + Duration::hours(1),
            ));
        }
    }
    // Another org's container: never listed here.
    events.push(
        json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "org_other",
                       "container_id": "c0", "occurred_at": timestamp(start),
                       "data": {"name": "job"}}),
    );
    post(&app, events).await;
    let head = projected_to_head(&app.pool, "projected").await;

    let all = all_pages(&app, ORG, "all", 3).await;
    assert_eq!(
        all,
        [
            vec!["Z_upper", "c1", "c2"],
            vec!["c3", "c4", "c5"],
            vec!["c6", "c7"]
        ]
    );
    let running = all_pages(&app, ORG, "running", 2).await;
    assert_eq!(running, [vec!["Z_upper", "c2"], vec!["c4", "c6"]]);
    let stopped = all_pages(&app, ORG, "stopped", 2).await;
    assert_eq!(stopped, [vec!["c1", "c3"], vec!["c5", "c7"]]);

    let page = ok(app
        .get_json(&format!("/v1/orgs/{ORG}/containers?after=c3&limit=2"))
        .await);
    assert_eq!(page["position"], head);
    assert_eq!(page["org_id"], ORG);
    let c4 = &page["containers"][0];
    assert_eq!(c4["container_id"], "c4");
    assert_eq!(c4["state"], "running");
    assert_eq!(c4["running_since"], timestamp(start + Duration::minutes(4)));
    assert_eq!(c4["last_event_at"], timestamp(start + Duration::minutes(4)));
    let c5 = &page["containers"][1];
    assert_eq!(
        (c5["state"].clone(), c5["running_since"].clone()),
        (json!("stopped"), json!(null))
    );
    assert_eq!(
        c5["last_event_at"],
        timestamp(start + Duration::minutes(63))
    );
    // The default page holds them all, and says no more follow.
    let page = ok(app.get_json(&format!("/v1/orgs/{ORG}/containers")).await);
    assert_eq!(page_ids(&page).len(), 8);
    assert_eq!(page["next_after"], json!(null));
    let nobody = ok(app.get_json("/v1/orgs/org_nobody/containers").await);
    assert_eq!(nobody["containers"], json!([]));

    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("limit=ten", "invalid_limit"),
        ("after=bad%20id", "invalid_after"),
        ("state=paused", "invalid_parameter"),
        ("colour=red", "unknown_parameter"),
    ] {
        let path = format!("/v1/orgs/{ORG}/containers?{query}");
        assert_eq!(refused(422, app.get_json(&path).await), code, "{query}");
    }
    ok(app
        .get_json(&format!("/v1/orgs/{ORG}/containers?limit=1000"))
        .await);
    app.stop().await;
}

#[tokio::test]
async fn containers_with_events_dated_ahead_of_the_clock_are_listed_and_read_in_their_state_now() {
    let app = spawn().await;
    let now = app.now();
    let ahead = now + Duration::seconds(200);
    let started = now - Duration::hours(2);
    let mut events = vec![
        // Created ahead: not running yet.
        container_event("a_created_ahead", "container.created", ahead),
        // Running now, its stop dated ahead.
        container_event("b_stops_ahead", "container.created", started),
        container_event("b_stops_ahead", "container.stopped", ahead),
        // Running, nothing ahead.
        container_event("c_settled", "container.created", started),
        // Stopped now, its resume dated ahead.
        container_event("d_resumes_ahead", "container.created", started),
        container_event(
            "d_resumes_ahead",
            "container.stopped",
            now - Duration::hours(1),
        ),
        container_event("d_resumes_ahead", "container.resumed", ahead),
    ];
    // Stopped, nothing ahead.
    events.push(container_event("e_settled", "container.created", started));
    events.push(container_event(
        "e_settled",
        "container.stopped",
        now - Duration::hours(1),
    ));
    post(&app, events).await;

    let running = ["b_stops_ahead", "c_settled"];
    let stopped = ["a_created_ahead", "d_resumes_ahead", "e_settled"];
    for limit in [1, 2, 100] {
        let pages = |state: &'static str| all_pages(&app, ORG, state, limit);
        assert_eq!(pages("running").await.concat(), running, "limit {limit}");
        assert_eq!(pages("stopped").await.concat(), stopped, "limit {limit}");
        assert_eq!(pages("all").await.concat().len(), 5, "limit {limit}");
    }
    let page = ok(app.get_json(&format!("/v1/orgs/{ORG}/containers")).await);
    let listed: Vec<(Value, Value)> = page["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| (item["state"].clone(), item["running_since"].clone()))
        .collect();
    let since = json!(timestamp(started));
    assert_eq!(
        listed,
        [
            (json!("stopped"), json!(null)),
            (json!("running"), since.clone()),
            (json!("running"), since.clone()),
            (json!("stopped"), json!(null)),
            (json!("stopped"), json!(null)),
        ]
    );
    // One container read by id says what the list says, and what `as_of` asks for.
    for (container, state) in [
        ("a_created_ahead", "stopped"),
        ("b_stops_ahead", "running"),
        ("d_resumes_ahead", "stopped"),
    ] {
        let read = ok(app.get_container(container, "").await);
        assert_eq!(read["state"], state, "{container}: {read}");
    }
    // Before its stop, a container read as of then was running.
    let earlier = timestamp(now - Duration::minutes(90));
    let read = ok(app
        .get_container("e_settled", &format!("as_of={earlier}"))
        .await);
    assert_eq!(read["state"], "running", "{read}");
    app.stop().await;
}

#[tokio::test]
async fn ten_thousand_containers_of_one_org_are_listed_in_pages_of_a_thousand() {
    let app = spawn().await;
    // Stored as the projector stores them (one in three stopped), without 20 000 events.
    sqlx::query(
        "INSERT INTO proj.container (org_id, container_id, intervals, last_at) \
         SELECT 'org_big', 'c' || lpad(n::TEXT, 5, '0'), \
                CASE WHEN n % 3 = 0 THEN '[[1764547200000, 1764550800000]]'::JSONB \
                     ELSE '[[1764547200000, null]]'::JSONB END, \
                to_timestamp(1764550800) \
         FROM generate_series(1, 10000) AS n",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let pages = all_pages(&app, "org_big", "all", 1_000).await;
    assert_eq!(pages.len(), 10, "ten full pages, the last says no more");
    let ids: Vec<String> = pages.concat();
    let expected: Vec<String> = (1..=10_000).map(|n| format!("c{n:05}")).collect();
    assert_eq!(ids, expected);
    let running: usize = all_pages(&app, "org_big", "running", 1_000)
        .await
        .iter()
        .map(Vec::len)
        .sum();
    assert_eq!(running, 10_000 - 3_333);
    let stopped = all_pages(&app, "org_big", "stopped", 1_000).await;
    assert_eq!(stopped.concat().len(), 3_333);
    assert!(stopped
        .concat()
        .iter()
        .all(|id| id[1..].parse::<u32>().unwrap() % 3 == 0));

    // A page reads the org's containers of that state from the cursor on, by an index of
    // its own, not the whole table: the planner matches the migration's indexes.
    sqlx::query("ANALYZE proj.container")
        .execute(&app.pool)
        .await
        .unwrap();
    // The containers with an event after now are found by the hour of their last event.
    for (filter, index) in [
        (StateFilter::All, "container_org_id"),
        (StateFilter::Running, "container_org_running"),
        (StateFilter::Stopped, "container_org_stopped"),
    ] {
        let sql = ContainerListSql::of(filter);
        let now = app.now();
        for (query, index, in_ms) in [
            (&sql.settled, index, false),
            (&sql.ahead, "container_org_hour", true),
        ] {
            let explain = format!("EXPLAIN {query}");
            let mut explained = sqlx::query_scalar(&explain)
                .bind("org_big")
                .bind("c05000")
                .bind(101_i64)
                .bind(now);
            if in_ms {
                explained = explained.bind(now.timestamp_millis());
            }
            let plan: Vec<String> = explained.fetch_all(&app.pool).await.unwrap();
            let plan = plan.join("\n");
            assert!(plan.contains(index), "{filter:?}: {plan}");
            assert!(!plan.contains("Seq Scan"), "{filter:?}: {plan}");
        }
    }
    app.stop().await;
}

#[tokio::test]
async fn status_gives_the_ledger_head_the_projection_checkpoint_and_the_streams_and_null_without_nats(
) {
    let mut app = TestApp::spawn().await;
    let (status, body) = app.get_json("/v1/status").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["ledger"],
        json!({"head_position": 0, "head_recorded_at": null})
    );

    post(&app, crate::helpers::valid_events(30)).await;
    let js = app.nats.jetstream().await;
    eventually(20, "the relay published the ledger", || async {
        stream_messages(&js, "TALLY_LEDGER").await == 30
    })
    .await;
    let (head, recorded_at): (i64, DateTime<Utc>) =
        sqlx::query_as("SELECT position, recorded_at FROM ledger ORDER BY position DESC LIMIT 1")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    let checkpoint: i64 = sqlx::query_scalar("SELECT position FROM proj.checkpoint")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let status = ok(app.get_json("/v1/status").await);
    assert_eq!(
        status,
        json!({
            "ledger": {"head_position": head, "head_recorded_at": timestamp(recorded_at)},
            "projection": {"position": checkpoint, "lag_events": head - checkpoint},
            "relay": {"stream_last_position": head, "lag_events": 0},
            "dlq": {"messages": stream_messages(&js, "TALLY_DLQ").await},
        })
    );
    assert_eq!(head, 30);
    assert_eq!(
        refused(422, app.get_json("/v1/status?verbose=1").await),
        "unknown_parameter"
    );
    let usage_only = answered(
        201,
        app.post_token(&json!({"scopes": ["usage:read"]})).await,
    );
    let answer = app
        .with_token(usage_only["token"].as_str().unwrap())
        .get_json("/v1/status")
        .await;
    assert_eq!(refused(403, answer), "forbidden_scope");

    // NATS gone: the Postgres figures still come, the NATS ones are null, not a 5xx.
    app.nats.stop();
    let status = ok(app.get_json("/v1/status").await);
    assert_eq!(status["ledger"]["head_position"], head);
    assert_eq!(status["projection"]["position"], checkpoint);
    assert_eq!(
        status["relay"],
        json!({"stream_last_position": null, "lag_events": null})
    );
    assert_eq!(status["dlq"], json!({"messages": null}));
    app.stop().await;
}

#[tokio::test]
async fn an_org_bound_token_reads_only_its_own_org_and_not_the_status() {
    let app = spawn().await;
    let token = answered(
        201,
        app.post_token(&json!({"scopes": ["usage:read", "audit"], "org_id": ORG}))
            .await,
    );
    let bound = app.with_token(token["token"].as_str().unwrap());
    let period = Period::containing(app.now());
    ok(bound.get_json(&format!("/v1/orgs/{ORG}")).await);
    ok(bound.get_json(&format!("/v1/orgs/{ORG}/containers")).await);
    ok(bound
        .get_usage(ORG, &format!("period={period}&window=day"))
        .await);
    for path in [
        "/v1/orgs/org_other".to_owned(),
        "/v1/orgs/org_other/containers".to_owned(),
        format!("/v1/orgs/org_other/usage?period={period}&window=day"),
    ] {
        assert_eq!(
            refused(403, bound.get_json(&path).await),
            "org_not_allowed",
            "{path}"
        );
    }
    assert_eq!(
        refused(403, bound.get_json("/v1/status").await),
        "org_bound_token"
    );
    let whoami = ok(bound.get_json("/v1/whoami").await);
    assert_eq!(whoami["org_id"], ORG);
    // A token without usage:read may not read an org.
    let audit = answered(201, app.post_token(&json!({"scopes": ["audit"]})).await);
    let answer = app
        .with_token(audit["token"].as_str().unwrap())
        .get_json(&format!("/v1/orgs/{ORG}"))
        .await;
    assert_eq!(refused(403, answer), "forbidden_scope");
    app.stop().await;
}
