//! `tally-bench`: how fast the whole service ingests, next to what Postgres and JetStream
//! do raw with the same rows and messages, measured in one run on the same machine. A crate
//! of its own, so that none of the load generator is compiled into the `tally` binary.
//!
//! It uses the configured Postgres and NATS, in a scratch database (`tally_bench_<hex>`)
//! and a NATS namespace (`bench<hex>`) of its own. Every part starts the real `tally serve`
//! binary as a child process (see `child`) and reads its CPU time and peak memory from
//! `/proc`; `tally migrate`, `tally replay`, `tally verify` and `tally reports import` run
//! as child processes too. Both are removed at the end, also when a step fails or the run
//! is interrupted.
//!
//! Flow: generate every event and check it with the service's own parser, serialize every
//! body and build the baseline rows (nothing of that is timed) → baselines while the
//! service idles (COPY, `INSERT … UNNEST`, raw JetStream publish) → HTTP batches → single
//! HTTP events → NATS ingest → count, chain and relay checks → with `--outside`, `wrk` and
//! `pgbench` from outside the bench's process (see `outside`) → the table. Then the
//! projection's own measurements, in a scratch database of their own (see `projection`),
//! then admission's, in another (see `admission`), then audit pages and verification on a
//! ledger of millions of events, in another (see `audit`), then the import and
//! reconciliation of a provider report of a million lines, in another (see
//! `reconciliation`), and container anomalies (see `anomalies`). With `--instances N`,
//! last, the ingest and admission workloads through one `tally serve` and through N on one
//! database, side by side (see `instances`). At the end, the targets of issue 23 measured
//! by the parts that ran, in one table (see `targets`).

mod admission;
mod anomalies;
mod audit;
mod child;
mod cpu;
mod instances;
mod outside;
mod projection;
mod reconciliation;
mod targets;

use std::collections::HashSet;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::{self, context::PublishAckFuture};
use bytes::Bytes;
use chrono::{DateTime, SubsecRound, Utc};
use hdrhistogram::Histogram;
use rand::seq::IndexedRandom;
use rand::Rng;
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use uuid::Uuid;

use tally::bus::{self, Names};
use tally::config::Config;
use tally::event::canonical;
use tally::event::parse::{parse_body, BodyKind};
use tally::event::{Event, TimeBounds};
use tally::ledger::db;
use tally::ledger::rows::{self, Rows};
use tally::projection::store::{self, LIVE};

pub use targets::{Bound, Figure as TargetFigure, Row as TargetRow, Summary};

/// Events posted in batches over HTTP: 200 full batches, enough for a stable p99 and a few
/// seconds of sustained load, yet the whole run stays within about two minutes.
const HTTP_EVENTS: usize = 200_000;
/// Events per HTTP batch: the service's maximum, a producer's best case.
const HTTP_BATCH_EVENTS: usize = tally::config::BATCH_EVENTS_MAX;
/// Concurrent batch producers: enough to keep a group commit waiting behind every commit.
const HTTP_BATCH_CLIENTS: usize = 4;
/// Events posted one per request: a thousand per client at the default client count.
const SINGLE_EVENTS: usize = 64_000;
/// Concurrent single-event producers, each with a connection of its own.
const SINGLE_CLIENTS: usize = 64;
/// Connections of the one-row-per-transaction baseline: the yardstick for single
/// events ("one INSERT per transaction from 16 connections").
const SINGLE_BASELINE_CONNECTIONS: usize = 16;
/// The table the single-event yardstick inserts into.
const SINGLE_BASELINE_TABLE: &str = "baseline_single";
/// Events published one per message to the ingest stream.
const NATS_EVENTS: usize = 100_000;
/// Events a message in the second NATS phase, which publishes as many events again in
/// batches (`{"events": [...]}`): the NATS path when producers batch, as HTTP's do.
const NATS_BATCH_EVENTS: usize = 100;
/// Organizations the events are spread over.
const ORGS: usize = 100;
/// Containers per organization: a few dozen sandboxes each, so a container has a history.
const CONTAINERS_PER_ORG: usize = 40;
/// How far back `occurred_at` goes: the last hour, well inside the backdate bound.
const OCCURRED_WINDOW_MS: i64 = 60 * 60 * 1000;
/// Unacknowledged JetStream publishes at once, for the ingest publish and its baseline
/// alike: the async-nats default, which the relay also runs with.
const PUBLISH_ACKS_IN_FLIGHT_MAX: usize = 5_000;
/// Whole-request deadline for the bench's HTTP client: far above any sane batch latency,
/// so a hung service fails the run instead of stalling it.
const HTTP_TIMEOUT_MS: u64 = 60_000;
/// How often a request refused with 503 (append queue full) is retried before the run
/// fails; each retry is counted and reported.
const HTTP_RETRIES_MAX: u32 = 50;
/// Pause before retrying a 503, as a well-behaved producer would.
const HTTP_RETRY_DELAY_MS: u64 = 20;
/// How long the service may take to create its streams and consumer after it starts.
const STARTUP_TIMEOUT_MS: u64 = 15_000;
/// How long the appender or the relay may take to catch up after a phase's last request.
const SETTLE_TIMEOUT_MS: u64 = 120_000;
/// Polling interval while waiting for the relay or the streams.
const POLL_MS: u64 = 20;
/// Longest error-body excerpt quoted in a failure.
const ERROR_EXCERPT_BYTES_MAX: usize = 500;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Events posted over HTTP in batches.
    #[arg(long, default_value_t = HTTP_EVENTS)]
    pub http_events: usize,

    /// Events per HTTP batch; also the rows per `INSERT … UNNEST` of the baseline.
    #[arg(long, default_value_t = HTTP_BATCH_EVENTS)]
    pub http_batch_events: usize,

    /// Concurrent clients posting batches.
    #[arg(long, default_value_t = HTTP_BATCH_CLIENTS)]
    pub http_batch_clients: usize,

    /// Events posted over HTTP one per request.
    #[arg(long, default_value_t = SINGLE_EVENTS)]
    pub single_events: usize,

    /// Concurrent clients posting single events.
    #[arg(long, default_value_t = SINGLE_CLIENTS)]
    pub single_clients: usize,

    /// Events published to the NATS ingest stream, one per message; as many again are
    /// published in batches of `--nats-batch-events` a message.
    #[arg(long, default_value_t = NATS_EVENTS)]
    pub nats_events: usize,

    /// Events a message in the batched NATS phase; at most the service's batch limit.
    #[arg(long, default_value_t = NATS_BATCH_EVENTS)]
    pub nats_batch_events: usize,

    /// Organizations the generated events are spread over.
    #[arg(long, default_value_t = ORGS)]
    pub orgs: usize,

    /// The `tally` binary the ingest part starts as `tally serve` (default: the one next to
    /// this binary).
    #[arg(long, env = "TALLY_BENCH_SERVE_BINARY")]
    pub serve_binary: Option<std::path::PathBuf>,

    /// Measure only these parts (comma-separated); every part when not given.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub only: Vec<Part>,

    /// Also run the ingest and admission workloads through 1 and through this many `tally
    /// serve` instances on one database, side by side (1 to 8; the `instances` part).
    #[arg(long)]
    pub instances: Option<usize>,

    /// After the ingest part's own phases, also drive single events from outside: `wrk`
    /// (64 connections) against the running service, then `pgbench -c 16` doing the
    /// yardstick's one-row INSERT (see `outside`). Both must be on the PATH.
    #[arg(long)]
    pub outside: bool,

    /// Seconds `wrk` and then `pgbench` each run with `--outside` (1 to 300).
    #[arg(long, default_value_t = outside::OUTSIDE_SECONDS)]
    pub outside_seconds: u64,

    #[command(flatten)]
    pub projection: projection::ProjectionArgs,

    #[command(flatten)]
    pub admission: admission::AdmissionArgs,

    #[command(flatten)]
    pub audit: audit::AuditArgs,

    #[command(flatten)]
    pub reconciliation: reconciliation::ReconciliationArgs,

    #[command(flatten)]
    pub anomalies: anomalies::AnomaliesArgs,
}

/// The parts of the benchmark, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Part {
    Ingest,
    Projection,
    Admission,
    Audit,
    Reconciliation,
    Anomalies,
    /// Runs only with `--instances`.
    Instances,
}

impl BenchArgs {
    fn runs(&self, part: Part) -> bool {
        if part == Part::Instances && self.instances.is_none() {
            return false;
        }
        self.only.is_empty() || self.only.contains(&part)
    }
}

/// Runs the parts `args` asks for, each printing its table, then the targets table of what
/// they measured; returns that summary.
pub async fn run(config: Config, args: BenchArgs) -> anyhow::Result<Summary> {
    check_args(&config, &args)?;
    if let Some(instances) = args.instances {
        instances::check_instances(instances)?;
    }
    anyhow::ensure!(
        args.instances.is_some() || !args.only.contains(&Part::Instances),
        "--only instances needs --instances N (how many instances to compare with one)"
    );
    // Every part runs the `tally` binary, so a missing one fails the run before anything.
    let binary = child::serve_binary(args.serve_binary.as_deref())?;
    let client = bus::connect(&config.nats_url).await?;
    print_stamp(&config, &client).await;
    let nats = publishing_context(client);
    let mut summary = Summary::default();
    // A failed or interrupted part ends the run there: starting another service after a
    // Ctrl-C would not be what was asked for.
    if args.runs(Part::Ingest) {
        let rows = ingest(&binary, config.clone(), &args, &nats).await?;
        summary.add(Part::Ingest, rows);
    }
    if args.runs(Part::Projection) {
        let rows =
            projection::run(&binary, config.clone(), &args.projection, args.orgs, &nats).await?;
        summary.add(Part::Projection, rows);
    }
    if args.runs(Part::Admission) {
        let rows = admission::run(&binary, config.clone(), &args.admission, &nats).await?;
        summary.add(Part::Admission, rows);
    }
    if args.runs(Part::Audit) {
        audit::run(&binary, config.clone(), &args.audit, &nats).await?;
    }
    if args.runs(Part::Reconciliation) {
        reconciliation::run(&binary, config.clone(), &args.reconciliation, &nats).await?;
    }
    if args.runs(Part::Anomalies) {
        anomalies::run(&binary, config.clone(), &args.anomalies, &nats).await?;
    }
    if let (true, Some(instances)) = (args.runs(Part::Instances), args.instances) {
        instances::run(&binary, config, &args, instances, &nats).await?;
    }
    summary.print();
    Ok(summary)
}

/// The line every table of the run is stamped with: when (UTC), which commit, on what.
async fn print_stamp(config: &Config, nats: &async_nats::Client) {
    let commit = std::process::Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .ok()
        .filter(|output| output.status.success())
        .and_then(|output| String::from_utf8(output.stdout).ok())
        .map(|commit| commit.trim().to_owned())
        .filter(|commit| !commit.is_empty())
        .unwrap_or_else(|| "unknown".to_owned());
    // Through the server's `postgres` database: the database `DATABASE_URL` names need not
    // exist.
    let postgres = match db::server_connection(&config.database_url).await {
        Ok(mut connection) => {
            let version: Option<String> = sqlx::query_scalar("SHOW server_version")
                .fetch_one(&mut connection)
                .await
                .ok();
            let _ = connection.close().await;
            version
        }
        Err(_) => None,
    };
    println!(
        "tally-bench, {} UTC, commit {commit}, machine: {}; Postgres {}, nats-server {}",
        Utc::now().format("%Y-%m-%d %H:%M"),
        machine(),
        postgres.as_deref().unwrap_or("unknown"),
        nats.server_info().version
    );
}

