//! Period close and usage export at scale: a close runs as a job, in
//! batches inside one transaction, from HTTP (202 and a status route) or the CLI; a running
//! close is found, not doubled; an abandoned or failed one leaves nothing and is retried.
//! The batch size is set tiny so that a few hundred orgs make many batches.

use chrono::Utc;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tally::clock::Clock;
use tally::runtime::Period;
use uuid::Uuid;

use crate::helpers::{mid_period, projected_to_head, TestApp};

/// Orgs in each test: many batches of [`BATCH_ORGS`].
const ORGS: usize = 230;
/// Small and prime, so that the last batch is partial.
const BATCH_ORGS: u32 = 7;

fn org(index: usize) -> String {
    format!("org-{index:04}")
}

/// The finished period before the service's current one, and the current one.
fn last_period(app: &TestApp) -> (Period, Period) {
    let current = Period::containing(app.now());
    let last = Period::containing(current.start() - chrono::Duration::days(1));
    (last, current)
}

fn at(instant: chrono::DateTime<Utc>) -> String {
    tally::event::canonical::timestamp(instant)
}

/// Every org ran a container in `last`; every third ran one across its end into the
/// current period, with a command after the end; the events go in batches of 1 000.
async fn seed(app: &TestApp, last: Period, current: Period) {
    let end = last.end();
    let mut events = Vec::new();
    for index in 0..ORGS {
        let org = org(index);
        let hours = (index % 5 + 1) as i64;
        events.push(
            json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org,
            "container_id": "a", "occurred_at": at(end - chrono::Duration::hours(hours + 2))}),
        );
        events.push(
            json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org,
            "container_id": "a", "occurred_at": at(end - chrono::Duration::hours(2))}),
        );
        if index % 3 == 0 {
            // Any instant between the current period's start and now.
            let after = current.start() + (app.now() - current.start()) / 2;
            let after =
                chrono::DurationRound::duration_trunc(after, chrono::Duration::milliseconds(1))
                    .unwrap();
            events.push(
                json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org,
                "container_id": "b", "occurred_at": at(end - chrono::Duration::minutes(90))}),
            );
            events.push(
                json!({"id": Uuid::new_v4(), "type": "container.command_ran", "org_id": org,
                "container_id": "b", "occurred_at": at(after),
                "data": {"command_id": "x", "exit_code": 0, "duration_ms": 5}}),
            );
            events.push(
                json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org,
                "container_id": "b", "occurred_at": at(after)}),
            );
        }
    }
    for chunk in events.chunks(1_000) {
        let (status, body) = app.post_events(&json!({ "events": chunk })).await;
        assert_eq!(status, 200, "{body}");
    }
    projected_to_head(&app.pool, "the seed is projected").await;
}

