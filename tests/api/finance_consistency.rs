//! Finance at the head (contract §8): a period close, a reconciliation and
//! the usage export reflect every event acknowledged before they were asked for, by any
//! instance, read in one snapshot, and name the ledger position they reflect; so do the
//! command line's export and close, which run no projector of their own.
//!
//! Both instances project slowly (a long projector linger and poll, as a loaded instance
//! would): events posted to one are not in the projection when the other is asked at once,
//! so only the wait for the head puts them in the answer.

use std::time::Duration as StdDuration;

use chrono::{DateTime, Duration, DurationRound, Utc};
use serde_json::{json, Value};
use tally::clock::Clock;
use tally::config::Config;
use tally::event::canonical::timestamp;
use tally::ledger::{AppendLimits, Appender};
use tally::runtime::Period;
use tally::startup::Service;
use uuid::Uuid;

use crate::helpers::{mid_period, parse_events, run_tally, Reply, TestApp, TestDb, TOKEN};

/// The projector linger and poll of both instances: far longer than a request takes.
const SLOW_PROJECTOR_MS: u64 = 1_500;
/// How often the close job's status is read: the close is a job, polled as a client does.
const JOB_POLL_MS: u64 = 20;

fn slow(config: &mut Config) {
    config.projector_linger_ms = SLOW_PROJECTOR_MS;
    config.projector_poll_ms = SLOW_PROJECTOR_MS;
    // The guarantee is the wait, not its budget: a loaded machine must not turn it into 503s.
    config.read_wait_ms = 60_000;
}

/// Instance A (with the test's database and NATS) and instance B on the same database, both
/// with their clock mid-period, so that minutes and hours before now are this period's.
async fn two_instances() -> (TestApp, Service) {
    let first = TestApp::spawn_with(|config| {
        slow(config);
        config.clock = Clock::starting_at(mid_period());
    })
    .await;
    let mut config = Config::new(&first.db.url, &first.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    config.clock = first.clock;
    slow(&mut config);
    let second = Service::start(config).await.unwrap();
    (first, second)
}

/// A container that ran from `from` to `to`, as two events.
fn run(org: &str, container: &str, from: DateTime<Utc>, to: DateTime<Utc>) -> Vec<Value> {
    vec![
        json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org,
               "container_id": container, "occurred_at": timestamp(from)}),
        json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org,
               "container_id": container, "occurred_at": timestamp(to)}),
    ]
}

/// Posts `events` to `app`, a request per org's pair; returns the highest position
/// acknowledged.
async fn append_acknowledged(app: &TestApp, events: &[Value]) -> i64 {
    let mut acknowledged = 0;
    for pair in events.chunks(2) {
        let (status, answer) = app.post_events(&json!({ "events": pair })).await;
        assert_eq!(status, 200, "{answer}");
        for result in answer["results"].as_array().unwrap() {
            acknowledged = acknowledged.max(result["position"].as_i64().unwrap());
        }
    }
    acknowledged
}

/// The `Tally-Position` header of an answer.
fn position_header(response: &Reply) -> i64 {
    response
        .header("tally-position")
        .unwrap_or_else(|| panic!("no Tally-Position in {:?}", response.headers))
        .parse()
        .unwrap()
}