/// Cores, CPU model and memory, from the standard library and `/proc`.
fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| line.strip_prefix("model name")?.split_once(':'))
        .map_or("unknown CPU", |(_, model)| model.trim())
        .to_owned();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let memory = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|kb| kb.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or_else(
            || "unknown memory".to_owned(),
            |kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0),
        );
    format!("{cores} cores ({model}), {memory}")
}

async fn ingest(
    binary: &std::path::Path,
    mut config: Config,
    args: &BenchArgs,
    nats: &jetstream::Context,
) -> anyhow::Result<Vec<targets::Row>> {
    let scratch = Scratch::new(&config.database_url)?;
    let shown_database_url = without_password(&config.database_url);
    config.database_url = scratch.database_url.clone();
    config.nats_namespace = scratch.namespace.clone();
    config.bootstrap_token = Some(scratch.token.clone());

    // Everything is generated and checked before anything is created, so that a workload
    // the service would refuse fails the run with nothing to clean up.
    let workload = Workload::generate(&config, args)?;

    eprintln!(
        "bench: database {}, namespace {}",
        scratch.database_name, scratch.namespace
    );
    let report = measured_then_cleaned(
        &scratch,
        nats,
        start_and_measure(binary, &config, args, &scratch, &workload, nats),
    )
    .await?;
    report.print(&config, args, &shown_database_url, &scratch);
    eprintln!(
        "bench: removed database {} and the {} streams",
        scratch.database_name, scratch.namespace
    );
    anyhow::ensure!(report.checks_passed(), "a check failed; see the table");
    Ok(report.targets())
}

fn check_args(config: &Config, args: &BenchArgs) -> anyhow::Result<()> {
    let counts = [
        ("--http-events", args.http_events),
        ("--http-batch-events", args.http_batch_events),
        ("--http-batch-clients", args.http_batch_clients),
        ("--single-events", args.single_events),
        ("--single-clients", args.single_clients),
        ("--nats-events", args.nats_events),
        ("--nats-batch-events", args.nats_batch_events),
        ("--orgs", args.orgs),
    ];
    for (flag, count) in counts {
        anyhow::ensure!(count > 0, "{flag} must be at least 1");
    }
    let batches = [
        ("--http-batch-events", args.http_batch_events),
        ("--nats-batch-events", args.nats_batch_events),
    ];
    for (flag, events) in batches {
        anyhow::ensure!(
            events <= config.batch_events_max,
            "{flag} must be at most the service's batch limit of {}",
            config.batch_events_max
        );
    }
    anyhow::ensure!(
        (1..=outside::OUTSIDE_SECONDS_MAX).contains(&args.outside_seconds),
        "--outside-seconds must be between 1 and {}, got {}",
        outside::OUTSIDE_SECONDS_MAX,
        args.outside_seconds
    );
    if args.outside && args.runs(Part::Ingest) {
        outside::tools()?;
    }
    Ok(())
}

/// The names that make this run's database and streams its own.
struct Scratch {
    database_name: String,
    database_url: String,
    namespace: String,
    names: Names,
    token: String,
}

impl Scratch {
    fn new(database_url: &str) -> anyhow::Result<Scratch> {
        let mut rng = rand::rng();
        let suffix = format!("{:012x}", rng.random::<u64>() >> 16);
        let database_name = format!("tally_bench_{suffix}");
        let mut url = url::Url::parse(database_url).context("DATABASE_URL is not a URL")?;
        url.set_path(&format!("/{database_name}"));
        let namespace = format!("bench{suffix}");
        let names = Names::new(&namespace)?;
        Ok(Scratch {
            database_name,
            database_url: url.to_string(),
            namespace,
            names,
            token: hex::encode(rng.random::<[u8; 32]>()),
        })
    }

    /// A scratch database and namespace for the part named `part`, with `config` pointed at
    /// them and their bootstrap token; said on stderr. Also the server's URL as a table
    /// shows it (without a password).
    fn for_part(part: &str, config: &mut Config) -> anyhow::Result<(Scratch, String)> {
        let scratch = Scratch::new(&config.database_url)?;
        let shown_database_url = without_password(&config.database_url);
        config.database_url = scratch.database_url.clone();
        config.nats_namespace = scratch.namespace.clone();
        config.bootstrap_token = Some(scratch.token.clone());
        eprintln!(
            "bench: {part}: database {}, namespace {}",
            scratch.database_name, scratch.namespace
        );
        Ok((scratch, shown_database_url))
    }

    /// The raw-publish baseline's stream, inside the namespace like the service's own.
    fn baseline_stream(&self) -> String {
        self.names.stream("BASELINE")
    }

    fn baseline_subject(&self) -> String {
        self.names.subject("baseline.bench")
    }
}

/// Prints a URL without its password.
fn without_password(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut parsed) => {
            let _ = parsed.set_password(None);
            parsed.to_string()
        }
        Err(_) => "(unparsable URL)".to_owned(),
    }
}

/// The bench's own JetStream context, with its publish window set here rather than
/// inherited, so that the ingest publish and its baseline run with the same window.
fn publishing_context(client: async_nats::Client) -> jetstream::Context {
    jetstream::context::ContextBuilder::new()
        .timeout(Duration::from_millis(bus::REQUEST_TIMEOUT_MS))
        .max_ack_inflight(PUBLISH_ACKS_IN_FLIGHT_MAX)
        .backpressure_on_inflight(true)
        .build(client)
}

/// Awaits `measure`, then removes the scratch database and streams whatever it returned. An
/// error of the measurement is the one returned; a clean-up error after it is only printed.
async fn measured_then_cleaned<T>(
    scratch: &Scratch,
    nats: &jetstream::Context,
    measure: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    let outcome = measure.await;
    let cleaned = clean_up(scratch, nats).await;
    match (outcome, cleaned) {
        (Ok(measured), Ok(())) => Ok(measured),
        (Ok(_), Err(error)) | (Err(error), Ok(())) => Err(error),
        (Err(error), Err(cleanup_error)) => {
            eprintln!("bench: cleaning up also failed: {cleanup_error:#}");
            Err(error)
        }
    }
}

/// Deletes every stream of the namespace and the scratch database, trying all of them even
/// when one fails.
async fn clean_up(scratch: &Scratch, nats: &jetstream::Context) -> anyhow::Result<()> {
    let names = &scratch.names;
    let streams = [
        names.ledger_stream(),
        names.ingest_stream(),
        names.dlq_stream(),
        scratch.baseline_stream(),
    ];
    let mut failures = Vec::new();
    for stream in streams {
        match nats.delete_stream(&stream).await {
            Ok(_) => {}
            Err(error)
                if matches!(
                    error.kind(),
                    jetstream::context::DeleteStreamErrorKind::JetStream(ref e)
                        if e.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
                ) => {}
            Err(error) => failures.push(format!("cannot delete stream {stream}: {error}")),
        }
    }
    if let Err(error) = db::drop_database(&scratch.database_url).await {
        failures.push(format!(
            "cannot drop database {}: {error}",
            scratch.database_name
        ));
    }
    anyhow::ensure!(failures.is_empty(), "{}", failures.join("; "));
    Ok(())
}

/// Every body and row of the run, built before any clock starts.
struct Workload {
    /// `{"events":[…]}` bodies of `http_batch_events` each.
    batch_bodies: Arc<Vec<Bytes>>,
    /// One native event per body.
    single_bodies: Arc<Vec<Bytes>>,
    /// One native event per message.
    nats_payloads: Arc<Vec<Bytes>>,
    /// Native batches of `--nats-batch-events`, one per message.
    nats_batch_payloads: Arc<Vec<Bytes>>,
    /// The events of `nats_batch_payloads`.
    nats_batch_events: usize,
    /// The batch events as the ledger would store them at positions 1.., for the baselines.
    baseline: BaselineRows,
    /// The single events the same way, for the one-row-per-transaction baseline.
    single_baseline: Arc<Rows>,
    /// Every event's id: each must be in the ledger exactly once at the end.
    ids: HashSet<Uuid>,
}

impl Workload {
    fn generate(config: &Config, args: &BenchArgs) -> anyhow::Result<Workload> {
        let started = Instant::now();
        let now = Utc::now();
        let mut rng = rand::rng();
        let total = args.http_events + args.single_events + 2 * args.nats_events;
        let mut producers = Producers::new(args.orgs, total, now);
        let batch_events = producers.events(&mut rng, args.http_events);
        let single_events = producers.events(&mut rng, args.single_events);
        let nats_events = producers.events(&mut rng, args.nats_events);
        let nats_batch_events = producers.events(&mut rng, args.nats_events);

        let batches = |events: &[String], size: usize| -> Vec<Bytes> {
            events
                .chunks(size)
                .map(|chunk| Bytes::from(format!("{{\"events\":[{}]}}", chunk.join(","))))
                .collect()
        };
        let batch_bodies = batches(&batch_events, args.http_batch_events);
        let nats_batch_payloads = batches(&nats_batch_events, args.nats_batch_events);
        let single_bodies: Vec<Bytes> = single_events.into_iter().map(Bytes::from).collect();
        let nats_payloads: Vec<Bytes> = nats_events.into_iter().map(Bytes::from).collect();

        // The service's own parser decides validity, so a generator bug shows up here and
        // not as a dead-lettered message or a 422 halfway through a timed phase.
        let bounds = TimeBounds {
            now: Utc::now(),
            backdate_max: config.backdate_max(),
        };
        let parse_all = |bodies: &[Bytes]| -> anyhow::Result<Vec<Event>> {
            let mut events = Vec::new();
            for body in bodies {
                let parsed = parse_body(BodyKind::Native, body, bounds, config.batch_events_max)
                    .map_err(|e| {
                        anyhow::anyhow!("a generated event is invalid: {}", e.describe())
                    })?;
                events.extend(parsed);
            }
            Ok(events)
        };
        let batch_parsed = parse_all(&batch_bodies)?;
        let single_parsed = parse_all(&single_bodies)?;
        let nats_parsed = parse_all(&nats_payloads)?;
        let nats_batch_parsed = parse_all(&nats_batch_payloads)?;
        let mut ids = HashSet::with_capacity(total);
        for event in batch_parsed
            .iter()
            .chain(&single_parsed)
            .chain(&nats_parsed)
            .chain(&nats_batch_parsed)
        {
            assert!(
                ids.insert(event.id.as_uuid()),
                "event ids are unique: {} repeats",
                event.id
            );
        }
        assert_eq!(batch_parsed.len(), args.http_events);
        let baseline = BaselineRows::build(&batch_parsed, args.http_batch_events);
        let single_baseline = ledger_rows(&single_parsed, single_parsed.len().max(1))
            .pop()
            .unwrap_or_default();
        eprintln!(
            "bench: generated and checked {} events in {:.1} s",
            ids.len(),
            started.elapsed().as_secs_f64()
        );
        Ok(Workload {
            batch_bodies: Arc::new(batch_bodies),
            single_bodies: Arc::new(single_bodies),
            nats_payloads: Arc::new(nats_payloads),
            nats_batch_payloads: Arc::new(nats_batch_payloads),
            nats_batch_events: nats_batch_parsed.len(),
            baseline,
            single_baseline: Arc::new(single_baseline),
            ids,
        })
    }