/// Waits until the status route says the job is no longer running, and returns it.
async fn finished(app: &TestApp, location: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let (status, job) = app.get_json(location).await;
        assert_eq!(status, 200, "{job}");
        if job["status"] != "running" {
            return job;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the close job still runs: {job}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Each org's figures for `period` as the per-org usage query prices them (no batching).
async fn expected_rows(app: &TestApp, period: Period) -> Vec<String> {
    let mut rows = Vec::new();
    for index in 0..ORGS {
        let org = org(index);
        let priced = tally::projection::query::priced_usage(&app.pool, &org, period, period.end())
            .await
            .unwrap()
            .figures;
        rows.push(tally::finance::pricing::Figures::from_priced(org, period, &priced).csv());
    }
    rows
}

async fn snapshot_rows(app: &TestApp, period: Period) -> Vec<String> {
    use sqlx::Row;
    let rows = sqlx::query(
        "SELECT org_id, plan, runtime_ms, included_ms, overage_ms, overage_amount, currency, \
                commands, ports_published \
         FROM period_snapshot WHERE period = $1 ORDER BY org_id",
    )
    .bind(period.to_string())
    .fetch_all(&app.pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|row| {
            tally::finance::pricing::Figures {
                org_id: row.get("org_id"),
                plan: row.get("plan"),
                period,
                runtime_ms: row.get("runtime_ms"),
                included_ms: row.get("included_ms"),
                overage_ms: row.get("overage_ms"),
                overage_amount: row.get("overage_amount"),
                currency: row.get("currency"),
                commands: row.get("commands"),
                ports_published: row.get("ports_published"),
            }
            .csv()
        })
        .collect()
}

/// The service with its clock at `clock`.
async fn spawn_on(clock: Clock) -> TestApp {
    TestApp::spawn_with(|config| {
        config.finance_batch_orgs = BATCH_ORGS;
        config.clock = clock;
    })
    .await
}

/// The service with its clock mid-period, so that the current period has begun long ago.
async fn spawn() -> TestApp {
    spawn_on(Clock::starting_at(mid_period())).await
}

#[tokio::test]
async fn a_close_of_many_batches_is_an_accepted_job_that_freezes_every_org_and_later_adjusts_them()
{
    let app = spawn().await;
    let (last, current) = last_period(&app);
    seed(&app, last, current).await;

    let (status, location, job) = app.close_period(&last.to_string()).await;
    assert_eq!(status, 202, "{job}");
    let location = location.expect("a Location for the job's status");
    assert_eq!(location, format!("/v1/periods/{last}/close"));
    assert_eq!(job["period"], last.to_string());
    let done = finished(&app, &location).await;
    assert_eq!(
        (done["status"].as_str(), done["id"].clone()),
        (Some("done"), job["id"].clone()),
        "{done}"
    );
    assert_eq!(done["closed"]["orgs"], ORGS);
    assert_eq!(done["closed"]["verified"], true);

    // The batched snapshot holds, in org order, what the per-org query prices, also for the
    // orgs whose events reach past the period's end.
    let expected = expected_rows(&app, last).await;
    assert_eq!(snapshot_rows(&app, last).await, expected);
    let (status, period) = app.get_period(&last.to_string()).await;
    assert_eq!(
        (status, &period["sha256"]),
        (200, &done["closed"]["sha256"])
    );
    assert_eq!(period["verified"], true);
    let position: i64 = sqlx::query_scalar("SELECT ledger_position FROM period_close")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(position, crate::helpers::ledger_count(&app.pool).await);

    // Closing again is the same close.
    let (status, _, again) = app.close_period(&last.to_string()).await;
    assert_eq!((status, &again["id"]), (200, &job["id"]), "{again}");
    assert_eq!(again["closed"]["sha256"], done["closed"]["sha256"]);

    // Late events for orgs in many batches: one adjustment each in the current export.
    let late_orgs: Vec<usize> = (0..ORGS).step_by(11).collect();
    let late: Vec<Value> = late_orgs
        .iter()
        .flat_map(|index| {
            [
                json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org(*index),
                    "container_id": "late", "occurred_at": at(last.end() - chrono::Duration::hours(1))}),
                json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org(*index),
                    "container_id": "late", "occurred_at": at(last.end() - chrono::Duration::minutes(30))}),
            ]
        })
        .collect();
    assert_eq!(app.post_events(&json!({ "events": late })).await.0, 200);
    projected_to_head(&app.pool, "the late events are projected").await;
    let (_, csv) = app.get_usage_export(&format!("period={current}")).await;
    let adjustments: Vec<&str> = csv
        .lines()
        .filter(|line| line.contains(&format!(",{last},")))
        .collect();
    let wanted: Vec<String> = late_orgs
        .iter()
        .map(|index| format!("{},free,{last},1800000,0,1800000,0.00,USD,0,0", org(*index)))
        .collect();
    assert_eq!(adjustments, wanted, "{csv}");
    let (status, exported) = app
        .get_json(&format!(
            "/v1/exports/usage.csv?period={current}&format=json"
        ))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        exported["adjustments"].as_array().unwrap().len(),
        late_orgs.len()
    );
    assert_eq!(
        exported["rows"].as_array().unwrap().len(),
        ORGS.div_ceil(3),
        "the orgs with usage in the current period"
    );
    // The closed period's own export: every org as the close froze it, in many batches,
    // hashing to the stored sha256; the late runs are in the adjustments only.
    let (_, csv) = app.get_usage_export(&format!("period={last}")).await;
    let exported: Vec<String> = csv
        .lines()
        .skip(1)
        .map(|line| format!("{line}\n"))
        .collect();
    assert_eq!(exported, expected);
    assert_ne!(exported, expected_rows(&app, last).await);
    assert_eq!(
        serde_json::json!(hex::encode(Sha256::digest(csv.as_bytes()))),
        done["closed"]["sha256"]
    );
    app.stop().await;
}

