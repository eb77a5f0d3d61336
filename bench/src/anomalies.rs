//! `tally-bench`, anomalies part: what commands of containers that were never created cost
//! the projection once each of those containers has a thousand anomalies, next to commands
//! of running containers, in the same run.
//!
//! It runs in a scratch database and NATS namespace of its own, removed at the end, also
//! when a step fails or the run is interrupted.
//!
//! Flow: `COPY` a ledger in which every stray container already has `--anomalies-seeded`
//! commands (each one a `command_while_not_running`) and every running container its
//! `created`, then replay it with `tally replay` (nothing of that is timed) → start `tally
//! serve` as a child process →
//! an untimed warm-up of each kind → alternately, phases of single events from 64 connections: commands
//! of running containers, then commands of the stray containers; each phase is timed from
//! its first request until the projection has taken its last event → the table, with the
//! ratio of the two rates.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use bytes::Bytes;
use chrono::{DateTime, SubsecRound, Utc};
use rand::Rng;
use serde::Deserialize;
use serde_json::json;
use sqlx::{Connection, PgConnection};

use crate::child::{self, Served};
use crate::{
    checkpoint, copy_into_ledger, envelope, ledger_head, load_average, measured_then_cleaned,
    part_finished, print_lines, seed_ledger_stream, verdict, wait_for_projection, Check, Endpoint,
    Figure, HttpConnection, Line, Scratch,
};
use tally::config::Config;

/// Containers that were never created, each with the seeded anomalies; as many are
/// running, so that both kinds of phase spread their events over the same number of rows.
const STRAY_CONTAINERS: usize = 200;
/// Anomalies each stray container has before the first timed phase: the bar.
const ANOMALIES_SEEDED: usize = 1_000;
/// Events per timed phase: 100 per container, a few seconds at the rates measured.
const PHASE_EVENTS: usize = 20_000;
/// Rounds of (running, stray) phases: alternating evens out the machine's other work.
const ROUNDS: usize = 2;
/// The untimed warm-up posts this share (1 / n) of a phase's events of each kind.
const WARMUP_DIVISOR: usize = 10;
/// Concurrent single-event producers, as the `wrk` runs of the issue had.
const CLIENTS: usize = 64;
/// The organizations the containers are spread over.
const ORGS: usize = 10;
/// Every seeded event is at least this old when the run starts, so the timed events are
/// later than everything their containers have seen.
const SEED_END_MARGIN_MS: i64 = 60_000;
/// How far back the seeded history starts: an hour, well inside the backdate bound.
const SEED_WINDOW_MS: i64 = 60 * 60 * 1000;
/// Seeded events turned into ledger rows and sent to `COPY` at a time.
const COPY_CHUNK_EVENTS: usize = 10_000;
/// Target: the stray rate is at least this share of the running rate.
const RATIO_TARGET_PERCENT: u64 = 80;

#[derive(Debug, Clone, clap::Args)]
pub struct AnomaliesArgs {
    /// Stray containers (never created), and as many running ones.
    #[arg(long, default_value_t = STRAY_CONTAINERS)]
    pub anomalies_containers: usize,

    /// Anomalies each stray container has before the timed phases.
    #[arg(long, default_value_t = ANOMALIES_SEEDED)]
    pub anomalies_seeded: usize,

    /// Single events per timed phase.
    #[arg(long, default_value_t = PHASE_EVENTS)]
    pub anomalies_phase_events: usize,
}

/// Measures and prints the table. `config` is the service configuration of the ingest
/// part: only its server addresses and credentials are used.
pub(super) async fn run(
    binary: &std::path::Path,
    mut config: Config,
    args: &AnomaliesArgs,
    nats: &jetstream::Context,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.anomalies_containers > 0,
        "--anomalies-containers must be at least 1"
    );
    anyhow::ensure!(
        args.anomalies_phase_events > 0,
        "--anomalies-phase-events must be at least 1"
    );
    let (scratch, shown_database_url) = Scratch::for_part("anomalies", &mut config)?;
    let report = measured_then_cleaned(
        &scratch,
        nats,
        prepare_and_measure(binary, &config, args, &scratch, nats),
    )
    .await?;
    println!();
    println!(
        "tally-bench, anomalies: Postgres {shown_database_url} (scratch database {}); {} stray \
         containers with {} anomalies each at the start, {} running containers; {ROUNDS} \
         rounds of {} single events per kind from {CLIENTS} connections",
        scratch.database_name,
        args.anomalies_containers,
        args.anomalies_seeded,
        args.anomalies_containers,
        args.anomalies_phase_events
    );
    println!();
    print_lines(&report.lines, report.service, &report.checks);
    part_finished("anomalies", &scratch, &report.checks)
}