    fn expected_events(&self) -> i64 {
        let count = self.baseline.count
            + self.single_bodies.len()
            + self.nats_payloads.len()
            + self.nats_batch_events;
        i64::try_from(count).expect("event counts fit in i64")
    }
}

const IMAGES: [&str; 5] = [
    "python:3.12-slim",
    "node:22-alpine",
    "ubuntu:24.04",
    "ghcr.io/acme/sandbox:1.4.2",
    "rust:1.85",
];
const STOP_REASONS: [&str; 4] = ["user", "idle", "admin", "provider"];
const PORTS: [u16; 5] = [3000, 5173, 8000, 8080, 8888];

/// Producers that behave as a container platform does: each container goes through its
/// own lifecycle (created, then mostly commands and ports while running, now and then
/// stopped and resumed), and `occurred_at` moves forward across the whole run, within the
/// last hour. Events arrive in the order they occurred, except one in
/// `LATE_ONE_IN`, which is delivered up to `LATE_EVENTS_MAX` events later, as a retried
/// request would be; the projector refolds the container of a late lifecycle event and
/// places a late command or port in its stored state.
struct Producers {
    /// Per container, whether it runs; `None` before it is created.
    running: Vec<Option<bool>>,
    started: DateTime<Utc>,
    step_ms: f64,
    produced: usize,
}

/// One event in this many is delivered late.
const LATE_ONE_IN: usize = 100;
/// How many later events a late one may be delivered behind.
const LATE_EVENTS_MAX: usize = 1_000;

impl Producers {
    fn new(orgs: usize, total_events: usize, now: DateTime<Utc>) -> Producers {
        Producers {
            running: vec![None; orgs * CONTAINERS_PER_ORG],
            started: now - chrono::Duration::milliseconds(OCCURRED_WINDOW_MS),
            step_ms: OCCURRED_WINDOW_MS as f64 / total_events.max(1) as f64,
            produced: 0,
        }
    }

    /// `count` events in the order they are delivered.
    fn events(&mut self, rng: &mut impl Rng, count: usize) -> Vec<String> {
        let mut events: Vec<String> = (0..count).map(|_| self.next(rng)).collect();
        for index in 0..count {
            if rng.random_range(0..LATE_ONE_IN) == 0 {
                let later = (index + rng.random_range(1..=LATE_EVENTS_MAX)).min(count - 1);
                events[index..=later].rotate_left(1);
            }
        }
        events
    }

    fn next(&mut self, rng: &mut impl Rng) -> String {
        let container = rng.random_range(0..self.running.len());
        let offset_ms = (self.produced as f64 * self.step_ms) as i64;
        self.produced += 1;
        let occurred_at = self.started + chrono::Duration::milliseconds(offset_ms);
        let event_type = match self.running[container] {
            None => "container.created",
            Some(false) => "container.resumed",
            Some(true) => match rng.random_range(0..100) {
                0..=74 => "container.command_ran",
                75..=87 => "container.port_published",
                _ => "container.stopped",
            },
        };
        self.running[container] = Some(event_type != "container.stopped");
        let org = container / CONTAINERS_PER_ORG;
        let container_id = format!("ctr_{org}_{}", container % CONTAINERS_PER_ORG);
        let data = container_data(rng, event_type, &container_id);
        envelope(
            &format!("org_{org}"),
            &container_id,
            event_type,
            occurred_at,
            data,
        )
    }
}

/// The `data` of a container event as a producer would send it: mostly clean exits, the
/// odd failure or timeout, ports of a few common dev servers.
fn container_data(rng: &mut impl Rng, event_type: &str, container_id: &str) -> serde_json::Value {
    match event_type {
        "container.created" => json!({
            "name": format!("task-{}", rng.random_range(0..1_000_000)),
            "image": IMAGES.choose(rng).expect("a non-empty list"),
        }),
        "container.command_ran" => {
            let exit_code = *[0, 0, 0, 0, 0, 0, 0, 1, 2, 137]
                .choose(rng)
                .expect("a non-empty list");
            let mut data = json!({
                "command_id": format!("cmd_{:016x}", rng.random::<u64>()),
                "exit_code": exit_code,
                "duration_ms": rng.random_range(5..120_000u64),
            });
            if exit_code == 137 {
                data["timed_out"] = json!(true);
            }
            data
        }
        "container.stopped" => {
            json!({"reason": STOP_REASONS.choose(rng).expect("a non-empty list")})
        }
        "container.port_published" => {
            let port = *PORTS.choose(rng).expect("a non-empty list");
            json!({
                "port": port,
                "url": format!("https://{container_id}-{port}.sandbox.example.com"),
            })
        }
        _ => json!({}),
    }
}

/// One event in the native envelope; the id is a UUIDv7, as producers are told to use.
fn envelope(
    org_id: &str,
    container_id: &str,
    event_type: &str,
    occurred_at: DateTime<Utc>,
    data: serde_json::Value,
) -> String {
    json!({
        "id": Uuid::now_v7().hyphenated().to_string(),
        "type": event_type,
        "org_id": org_id,
        "container_id": container_id,
        "occurred_at": canonical::timestamp(occurred_at),
        "data": data,
    })
    .to_string()
}

/// The ledger rows of the batch events, as the appender would write them (the appender's
/// own [`Rows`]): same columns, content digests and hash chain, one `recorded_at` per batch
/// as one group commit has.
struct BaselineRows {
    count: usize,
    /// One `INSERT … UNNEST` each.
    batches: Vec<Rows>,
    /// CSV for `COPY`, one chunk per batch.
    copy_chunks: Vec<Bytes>,
}

impl BaselineRows {
    fn build(events: &[Event], batch_events: usize) -> BaselineRows {
        let batches = ledger_rows(events, batch_events);
        let copy_chunks = batches
            .iter()
            .map(|rows| {
                let mut csv = String::new();
                for row in 0..rows.len() {
                    write_csv_row(&mut csv, rows, row);
                }
                Bytes::from(csv)
            })
            .collect();
        BaselineRows {
            count: events.len(),
            batches,
            copy_chunks,
        }
    }
}

/// `events` as the ledger would store them at positions 1.., chained from the genesis
/// hash, in `Rows` of `batch_events` each (each batch recorded at its own instant).
fn ledger_rows(events: &[Event], batch_events: usize) -> Vec<Rows> {
    let mut prev_hash = canonical::GENESIS_HASH;
    let mut position = 0_i64;
    events
        .chunks(batch_events)
        .map(|chunk| {
            let recorded_at = Utc::now().trunc_subsecs(3);
            let mut rows = Rows::default();
            for event in chunk {
                position += 1;
                let data = event.data_json();
                let digest = canonical::content_digest(&event.record_fields(&data));
                prev_hash = rows.push(event, data, digest, position, recorded_at, &prev_hash);
            }
            rows
        })
        .collect()
}

/// Row `row` of `rows` in `COPY … (FORMAT csv)`: NULL is an unquoted empty field, text is
/// quoted with `"` doubled, `bytea` goes in its `\x` hex form (CSV gives backslashes no
/// meaning).
fn write_csv_row(out: &mut String, rows: &Rows, row: usize) {
    fn text(out: &mut String, value: Option<&str>) {
        if let Some(value) = value {
            out.push('"');
            out.push_str(&value.replace('"', "\"\""));
            out.push('"');
        }
        out.push(',');
    }
    let _ = write!(out, "{},{},", rows.position[row], rows.id[row].hyphenated());
    text(out, Some(rows.event_type[row]));
    text(out, Some(&rows.org_id[row]));
    text(out, rows.container_id[row].as_deref());
    let _ = write!(
        out,
        "{},{},",
        canonical::timestamp(rows.occurred_at[row]),
        canonical::timestamp(rows.recorded_at[row])
    );
    text(out, Some(&rows.data[row].to_string()));
    text(out, rows.source[row].as_deref());
    text(out, rows.source_event_id[row].as_deref());
    text(
        out,
        rows.attributes[row]
            .as_ref()
            .map(|a| a.to_string())
            .as_deref(),
    );
    let _ = writeln!(
        out,
        "\\x{},\\x{}",
        hex::encode(&rows.content_digest[row]),
        hex::encode(&rows.hash[row])
    );
}

/// Writes events into an empty `ledger` with `COPY`, as rows the appender would have written
/// (its own [`Rows`], so content digests and the hash chain are the real ones); returns the
/// head. `next_chunk` yields the next events in position order, each a native body and when
/// the ledger recorded it, no earlier than `history_from`, until it yields `None`: the
/// caller decides how many events are built and held at once, so the ledger can be far
/// larger than memory. Each event goes through the service's parser first, judged as of the
/// moment it was recorded, so a generator bug fails here.
async fn copy_into_ledger(
    connection: &mut PgConnection,
    config: &Config,
    history_from: DateTime<Utc>,
    mut next_chunk: impl FnMut() -> Option<Vec<(String, DateTime<Utc>)>>,
) -> anyhow::Result<i64> {
    let now = Utc::now();
    // The ledger's months from the first `recorded_at` to now, and a day past it for the
    // moments an event's recording follows it: COPY cannot make them.
    tally::ledger::partitions::ensure(
        &mut *connection,
        history_from,
        now + chrono::Duration::days(1),
    )
    .await?;
    let statement = format!(
        "COPY ledger ({}) FROM STDIN WITH (FORMAT csv)",
        rows::COLUMNS
    );
    let mut copy = connection.copy_in_raw(&statement).await?;
    let mut prev_hash = canonical::GENESIS_HASH;
    let mut position = 0_i64;
    while let Some(chunk) = next_chunk() {
        let csv = {
            let mut rows = Rows::default();
            for (body, recorded_at) in chunk {
                anyhow::ensure!(
                    recorded_at >= history_from,
                    "a planned event is recorded at {recorded_at}, before {history_from}"
                );
                let bounds = TimeBounds {
                    now: recorded_at,
                    backdate_max: config.backdate_max(),
                };
                let mut parsed = parse_body(BodyKind::Native, body.as_bytes(), bounds, 1)
                    .map_err(|e| anyhow::anyhow!("a planned event is invalid: {}", e.describe()))?;
                let event = parsed.pop().expect("one body, one event");
                position += 1;
                let data = event.data_json();
                let digest = canonical::content_digest(&event.record_fields(&data));
                prev_hash = rows.push(&event, data, digest, position, recorded_at, &prev_hash);
            }
            let mut csv = String::new();
            for row in 0..rows.len() {
                write_csv_row(&mut csv, &rows, row);
            }
            csv
        };
        copy.send(csv.into_bytes()).await?;
    }
    let copied = copy.finish().await?;
    anyhow::ensure!(
        copied == position as u64,
        "COPY stored {copied} rows of {position}"
    );
    Ok(position)
}

