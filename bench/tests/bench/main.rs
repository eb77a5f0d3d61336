//! `tally-bench` itself, on small sizes: the parts that measure the service run end to end
//! against real Postgres and NATS, every correctness check they make passes (the run fails
//! otherwise), and they remove the scratch databases they create. The figures are not
//! looked at: speed is the bench's to report, not a test's to assert.

use std::collections::HashSet;

use clap::Parser;
use sqlx::PgPool;
use tally::config::Config;
use tally_bench::{BenchArgs, Summary, TargetFigure};

use servers::{server_url, tally_binary, TestNats};

mod servers;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
}

/// Held by each test for its whole run: a test counts the scratch databases left after it
/// by comparing with those before, which another bench running meanwhile would upset.
static ONE_BENCH_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Asserts that `summary` holds exactly the rows of `figures`, in that order, each with a
/// ratio (a finite, positive number) and so a verdict.
fn assert_targets(summary: &Summary, figures: &[TargetFigure]) {
    let shown: Vec<TargetFigure> = summary.rows.iter().map(|row| row.figure).collect();
    assert_eq!(shown, figures, "{summary:?}");
    for row in &summary.rows {
        assert!(row.ratio.is_finite() && row.ratio > 0.0, "{row:?}");
        assert!(
            !row.measured.is_empty() && !row.target.is_empty(),
            "{row:?}"
        );
    }
}

/// Asserts that each row of `figures` in `summary` gives what the machine spent per event
/// for the figure and for its reference: both measured, finite and positive.
fn assert_cpu_per_event(summary: &Summary, figures: &[TargetFigure]) {
    for figure in figures {
        let row = summary.row(*figure).expect("the row is in the summary");
        let (measured, reference) = row
            .cpu_per_event_us
            .unwrap_or_else(|| panic!("no CPU per event in {row:?}"));
        for microseconds in [measured, reference] {
            assert!(microseconds.is_finite() && microseconds > 0.0, "{row:?}");
        }
    }
}

async fn scratch_databases(pool: &PgPool) -> HashSet<String> {
    sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 'tally_bench_%'")
        .fetch_all(pool)
        .await
        .expect("listing databases")
        .into_iter()
        .collect()
}

/// The bench's options: `--serve-binary serve_binary`, then `arguments`.
fn bench_args(serve_binary: &str, arguments: &[&str]) -> BenchArgs {
    let args = ["bench", "--serve-binary", serve_binary]
        .into_iter()
        .chain(arguments.iter().copied());
    Cli::parse_from(args).args
}