struct Report {
    lines: Vec<Line>,
    checks: Vec<Check>,
    /// The `tally serve` child's, over the timed phases and the warm-up.
    service: Option<child::ProcessUsage>,
}

fn org_id(container: usize) -> String {
    format!("org_{}", container % ORGS)
}

fn stray_id(container: usize) -> String {
    format!("ctr_stray_{container}")
}

fn running_id(container: usize) -> String {
    format!("ctr_run_{container}")
}

fn command(rng: &mut impl Rng, container_id: &str, occurred_at: DateTime<Utc>) -> String {
    envelope(
        &org_id(container_index(container_id)),
        container_id,
        "container.command_ran",
        occurred_at,
        json!({
            "command_id": format!("cmd_{:016x}", rng.random::<u64>()),
            "exit_code": 0,
            "duration_ms": rng.random_range(5..120_000),
        }),
    )
}

/// The number at the end of a container id, which picks its org.
fn container_index(container_id: &str) -> usize {
    container_id
        .rsplit('_')
        .next()
        .and_then(|index| index.parse().ok())
        .expect("bench container ids end with their index")
}

async fn prepare_and_measure(
    binary: &std::path::Path,
    config: &Config,
    args: &AnomaliesArgs,
    scratch: &Scratch,
    nats: &jetstream::Context,
) -> anyhow::Result<Report> {
    child::run_cli(binary, config, &["migrate"]).await?;
    let mut connection = PgConnection::connect(&scratch.database_url)
        .await
        .context("cannot connect to the scratch database")?;
    let started = Instant::now();
    let head = seed(&mut connection, config, args).await?;
    sqlx::query("VACUUM (ANALYZE) ledger")
        .execute(&mut connection)
        .await?;
    seed_ledger_stream(&mut connection, nats, scratch, head).await?;
    let replayed = crate::replay(binary, config).await?.position;
    checkpoint(&mut connection).await;
    connection.close().await?;
    eprintln!(
        "bench: anomalies: seeded {head} events and replayed them in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut checks = vec![Check {
        description: format!(
            "the seeded ledger of {head} events was replayed up to {}",
            replayed
        ),
        passed: replayed == head,
    }];
    let service = Served::start(binary, config).await?;
    let outcome = tokio::select! {
        outcome = measure(&service, args, scratch, head, &mut checks) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    eprintln!("bench: anomalies: stopping the service");
    let usage = service.stop().await;
    let lines = outcome?;
    Ok(Report {
        lines,
        checks,
        service: Some(usage?),
    })
}

/// The seeded ledger: every running container's `created`, then the stray containers'
/// commands round-robin, in time order over the last hour.
async fn seed(
    connection: &mut PgConnection,
    config: &Config,
    args: &AnomaliesArgs,
) -> anyhow::Result<i64> {
    let containers = args.anomalies_containers;
    let total = containers + containers * args.anomalies_seeded;
    let start = Utc::now().trunc_subsecs(3) - chrono::Duration::milliseconds(SEED_WINDOW_MS);
    let step_ms = (SEED_WINDOW_MS - SEED_END_MARGIN_MS) as f64 / total as f64;
    let mut rng = rand::rng();
    let mut next = 0_usize;
    copy_into_ledger(connection, config, start, || {
        if next >= total {
            return None;
        }
        let end = (next + COPY_CHUNK_EVENTS).min(total);
        let chunk = (next..end)
            .map(|index| {
                let occurred_at =
                    start + chrono::Duration::milliseconds((index as f64 * step_ms) as i64);
                let body = if index < containers {
                    let container_id = running_id(index);
                    envelope(
                        &org_id(index),
                        &container_id,
                        "container.created",
                        occurred_at,
                        json!({"name": format!("task-{index}")}),
                    )
                } else {
                    command(
                        &mut rng,
                        &stray_id((index - containers) % containers),
                        occurred_at,
                    )
                };
                (body, occurred_at + chrono::Duration::milliseconds(5))
            })
            .collect();
        next = end;
        Some(chunk)
    })
    .await
}

/// One container as `GET /v1/containers/{id}` answers it, reduced to the anomaly count.
#[derive(Deserialize)]
struct ContainerAnswer {
    anomalies_total: Option<u64>,
}