/// Puts the ledger's last event into the scratch `TALLY_LEDGER`, as the relay would have
/// published it. The relay resumes after the last position in its stream, so it starts
/// caught up — as it is in production, where the history was relayed as it was written —
/// instead of publishing a whole `COPY`-built ledger during the measurements.
async fn seed_ledger_stream(
    connection: &mut PgConnection,
    nats: &jetstream::Context,
    scratch: &Scratch,
    head: i64,
) -> anyhow::Result<()> {
    let names = &scratch.names;
    bus::apply_streams(nats, names, &["TALLY_LEDGER"]).await?;
    let rows = tally::ledger::read::read_after(&mut *connection, head - 1, 1).await?;
    let row = rows.first().context("the ledger has no head row")?;
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", row.id.hyphenated().to_string().as_str());
    headers.insert("Nats-Expected-Last-Sequence", "0");
    headers.insert(bus::POSITION_HEADER, row.position.to_string().as_str());
    let ack = nats
        .publish_with_headers(
            names.ledger_subject(&row.org_id, &row.event_type),
            headers,
            serde_json::to_vec(&row.to_message())?.into(),
        )
        .await?
        .await
        .context("the seed of the ledger stream was not acknowledged")?;
    anyhow::ensure!(ack.sequence == 1, "the ledger stream was not empty");
    Ok(())
}

/// Starts `tally serve` as a child process, measures, and stops it whatever happened, so
/// that no relay or consumer outlives the run and recreates a stream after clean-up.
async fn start_and_measure(
    binary: &std::path::Path,
    config: &Config,
    args: &BenchArgs,
    scratch: &Scratch,
    workload: &Workload,
    nats: &jetstream::Context,
) -> anyhow::Result<Report> {
    let served = child::Served::start(binary, config).await?;
    let outcome = tokio::select! {
        outcome = measure(binary, config, &served, args, scratch, workload, nats) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    eprintln!("bench: stopping the service");
    let usage = served.stop().await;
    let mut report = outcome?;
    report.service = Some(usage?);
    Ok(report)
}

async fn measure(
    binary: &std::path::Path,
    config: &Config,
    service: &child::Served,
    args: &BenchArgs,
    scratch: &Scratch,
    workload: &Workload,
    nats: &jetstream::Context,
) -> anyhow::Result<Report> {
    let services = std::slice::from_ref(service);
    let mut phases = Phases::new(services, nats, scratch).await?;
    let connection = &mut phases.connection;
    let baselines = Baselines {
        copy: baseline_copy(connection, services, &workload.baseline).await?,
        unnest: baseline_unnest(connection, services, &workload.baseline).await?,
        single_rows: baseline_single_rows(
            connection,
            services,
            &scratch.database_url,
            &workload.single_baseline,
        )
        .await?,
        publish: baseline_publish(nats, services, scratch, &workload.nats_payloads).await?,
    };
    let ingested = phases.ingest(workload, args).await?;

    eprintln!("bench: checking the ledger");
    let mut checks = check_ledger(
        binary,
        config,
        &service.pool,
        nats,
        &scratch.names,
        workload,
    )
    .await?;
    let outside = if args.outside {
        let outside = outside::measure(
            service.address,
            &scratch.token,
            &scratch.database_url,
            &service.pool,
            &workload.single_bodies,
            args.outside_seconds,
        )
        .await?;
        checks.extend(outside.checks);
        Some(outside.figures)
    } else {
        None
    };
    Ok(Report {
        baselines,
        batch: ingested.batch,
        batch_relayed: ingested.batch_relayed,
        single: ingested.single,
        nats_ingest: ingested.nats,
        nats_batched: ingested.nats_batched,
        outside,
        checks,
        service: None,
    })
}

/// What the timed phases against the running service share: one instance, or several on
/// the same database and namespace, whose HTTP load is spread round-robin and which share
/// the ingest consumer.
struct Phases<'a> {
    services: &'a [child::Served],
    nats: &'a jetstream::Context,
    names: &'a Names,
    /// For `CHECKPOINT`s between phases.
    connection: PgConnection,
    endpoint: Endpoint,
    /// The ledger head the phases so far should have reached.
    head: i64,
}

/// The figures of the three ingest phases, in the order they run.
struct IngestFigures {
    batch: Figure,
    /// The batches from the first post until the relay had published their events.
    batch_relayed: Figure,
    single: Figure,
    nats: Figure,
    /// The same path with `--nats-batch-events` events a message.
    nats_batched: Figure,
}

impl<'a> Phases<'a> {
    /// Waits for `scratch`'s streams and connects to its database, which `services` share.
    async fn new(
        services: &'a [child::Served],
        nats: &'a jetstream::Context,
        scratch: &'a Scratch,
    ) -> anyhow::Result<Phases<'a>> {
        wait_for_streams(nats, &scratch.names).await?;
        let connection = PgConnection::connect(&scratch.database_url)
            .await
            .context("cannot connect to the scratch database")?;
        Ok(Phases {
            services,
            nats,
            names: &scratch.names,
            connection,
            endpoint: Endpoint {
                addresses: services.iter().map(|service| service.address).collect(),
                url: "/v1/events".to_string(),
                token: scratch.token.clone(),
            },
            head: 0,
        })
    }

    /// The ingest part's workload: HTTP batches, single HTTP events, then NATS ingest, an
    /// event a message and then in batches; closes the connection after them.
    async fn ingest(
        mut self,
        workload: &Workload,
        args: &BenchArgs,
    ) -> anyhow::Result<IngestFigures> {
        let (batch, batch_relayed) = self
            .http(
                "HTTP batches",
                &workload.batch_bodies,
                workload.baseline.count,
                args.http_batch_clients,
            )
            .await?;
        let batch_relayed = Figure::new(
            "HTTP batches, until relayed",
            workload.baseline.count,
            batch_relayed,
        );
        let (single, _) = self
            .http(
                "HTTP single events",
                &workload.single_bodies,
                workload.single_bodies.len(),
                args.single_clients,
            )
            .await?;
        let nats = self
            .nats(
                "NATS ingest, publish to committed",
                &workload.nats_payloads,
                workload.nats_payloads.len(),
            )
            .await?;
        let nats_batched = self
            .nats(
                &format!("NATS ingest, {} events a message", args.nats_batch_events),
                &workload.nats_batch_payloads,
                workload.nats_batch_events,
            )
            .await?;
        self.connection.close().await?;
        Ok(IngestFigures {
            batch,
            batch_relayed,
            single,
            nats,
            nats_batched,
        })
    }
}

impl Phases<'_> {
    /// Posts every body; returns the figure and the time until the relay had published
    /// the phase's events too.
    async fn http(
        &mut self,
        label: &str,
        bodies: &Arc<Vec<Bytes>>,
        events: usize,
        clients: usize,
    ) -> anyhow::Result<(Figure, Duration)> {
        checkpoint(&mut self.connection).await;
        eprintln!("bench: {label}: {events} events from {clients} clients");
        let wal_before = WalPosition::now(&mut self.connection).await?;
        let commits_before = GroupCommits::of(self.services).await?;
        let cpu_before = services_cpu(self.services)?;
        let split_before = cpu::CpuSplit::now(self.services);
        let started = Instant::now();
        let posted = self.endpoint.post_all(bodies, clients).await?;
        let cpu = services_cpu(self.services)? - cpu_before;
        let split_after = cpu::CpuSplit::now(self.services);
        let group_commits = GroupCommits::of(self.services).await?.since(commits_before);
        let wal = WalPosition::now(&mut self.connection)
            .await?
            .since(wal_before, label);
        self.head += i64::try_from(events)?;
        // Every answer came after its commit, so the head is already there.
        let head = ledger_head(self.pool()).await?;
        anyhow::ensure!(
            head == self.head,
            "the ledger head is {head} after {label}, expected {}",
            self.head
        );
        wait_for_relay(self.nats, self.names, self.head).await?;
        let relayed = started.elapsed();
        let projected = wait_for_projection(self.pool(), self.head).await?;
        let figure = Figure::new(label, events, posted.elapsed)
            .with_latencies(&posted.latencies)
            .with_group_commits(group_commits)
            .with_retries(posted.retries)
            .with_wal(wal)
            .with_note(service_cpu_note(cpu, posted.elapsed))
            .with_cpu(split_before, split_after)
            .with_note(projected_note(started.elapsed(), projected));
        Ok((figure, relayed))
    }

    /// Publishes `payloads` (holding `events` events) to the ingest stream and times from
    /// the first publish until the appender has committed the last event.
    async fn nats(
        &mut self,
        label: &str,
        payloads: &Arc<Vec<Bytes>>,
        events: usize,
    ) -> anyhow::Result<Figure> {
        checkpoint(&mut self.connection).await;
        eprintln!(
            "bench: {label}: {events} events in {} messages",
            payloads.len()
        );
        let wal_before = WalPosition::now(&mut self.connection).await?;
        let commits_before = GroupCommits::of(self.services).await?;
        let cpu_before = services_cpu(self.services)?;
        let split_before = cpu::CpuSplit::now(self.services);
        let started = Instant::now();
        // Aborted on any early return, so that no publish outlives the run.
        let mut publisher = AbortOnDrop(tokio::spawn(publish_all(
            self.nats.clone(),
            self.names.subject("tally.ingest.bench"),
            payloads.clone(),
        )));
        self.head += i64::try_from(events)?;
        wait_for_head(self.pool(), self.head).await?;
        let ingested = started.elapsed();
        let cpu = services_cpu(self.services)? - cpu_before;
        let split_after = cpu::CpuSplit::now(self.services);
        let published = (&mut publisher.0)
            .await
            .context("the publishing task failed")??;
        let group_commits = GroupCommits::of(self.services).await?.since(commits_before);
        let wal = WalPosition::now(&mut self.connection)
            .await?
            .since(wal_before, label);
        wait_for_relay(self.nats, self.names, self.head).await?;
        let projected = wait_for_projection(self.pool(), self.head).await?;
        Ok(Figure::new(label, events, ingested)
            .with_group_commits(group_commits)
            .with_wal(wal)
            .with_note(service_cpu_note(cpu, ingested))
            .with_cpu(split_before, split_after)
            .with_note(format!("all acks after {:.2} s", published.as_secs_f64()))
            .with_note(projected_note(started.elapsed(), projected)))
    }
}

impl Phases<'_> {
    /// The bench's own connections to the database the instances share.
    fn pool(&self) -> &sqlx::PgPool {
        &self.services[0].pool
    }
}

/// The CPU time of every `tally serve` child so far.
fn services_cpu(services: &[child::Served]) -> anyhow::Result<Duration> {
    let mut cpu = Duration::ZERO;
    for service in services {
        cpu += service.usage()?.cpu;
    }
    Ok(cpu)
}

/// The CPU time `tally serve` spent during a phase, and as a share of one core.
fn service_cpu_note(cpu: Duration, elapsed: Duration) -> String {
    format!(
        "tally serve CPU {:.2} s ({:.0} % of a core)",
        cpu.as_secs_f64(),
        100.0 * cpu.as_secs_f64() / elapsed.as_secs_f64()
    )
}