/// Runs the bench with `arguments` (after `--serve-binary` and this workspace's `tally`)
/// against the test Postgres and a private nats-server, expects every check it makes to
/// pass and no scratch database to be left, and returns its targets summary.
async fn run_bench(arguments: &[&str]) -> Summary {
    let _alone = ONE_BENCH_AT_A_TIME.lock().await;
    let nats = TestNats::start();
    let server = format!("{}/postgres", server_url().trim_end_matches('/'));
    let admin = PgPool::connect(&server)
        .await
        .expect("connecting to the test server");
    let before = scratch_databases(&admin).await;

    // Every part runs this workspace's tally binary: `tally serve`, `tally replay`, ….
    let serve_binary = tally_binary();
    let args = bench_args(serve_binary.to_str().expect("a UTF-8 path"), arguments);
    let summary = tally_bench::run(Config::new(&server, &nats.url), args)
        .await
        .expect("the bench runs and every check it makes passes");

    let left = scratch_databases(&admin).await;
    let created: Vec<&String> = left.difference(&before).collect();
    assert!(created.is_empty(), "the bench left databases: {created:?}");
    summary
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_runs_ingest_admission_anomalies_and_audit_on_small_sizes_with_every_check_passing_and_leaves_no_database(
) {
    let summary = run_bench(&[
        "--only",
        "ingest,admission,anomalies,audit",
        "--http-events",
        "2000",
        "--single-events",
        "640",
        "--nats-events",
        "500",
        "--admission-orgs",
        "20",
        "--admission-checks",
        "2000",
        "--admission-paced-seconds",
        "1",
        "--anomalies-containers",
        "10",
        "--anomalies-seeded",
        "20",
        "--anomalies-phase-events",
        "200",
        "--audit-events",
        "100000",
        "--audit-orgs",
        "20",
        "--audit-requests",
        "200",
    ])
    .await;
    // The targets of the ingest and admission parts; the outside figure needs --outside,
    // replay the projection part.
    assert_targets(
        &summary,
        &[
            TargetFigure::Single,
            TargetFigure::Batches,
            TargetFigure::Nats,
            TargetFigure::PacedChecks,
            TargetFigure::ClosedChecks,
        ],
    );
    assert_cpu_per_event(
        &summary,
        &[
            TargetFigure::Single,
            TargetFigure::Batches,
            TargetFigure::Nats,
        ],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_runs_projection_on_small_sizes_and_every_default_usage_read_under_load_reflects_every_acknowledged_batch(
) {
    // Among the projection part's checks: every usage answer in both modes equals the
    // plan, and no default-mode read during the lag load answers at a position short of a
    // batch acknowledged before it was sent.
    let summary = run_bench(&[
        "--only",
        "projection",
        "--orgs",
        "10",
        "--replay-events",
        "20000",
        // Enough containers that org_big almost surely has commands in the current period,
        // which the usage check asks for, even when the period is only hours old.
        "--usage-containers",
        "500",
        "--lag-rate",
        "2000",
        "--lag-seconds",
        "2",
    ])
    .await;
    assert_targets(&summary, &[TargetFigure::Replay]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_drives_single_events_from_outside_with_wrk_and_the_yardstick_with_pgbench_and_finds_every_acknowledged_event_in_the_ledger(
) {
    // wrk and pgbench are on the PATH: scripts/test runs scripts/load-tools first. Among
    // the ingest part's checks then: wrk got nothing but 200s, and every event it got a
    // 200 for is in the ledger at its position, once.
    let summary = run_bench(&[
        "--only",
        "ingest",
        "--http-events",
        "1000",
        "--single-events",
        "64",
        "--single-clients",
        "8",
        "--nats-events",
        "100",
        "--outside",
        "--outside-seconds",
        "2",
    ])
    .await;
    assert_targets(
        &summary,
        &[
            TargetFigure::Single,
            TargetFigure::Outside,
            TargetFigure::Batches,
            TargetFigure::Nats,
        ],
    );
    // wrk's and pgbench's runs last seconds, long enough for /proc's ticks to count.
    assert_cpu_per_event(&summary, &[TargetFigure::Outside]);
}

/// The error the bench refuses `arguments` with (after `--serve-binary` and a path where
/// there is no binary), before it creates anything.
async fn refusal(arguments: &[&str]) -> String {
    let nats = TestNats::start();
    let server = format!("{}/postgres", server_url().trim_end_matches('/'));
    let args = bench_args("/nonexistent/tally", arguments);
    let error = tally_bench::run(Config::new(&server, &nats.url), args)
        .await
        .expect_err("the bench refuses");
    format!("{error:#}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_refuses_an_outside_measurement_longer_than_five_minutes_before_it_creates_anything(
) {
    let error = refusal(&["--only", "ingest", "--outside", "--outside-seconds", "301"]).await;
    assert_eq!(
        error,
        "--outside-seconds must be between 1 and 300, got 301"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_refuses_nats_batches_past_the_services_batch_limit_before_it_creates_anything() {
    let limit = Config::new("postgres://unused", "nats://unused").batch_events_max;
    let past = (limit + 1).to_string();
    let error = refusal(&["--only", "ingest", "--nats-batch-events", &past]).await;
    assert_eq!(
        error,
        format!("--nats-batch-events must be at most the service's batch limit of {limit}")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_runs_the_workloads_through_one_and_three_instances_and_prints_them_side_by_side_with_every_check_passing(
) {
    let _alone = ONE_BENCH_AT_A_TIME.lock().await;
    let nats = TestNats::start();
    let server = format!("{}/postgres", server_url().trim_end_matches('/'));
    let admin = PgPool::connect(&server)
        .await
        .expect("connecting to the test server");
    let before = scratch_databases(&admin).await;

    // The bench binary itself, so that the table it prints can be read.
    let serve_binary = tally_binary();
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_tally-bench"))
        .args([
            "--serve-binary",
            serve_binary.to_str().expect("a UTF-8 path"),
        ])
        .args(["--only", "instances", "--instances", "3"])
        .args(["--http-events", "1000", "--single-events", "64"])
        .args(["--single-clients", "8", "--nats-events", "100"])
        .args(["--admission-orgs", "20", "--admission-checks", "200"])
        .args(["--admission-paced-seconds", "1"])
        .env("DATABASE_URL", &server)
        .env("NATS_URL", &nats.url)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("running tally-bench");
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "tally-bench failed: {}\n{printed}",
        String::from_utf8_lossy(&output.stderr)
    );
    let header = printed
        .lines()
        .find(|line| line.starts_with("| measurement"))
        .unwrap_or_else(|| panic!("no table in {printed}"));
    for column in [
        "1 instance: per second",
        "1 instance: p99 ms",
        "3 instances: per second",
        "3 instances: p99 ms",
        "per second, 3 / 1",
        "p99, 3 / 1",
    ] {
        assert!(header.contains(column), "no column {column:?} in {header}");
    }
    for row in [
        "| HTTP batches ",
        "| HTTP single events ",
        "| NATS ingest, publish to committed ",
        "| admission checks, 64 clients, closed loop ",
        "| admission checks paced at ",
    ] {
        let line = printed
            .lines()
            .find(|line| line.starts_with(row))
            .unwrap_or_else(|| panic!("no row {row:?} in {printed}"));
        // The label, two figures per run and two ratios.
        assert_eq!(line.matches('|').count(), 8, "{line}");
    }
    // Each run's ledger checks, the 3-instance run's too.
    for heading in ["1 instance:", "3 instances:"] {
        let checks: Vec<&str> = printed
            .split(&format!("\n{heading}\n"))
            .nth(1)
            .unwrap_or_else(|| panic!("no checks of {heading} in {printed}"))
            .lines()
            .take_while(|line| line.starts_with("- check"))
            .collect();
        assert!(
            checks.iter().any(|check| check.contains("exactly once")),
            "{checks:?}"
        );
        assert!(
            checks.iter().all(|check| check.starts_with("- check ok")),
            "{checks:?}"
        );
    }
    assert!(printed.contains("- 3 instances, storage: "), "{printed}");

    let left = scratch_databases(&admin).await;
    let created: Vec<&String> = left.difference(&before).collect();
    assert!(created.is_empty(), "the bench left databases: {created:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_refuses_more_than_eight_instances_or_none_before_it_creates_anything() {
    let nats = TestNats::start();
    let server = format!("{}/postgres", server_url().trim_end_matches('/'));
    for (instances, only) in [("9", "instances"), ("0", "ingest")] {
        let args = Cli::parse_from([
            "bench",
            "--serve-binary",
            "/nonexistent/tally",
            "--only",
            only,
            "--instances",
            instances,
        ])
        .args;
        let error = tally_bench::run(Config::new(&server, &nats.url), args)
            .await
            .expect_err("at most 8 instances, at least 1");
        assert_eq!(
            error.to_string(),
            format!("--instances must be between 1 and 8, got {instances}")
        );
    }
    let args = Cli::parse_from(["bench", "--only", "instances"]).args;
    let error = tally_bench::run(Config::new(&server, &nats.url), args)
        .await
        .expect_err("the instances part needs a count");
    assert!(error.to_string().contains("--instances N"), "{error:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bench_refuses_to_start_without_a_tally_binary_to_run() {
    // Every part runs the tally binary as a child process.
    let error = refusal(&["--only", "ingest"]).await;
    assert!(
        error.contains("no tally binary at /nonexistent/tally"),
        "{error}"
    );
}