async fn measure(
    service: &Served,
    args: &AnomaliesArgs,
    scratch: &Scratch,
    seeded_head: i64,
    checks: &mut Vec<Check>,
) -> anyhow::Result<Vec<Line>> {
    let endpoint = Endpoint {
        addresses: vec![service.address],
        url: "/v1/events".to_string(),
        token: scratch.token.clone(),
    };
    let containers = args.anomalies_containers;
    let mut head = seeded_head;
    let mut rng = rand::rng();
    let mut totals = [(0_usize, Duration::ZERO); 2];
    let mut lines = Vec::new();
    // Distinct instants, each after everything before, in the order the clients take
    // them: events arrive as they occurred, as from a live producer.
    let mut next_at = Utc::now().trunc_subsecs(3);
    let mut bodies = |kind: usize, count: usize| -> Vec<Bytes> {
        next_at = next_at.max(Utc::now().trunc_subsecs(3));
        (0..count)
            .map(|_| {
                let container = rng.random_range(0..containers);
                let container_id = if kind == 0 {
                    running_id(container)
                } else {
                    stray_id(container)
                };
                let occurred_at = next_at;
                next_at += chrono::Duration::milliseconds(1);
                Bytes::from(command(&mut rng, &container_id, occurred_at))
            })
            .collect()
    };
    // Untimed: connections, caches and query plans warm for both kinds, so that neither
    // kind's first round pays for them.
    let warmup_events = (args.anomalies_phase_events / WARMUP_DIVISOR).max(1);
    for kind in [0, 1] {
        let warmup = bodies(kind, warmup_events);
        endpoint.post_all(&Arc::new(warmup), CLIENTS).await?;
        head += i64::try_from(warmup_events)?;
        wait_for_projection(&service.pool, head).await?;
    }
    for round in 0..ROUNDS {
        for (kind, label) in [(0, "running"), (1, "stray")] {
            let bodies = bodies(kind, args.anomalies_phase_events);
            let events = bodies.len();
            eprintln!(
                "bench: anomalies: round {}, commands of {label} containers: {events} single \
                 events from {CLIENTS} clients",
                round + 1
            );
            let started = Instant::now();
            let posted = endpoint.post_all(&Arc::new(bodies), CLIENTS).await?;
            head += i64::try_from(events)?;
            let appended = ledger_head(&service.pool).await?;
            anyhow::ensure!(
                appended == head,
                "the ledger head is {appended} after posting, expected {head}"
            );
            wait_for_projection(&service.pool, head).await?;
            let elapsed = started.elapsed();
            totals[kind].0 += events;
            totals[kind].1 += elapsed;
            let figure = Figure::new(
                format!(
                    "round {}: commands of {label} containers, until projected",
                    round + 1
                ),
                events,
                elapsed,
            )
            .with_latencies(&posted.latencies)
            .with_note(format!(
                "posted in {:.2} s ({:.0}/s); latencies are the POSTs'; load average {}",
                posted.elapsed.as_secs_f64(),
                events as f64 / posted.elapsed.as_secs_f64(),
                load_average()
            ));
            lines.push(Line {
                figure,
                target: "-".to_owned(),
            });
        }
    }
    let rate = |(events, elapsed): (usize, Duration)| events as f64 / elapsed.as_secs_f64();
    let (running, stray) = (rate(totals[0]), rate(totals[1]));
    let ratio = stray / running;
    let met = ratio * 100.0 >= RATIO_TARGET_PERCENT as f64;
    lines.push(Line {
        figure: Figure::new(
            "commands of stray containers, all rounds",
            totals[1].0,
            totals[1].1,
        )
        .with_note(format!(
            "{:.2} × the {running:.0}/s of running containers in the same rounds",
            ratio
        )),
        target: format!("≥ 0.{RATIO_TARGET_PERCENT} × running: {}", verdict(met)),
    });

    // The stray containers kept counting: each has its seeded anomalies and one per
    // command since.
    let uri: hyper::Uri = format!(
        "/v1/containers/{}?org_id={}&anomalies_limit=1",
        stray_id(0),
        org_id(0)
    )
    .parse()?;
    let mut connection = HttpConnection::open(service.address, "/", &scratch.token).await?;
    let answer: ContainerAnswer = serde_json::from_slice(&connection.get(&uri).await?)
        .context("the container answer does not parse")?;
    let commands: i64 =
        sqlx::query_scalar("SELECT count(*) FROM ledger WHERE org_id = $1 AND container_id = $2")
            .bind(org_id(0))
            .bind(stray_id(0))
            .fetch_one(&service.pool)
            .await?;
    checks.push(Check {
        description: format!(
            "stray container {} has {} anomalies, one per command in the ledger ({commands}), \
             at least the {} seeded",
            stray_id(0),
            answer
                .anomalies_total
                .map_or_else(|| "no count of".to_owned(), |total| total.to_string()),
            args.anomalies_seeded
        ),
        passed: answer.anomalies_total.is_some_and(|total| {
            i64::try_from(total) == Ok(commands) && total >= args.anomalies_seeded as u64
        }),
    });
    Ok(lines)
}