#[tokio::test]
async fn a_second_close_while_one_runs_gets_that_job_and_an_abandoned_one_is_retried() {
    let app = spawn().await;
    let (last, current) = last_period(&app);
    seed(&app, last, current).await;

    // A process mid-close: it holds the period's close lock and has stored its running job.
    let mut running = app.db.pool().await.acquire().await.unwrap().detach();
    let key = last
        .start()
        .format("%Y%m")
        .to_string()
        .parse::<i32>()
        .unwrap();
    sqlx::query("SELECT pg_advisory_lock($1, $2)")
        .bind(0x7065_7269_i32)
        .bind(key)
        .execute(&mut running)
        .await
        .unwrap();
    let id = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO period_close_job (id, period, status, requested_by, started_at) \
         VALUES ($1, $2, 'running', 'elsewhere', now())",
    )
    .bind(id)
    .bind(last.to_string())
    .execute(&mut running)
    .await
    .unwrap();

    let (status, location, job) = app.close_period(&last.to_string()).await;
    assert_eq!(
        (status, job["id"].as_str()),
        (202, Some(id.to_string().as_str())),
        "{job}"
    );
    assert_eq!(job["status"], "running");
    let location = location.unwrap();
    let (_, status_now) = app.get_json(&location).await;
    assert_eq!(status_now["status"], "running");
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM period_close_job")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(jobs, 1, "no second close was started");

    // The process dies: its session ends, the job reads as abandoned, nothing was stored;
    // the same lock held in another database (another deployment) does not count.
    sqlx::Connection::close(running).await.unwrap();
    let elsewhere = crate::helpers::TestDb::new().await;
    let mut other = elsewhere.pool().await.acquire().await.unwrap().detach();
    sqlx::query("SELECT pg_advisory_lock($1, $2)")
        .bind(0x7065_7269_i32)
        .bind(key)
        .execute(&mut other)
        .await
        .unwrap();
    let (_, abandoned) = app.get_json(&location).await;
    assert_eq!(
        (
            abandoned["status"].as_str(),
            abandoned["error"]["code"].as_str()
        ),
        (Some("failed"), Some("close_abandoned")),
        "{abandoned}"
    );
    let (status, _) = app.get_period(&last.to_string()).await;
    assert_eq!(status, 404, "nothing of the close is visible");

    sqlx::Connection::close(other).await.unwrap();
    let (status, _, retried) = app.close_period(&last.to_string()).await;
    assert_eq!(status, 202, "{retried}");
    assert_ne!(retried["id"], job["id"]);
    let done = finished(&app, &location).await;
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(done["closed"]["orgs"], ORGS);
    app.stop().await;
}

#[tokio::test]
async fn a_close_that_fails_in_a_late_batch_stores_nothing_and_can_be_retried() {
    let app = spawn().await;
    let (last, current) = last_period(&app);
    seed(&app, last, current).await;
    // The last org in org order on a plan with no version: pricing fails in the last batch,
    // after every other batch was written.
    sqlx::query(
        "INSERT INTO proj.account_change (org_id, position, occurred_at, event_id, plan) \
         VALUES ($1, 1000000, $2, $3, 'vanished')",
    )
    .bind(org(ORGS - 1))
    .bind(last.start())
    .bind(Uuid::new_v4())
    .execute(&app.pool)
    .await
    .unwrap();

    let (status, location, _) = app.close_period(&last.to_string()).await;
    assert_eq!(status, 202);
    let location = location.unwrap();
    let failed = finished(&app, &location).await;
    assert_eq!(
        (failed["status"].as_str(), failed["error"]["code"].as_str()),
        (Some("failed"), Some("close_failed")),
        "{failed}"
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM period_snapshot")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(rows, 0, "no batch of the failed close is stored");

    sqlx::query("DELETE FROM proj.account_change WHERE plan = 'vanished'")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, _, _) = app.close_period(&last.to_string()).await;
    assert_eq!(status, 202);
    let done = finished(&app, &location).await;
    assert_eq!(done["status"], "done", "{done}");
    assert_eq!(snapshot_rows(&app, last).await.len(), ORGS);
    app.stop().await;
}

#[tokio::test]
async fn the_cli_closes_a_period_of_many_batches_and_prints_it_and_then_prints_it_again() {
    // The command line reads the system clock, so the service's periods are the system's.
    let app = spawn_on(Clock::system()).await;
    let (last, current) = last_period(&app);
    seed(&app, last, current).await;
    let close = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .args(["periods", "close", &last.to_string()])
            .env("DATABASE_URL", &app.db.url)
            .env("TALLY_FINANCE_BATCH_ORGS", BATCH_ORGS.to_string())
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
    };
    let output = close();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let closed: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(closed["period"], last.to_string());
    assert_eq!(
        (closed["orgs"].clone(), closed["verified"].clone()),
        (json!(ORGS), json!(true))
    );
    assert_eq!(
        snapshot_rows(&app, last).await,
        expected_rows(&app, last).await
    );

    let again = close();
    assert!(again.status.success());
    let again: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(again["sha256"], closed["sha256"]);
    let (status, job) = app.get_close(&last.to_string()).await;
    assert_eq!((status, job["requested_by"].as_str()), (200, Some("cli")));

    let running = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["periods", "close", &current.to_string()])
        .env("DATABASE_URL", &app.db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert_eq!(
        running.status.code(),
        Some(1),
        "the current period is still running"
    );
    app.stop().await;
}