/// Five orgs' November-style late events: containers of the closed period, each org its own
/// runtime (org n ran n hours), posted after the period ended.
fn late_events(closed: Period) -> (Vec<Value>, Vec<(String, i64)>) {
    let mut events = Vec::new();
    let mut expected = Vec::new();
    for n in 1..=5i64 {
        let org = format!("org_{n}");
        let stop = closed.end() - Duration::hours(1);
        events.extend(run(
            &org,
            &format!("late_{n}"),
            stop - Duration::hours(n),
            stop,
        ));
        expected.push((org, n * 3_600_000));
    }
    (events, expected)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_close_right_after_late_events_holds_them_and_the_next_export_has_no_adjustment_for_them()
{
    let (first, second) = two_instances().await;
    let current = Period::containing(first.now());
    let closed = Period::containing(current.start() - Duration::days(1));
    let (events, expected) = late_events(closed);
    let acknowledged = append_acknowledged(&first, &events).await;

    // At once, on the other instance.
    let other = first.at(second.local_addr);
    let closed_name = closed.to_string();
    let (status, _, job) = other.close_period(&closed_name).await;
    assert_eq!(status, 202, "{job}");
    let job = loop {
        let (status, job) = other.get_close(&closed_name).await;
        assert_eq!(status, 200, "{job}");
        if job["status"] != "running" {
            break job;
        }
        tokio::time::sleep(StdDuration::from_millis(JOB_POLL_MS)).await;
    };
    assert_eq!(job["status"], "done", "{job}");
    let position = job["closed"]["position"].as_i64().unwrap();
    assert!(position >= acknowledged, "{job}: short of {acknowledged}");
    assert_eq!(job["closed"]["orgs"], 5, "{job}");

    let frozen: Vec<(String, i64)> = sqlx::query_as(
        "SELECT org_id, runtime_ms FROM period_snapshot WHERE period = $1 ORDER BY org_id",
    )
    .bind(closed.to_string())
    .fetch_all(&first.pool)
    .await
    .unwrap();
    assert_eq!(frozen, expected, "the snapshot holds every late event");
    let (status, period) = other.get_period(&closed_name).await;
    assert_eq!((status, &period["position"]), (200, &json!(position)));

    let query = format!("period={current}&format=json");
    let (status, export) = other.get_usage_export(&query).await;
    let export: Value = serde_json::from_str(&export).unwrap();
    assert_eq!(status, 200, "{export}");
    assert_eq!(
        export["adjustments"],
        json!([]),
        "no event acknowledged before the close is an adjustment"
    );

    second.stop().await;
    first.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reconciliation_right_after_its_containers_events_finds_them_matched() {
    let (first, second) = two_instances().await;
    let now = first.now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| now - Duration::hours(hours_ago);
    // Four containers in two orgs, each run 2 hours, billed exactly.
    let containers: Vec<(String, String)> = (0..4)
        .map(|n| (format!("org_{}", n % 2), format!("ctr_{n}")))
        .collect();
    let (start, end) = (timestamp(at(6)), timestamp(at(2)));
    let mut report = vec![
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory".to_owned(),
    ];
    for (org, container) in &containers {
        report.push(format!(
            r#"{start},{end},{container},7200,Seconds,1.44,USD,"{{""org_id"":""{org}""}}",Usage"#
        ));
    }
    let (status, report) = first.post_report(report.join("\n")).await;
    assert_eq!(status, 201, "{report}");
    let events: Vec<Value> = containers
        .iter()
        .flat_map(|(org, container)| run(org, container, at(5), at(3)))
        .collect();
    let acknowledged = append_acknowledged(&first, &events).await;

    // At once, on the other instance.
    let (status, result) = first
        .at(second.local_addr)
        .post_reconciliation(&json!({"report_id": report["report_id"]}))
        .await;
    assert_eq!(status, 201, "{result}");
    assert_eq!(
        result["counts"],
        json!({"matched": 4, "provider_over": 0, "provider_under": 0, "missing_in_ledger": 0,
               "org_mismatch": 0, "missing_in_provider": 0, "not_runtime": 0}),
        "{result}"
    );
    let position = result["position"].as_i64().unwrap();
    assert!(
        position >= acknowledged,
        "{result}: short of {acknowledged}"
    );

    let id = result["reconciliation_id"].as_str().unwrap();
    let lines = format!("/v1/reconciliations/{id}/lines.csv");
    let response = first.get(&lines).await;
    assert_eq!(position_header(&response), position);
    let csv = response.text.clone();
    let statuses: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|line| line.split(',').nth(7).unwrap())
        .collect();
    assert_eq!(statuses, ["matched"; 4], "{csv}");
    let response = first.get(&format!("{lines}?format=json")).await;
    assert_eq!(position_header(&response), position);
    let (_, lines) = response.status_json();
    assert_eq!(lines["position"], position, "{lines}");
    assert_eq!(lines["lines"].as_array().unwrap().len(), 4);

    second.stop().await;
    first.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_usage_export_right_after_events_lists_them_and_names_its_position() {
    let (first, second) = two_instances().await;
    let now = first.now().duration_trunc(Duration::seconds(1)).unwrap();
    let period = Period::containing(now);
    let events: Vec<Value> = (1..=5i64)
        .flat_map(|n| {
            run(
                &format!("org_{n}"),
                &format!("ctr_{n}"),
                now - Duration::minutes(30),
                now - Duration::minutes(30) + Duration::seconds(n),
            )
        })
        .collect();
    let acknowledged = append_acknowledged(&first, &events).await;

    // At once, on the other instance.
    let path = format!("/v1/exports/usage.csv?period={period}");
    let response = first.at(second.local_addr).get(&path).await;
    assert_eq!(response.status, 200);
    let position = position_header(&response);
    assert!(
        position >= acknowledged,
        "{position} short of {acknowledged}"
    );
    let csv = response.text.clone();
    let runtimes: Vec<(&str, &str)> = csv
        .lines()
        .skip(1)
        .map(|line| {
            let fields: Vec<&str> = line.split(',').collect();
            (fields[0], fields[3])
        })
        .collect();
    assert_eq!(
        runtimes,
        [
            ("org_1", "1000"),
            ("org_2", "2000"),
            ("org_3", "3000"),
            ("org_4", "4000"),
            ("org_5", "5000")
        ],
        "{csv}"
    );

    let response = first
        .at(second.local_addr)
        .get(&format!("{path}&format=json"))
        .await;
    let header = position_header(&response);
    let (status, export) = response.status_json();
    assert_eq!(status, 200, "{export}");
    assert_eq!(export["position"], header, "{export}");
    assert!(header >= acknowledged);
    assert_eq!(export["rows"].as_array().unwrap().len(), 5, "{export}");

    second.stop().await;
    first.stop().await;
}

#[tokio::test]
async fn the_usage_export_takes_the_consistency_parameters_and_refuses_unknown_ones() {
    let app = TestApp::spawn().await;
    let period = Period::containing(Utc::now());
    let export = format!("/v1/exports/usage.csv?period={period}&format=json");
    for (query, status, code) in [
        ("&consistency=eventual", 200, None),
        ("&min_position=0", 200, None),
        ("&min_position=-1", 422, Some("invalid_min_position")),
        ("&consistency=strong", 422, Some("invalid_consistency")),
        ("&color=red", 422, Some("unknown_parameter")),
    ] {
        let path = format!("{export}{query}");
        let (actual, answer) = app.get_json(&path).await;
        assert_eq!(
            (actual, answer["error"]["code"].as_str()),
            (status, code),
            "{path}: {answer}"
        );
    }
    app.stop().await;
}

/// Appends `events` as the ingest does, with no projector anywhere; the highest position.
async fn append(appender: &Appender, events: &[Value]) -> i64 {
    let appended = appender.append(parse_events(events)).await.unwrap();
    appended.iter().map(|event| event.position).max().unwrap()
}

#[tokio::test]
async fn the_command_line_close_and_export_project_what_was_acknowledged_without_a_service() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _, _task) = Appender::start(
        pool.clone(),
        AppendLimits {
            queue_max: 64,
            group_events_max: 1_000,
        },
    );
    let current = Period::containing(Utc::now());
    let closed = Period::containing(current.start() - Duration::days(1));
    let (late, expected) = late_events(closed);
    let acknowledged = append(&appender, &late).await;

    let (ok, stdout, stderr) = run_tally(&db.url, &["periods", "close", &closed.to_string()]);
    assert!(ok, "{stderr}");
    let closed_period: Value = serde_json::from_str(&stdout).unwrap();
    assert!(
        closed_period["position"].as_i64().unwrap() >= acknowledged,
        "{closed_period}: short of {acknowledged}"
    );
    assert_eq!(closed_period["orgs"], expected.len(), "{closed_period}");

    // The command line reads the system clock, whose current period may have begun a
    // moment ago; a run in the closed period after its close has room on any day, and
    // shows as the closed period's adjustment in the export of the current one.
    let end = closed.end();
    let events = run(
        "org_cli",
        "ctr_cli",
        end - Duration::minutes(30),
        end - Duration::minutes(20),
    );
    let acknowledged = append(&appender, &events).await;
    let (ok, stdout, stderr) = run_tally(
        &db.url,
        &["export", "usage", "--period", &current.to_string()],
    );
    assert!(ok, "{stderr}");
    assert!(
        stdout
            .lines()
            .any(|line| line.starts_with(&format!("org_cli,free,{closed},600000,"))),
        "{stdout}"
    );
    let position: i64 = stderr
        .lines()
        .find_map(|line| line.strip_prefix("position "))
        .unwrap_or_else(|| panic!("no position line in {stderr:?}"))
        .parse()
        .unwrap();
    assert!(
        position >= acknowledged,
        "{position} short of {acknowledged}"
    );
    // The closed period's own export is its snapshot: the run recorded after the close
    // is in the adjustment only.
    let (ok, stdout, stderr) = run_tally(
        &db.url,
        &["export", "usage", "--period", &closed.to_string()],
    );
    assert!(ok, "{stderr}");
    assert!(!stdout.contains("org_cli"), "{stdout}");
    assert_eq!(stdout.lines().count(), 1 + expected.len(), "{stdout}");
}