/// What `tally replay` reports, read from the line it prints, with the child's own figures.
struct Replayed {
    events: u64,
    containers: usize,
    position: i64,
    /// Replay's own time, from its line: without the process's start-up and connecting.
    elapsed: Duration,
    ran: child::Ran,
}

/// Runs `tally replay` as a child process on `config`'s database.
async fn replay(binary: &std::path::Path, config: &Config) -> anyhow::Result<Replayed> {
    let ran = child::run_cli(binary, config, &["replay"]).await?;
    let parsed = parse_replayed(&ran.stdout)
        .with_context(|| format!("tally replay printed {:?}", ran.stdout.trim()))?;
    let (events, containers, position, elapsed) = parsed;
    Ok(Replayed {
        events,
        containers,
        position,
        elapsed,
        ran,
    })
}

/// "replayed E events (C containers) up to position P in S s: …", as `tally replay`
/// prints it.
fn parse_replayed(line: &str) -> anyhow::Result<(u64, usize, i64, Duration)> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let after = |word: &str| -> anyhow::Result<&str> {
        let index = words
            .iter()
            .position(|w| *w == word)
            .with_context(|| format!("no {word:?}"))?;
        Ok(words.get(index + 1).context("the line ends early")?)
    };
    anyhow::ensure!(words.first() == Some(&"replayed"), "not a replay line");
    let events = words.get(1).context("no event count")?.parse()?;
    let containers = words
        .get(3)
        .context("no container count")?
        .trim_start_matches('(')
        .parse()?;
    let position = after("position")?.parse()?;
    let seconds: f64 = after("in")?.parse()?;
    Ok((
        events,
        containers,
        position,
        Duration::from_secs_f64(seconds),
    ))
}

/// What `tally verify` prints on standard output (its `VerifyReport` as JSON).
#[derive(Debug, serde::Deserialize)]
struct Verified {
    ok: bool,
    events_checked: u64,
    head_position: i64,
    from_position: i64,
    first_bad_position: Option<i64>,
    #[serde(default)]
    problem: Option<String>,
}

/// Runs `tally verify` (with `--incremental` when asked) as a child process on `config`'s
/// database. A broken chain makes it exit 1, which fails the run.
async fn verify_ledger(
    binary: &std::path::Path,
    config: &Config,
    incremental: bool,
) -> anyhow::Result<(Verified, child::Ran)> {
    let args: &[&str] = if incremental {
        &["verify", "--incremental"]
    } else {
        &["verify"]
    };
    let ran = child::run_cli(binary, config, args).await?;
    let verified = serde_json::from_str(&ran.stdout)
        .with_context(|| format!("tally verify printed {:?}", ran.stdout.trim()))?;
    Ok((verified, ran))
}

/// A `tally` subcommand's own CPU time and peak memory, for a line's notes.
fn ran_note(ran: &child::Ran) -> String {
    format!(
        "child CPU {:.2} s, peak RSS {:.0} MiB",
        ran.usage.cpu.as_secs_f64(),
        ran.usage.peak_mb
    )
}

/// The last position of the ledger (0 when empty).
async fn ledger_head(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT coalesce(max(position), 0)::bigint FROM ledger")
            .fetch_one(pool)
            .await?,
    )
}

/// How far the projector was behind when a phase's load ended.
fn projected_note(since_start: Duration, waited: Duration) -> String {
    format!(
        "projected {:.2} s after the start (waited {:.2} s for it)",
        since_start.as_secs_f64(),
        waited.as_secs_f64()
    )
}