/// While another process holds the projection's checkpoint (as a running service's
/// projector does during a round) and does not move it, the command line's export cannot
/// reach the head: it waits `TALLY_READ_WAIT_MS`, then fails saying so, rather than print
/// figures that miss an acknowledged event.
#[tokio::test]
async fn the_command_line_export_fails_clearly_when_a_held_projection_does_not_reach_the_head() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _, _task) = Appender::start(
        pool.clone(),
        AppendLimits {
            queue_max: 64,
            group_events_max: 1_000,
        },
    );
    let now = Utc::now().duration_trunc(Duration::seconds(1)).unwrap();
    let events = run(
        "org_held",
        "ctr_held",
        now - Duration::minutes(2),
        now - Duration::minutes(1),
    );
    let acknowledged = append(&appender, &events).await;
    let mut hold = pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM proj.checkpoint FOR UPDATE")
        .execute(&mut *hold)
        .await
        .unwrap();

    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args([
            "export",
            "usage",
            "--period",
            &Period::containing(now).to_string(),
        ])
        .env("DATABASE_URL", &db.url)
        .env("TALLY_READ_WAIT_MS", "300")
        .env("RUST_LOG", "off")
        .output()
        .unwrap();
    hold.rollback().await.unwrap();
    let printed = String::from_utf8(output.stderr).unwrap();
    assert!(!output.status.success(), "{printed}");
    assert!(output.stdout.is_empty(), "nothing is exported: {printed}");
    assert!(
        printed.contains(&format!("short of the ledger head {acknowledged}")),
        "{printed}"
    );
}