/// A task that is aborted when its handle is dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The service creates its streams and the ingest consumer in the background; publishing
/// before they exist would fail with "no responders" or time the consumer's creation.
async fn wait_for_streams(nats: &jetstream::Context, names: &Names) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
    loop {
        let ready = match nats.get_stream(names.ingest_stream()).await {
            Ok(stream) => {
                stream.consumer_info(bus::INGEST_CONSUMER).await.is_ok()
                    && nats.get_stream(names.ledger_stream()).await.is_ok()
            }
            Err(_) => false,
        };
        if ready {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the service did not create its streams within {STARTUP_TIMEOUT_MS} ms"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// Flushes dirty pages before a timed phase, so that no phase pays for the writes of the
/// one before it. Needs superuser (or `pg_checkpoint`); without it the run goes on.
async fn checkpoint(connection: &mut PgConnection) {
    if let Err(error) = sqlx::query("CHECKPOINT").execute(&mut *connection).await {
        eprintln!("bench: CHECKPOINT refused ({error}); phases may carry each other's writes");
    }
}

/// Waits until the ledger holds `expected` events, read from the database the child
/// commits to.
async fn wait_for_head(pool: &sqlx::PgPool, expected: i64) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_millis(SETTLE_TIMEOUT_MS);
    loop {
        let head = ledger_head(pool).await?;
        if head >= expected {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the ledger head did not reach {expected} within {SETTLE_TIMEOUT_MS} ms (it is at \
             {head})"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// Waits until the relay has published everything up to `position`. On a fresh stream the
/// relay's sequence numbers are the ledger positions, one message per event.
async fn wait_for_relay(
    nats: &jetstream::Context,
    names: &Names,
    position: i64,
) -> anyhow::Result<()> {
    let expected = u64::try_from(position).expect("positions are positive");
    let deadline = Instant::now() + Duration::from_millis(SETTLE_TIMEOUT_MS);
    let mut stream = nats.get_stream(names.ledger_stream()).await?;
    loop {
        let relayed = stream.info().await?.state.last_sequence;
        if relayed >= expected {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the relay reached {relayed} of {expected} within {SETTLE_TIMEOUT_MS} ms"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// Waits until the projector has taken every event up to `head`; returns how long that took.
/// A phase waits for this before it ends, so that the next phase neither shares the
/// machine with this one's projection backlog nor is charged for it.
pub(crate) async fn wait_for_projection(
    pool: &sqlx::PgPool,
    head: i64,
) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let deadline = started + Duration::from_millis(SETTLE_TIMEOUT_MS);
    let mut connection = pool.acquire().await?;
    loop {
        let projected = store::checkpoint(&mut connection, LIVE).await?;
        if projected >= head {
            return Ok(started.elapsed());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the projection reached {projected} of {head} within {SETTLE_TIMEOUT_MS} ms"
        );
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
}

/// The raw write limits tally is compared with, on the same rows and payloads.
struct Baselines {
    copy: Figure,
    unnest: Figure,
    /// One row per transaction from [`SINGLE_BASELINE_CONNECTIONS`] connections.
    single_rows: Figure,
    publish: Figure,
}

/// A baseline table: the ledger's columns, constraints and indexes (`LIKE … INCLUDING
/// ALL` follows the migrations), but none of its triggers, which `LIKE` never copies.
async fn create_baseline_table(connection: &mut PgConnection, name: &str) -> anyhow::Result<()> {
    sqlx::query(&format!("CREATE TABLE {name} (LIKE ledger INCLUDING ALL)"))
        .execute(&mut *connection)
        .await?;
    let indexes: Vec<(String, i64)> = sqlx::query_as(
        "SELECT tablename::text, count(*) FROM pg_indexes \
         WHERE schemaname = current_schema() AND tablename IN ('ledger', $1) \
         GROUP BY tablename",
    )
    .bind(name)
    .fetch_all(&mut *connection)
    .await?;
    let count = |table: &str| indexes.iter().find(|(t, _)| t == table).map(|(_, c)| *c);
    anyhow::ensure!(
        count("ledger").is_some() && count("ledger") == count(name),
        "the table {name} does not have the ledger's indexes: {indexes:?}"
    );
    Ok(())
}

async fn baseline_copy(
    connection: &mut PgConnection,
    services: &[child::Served],
    rows: &BaselineRows,
) -> anyhow::Result<Figure> {
    create_baseline_table(connection, "baseline").await?;
    checkpoint(connection).await;
    eprintln!("bench: baseline COPY of {} rows", rows.count);
    let wal_before = WalPosition::now(connection).await?;
    let split_before = cpu::CpuSplit::now(services);
    let started = Instant::now();
    let statement = format!(
        "COPY baseline ({}) FROM STDIN WITH (FORMAT csv)",
        rows::COLUMNS
    );
    let mut copy = connection.copy_in_raw(&statement).await?;
    for chunk in &rows.copy_chunks {
        copy.send(chunk.clone()).await?;
    }
    let copied = copy.finish().await?;
    let elapsed = started.elapsed();
    let split_after = cpu::CpuSplit::now(services);
    let wal = WalPosition::now(connection)
        .await?
        .since(wal_before, "COPY");
    anyhow::ensure!(
        copied == rows.count as u64,
        "COPY stored {copied} rows of {}",
        rows.count
    );
    Ok(Figure::new("COPY, one connection", rows.count, elapsed)
        .with_wal(wal)
        .with_cpu(split_before, split_after))
}

async fn baseline_unnest(
    connection: &mut PgConnection,
    services: &[child::Served],
    rows: &BaselineRows,
) -> anyhow::Result<Figure> {
    sqlx::query("TRUNCATE baseline")
        .execute(&mut *connection)
        .await?;
    checkpoint(connection).await;
    eprintln!("bench: baseline INSERT … UNNEST of {} rows", rows.count);
    let mut latencies = Vec::with_capacity(rows.batches.len());
    let split_before = cpu::CpuSplit::now(services);
    let started = Instant::now();
    for batch in &rows.batches {
        let sent = Instant::now();
        // The appender's statement, on the baseline table.
        let inserted = batch.insert_into(&mut *connection, "baseline").await?;
        latencies.push(sent.elapsed());
        assert_eq!(inserted, batch.len() as u64, "UNNEST inserts every row");
    }
    let elapsed = started.elapsed();
    let split_after = cpu::CpuSplit::now(services);
    let label = format!("INSERT UNNEST x{}, one connection", rows.batches[0].len());
    Ok(Figure::new(label, rows.count, elapsed)
        .with_latencies(&latencies)
        .with_cpu(split_before, split_after))
}

/// The yardstick for single events: each row in a transaction of its own (one
/// `INSERT … VALUES`, committed on its own), from [`SINGLE_BASELINE_CONNECTIONS`]
/// connections at once, into a table of its own shaped like the ledger. The same rows as
/// the single events the service is sent; each connection takes the next row as soon as
/// its last one is committed.
async fn baseline_single_rows(
    connection: &mut PgConnection,
    services: &[child::Served],
    database_url: &str,
    rows: &Arc<Rows>,
) -> anyhow::Result<Figure> {
    create_baseline_table(connection, SINGLE_BASELINE_TABLE).await?;
    // Built once: the loop below is measured.
    let statement: Arc<str> = format!(
        "INSERT INTO {SINGLE_BASELINE_TABLE} ({}) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        rows::COLUMNS
    )
    .into();
    checkpoint(connection).await;
    eprintln!(
        "bench: baseline INSERT of {} rows, one per transaction, from {SINGLE_BASELINE_CONNECTIONS} connections",
        rows.len()
    );
    let mut connections = Vec::with_capacity(SINGLE_BASELINE_CONNECTIONS);
    for _ in 0..SINGLE_BASELINE_CONNECTIONS {
        connections.push(PgConnection::connect(database_url).await?);
    }
    let wal_before = WalPosition::now(connection).await?;
    let next = Arc::new(AtomicUsize::new(0));
    let split_before = cpu::CpuSplit::now(services);
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for mut inserter in connections {
        let rows = rows.clone();
        let next = next.clone();
        let statement = Arc::clone(&statement);
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let row = next.fetch_add(1, Ordering::Relaxed);
                if row >= rows.len() {
                    break;
                }
                let sent = Instant::now();
                let inserted = rows
                    .bind_row(sqlx::query(&statement), row)
                    .execute(&mut inserter)
                    .await?
                    .rows_affected();
                latencies.push(sent.elapsed());
                anyhow::ensure!(inserted == 1, "an INSERT of one row inserted {inserted}");
            }
            anyhow::Ok((latencies, inserter))
        });
    }
    let mut latencies = Vec::with_capacity(rows.len());
    let mut inserters = Vec::with_capacity(SINGLE_BASELINE_CONNECTIONS);
    while let Some(joined) = tasks.join_next().await {
        let (done, inserter) = joined.context("a baseline inserter panicked")??;
        latencies.extend(done);
        inserters.push(inserter);
    }
    let elapsed = started.elapsed();
    // Before the connections close: a backend that has exited is counted only once
    // Postgres has reaped it, which may be after this reading.
    let split_after = cpu::CpuSplit::now(services);
    for inserter in inserters {
        inserter.close().await?;
    }
    let wal = WalPosition::now(connection)
        .await?
        .since(wal_before, "INSERT one row per transaction");
    anyhow::ensure!(latencies.len() == rows.len(), "every row is inserted once");
    let label = format!("INSERT 1 row per transaction, {SINGLE_BASELINE_CONNECTIONS} connections");
    Ok(Figure::new(label, rows.len(), elapsed)
        .with_latencies(&latencies)
        .with_wal(wal)
        .with_cpu(split_before, split_after))
}

async fn baseline_publish(
    nats: &jetstream::Context,
    services: &[child::Served],
    scratch: &Scratch,
    payloads: &Arc<Vec<Bytes>>,
) -> anyhow::Result<Figure> {
    // The ingest stream's own settings (file storage, limits, duplicate window), renamed,
    // so that the only difference left is what tally does with each message.
    let mut config = scratch
        .names
        .stream_configs()?
        .into_iter()
        .find(|c| c.name == scratch.names.ingest_stream())
        .context("the ingest stream has no definition")?;
    config.name = scratch.baseline_stream();
    config.subjects = vec![scratch.names.subject("baseline.>")];
    config.description = Some("tally-bench: raw publish baseline".to_owned());
    nats.create_stream(config)
        .await
        .context("cannot create the baseline stream")?;
    eprintln!(
        "bench: baseline JetStream publish of {} messages",
        payloads.len()
    );
    let split_before = cpu::CpuSplit::now(services);
    let elapsed = publish_all(nats.clone(), scratch.baseline_subject(), payloads.clone()).await?;
    let split_after = cpu::CpuSplit::now(services);
    Ok(
        Figure::new("JetStream async publish", payloads.len(), elapsed)
            .with_cpu(split_before, split_after),
    )
}

/// Publishes every payload with JetStream async publish and returns once every ack is in.
/// The acks are awaited by a second task as they come, so the context's in-flight window,
/// not a round trip per message, paces the publisher.
async fn publish_all(
    nats: jetstream::Context,
    subject: String,
    payloads: Arc<Vec<Bytes>>,
) -> anyhow::Result<Duration> {
    let subject = async_nats::Subject::from(subject);
    let started = Instant::now();
    let (sender, mut receiver) = mpsc::channel::<PublishAckFuture>(PUBLISH_ACKS_IN_FLIGHT_MAX);
    let mut collector = AbortOnDrop(tokio::spawn(async move {
        let mut acknowledged = 0_usize;
        while let Some(ack) = receiver.recv().await {
            ack.await.context("a publish was not acknowledged")?;
            acknowledged += 1;
        }
        anyhow::Ok(acknowledged)
    }));
    for payload in payloads.iter() {
        let ack = nats.publish(subject.clone(), payload.clone()).await?;
        if sender.send(ack).await.is_err() {
            // The collector stopped on a failed ack; its error is reported below.
            break;
        }
    }
    drop(sender);
    let acknowledged = (&mut collector.0)
        .await
        .context("the ack collector failed")??;
    anyhow::ensure!(
        acknowledged == payloads.len(),
        "{acknowledged} of {} publishes were acknowledged",
        payloads.len()
    );
    Ok(started.elapsed())
}

/// The service's HTTP ingest, as producers reach it: through one instance, or spread over
/// several (client `i` talks to instance `i % addresses.len()`, round-robin).
struct Endpoint {
    addresses: Vec<std::net::SocketAddr>,
    url: String,
    token: String,
}

struct Posted {
    elapsed: Duration,
    /// One per body.
    latencies: Vec<Duration>,
    retries: u64,
}

impl Endpoint {
    /// Posts every body, `clients` requests at a time, each client taking the next body as
    /// soon as its previous one is answered.
    async fn post_all(&self, bodies: &Arc<Vec<Bytes>>, clients: usize) -> anyhow::Result<Posted> {
        assert!(!self.addresses.is_empty(), "an instance to post to");
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        // A JoinSet aborts the other clients as soon as one fails and this returns.
        let mut tasks = JoinSet::new();
        for client_index in 0..clients {
            let client = self.addresses[client_index % self.addresses.len()];
            let url = self.url.clone();
            let token = self.token.clone();
            let bodies = bodies.clone();
            let next = next.clone();
            tasks.spawn(async move {
                let mut connection = HttpConnection::open(client, &url, &token).await?;
                let mut latencies = Vec::new();
                let mut retries = 0_u64;
                while let Some(body) = bodies.get(next.fetch_add(1, Ordering::Relaxed)) {
                    let sent = Instant::now();
                    retries += u64::from(connection.post(body).await?);
                    latencies.push(sent.elapsed());
                }
                anyhow::Ok((latencies, retries))
            });
        }
        let mut latencies = Vec::with_capacity(bodies.len());
        let mut retries = 0;
        while let Some(joined) = tasks.join_next().await {
            let (client_latencies, client_retries) =
                joined.context("an HTTP client panicked")??;
            latencies.extend(client_latencies);
            retries += client_retries;
        }
        let elapsed = started.elapsed();
        assert_eq!(latencies.len(), bodies.len(), "every body is posted once");
        Ok(Posted {
            elapsed,
            latencies,
            retries,
        })
    }
}

/// One client's own keep-alive HTTP/1.1 connection, driven by hyper directly.
///
/// The load generator shares the machine's two cores with the service, Postgres and
/// nats-server, so its own cost is taken from what it measures; a bare connection per
/// client costs noticeably less per request than a pooled general-purpose client.
struct HttpConnection {
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<Bytes>>,
    uri: hyper::Uri,
    authorization: hyper::header::HeaderValue,
    host: hyper::header::HeaderValue,
}

impl HttpConnection {
    async fn open(
        address: std::net::SocketAddr,
        path: &str,
        token: &str,
    ) -> anyhow::Result<HttpConnection> {
        let stream = tokio::net::TcpStream::connect(address).await?;
        stream.set_nodelay(true)?;
        let (sender, driver) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
        // The driver ends when the sender is dropped or the service closes the connection.
        tokio::spawn(driver);
        Ok(HttpConnection {
            sender,
            uri: path.parse()?,
            authorization: format!("Bearer {token}").parse()?,
            host: address.to_string().parse()?,
        })
    }

    /// One request on this connection, its answer read to the end whatever its status, so
    /// that the connection can carry the next one.
    async fn round_trip(
        &mut self,
        method: &hyper::Method,
        uri: &hyper::Uri,
        body: Bytes,
    ) -> anyhow::Result<(hyper::StatusCode, Bytes)> {
        use http_body_util::BodyExt;

        let request = hyper::Request::builder()
            .method(method.clone())
            .uri(uri.clone())
            .header(hyper::header::HOST, self.host.clone())
            .header(hyper::header::AUTHORIZATION, self.authorization.clone())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(http_body_util::Full::new(body))?;
        self.sender.ready().await?;
        let response = tokio::time::timeout(
            Duration::from_millis(HTTP_TIMEOUT_MS),
            self.sender.send_request(request),
        )
        .await
        .with_context(|| format!("{method} {uri} timed out"))?
        .with_context(|| format!("{method} {uri} failed"))?;
        let status = response.status();
        Ok((status, response.into_body().collect().await?.to_bytes()))
    }

    /// As [`round_trip`](Self::round_trip), failing on any status but `expected`: a bench
    /// must not pass on errors.
    async fn expect(
        &mut self,
        method: &hyper::Method,
        uri: &hyper::Uri,
        body: Bytes,
        expected: hyper::StatusCode,
    ) -> anyhow::Result<Bytes> {
        let (status, answer) = self.round_trip(method, uri, body).await?;
        if status != expected {
            anyhow::bail!("{method} {uri} answered {status}: {}", excerpt(&answer));
        }
        Ok(answer)
    }

    /// One `GET`, answered with 200.
    async fn get(&mut self, uri: &hyper::Uri) -> anyhow::Result<Bytes> {
        self.expect(
            &hyper::Method::GET,
            uri,
            Bytes::new(),
            hyper::StatusCode::OK,
        )
        .await
    }

    /// One `POST` of `body` to the connection's path, retried while the service answers
    /// 503; returns the retries.
    async fn post(&mut self, body: &Bytes) -> anyhow::Result<u32> {
        Ok(self.post_retried(body).await?.0)
    }

    /// As [`post`](Self::post), returning the answer.
    async fn post_answered(&mut self, body: &Bytes) -> anyhow::Result<Bytes> {
        Ok(self.post_retried(body).await?.1)
    }

    async fn post_retried(&mut self, body: &Bytes) -> anyhow::Result<(u32, Bytes)> {
        let uri = self.uri.clone();
        for retries in 0..=HTTP_RETRIES_MAX {
            let (status, answer) = self
                .round_trip(&hyper::Method::POST, &uri, body.clone())
                .await?;
            if status.is_success() {
                return Ok((retries, answer));
            }
            if status != hyper::StatusCode::SERVICE_UNAVAILABLE {
                anyhow::bail!("POST {uri} answered {status}: {}", excerpt(&answer));
            }
            tokio::time::sleep(Duration::from_millis(HTTP_RETRY_DELAY_MS)).await;
        }
        anyhow::bail!("POST {uri} still answered 503 after {HTTP_RETRIES_MAX} retries")
    }
}

/// The start of an error answer, for a message.
fn excerpt(answer: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(&answer[..answer.len().min(ERROR_EXCERPT_BYTES_MAX)])
}

/// The 1-, 5- and 15-minute load averages, where the system tells them: the machine's
/// other work shows in the tail latencies.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// The longest of the latencies, in ms (0 when there are none).
fn max_ms(durations: &[Duration]) -> f64 {
    durations
        .iter()
        .max()
        .map_or(0.0, |longest| longest.as_secs_f64() * 1000.0)
}

/// The appender's group-commit histograms, read from the child's `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
struct GroupCommits {
    commits: f64,
    events: f64,
    seconds: f64,
}

impl GroupCommits {
    /// Summed over every instance: each has an appender of its own.
    async fn of(services: &[child::Served]) -> anyhow::Result<GroupCommits> {
        let mut sum = GroupCommits::default();
        for service in services {
            let one = GroupCommits::from_text(&service.metrics().await?);
            sum.commits += one.commits;
            sum.events += one.events;
            sum.seconds += one.seconds;
        }
        Ok(sum)
    }

    fn from_text(text: &str) -> GroupCommits {
        let value = |name: &str| {
            text.lines()
                .find_map(|line| {
                    line.strip_prefix(name)?
                        .strip_prefix(' ')?
                        .trim()
                        .parse()
                        .ok()
                })
                .unwrap_or(0.0)
        };
        GroupCommits {
            commits: value("tally_append_batch_events_count"),
            events: value("tally_append_batch_events_sum"),
            seconds: value("tally_append_batch_seconds_sum"),
        }
    }

    fn since(self, before: GroupCommits) -> GroupCommits {
        GroupCommits {
            commits: self.commits - before.commits,
            events: self.events - before.events,
            seconds: self.seconds - before.seconds,
        }
    }
}

/// Where the server's write-ahead log ends: the difference over a phase is the WAL that
/// phase wrote, full-page images included, which unlike the timings does not depend on how
/// busy the machine is. It counts the whole server, so other databases' writes at the same
/// time are included.
#[derive(Debug, Clone)]
struct WalPosition {
    /// Bytes since `0/0`.
    bytes: i64,
    /// As Postgres prints it, for `pg_waldump --start … --end …`.
    lsn: String,
}

impl WalPosition {
    async fn now(connection: &mut PgConnection) -> anyhow::Result<WalPosition> {
        let (bytes, lsn): (i64, String) = sqlx::query_as(
            "SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::bigint, \
             pg_current_wal_insert_lsn()::text",
        )
        .fetch_one(&mut *connection)
        .await?;
        Ok(WalPosition { bytes, lsn })
    }

    /// The WAL written since `before`; names the range so that `pg_waldump --stats` can
    /// break it down into records and full-page images.
    fn since(self, before: WalPosition, label: &str) -> u64 {
        eprintln!(
            "bench: {label}: WAL {} .. {} ({} bytes)",
            before.lsn,
            self.lsn,
            self.bytes - before.bytes
        );
        u64::try_from(self.bytes - before.bytes).expect("the WAL only grows")
    }
}

/// The columns every table starts with, one [`Figure`] a row.
const FIGURE_COLUMNS: [&str; 6] = [
    "measurement",
    "count",
    "seconds",
    "per second",
    "p50 ms",
    "p99 ms",
];

/// An empty cell.
fn dash() -> String {
    "-".to_owned()
}

/// One measured line of the table.
struct Figure {
    label: String,
    count: usize,
    elapsed: Duration,
    /// p50 and p99, in milliseconds.
    latency_ms: Option<(f64, f64)>,
    group_commits: Option<GroupCommits>,
    /// The machine's busy core-seconds over the timed part (see [`Figure::with_cpu`]).
    machine_seconds: Option<f64>,
    notes: Vec<String>,
}

impl Figure {
    fn new(label: impl Into<String>, count: usize, elapsed: Duration) -> Figure {
        Figure {
            label: label.into(),
            count,
            elapsed,
            latency_ms: None,
            group_commits: None,
            machine_seconds: None,
            notes: Vec::new(),
        }
    }

    /// The cells of the columns every table starts with ([`FIGURE_COLUMNS`]), latencies
    /// with `decimals` places.
    fn cells(&self, decimals: usize) -> Vec<String> {
        let (p50, p99) = self.latency_ms.map_or((dash(), dash()), |(p50, p99)| {
            (format!("{p50:.decimals$}"), format!("{p99:.decimals$}"))
        });
        vec![
            self.label.clone(),
            self.count.to_string(),
            format!("{:.2}", self.elapsed.as_secs_f64()),
            format!("{:.0}", self.per_second()),
            p50,
            p99,
        ]
    }

    fn with_latencies(mut self, durations: &[Duration]) -> Figure {
        let latencies = Latencies::of(durations);
        self.latency_ms = Some((latencies.percentile_ms(0.50), latencies.percentile_ms(0.99)));
        self
    }

    fn with_group_commits(mut self, group_commits: GroupCommits) -> Figure {
        self.group_commits = (group_commits.commits > 0.0).then_some(group_commits);
        self
    }

    /// Notes the WAL written per event.
    fn with_wal(self, wal_bytes: u64) -> Figure {
        let per_event = wal_bytes as f64 / self.count as f64;
        self.with_note(format!("WAL {per_event:.0} B/event"))
    }

    /// Notes who used the CPU between the readings `before` and `after` (taken around the
    /// timed part) and what the machine spent per event.
    fn with_cpu(mut self, before: Option<cpu::CpuSplit>, after: Option<cpu::CpuSplit>) -> Figure {
        self.machine_seconds = cpu::CpuSplit::machine_seconds(before, after);
        self.notes.push(cpu::CpuSplit::describe(before, after));
        if let Some(microseconds) = self.cpu_per_event_us() {
            self.notes
                .push(format!("machine CPU {microseconds:.0} µs an event"));
        }
        self
    }

    /// The machine's CPU per event over the timed part, in microseconds, when measured.
    fn cpu_per_event_us(&self) -> Option<f64> {
        cpu::CpuSplit::per_event_us(self.machine_seconds, u64::try_from(self.count).ok()?)
    }

    fn with_retries(self, retries: u64) -> Figure {
        if retries == 0 {
            return self;
        }
        self.with_note(format!("{retries} retries after 503"))
    }

    fn with_note(mut self, note: String) -> Figure {
        self.notes.push(note);
        self
    }

    fn with_notes(mut self, notes: Vec<String>) -> Figure {
        self.notes.extend(notes);
        self
    }

    fn per_second(&self) -> f64 {
        self.count as f64 / self.elapsed.as_secs_f64()
    }
}

/// Significant decimal digits the latency histograms keep: every percentile is within
/// 0.1 % of the recorded value it stands for, from nanoseconds to hours.
const LATENCY_SIGNIFICANT_DIGITS: u8 = 3;

/// Durations in an HDR histogram of nanoseconds, for their percentiles.
struct Latencies(Histogram<u64>);

impl Latencies {
    fn of(durations: &[Duration]) -> Latencies {
        let mut histogram = Histogram::new(LATENCY_SIGNIFICANT_DIGITS)
            .expect("3 significant digits is within hdrhistogram's range");
        for duration in durations {
            // Saturates only after 584 years; the histogram grows to fit the largest value.
            let nanoseconds = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
            histogram
                .record(nanoseconds)
                .expect("an auto-resizing histogram records any value");
        }
        Latencies(histogram)
    }

    /// The duration below which `fraction` of them lie, in milliseconds.
    fn percentile_ms(&self, fraction: f64) -> f64 {
        assert!(!self.0.is_empty(), "a percentile of nothing");
        self.0.value_at_quantile(fraction) as f64 / 1e6
    }
}

/// One percentile of durations, in milliseconds (see [`Latencies`]).
fn percentile_ms(durations: &[Duration], fraction: f64) -> f64 {
    Latencies::of(durations).percentile_ms(fraction)
}

/// The end-of-run checks, each a sentence and whether it held.
struct Check {
    description: String,
    passed: bool,
}

/// A part's end, once its scratch database and streams are removed: says so, and fails
/// when one of the part's checks failed.
fn part_finished(part: &str, scratch: &Scratch, checks: &[Check]) -> anyhow::Result<()> {
    eprintln!(
        "bench: removed database {} and the {} streams",
        scratch.database_name, scratch.namespace
    );
    anyhow::ensure!(
        checks.iter().all(|check| check.passed),
        "a check of the {part} part failed; see the table"
    );
    Ok(())
}

/// The checks as a markdown list.
fn print_checks(checks: &[Check]) {
    for check in checks {
        let verdict = if check.passed { "ok" } else { "FAILED" };
        println!("- check {verdict}: {}", check.description);
    }
}

/// A line of a part's table: a figure and its target, with whether it was met.
struct Line {
    figure: Figure,
    target: String,
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

/// Prints the table of a part with targets (every part after ingest), the `tally` children's
/// CPU time and peak memory, then its checks.
fn print_lines<'a>(
    lines: impl IntoIterator<Item = &'a Line>,
    usage: Option<child::ProcessUsage>,
    checks: &[Check],
) {
    let header = [&FIGURE_COLUMNS[..], &["target", "notes"]].concat();
    let cells: Vec<Vec<String>> = lines
        .into_iter()
        .map(|Line { figure, target }| {
            let mut cells = figure.cells(2);
            cells.extend([target.clone(), figure.notes.join("; ")]);
            cells
        })
        .collect();
    print_table(&header, &cells);
    println!();
    if let Some(usage) = usage {
        print_service_usage(usage);
    }
    print_checks(checks);
}

async fn check_ledger(
    binary: &std::path::Path,
    config: &Config,
    pool: &sqlx::PgPool,
    nats: &jetstream::Context,
    names: &Names,
    workload: &Workload,
) -> anyhow::Result<Vec<Check>> {
    let mut checks = ledger_checks(binary, config, pool, nats, names, workload).await?;
    for (table, expected) in [
        ("baseline", workload.baseline.count),
        (SINGLE_BASELINE_TABLE, workload.single_baseline.len()),
    ] {
        let matching = same_content_as_ledger(pool, table).await?;
        checks.push(Check {
            description: format!(
                "{matching} of the {expected} rows of {table} have the content of their \
                 ledger rows"
            ),
            passed: matching == expected as i64,
        });
    }
    Ok(checks)
}

/// The checks of the ledger and the streams after the ingest phases, through one instance
/// or several: every event sent is in the ledger exactly once at gap-free positions, the
/// hash chain verifies, the relay published every event, nothing was dead-lettered.
async fn ledger_checks(
    binary: &std::path::Path,
    config: &Config,
    pool: &sqlx::PgPool,
    nats: &jetstream::Context,
    names: &Names,
    workload: &Workload,
) -> anyhow::Result<Vec<Check>> {
    let expected = workload.expected_events();
    let (count, first, last): (i64, Option<i64>, Option<i64>) =
        sqlx::query_as("SELECT count(*), min(position), max(position) FROM ledger")
            .fetch_one(pool)
            .await?;
    let mut checks = vec![Check {
        description: format!(
            "ledger holds {count} events at positions {}..{}, expected {expected} \
             ({} HTTP batch + {} HTTP single + {} NATS + {} NATS in batches)",
            first.unwrap_or(0),
            last.unwrap_or(0),
            workload.baseline.count,
            workload.single_bodies.len(),
            workload.nats_payloads.len(),
            workload.nats_batch_events
        ),
        passed: count == expected && first == Some(1) && last == Some(expected),
    }];
    let stored: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM ledger")
        .fetch_all(pool)
        .await?;
    let stored_count = stored.len();
    let stored: HashSet<Uuid> = stored.into_iter().collect();
    let missing = workload.ids.difference(&stored).count();
    let foreign = stored.difference(&workload.ids).count();
    checks.push(Check {
        description: format!(
            "every event sent is in the ledger exactly once: {missing} missing, {foreign} not \
             sent, {} stored twice",
            stored_count - stored.len()
        ),
        passed: missing == 0 && foreign == 0 && stored_count == stored.len(),
    });
    let (report, ran) = verify_ledger(binary, config, false).await?;
    checks.push(Check {
        description: format!(
            "hash chain recomputed by tally verify over {} events in {:.1} s: {}",
            report.events_checked,
            ran.elapsed.as_secs_f64(),
            match report.first_bad_position {
                None => "intact".to_owned(),
                Some(position) => format!("broken at {position}"),
            }
        ),
        passed: report.ok,
    });
    let messages = |stream: String| async move {
        let mut stream = nats.get_stream(&stream).await?;
        anyhow::Ok(stream.info().await?.state.messages)
    };
    let relayed = messages(names.ledger_stream()).await?;
    checks.push(Check {
        description: format!("{} holds {relayed} messages", names.ledger_stream()),
        passed: relayed == expected as u64,
    });
    let dead = messages(names.dlq_stream()).await?;
    checks.push(Check {
        description: format!("{} holds {dead} messages", names.dlq_stream()),
        passed: dead == 0,
    });
    Ok(checks)
}

/// How many rows of the baseline `table` have the content of the ledger row with their id.
/// Positions and hashes differ (the clients commit in any order), but everything the
/// producer sent and the content digest must be the same, or a baseline wrote other rows
/// than the service did.
async fn same_content_as_ledger(pool: &sqlx::PgPool, table: &str) -> anyhow::Result<i64> {
    Ok(sqlx::query_scalar(&format!(
        "SELECT count(*) FROM {table} b JOIN ledger l USING (id) \
         WHERE (b.type, b.org_id, b.container_id, b.occurred_at, b.data, b.content_digest) \
         IS NOT DISTINCT FROM (l.type, l.org_id, l.container_id, l.occurred_at, l.data, \
         l.content_digest)"
    ))
    .fetch_one(pool)
    .await?)
}

/// Everything the table prints.
struct Report {
    baselines: Baselines,
    batch: Figure,
    batch_relayed: Figure,
    single: Figure,
    nats_ingest: Figure,
    nats_batched: Figure,
    /// With `--outside`: `wrk` against the service, `pgbench` doing the yardstick.
    outside: Option<outside::Figures>,
    checks: Vec<Check>,
    /// The child's CPU time and peak memory over the whole part, read as it stopped.
    service: Option<child::ProcessUsage>,
}

impl Report {
    fn checks_passed(&self) -> bool {
        self.checks.iter().all(|c| c.passed)
    }

    fn print(&self, config: &Config, args: &BenchArgs, database_url: &str, scratch: &Scratch) {
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        println!();
        println!(
            "tally-bench: {cpus} CPUs; Postgres {database_url} (scratch database {}); NATS {} \
             (namespace {})",
            scratch.database_name,
            without_password(&config.nats_url),
            scratch.namespace
        );
        println!(
            "HTTP batches of {} from {} clients, single events from {} clients, group commits \
             of at most {} events, {} orgs",
            args.http_batch_events,
            args.http_batch_clients,
            args.single_clients,
            config.append_group_events_max,
            args.orgs
        );
        println!();
        let baselines = &self.baselines;
        let ratio = |figure: &Figure, baseline: &Figure, name: &str| {
            format!(
                "{:.3} x {name}",
                figure.per_second() / baseline.per_second()
            )
        };
        let rows = [
            (&baselines.copy, "baseline, rows".to_owned()),
            (&baselines.unnest, "baseline, rows".to_owned()),
            (&baselines.single_rows, "baseline, rows".to_owned()),
            (&baselines.publish, "baseline, messages".to_owned()),
            (
                &self.batch,
                format!(
                    "{}, {}",
                    ratio(&self.batch, &baselines.copy, "COPY"),
                    ratio(&self.batch, &baselines.unnest, "UNNEST")
                ),
            ),
            (
                &self.batch_relayed,
                ratio(&self.batch_relayed, &baselines.publish, "JetStream publish"),
            ),
            (
                &self.single,
                format!(
                    "{}, {}, {}",
                    ratio(&self.single, &baselines.single_rows, "INSERT 1 row/tx"),
                    ratio(&self.single, &baselines.unnest, "UNNEST"),
                    ratio(&self.single, &baselines.copy, "COPY")
                ),
            ),
            (
                &self.nats_ingest,
                ratio(&self.nats_ingest, &baselines.publish, "JetStream publish"),
            ),
            (
                &self.nats_batched,
                format!(
                    "{} (in events), {}",
                    ratio(&self.nats_batched, &baselines.publish, "JetStream publish"),
                    ratio(&self.nats_batched, &self.batch, "HTTP batches")
                ),
            ),
        ];
        let header = [
            &FIGURE_COLUMNS[..],
            &["events/commit", "commit ms", "vs baseline", "notes"],
        ]
        .concat();
        let cells: Vec<Vec<String>> = rows
            .iter()
            .map(|(figure, versus)| {
                let (events_per_commit, commit_ms) =
                    figure.group_commits.map_or((dash(), dash()), |g| {
                        (
                            format!("{:.1}", g.events / g.commits),
                            format!("{:.2}", g.seconds / g.commits * 1000.0),
                        )
                    });
                let mut cells = figure.cells(1);
                cells.extend([
                    events_per_commit,
                    commit_ms,
                    versus.clone(),
                    figure.notes.join("; "),
                ]);
                cells
            })
            .collect();
        print_table(&header, &cells);
        println!();
        if let Some(outside) = &self.outside {
            outside.print();
        }
        if let Some(usage) = self.service {
            print_service_usage(usage);
        }
        print_checks(&self.checks);
    }

    /// The rows of the targets table that the ingest part measures.
    fn targets(&self) -> Vec<targets::Row> {
        use targets::{per_second, Bound, Figure as Target, Row};

        // A row of two rates: `figure`'s over `reference`'s, named `name` in the values.
        let row = |target, figure: &Figure, reference: &Figure, name: &str, bound, text: &str| {
            let values = format!(
                "{} vs {name} {}",
                per_second(figure.per_second()),
                per_second(reference.per_second())
            );
            let (value, over) = (figure.per_second(), reference.per_second());
            Row::new(target, values, value, over, bound, text)
                .with_cpu_per_event(figure.cpu_per_event_us(), reference.cpu_per_event_us())
        };
        let baselines = &self.baselines;
        let (single, batch) = (&self.single, &self.batch);
        let mut rows = vec![
            row(
                Target::Single,
                single,
                &baselines.single_rows,
                "INSERT",
                Bound::AtLeast(1.5),
                "≥ 1.5 ×",
            ),
            row(
                Target::Batches,
                batch,
                &baselines.unnest,
                "UNNEST",
                Bound::AtLeast(0.6),
                "≥ 0.6 ×",
            ),
            row(
                Target::Nats,
                &self.nats_ingest,
                batch,
                "HTTP batches",
                Bound::AtLeast(1.0),
                "≥ the HTTP batch rate",
            ),
        ];
        rows.extend(self.outside.as_ref().map(outside::Figures::target));
        rows
    }
}

/// The `tally serve` child's CPU time over a whole part and its peak memory, after the table.
fn print_service_usage(usage: child::ProcessUsage) {
    println!(
        "tally serve (a child process): CPU {:.1} s over the part, peak RSS {:.0} MiB",
        usage.cpu.as_secs_f64(),
        usage.peak_mb
    );
    println!();
}

/// A markdown table, padded so that it also reads as plain text: text columns
/// left-aligned, number columns right-aligned.
fn print_table(header: &[&str], rows: &[Vec<String>]) {
    let width = |column: usize| {
        rows.iter()
            .map(|row| row[column].chars().count())
            .chain([header[column].chars().count()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..header.len()).map(width).collect();
    let is_text = |column: usize| column == 0 || column + 2 >= header.len();
    let line = |cells: Vec<&str>| {
        let mut out = String::from("|");
        for (column, cell) in cells.into_iter().enumerate() {
            // A `|` inside a cell would end it.
            let cell = cell.replace('|', "\\|");
            let padding = " ".repeat(widths[column].saturating_sub(cell.chars().count()));
            out.push(' ');
            if is_text(column) {
                out.push_str(&cell);
                out.push_str(&padding);
            } else {
                out.push_str(&padding);
                out.push_str(&cell);
            }
            out.push_str(" |");
        }
        println!("{out}");
    };
    line(header.to_vec());
    let rule: String = widths
        .iter()
        .enumerate()
        .map(|(column, width)| {
            let dashes = "-".repeat((*width).max(3));
            if is_text(column) {
                format!(" {dashes} |")
            } else {
                format!(" {}: |", &dashes[1..])
            }
        })
        .collect();
    println!("|{rule}");
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Within the histogram's 3 significant digits of `expected` (ms).
    fn close_to(actual: f64, expected: f64) -> bool {
        (actual - expected).abs() <= expected / 1000.0
    }

    #[test]
    fn percentiles_of_shuffled_latencies_are_their_nearest_ranks_to_three_significant_digits() {
        // 1 ms … 1000 ms in an order that is not sorted: the histogram needs no sorting.
        let mut durations: Vec<Duration> = (1..=1000).map(Duration::from_millis).collect();
        durations.reverse();
        durations.swap(0, 500);
        let latencies = Latencies::of(&durations);
        assert!(close_to(latencies.percentile_ms(0.50), 500.0));
        assert!(close_to(latencies.percentile_ms(0.99), 990.0));
        assert!(close_to(latencies.percentile_ms(1.0), 1000.0));
        assert!(close_to(percentile_ms(&durations, 0.50), 500.0));
    }

    #[test]
    fn sub_millisecond_latencies_keep_their_microseconds() {
        let durations = [Duration::from_micros(37); 10];
        assert!(close_to(percentile_ms(&durations, 0.99), 0.037));
    }

    #[test]
    fn the_line_tally_replay_prints_gives_its_counts_position_and_time() {
        let line = "replayed 20000 events (400 containers) up to position 20000 in 1.25 s: \
                    16000 events/s\n";
        let (events, containers, position, elapsed) = parse_replayed(line).unwrap();
        assert_eq!((events, containers, position), (20000, 400, 20000));
        assert_eq!(elapsed, Duration::from_millis(1250));
        assert!(parse_replayed("migrated").is_err());
    }

    #[test]
    fn the_longest_latency_needs_no_sorting() {
        let durations = [3, 9, 1].map(Duration::from_millis);
        assert_eq!(max_ms(&durations), 9.0);
        assert_eq!(max_ms(&[]), 0.0);
    }
}
