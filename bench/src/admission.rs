//! `tally-bench`, third part: how many admission checks the service answers, how fast at
//! half that load, and what the floor of the same HTTP path is.
//!
//! It runs after the projection part, in a scratch database and NATS namespace of its own,
//! which it removes at the end, also when a step fails or the run is interrupted.
//!
//! Flow: start `tally serve` as a child process → define two plans with sandboxes (`PUT /v1/plans`)
//! and post a population over HTTP: orgs that are verified, billing eligible and on a plan,
//! each with containers of which some run, some of them at their concurrency limit, some
//! past a denying allowance → wait until the projection holds it all → checks from 64
//! keep-alive connections as fast as they are answered, every answer compared with what the
//! population says → checks paced at half that rate → the same again while events arrive
//! → `GET /healthz` from 64 connections, the floor → the library's `admission::check` in
//! the bench's own process, without HTTP (on purpose: what a check costs apart from serving
//! it), from facts kept in memory and from Postgres, and statements apart → `GET /healthz`
//! paced as the checks were → the library's `admission::check` from Postgres while events
//! arrive through the child, in turn waiting for the events the bench was acknowledged and
//! waiting for nothing → the table.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use bytes::Bytes;
use chrono::{DateTime, Datelike, SubsecRound, TimeZone, Utc};
use rand::seq::IndexedRandom;
use rand::Rng;
use serde::Deserialize;
use serde_json::json;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::{
    ledger_head, load_average, max_ms, measured_then_cleaned, part_finished, percentile_ms,
    print_lines, verdict, wait_for_projection, Check, Endpoint, Figure, HttpConnection, Line,
    Scratch, IMAGES, PORTS, STOP_REASONS,
};
use tally::admission::cache::CacheStats;
use tally::admission::{Checker, Request};
use tally::billing::Action;
use tally::clock::Clock;
use tally::config::Config;
use tally::event::canonical;
use tally::event::{ContainerId, OrgId, PlanId};
use tally::ledger::append::Acknowledged;
use tally::ledger::plans;
use tally::projection::store::{self, LIVE};
use tally::projection::Freshness;

use crate::child::{self, Served};
use crate::targets::{self, Bound, Figure as TargetFigure, Row};

/// Checks in the throughput phase: ten seconds at the target rate.
const CHECKS: usize = 100_000;
/// Orgs of the population: a platform's worth of paying tenants.
const ORGS: usize = 1_000;
/// How long the paced phase lasts: long enough for a stable p99 at thousands a second.
const PACED_SECONDS: u64 = 10;
/// Events a second posted while the paced checks run a second time: orgs keep working
/// while they are checked, and every event makes the facts kept of its org stale.
const STREAM_EVENTS_PER_SECOND: usize = 1_000;
/// Events per `POST /v1/events` of that stream.
const STREAM_BATCH_EVENTS: usize = 10;
/// Concurrent clients of the throughput and floor phases, each with a connection of its
/// own, as in the single-event phase of the ingest part.
const CLIENTS: usize = 64;
/// Connections the paced checks are spread over: a check waits for no earlier one unless
/// all of them are still waiting for their answers. As many as the closed loop has, so
/// that half its rate is half the load on the connections too: each carries one request
/// at a time, so at half the closed-loop rate they are all busy once an answer takes
/// twice as long as it did in the closed loop (with half as many, once it takes as long).
const PACED_CLIENTS: usize = CLIENTS;
/// Checks (and `/healthz` requests) before measuring, so that connections, the pool and
/// Postgres's caches and plans are warm.
const WARMUP_REQUESTS: usize = 2_000;
/// Sequential calls of `admission::check` and of each of its statements, without HTTP.
const DIRECT_REQUESTS: usize = 2_000;
/// Containers per org: a handful of sandboxes each.
const CONTAINERS_PER_ORG: usize = 6;
/// Most orgs are on this plan: sandboxes, a generous allowance, four running slots.
const TEAM_PLAN: &str = "bench_team";
/// One org in [`TRIAL_ONE_IN`] is on this plan: ten minutes included, overage denied, so
/// that its checks are refused with `runtime_allowance_exhausted`.
const TRIAL_PLAN: &str = "bench_trial";
const TRIAL_ONE_IN: usize = 20;
/// One org in this many runs as many containers as its plan allows: `concurrency_limit`.
const FULL_ONE_IN: usize = 10;
/// Running slots of both plans.
const MAX_RUNNING: u64 = 4;
/// Far more ports than any org publishes here: `port_limit` is not what this measures.
const MAX_PORTS: u64 = 1_000;
const TEAM_INCLUDED_SECONDS: u64 = 100 * 3_600;
const TRIAL_INCLUDED_SECONDS: u64 = 600;
/// The account events occurred this long ago; the containers' histories after them.
const ACCOUNT_AGO_MS: i64 = 3 * 3_600 * 1_000;
/// A container was created between these long ago.
const CREATED_AGO_MIN_MS: i64 = 40 * 60 * 1_000;
const CREATED_AGO_MAX_MS: i64 = 2 * 3_600 * 1_000;
/// A stopped container ran between these.
const RUN_MIN_MS: i64 = 5 * 60 * 1_000;
const RUN_MAX_MS: i64 = 30 * 60 * 1_000;
/// Commands per container.
const COMMANDS_PER_CONTAINER: usize = 3;
/// Events per population batch: the service's batch limit.
const POPULATION_BATCH_EVENTS: usize = tally::config::BATCH_EVENTS_MAX;
/// Connections the population is posted on.
const POPULATION_CLIENTS: usize = 4;
/// Targets.
const TARGET_CHECKS_PER_SECOND: u64 = 10_000;
const TARGET_PACED_P99_MS: f64 = 3.0;

#[derive(Debug, Clone, clap::Args)]
pub struct AdmissionArgs {
    /// Admission checks posted as fast as they are answered, from 64 connections.
    #[arg(long, default_value_t = CHECKS)]
    pub admission_checks: usize,

    /// Orgs of the admission population.
    #[arg(long, default_value_t = ORGS)]
    pub admission_orgs: usize,

    /// Seconds the checks paced at half the measured throughput last.
    #[arg(long, default_value_t = PACED_SECONDS)]
    pub admission_paced_seconds: u64,
}

/// Measures admission and prints its table. `config` is the service configuration of the
/// ingest part: only its server addresses and credentials are used.
pub(super) async fn run(
    binary: &std::path::Path,
    mut config: Config,
    args: &AdmissionArgs,
    nats: &jetstream::Context,
) -> anyhow::Result<Vec<targets::Row>> {
    anyhow::ensure!(
        args.admission_checks > 0,
        "--admission-checks must be at least 1"
    );
    anyhow::ensure!(
        args.admission_orgs >= FULL_ONE_IN.max(TRIAL_ONE_IN),
        "--admission-orgs must be at least {}, so that every kind of org is there",
        FULL_ONE_IN.max(TRIAL_ONE_IN)
    );
    anyhow::ensure!(
        args.admission_paced_seconds > 0,
        "--admission-paced-seconds must be at least 1"
    );
    let (scratch, shown_database_url) = Scratch::for_part("admission", &mut config)?;

    let report = measured_then_cleaned(
        &scratch,
        nats,
        start_and_measure(binary, &config, args, &scratch),
    )
    .await?;
    report.print(args, &shown_database_url, &scratch);
    part_finished("admission", &scratch, &report.checks)?;
    Ok(report.targets)
}

/// Starts the service, measures, and stops the service whatever happened, so that nothing
/// of it outlives the run and recreates a stream after clean-up.
async fn start_and_measure(
    binary: &std::path::Path,
    config: &Config,
    args: &AdmissionArgs,
    scratch: &Scratch,
) -> anyhow::Result<Report> {
    let service = Served::start(binary, config).await?;
    // The library's checkers get a pool of the size the service's has.
    let library_pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(config.db_pool_max)
        .connect_lazy(&config.database_url)?;
    let outcome = tokio::select! {
        outcome = measure(&service, &library_pool, args, scratch) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    library_pool.close().await;
    eprintln!("bench: admission: stopping the service");
    let usage = service.stop().await;
    let mut report = outcome?;
    report.service = Some(usage?);
    Ok(report)
}

/// What an org is, by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Under every limit.
    Open,
    /// Runs [`MAX_RUNNING`] containers.
    Full,
    /// On the trial plan, past its allowance.
    Exhausted,
}

/// One container's history: created at `start_ms`, stopped at `stop_ms` if it was.
#[derive(Debug, Clone, Copy)]
struct Container {
    start_ms: i64,
    stop_ms: Option<i64>,
}

#[derive(Debug, Clone)]
struct Org {
    kind: Kind,
    /// The first `running` containers run.
    containers: Vec<Container>,
    running: u64,
}

impl Org {
    fn plan(&self) -> &'static str {
        match self.kind {
            Kind::Exhausted => TRIAL_PLAN,
            Kind::Open | Kind::Full => TEAM_PLAN,
        }
    }

    /// Runtime up to `at_ms`, every interval inside the current period.
    fn runtime_ms(&self, at_ms: i64) -> i64 {
        self.containers
            .iter()
            .map(|c| c.stop_ms.unwrap_or(at_ms).min(at_ms) - c.start_ms)
            .sum()
    }
}

fn org_id(org: usize) -> String {
    format!("org_{org}")
}

fn container_id(org: usize, container: usize) -> String {
    format!("ctr_{org}_{container}")
}

/// The orgs, their events as `POST /v1/events` bodies, and when the earliest event
/// occurred.
struct Population {
    orgs: Vec<Org>,
    bodies: Arc<Vec<Bytes>>,
    events: usize,
    earliest_ms: i64,
}

impl Population {
    fn generate(orgs: usize, now: DateTime<Utc>) -> Population {
        let mut rng = rand::rng();
        let now_ms = now.timestamp_millis();
        let at = |ms: i64| {
            canonical::timestamp(
                Utc.timestamp_millis_opt(ms)
                    .single()
                    .expect("a valid instant"),
            )
        };
        let mut population = Vec::with_capacity(orgs);
        let mut events = Vec::new();
        for org in 0..orgs {
            let kind = if org % FULL_ONE_IN == 0 {
                Kind::Full
            } else if org % TRIAL_ONE_IN == 1 {
                Kind::Exhausted
            } else {
                Kind::Open
            };
            let running = match kind {
                Kind::Full => MAX_RUNNING,
                Kind::Exhausted => rng.random_range(1..MAX_RUNNING),
                Kind::Open => rng.random_range(0..MAX_RUNNING),
            };
            let containers: Vec<Container> = (0..CONTAINERS_PER_ORG)
                .map(|container| {
                    let start_ms =
                        now_ms - rng.random_range(CREATED_AGO_MIN_MS..CREATED_AGO_MAX_MS);
                    let stopped = container as u64 >= running;
                    Container {
                        start_ms,
                        stop_ms: stopped
                            .then(|| start_ms + rng.random_range(RUN_MIN_MS..RUN_MAX_MS)),
                    }
                })
                .collect();
            let entry = Org {
                kind,
                containers,
                running,
            };
            let account_at = at(now_ms - ACCOUNT_AGO_MS);
            for (event_type, data) in [
                ("org.plan_changed", json!({"plan": entry.plan()})),
                ("org.verification_changed", json!({"verified": true})),
                ("org.billing_eligibility_changed", json!({"eligible": true})),
            ] {
                events.push(
                    json!({"id": Uuid::now_v7(), "type": event_type, "org_id": org_id(org),
                                   "occurred_at": account_at, "data": data}),
                );
            }
            for (index, container) in entry.containers.iter().enumerate() {
                let mut event = |event_type: &str, at_ms: i64, data: serde_json::Value| {
                    events.push(json!({"id": Uuid::now_v7(), "type": event_type,
                                       "org_id": org_id(org), "container_id": container_id(org, index),
                                       "occurred_at": at(at_ms), "data": data}));
                };
                let start = container.start_ms;
                event(
                    "container.created",
                    start,
                    json!({"name": format!("task-{org}-{index}"),
                           "image": IMAGES.choose(&mut rng).expect("a non-empty list")}),
                );
                let port = *PORTS.choose(&mut rng).expect("a non-empty list");
                let cid = container_id(org, index);
                event(
                    "container.port_published",
                    start + 1_000,
                    json!({"port": port, "url": format!("https://{cid}-{port}.sandbox.example.com")}),
                );
                for command in 0..COMMANDS_PER_CONTAINER {
                    event(
                        "container.command_ran",
                        start + 2_000 + 1_000 * command as i64,
                        json!({"command_id": format!("cmd_{:016x}", rng.random::<u64>()),
                               "exit_code": 0, "duration_ms": rng.random_range(5..900u64)}),
                    );
                }
                if let Some(stop) = container.stop_ms {
                    event(
                        "container.stopped",
                        stop,
                        json!({"reason": STOP_REASONS.choose(&mut rng).expect("a non-empty list")}),
                    );
                }
            }
            population.push(entry);
        }
        let count = events.len();
        let bodies = events
            .chunks(POPULATION_BATCH_EVENTS)
            .map(|chunk| Bytes::from(json!({ "events": chunk }).to_string()))
            .collect();
        let earliest_ms = population
            .iter()
            .flat_map(|org| org.containers.iter().map(|c| c.start_ms))
            .min()
            .unwrap_or(now_ms);
        Population {
            orgs: population,
            bodies: Arc::new(bodies),
            events: count,
            earliest_ms,
        }
    }
}

fn plan_body(included_runtime_seconds: u64) -> Bytes {
    Bytes::from(
        json!({"sandbox_runtime": true, "included_runtime_seconds": included_runtime_seconds,
               "overage": "deny", "overage_price_per_hour": "0.12", "currency": "USD",
               "max_running_containers": MAX_RUNNING, "max_published_ports": MAX_PORTS})
        .to_string(),
    )
}

/// One admission question of the workload.
#[derive(Debug, Clone)]
struct Probe {
    org: usize,
    action: &'static str,
    /// An existing container's index, or `None` for a new container (create) or none.
    container: Option<usize>,
    body: Bytes,
}

impl Probe {
    fn random(rng: &mut impl Rng, orgs: usize, serial: usize) -> Probe {
        let org = rng.random_range(0..orgs);
        let action = *["create", "resume", "run", "publish_port"]
            .choose(rng)
            .expect("a non-empty list");
        let container = match action {
            "create" => None,
            _ => Some(rng.random_range(0..CONTAINERS_PER_ORG)),
        };
        let container_id = match container {
            Some(index) => container_id(org, index),
            None => format!("ctr_{org}_new_{serial}"),
        };
        let body = Bytes::from(
            json!({"org_id": org_id(org), "action": action, "container_id": container_id})
                .to_string(),
        );
        Probe {
            org,
            action,
            container,
            body,
        }
    }

    /// The reasons contract §4 gives for this question, from what the population is by
    /// construction (no reservations are taken in this bench).
    fn expected_reasons(&self, orgs: &[Org]) -> Vec<&'static str> {
        let org = &orgs[self.org];
        let takes_slot = matches!(self.action, "create" | "resume");
        let needs_running = matches!(self.action, "run" | "publish_port");
        let mut reasons = Vec::new();
        if takes_slot && org.running >= MAX_RUNNING {
            reasons.push("concurrency_limit");
        }
        if org.kind == Kind::Exhausted {
            reasons.push("runtime_allowance_exhausted");
        }
        let running = self
            .container
            .is_some_and(|index| (index as u64) < org.running);
        if needs_running && !running {
            reasons.push("container_not_running");
        }
        reasons
    }

    fn request(&self) -> anyhow::Result<Request> {
        Ok(Request {
            org_id: OrgId::parse(&org_id(self.org))?,
            action: Action::parse(self.action).context("a known action")?,
            container_id: Some(ContainerId::parse(&match self.container {
                Some(index) => container_id(self.org, index),
                None => format!("ctr_{}_new", self.org),
            })?),
        })
    }
}

/// `POST /v1/admission/check`'s answer.
#[derive(Debug, Deserialize, PartialEq, Eq)]
struct CheckAnswer {
    allowed: bool,
    reasons: Vec<String>,
    plan: String,
    runtime_used_ms: i64,
    runtime_included_ms: i64,
    overage: bool,
    running_containers: u64,
    max_running_containers: u64,
}

/// A request every client of a phase can send: all checks go to one URI, all floor
/// requests to another.
#[derive(Clone)]
struct Target {
    method: hyper::Method,
    uri: hyper::Uri,
}

impl Target {
    fn check() -> Target {
        Target {
            method: hyper::Method::POST,
            uri: hyper::Uri::from_static("/v1/admission/check"),
        }
    }

    fn healthz() -> Target {
        Target {
            method: hyper::Method::GET,
            uri: hyper::Uri::from_static("/healthz"),
        }
    }
}

/// What a phase sends, and how.
struct Load<'a> {
    target: &'a Target,
    bodies: &'a Arc<Vec<Bytes>>,
    count: usize,
    clients: usize,
    /// `None`: as fast as answered.
    rate_per_second: Option<f64>,
    /// Keep every answer, by request index, for checking after the clock stops.
    keep_answers: bool,
}

impl<'a> Load<'a> {
    /// `count` requests due at `rate` a second, open loop over `PACED_CLIENTS` connections.
    fn paced(target: &'a Target, bodies: &'a Arc<Vec<Bytes>>, count: usize, rate: f64) -> Load<'a> {
        Load {
            clients: PACED_CLIENTS,
            rate_per_second: Some(rate),
            ..Load::closed(target, bodies, count)
        }
    }

    fn closed(target: &'a Target, bodies: &'a Arc<Vec<Bytes>>, count: usize) -> Load<'a> {
        Load {
            target,
            bodies,
            count,
            clients: CLIENTS,
            rate_per_second: None,
            keep_answers: false,
        }
    }
}

/// What a phase's clients saw.
struct Answered {
    elapsed: Duration,
    /// From each request's send.
    latencies: Vec<Duration>,
    /// From each request's due instant (paced phases only).
    latencies_from_due: Vec<Duration>,
    /// By request index, when kept.
    answers: Vec<Bytes>,
}

/// Sends `bodies` (`count` requests, body `index % bodies.len()`) from `clients` connections,
/// connection `i` to the instance at `addresses[i % addresses.len()]` (round-robin).
/// Unpaced (`rate_per_second` is `None`), each client sends its next request as soon as
/// the previous one is answered; paced, request `index` is due `index / rate` after the
/// start, whichever client is free takes it, and its latency is also taken from when it
/// was due (open loop: a late send counts against the service, not hidden).
async fn send_all(
    addresses: &[std::net::SocketAddr],
    token: &str,
    load: Load<'_>,
) -> anyhow::Result<Answered> {
    let Load {
        target,
        bodies,
        count,
        clients,
        rate_per_second,
        keep_answers,
    } = load;
    assert!(!bodies.is_empty(), "something to send");
    assert!(!addresses.is_empty(), "an instance to send to");
    let next = Arc::new(AtomicUsize::new(0));
    // Connections are opened before the clock starts.
    let mut connections = Vec::with_capacity(clients);
    for client in 0..clients {
        let address = addresses[client % addresses.len()];
        connections.push(HttpConnection::open(address, "/healthz", token).await?);
    }
    let started = Instant::now();
    let pacer = rate_per_second.map(|rate| Pacer::start(started, rate, count, clients));
    // A JoinSet aborts the other clients as soon as one fails and this returns.
    let mut tasks = JoinSet::new();
    for mut connection in connections {
        let (next, bodies, target) = (next.clone(), bodies.clone(), target.clone());
        let releases = pacer.as_ref().map(|pacer| pacer.releases.clone());
        tasks.spawn(async move {
            let mut latencies = Vec::new();
            let mut from_due = Vec::new();
            let mut answers = Vec::new();
            loop {
                if let Some(releases) = &releases {
                    // Closed only when the run is abandoned.
                    let Ok(permit) = releases.semaphore.acquire().await else {
                        break;
                    };
                    permit.forget();
                }
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= count {
                    break;
                }
                let due = releases.as_ref().map(|releases| releases.due(index));
                let body = bodies[index % bodies.len()].clone();
                let sent = Instant::now();
                let answer = connection
                    .expect(&target.method, &target.uri, body, hyper::StatusCode::OK)
                    .await?;
                let answered = Instant::now();
                latencies.push(answered - sent);
                if let Some(due) = due {
                    from_due.push(answered.saturating_duration_since(due));
                }
                if keep_answers {
                    answers.push((index, answer));
                }
            }
            anyhow::Ok((latencies, from_due, answers))
        });
    }
    let mut latencies = Vec::with_capacity(count);
    let mut latencies_from_due = Vec::new();
    let mut indexed = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        let (client, due, answers) = joined.context("a client panicked")??;
        latencies.extend(client);
        latencies_from_due.extend(due);
        indexed.extend(answers);
    }
    let elapsed = started.elapsed();
    drop(pacer);
    assert_eq!(latencies.len(), count, "every request is sent once");
    indexed.sort_unstable_by_key(|(index, _)| *index);
    Ok(Answered {
        elapsed,
        latencies,
        latencies_from_due,
        answers: indexed.into_iter().map(|(_, answer)| answer).collect(),
    })
}

/// Releases paced requests at their due instants from a thread of its own.
///
/// Tokio's timer ticks in whole milliseconds: clients that slept until their due instants
/// woke together at the next tick, so at 6 000 checks a second they sent bursts of six, up
/// to a millisecond late, and the latency from when each was due counted that lateness. A
/// thread's sleep is not held to those ticks, so requests go out spread evenly, as an
/// open-loop load generator (wrk2's constant rate) sends them. Its thousands of sleeps a
/// second cost about 0.08 of a core at 6 000 checks a second (in a profile).
struct Pacer {
    releases: Arc<Releases>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The pacer's side shared with the clients: a permit a request, in due order.
struct Releases {
    semaphore: tokio::sync::Semaphore,
    started: Instant,
    interval_ns: f64,
}

impl Releases {
    fn due(&self, index: usize) -> Instant {
        self.started + Duration::from_nanos((self.interval_ns * index as f64) as u64)
    }
}

impl Pacer {
    fn start(started: Instant, rate_per_second: f64, count: usize, clients: usize) -> Pacer {
        let releases = Arc::new(Releases {
            semaphore: tokio::sync::Semaphore::new(0),
            started,
            interval_ns: 1e9 / rate_per_second,
        });
        let shared = releases.clone();
        let thread = std::thread::spawn(move || {
            for index in 0..count {
                if shared.semaphore.is_closed() {
                    return;
                }
                let due = shared.due(index);
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                shared.semaphore.add_permits(1);
            }
            // Every request is released; one more permit a client, for it to find none left.
            shared.semaphore.add_permits(clients);
        });
        Pacer {
            releases,
            thread: Some(thread),
        }
    }
}

impl Drop for Pacer {
    fn drop(&mut self) {
        self.releases.semaphore.close();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// CPU time so far, in seconds: the `tally serve` child's, this process's (the load
/// clients, and the library where a line calls it here) and the machine's.
#[derive(Debug, Clone, Copy)]
struct CpuTime {
    service: f64,
    bench: f64,
    busy: f64,
}

impl CpuTime {
    /// `None` where `/proc` does not tell.
    fn now(service: &Served) -> Option<CpuTime> {
        let service = service.usage().ok()?.cpu.as_secs_f64();
        let bench = crate::cpu::own_seconds(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
        let busy = crate::cpu::machine_busy_seconds(&std::fs::read_to_string("/proc/stat").ok()?)?;
        Some(CpuTime {
            service,
            bench,
            busy,
        })
    }

    /// "tally serve N cores, the bench M cores, the rest K cores" over `elapsed`.
    fn describe(before: Option<CpuTime>, after: Option<CpuTime>, elapsed: Duration) -> String {
        let (Some(before), Some(after)) = (before, after) else {
            return "CPU use unknown".to_owned();
        };
        let cores = |seconds: f64| seconds / elapsed.as_secs_f64();
        let service = after.service - before.service;
        let bench = after.bench - before.bench;
        let busy = after.busy - before.busy;
        format!(
            "CPU: tally serve {:.2} cores, the bench {:.2} cores, everything else (Postgres, \
             NATS, other work) {:.2} cores",
            cores(service),
            cores(bench),
            cores((busy - service - bench).max(0.0))
        )
    }
}

async fn measure(
    service: &Served,
    library_pool: &sqlx::PgPool,
    args: &AdmissionArgs,
    scratch: &Scratch,
) -> anyhow::Result<Report> {
    let token = scratch.token.as_str();
    let mut checks = Vec::new();

    // The population.
    let started = Instant::now();
    let population = Population::generate(args.admission_orgs, Utc::now());
    let mut connection = HttpConnection::open(service.address, "/healthz", token).await?;
    define_plans(&mut connection).await?;
    let endpoint = Endpoint {
        addresses: vec![service.address],
        url: "/v1/events".to_owned(),
        token: token.to_owned(),
    };
    endpoint
        .post_all(&population.bodies, POPULATION_CLIENTS)
        .await?;
    let head = ledger_head(&service.pool).await?;
    wait_for_projection(&service.pool, head).await?;
    // A live database's autovacuum has analyzed its tables; freshly filled ones have no
    // statistics, and the planner would guess.
    sqlx::query("ANALYZE").execute(&service.pool).await?;
    let running: u64 = population.orgs.iter().map(|org| org.running).sum();
    let count_of = |kind: Kind| population.orgs.iter().filter(|o| o.kind == kind).count();
    eprintln!(
        "bench: admission: {} orgs ({} full, {} past their allowance), {} containers ({running} \
         running), {} events posted and projected in {:.1} s",
        population.orgs.len(),
        count_of(Kind::Full),
        count_of(Kind::Exhausted),
        population.orgs.len() * CONTAINERS_PER_ORG,
        population.events,
        started.elapsed().as_secs_f64()
    );
    checks.push(Check {
        description: format!(
            "2 plans and {} population events appended (ledger head {head}) and projected",
            population.events
        ),
        passed: head == i64::try_from(population.events)? + 2,
    });
    checks.extend(sample_checks(&mut connection, &population).await?);

    // Throughput.
    let closed = closed_loop(
        &[service.address],
        token,
        &population,
        args.admission_checks,
        format!("checks, {CLIENTS} clients, closed loop"),
        "admission",
        &ChildMeter(service),
    )
    .await?;
    checks.push(closed.verified.check);
    let checks_per_second = closed.figure.per_second();
    let throughput = Line {
        target: format!(
            "≥ {TARGET_CHECKS_PER_SECOND}/s: {}",
            verdict(checks_per_second >= TARGET_CHECKS_PER_SECOND as f64)
        ),
        figure: closed
            .figure
            .with_note(format!(
                "{:.0} % allowed; every answer as the population implies",
                closed.verified.allowed as f64 * 100.0 / args.admission_checks as f64
            ))
            .with_notes(closed.notes),
    };
    let (probes, bodies, check) = (closed.probes, closed.bodies, Target::check());

    // Latency at half the measured load.
    let rate = (checks_per_second / 2.0).max(1.0);
    let paced_count = ((rate * args.admission_paced_seconds as f64) as usize).max(1);
    eprintln!(
        "bench: admission: {paced_count} checks paced at {rate:.0}/s from {PACED_CLIENTS} clients"
    );
    // The paced checks, run twice: alone, then while events arrive.
    let paced_checks = |label: String| {
        measure_paced(
            service,
            token,
            Load::paced(&check, &bodies, paced_count, rate),
            label,
            "latency from send",
        )
    };
    let facts_before = ServedFacts::of(service).await?;
    let (figure, _) = paced_checks(format!(
        "checks paced at {rate:.0}/s, {PACED_CLIENTS} clients, open loop"
    ))
    .await?;
    let figure = figure.with_note(ServedFacts::of(service).await?.since(&facts_before));
    let p99_met = figure
        .latency_ms
        .is_some_and(|(_, p99)| p99 <= TARGET_PACED_P99_MS);
    let paced = Line {
        target: format!("p99 ≤ {TARGET_PACED_P99_MS} ms: {}", verdict(p99_met)),
        figure,
    };

    // The same paced checks while events arrive.
    eprintln!(
        "bench: admission: the paced checks again, while {STREAM_EVENTS_PER_SECOND} events/s arrive"
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let facts_before = ServedFacts::of(service).await?;
    let head_before = ledger_head(&service.pool).await?;
    let paced_run = async {
        let figure = paced_checks(format!(
            "checks paced at {rate:.0}/s while {STREAM_EVENTS_PER_SECOND} events/s arrive"
        ))
        .await;
        stop.cancel();
        figure
    };
    let (figure, streamed) = tokio::join!(
        paced_run,
        stream_commands(service, token, &population, None, &stop)
    );
    let streamed = streamed?;
    let (figure, during_ingest_due_p99_ms) = figure?;
    let arrived_per_second = streamed as f64 / figure.elapsed.as_secs_f64();
    let during_ingest = Line {
        figure: figure
            .with_note(ServedFacts::of(service).await?.since(&facts_before))
            .with_note(format!(
                "{streamed} command events posted meanwhile in batches of {STREAM_BATCH_EVENTS}, \
                 each of a running container of a random org"
            )),
        target: "-".to_owned(),
    };
    checks.push(Check {
        description: format!("the {streamed} events posted during the paced checks were appended"),
        passed: ledger_head(&service.pool).await? - head_before == i64::try_from(streamed)?,
    });

    // The floor: the same clients and connections, no admission.
    let healthz = Target::healthz();
    let empty = Arc::new(vec![Bytes::new()]);
    send_all(
        &[service.address],
        token,
        Load::closed(&healthz, &empty, WARMUP_REQUESTS),
    )
    .await?;
    eprintln!(
        "bench: admission: {} GET /healthz from {CLIENTS} clients",
        args.admission_checks
    );
    let cpu_before = CpuTime::now(service);
    let floor = send_all(
        &[service.address],
        token,
        Load::closed(&healthz, &empty, args.admission_checks),
    )
    .await?;
    let floor = Line {
        figure: Figure::new(
            format!("GET /healthz, {CLIENTS} clients, closed loop"),
            args.admission_checks,
            floor.elapsed,
        )
        .with_latencies(&floor.latencies)
        .with_note("the floor: HTTP, routing, the clients".to_owned())
        .with_note(CpuTime::describe(
            cpu_before,
            CpuTime::now(service),
            floor.elapsed,
        ))
        .with_note(format!("load average {}", load_average())),
        target: "-".to_owned(),
    };

    let direct = measure_direct(service, library_pool, &probes).await?;
    // A connection of its own: the first one has been idle through every phase since, and
    // on a slow machine that is past the service's idle timeout (`HTTP_IDLE_TIMEOUT_MS`),
    // after which the service has closed it.
    let mut connection = HttpConnection::open(service.address, "/healthz", token).await?;
    let again = sample_checks(&mut connection, &population).await?;
    checks.push(Check {
        description: format!(
            "the {} sample checks answer the same after the load",
            again.len()
        ),
        passed: again.iter().all(|check| check.passed),
    });
    // The paced floor: `/healthz` at the rate and on the connections of the paced checks,
    // so the two tails compare.
    let (figure, floor_due_p99_ms) = measure_paced(
        service,
        token,
        Load::paced(&healthz, &empty, paced_count, rate),
        format!("GET /healthz paced at {rate:.0}/s, {PACED_CLIENTS} clients"),
        "the paced checks' floor",
    )
    .await?;
    let paced_floor = Line {
        figure,
        target: "-".to_owned(),
    };

    let waits = measure_waits(
        service,
        library_pool,
        token,
        &population,
        &probes,
        &mut checks,
    )
    .await?;

    let p99_ms = |line: &Line| line.figure.latency_ms.map_or(f64::NAN, |(_, p99)| p99);
    let targets = vec![
        Row::new(
            TargetFigure::PacedChecks,
            format!(
                "{during_ingest_due_p99_ms:.2} ms at {rate:.0}/s while {arrived_per_second:.0} \
                 events/s arrived vs /healthz {floor_due_p99_ms:.2} ms"
            ),
            during_ingest_due_p99_ms,
            floor_due_p99_ms,
            Bound::AtMost(4.0),
            "≤ 4 ×",
        ),
        Row::new(
            TargetFigure::ClosedChecks,
            format!(
                "{:.2} ms vs /healthz {:.2} ms",
                p99_ms(&throughput),
                p99_ms(&floor)
            ),
            p99_ms(&throughput),
            p99_ms(&floor),
            Bound::AtMost(2.0),
            "≤ 2 ×",
        ),
    ];
    let mut lines = vec![throughput, paced, during_ingest, floor, paced_floor];
    lines.extend(direct);
    lines.extend(waits);
    Ok(Report {
        lines,
        checks,
        targets,
        service: None,
    })
}

/// Sends a paced load and describes it: latencies from the send, and in the notes (after
/// `note`) from when each request was due, the CPU used and the load average. Also the p99
/// from when due, in milliseconds, for the targets table.
async fn measure_paced(
    service: &Served,
    token: &str,
    load: Load<'_>,
    label: String,
    note: &str,
) -> anyhow::Result<(Figure, f64)> {
    let count = load.count;
    let cpu_before = CpuTime::now(service);
    let sent = send_all(&[service.address], token, load).await?;
    let cpu = CpuTime::describe(cpu_before, CpuTime::now(service), sent.elapsed);
    let due_p99_ms = percentile_ms(&sent.latencies_from_due, 0.99);
    let figure = Figure::new(label, count, sent.elapsed)
        .with_latencies(&sent.latencies)
        .with_note(format!(
            "{note}; from when due p50 {:.2} ms, p99 {due_p99_ms:.2} ms",
            percentile_ms(&sent.latencies_from_due, 0.50),
        ))
        .with_note(cpu)
        .with_note(format!("load average {}", load_average()));
    Ok((figure, due_p99_ms))
}

/// What a part reads just before and just after the clock of its closed-loop checks, and
/// the notes it makes of the two readings.
trait Meter {
    type Reading;

    async fn read(&self) -> anyhow::Result<Self::Reading>;

    /// The notes on a phase `elapsed` long that began at `before`.
    async fn notes_since(
        &self,
        before: Self::Reading,
        elapsed: Duration,
    ) -> anyhow::Result<Vec<String>>;
}

/// The admission part's: where the child's facts came from, its CPU time with the bench's
/// and the rest's, and the load average.
struct ChildMeter<'a>(&'a Served);

impl Meter for ChildMeter<'_> {
    type Reading = (Option<CpuTime>, ServedFacts);

    async fn read(&self) -> anyhow::Result<Self::Reading> {
        Ok((CpuTime::now(self.0), ServedFacts::of(self.0).await?))
    }

    async fn notes_since(
        &self,
        (cpu_before, facts_before): Self::Reading,
        elapsed: Duration,
    ) -> anyhow::Result<Vec<String>> {
        let cpu = CpuTime::describe(cpu_before, CpuTime::now(self.0), elapsed);
        let facts = ServedFacts::of(self.0).await?.since(&facts_before);
        Ok(vec![facts, cpu, format!("load average {}", load_average())])
    }
}

/// The instances part's: the CPU time of every instance, Postgres, nats-server and the
/// bench.
struct SplitMeter<'a>(&'a [Served]);

impl Meter for SplitMeter<'_> {
    type Reading = Option<crate::cpu::CpuSplit>;

    async fn read(&self) -> anyhow::Result<Self::Reading> {
        Ok(crate::cpu::CpuSplit::now(self.0))
    }

    async fn notes_since(
        &self,
        before: Self::Reading,
        _elapsed: Duration,
    ) -> anyhow::Result<Vec<String>> {
        let after = crate::cpu::CpuSplit::now(self.0);
        Ok(vec![crate::cpu::CpuSplit::describe(before, after)])
    }
}

/// The closed-loop checks' probes and what they gave.
struct ClosedLoop {
    probes: Vec<Probe>,
    bodies: Arc<Vec<Bytes>>,
    /// With its latencies, without notes.
    figure: Figure,
    verified: Verified,
    /// The meter's notes on the phase.
    notes: Vec<String>,
}

/// `count` random checks of `population`'s orgs after a warm-up, each sent as soon as the
/// previous one is answered from [`CLIENTS`] connections spread round-robin over
/// `addresses`, every answer compared with what the population implies; `meter` reads
/// around the clock, and `part` names the part in the progress lines.
async fn closed_loop(
    addresses: &[std::net::SocketAddr],
    token: &str,
    population: &Population,
    count: usize,
    label: String,
    part: &str,
    meter: &impl Meter,
) -> anyhow::Result<ClosedLoop> {
    let probes: Vec<Probe> = {
        let mut rng = rand::rng();
        (0..count)
            .map(|serial| Probe::random(&mut rng, population.orgs.len(), serial))
            .collect()
    };
    let bodies = Arc::new(probes.iter().map(|p| p.body.clone()).collect::<Vec<_>>());
    let check = Target::check();
    eprintln!("bench: {part}: warming up");
    send_all(
        addresses,
        token,
        Load::closed(&check, &bodies, WARMUP_REQUESTS),
    )
    .await?;
    eprintln!("bench: {part}: {count} checks from {CLIENTS} clients");
    let before = meter.read().await?;
    let phase_start_ms = Utc::now().trunc_subsecs(3).timestamp_millis();
    let answered = send_all(
        addresses,
        token,
        Load {
            keep_answers: true,
            ..Load::closed(&check, &bodies, count)
        },
    )
    .await?;
    let phase_end_ms = Utc::now().timestamp_millis() + 1;
    let notes = meter.notes_since(before, answered.elapsed).await?;
    let verified = verify_answers(
        &probes,
        &answered.answers,
        population,
        (phase_start_ms, phase_end_ms),
    )?;
    let figure = Figure::new(label, count, answered.elapsed).with_latencies(&answered.latencies);
    Ok(ClosedLoop {
        probes,
        bodies,
        figure,
        verified,
        notes,
    })
}

/// A few questions whose answers are known exactly, one of each kind, each a check.
async fn sample_checks(
    connection: &mut HttpConnection,
    population: &Population,
) -> anyhow::Result<Vec<Check>> {
    let find = |kind: Kind| {
        population
            .orgs
            .iter()
            .position(|org| org.kind == kind && org.running > 0)
            .context("the population has every kind of org")
    };
    let (open, full, exhausted) = (find(Kind::Open)?, find(Kind::Full)?, find(Kind::Exhausted)?);
    let stopped = CONTAINERS_PER_ORG - 1;
    let samples = [
        (
            json!({"org_id": org_id(open), "action": "create"}),
            true,
            vec![],
        ),
        (
            json!({"org_id": org_id(open), "action": "run", "container_id": container_id(open, 0)}),
            true,
            vec![],
        ),
        (
            json!({"org_id": org_id(open), "action": "publish_port", "container_id": container_id(open, stopped)}),
            false,
            vec!["container_not_running"],
        ),
        (
            json!({"org_id": org_id(full), "action": "resume", "container_id": container_id(full, stopped)}),
            false,
            vec!["concurrency_limit"],
        ),
        (
            json!({"org_id": org_id(exhausted), "action": "run", "container_id": container_id(exhausted, 0)}),
            false,
            vec!["runtime_allowance_exhausted"],
        ),
        (
            json!({"org_id": "org_unknown", "action": "create"}),
            false,
            vec![
                "plan_excludes_sandbox",
                "not_verified",
                "not_billing_eligible",
            ],
        ),
    ];
    let uri = Target::check().uri;
    let mut checks = Vec::with_capacity(samples.len());
    for (body, allowed, reasons) in samples {
        let answer = connection
            .expect(
                &hyper::Method::POST,
                &uri,
                Bytes::from(body.to_string()),
                hyper::StatusCode::OK,
            )
            .await?;
        let answer: CheckAnswer =
            serde_json::from_slice(&answer).context("a check answer does not parse")?;
        checks.push(Check {
            description: format!(
                "{body} → allowed {}, reasons {:?} (expected {allowed}, {reasons:?})",
                answer.allowed, answer.reasons
            ),
            passed: answer.allowed == allowed && answer.reasons == reasons,
        });
    }
    Ok(checks)
}

struct Verified {
    check: Check,
    allowed: usize,
}

/// Compares every answer of the throughput phase with what the population implies:
/// decision and reasons, plan, running containers, limits, and runtime between its values
/// at the phase's start and end.
fn verify_answers(
    probes: &[Probe],
    answers: &[Bytes],
    population: &Population,
    (start_ms, end_ms): (i64, i64),
) -> anyhow::Result<Verified> {
    assert_eq!(probes.len(), answers.len(), "one answer per probe");
    // Runtime is summed within the period; the population's intervals are all inside it
    // unless the month began less than a few hours ago.
    let now = Utc::now();
    let month_start = Utc
        .with_ymd_and_hms(now.year(), now.month(), 1, 0, 0, 0)
        .single()
        .context("the month's first instant")?
        .timestamp_millis();
    let runtime_checked = population.earliest_ms >= month_start;
    let mut wrong = 0_usize;
    let mut first_wrong = None;
    let mut allowed = 0_usize;
    for (probe, answer) in probes.iter().zip(answers) {
        let answer: CheckAnswer =
            serde_json::from_slice(answer).context("a check answer does not parse")?;
        let org = &population.orgs[probe.org];
        let reasons = probe.expected_reasons(&population.orgs);
        let included_ms = match org.kind {
            Kind::Exhausted => TRIAL_INCLUDED_SECONDS,
            Kind::Open | Kind::Full => TEAM_INCLUDED_SECONDS,
        } as i64
            * 1_000;
        let runtime_right = !runtime_checked
            || (org.runtime_ms(start_ms)..=org.runtime_ms(end_ms))
                .contains(&answer.runtime_used_ms);
        let right = answer.allowed == reasons.is_empty()
            && answer.reasons == reasons
            && answer.plan == org.plan()
            && answer.running_containers == org.running
            && answer.max_running_containers == MAX_RUNNING
            && answer.runtime_included_ms == included_ms
            && answer.overage == (answer.runtime_used_ms >= included_ms)
            && runtime_right;
        allowed += usize::from(answer.allowed);
        if !right {
            wrong += 1;
            first_wrong.get_or_insert_with(|| {
                format!(
                    "; e.g. {} answered {answer:?}, expected reasons {reasons:?}, running {}, \
                     runtime {}..{} ms",
                    String::from_utf8_lossy(&probe.body),
                    org.running,
                    org.runtime_ms(start_ms),
                    org.runtime_ms(end_ms)
                )
            });
        }
    }
    Ok(Verified {
        check: Check {
            description: format!(
                "{} of {} throughput answers are 200 with the decision, reasons, plan, running \
                 containers and limits the population implies{}{}",
                answers.len() - wrong,
                answers.len(),
                if runtime_checked {
                    ", and runtime between its values at the phase's start and end"
                } else {
                    " (runtime not compared: the history starts in the previous month)"
                },
                first_wrong.unwrap_or_default()
            ),
            passed: wrong == 0 && allowed > 0 && allowed < answers.len(),
        },
        allowed,
    })
}

/// Posts `container.command_ran` events of running containers of random orgs, dated now,
/// at [`STREAM_EVENTS_PER_SECOND`] on a connection of its own until `stop`; returns how
/// many were acknowledged. Each acknowledged event's org and position go into
/// `acknowledged` when given, as the service records its own.
async fn stream_commands(
    service: &Served,
    token: &str,
    population: &Population,
    acknowledged: Option<&Mutex<Acknowledged>>,
    stop: &tokio_util::sync::CancellationToken,
) -> anyhow::Result<usize> {
    let running: Vec<(usize, usize)> = population
        .orgs
        .iter()
        .enumerate()
        .flat_map(|(org, entry)| (0..entry.running as usize).map(move |index| (org, index)))
        .collect();
    anyhow::ensure!(!running.is_empty(), "the population runs containers");
    let mut connection = HttpConnection::open(service.address, "/v1/events", token).await?;
    let period =
        Duration::from_secs(1) * STREAM_BATCH_EVENTS as u32 / STREAM_EVENTS_PER_SECOND as u32;
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut posted = 0;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return Ok(posted),
            _ = tick.tick() => {}
        }
        let mut orgs = Vec::with_capacity(STREAM_BATCH_EVENTS);
        let body = {
            let mut rng = rand::rng();
            let now = canonical::timestamp(Utc::now());
            let events: Vec<serde_json::Value> = (0..STREAM_BATCH_EVENTS)
                .map(|_| {
                    let (org, index) = *running.choose(&mut rng).expect("not empty");
                    orgs.push(org_id(org));
                    json!({"id": Uuid::now_v7(), "type": "container.command_ran",
                           "org_id": org_id(org), "container_id": container_id(org, index),
                           "occurred_at": now,
                           "data": {"command_id": format!("cmd_{:016x}", rng.random::<u64>()),
                                    "exit_code": 0, "duration_ms": 100}})
                })
                .collect();
            Bytes::from(json!({ "events": events }).to_string())
        };
        let answer = connection.post_answered(&body).await?;
        if let Some(acknowledged) = acknowledged {
            let answer: EventsAnswer =
                serde_json::from_slice(&answer).context("the events answer does not parse")?;
            anyhow::ensure!(answer.results.len() == orgs.len(), "one result per event");
            let mut record = acknowledged.lock().expect("never held across a panic");
            for (org, result) in orgs.iter().zip(&answer.results) {
                record.record(org, result.position, false);
            }
        }
        posted += STREAM_BATCH_EVENTS;
    }
}

/// `POST /v1/events`'s answer, reduced to the positions.
#[derive(Deserialize)]
struct EventsAnswer {
    results: Vec<EventPosition>,
}

#[derive(Deserialize)]
struct EventPosition {
    position: i64,
}

/// The child's count of admission checks by where their facts came from
/// (`tally_admission_check_facts_total`) and of the checks that waited for the projection
/// (`tally_admission_wait_seconds`), read from its `/metrics`.
#[derive(Debug, Clone, Default)]
struct ServedFacts {
    memory: f64,
    all: f64,
    /// Waits for this instance's round notices.
    notices: Waits,
    /// Waits for the stored checkpoint.
    checkpoint: Waits,
}

/// One series of `tally_admission_wait_seconds`: how many waited, for how long in all, and
/// its cumulative buckets by upper bound.
#[derive(Debug, Clone, Default)]
struct Waits {
    count: f64,
    seconds: f64,
    buckets: Vec<(f64, f64)>,
}

impl Waits {
    /// Takes one line of the series (`_bucket{…le="…"} n`, `_sum{…} s`, `_count{…} n`).
    fn take(&mut self, line: &str) {
        let Some((name_labels, value)) = line.rsplit_once(' ') else {
            return;
        };
        let value: f64 = value.trim().parse().unwrap_or(0.0);
        if name_labels.starts_with("tally_admission_wait_seconds_count") {
            self.count = value;
        } else if name_labels.starts_with("tally_admission_wait_seconds_sum") {
            self.seconds = value;
        } else if let Some((_, le)) = name_labels.split_once("le=\"") {
            let le = le.trim_end_matches("\"}");
            if let Ok(bound) = le.parse::<f64>() {
                self.buckets.push((bound, value));
            }
        }
    }

    /// The waits since `before`: how many, their mean, and the smallest bucket bound that
    /// holds 99 % of them.
    fn since(&self, before: &Waits, what: &str) -> String {
        let count = self.count - before.count;
        if count < 1.0 {
            return format!("no check waited for {what}");
        }
        let mean_ms = (self.seconds - before.seconds) * 1000.0 / count;
        let p99_bound = self
            .buckets
            .iter()
            .map(|(bound, cumulative)| {
                let earlier = before
                    .buckets
                    .iter()
                    .find(|(b, _)| b == bound)
                    .map_or(0.0, |(_, c)| *c);
                (*bound, cumulative - earlier)
            })
            .find(|(_, within)| *within >= count * 0.99)
            .map_or_else(
                || "more".to_owned(),
                |(bound, _)| format!("≤ {} ms", bound * 1000.0),
            );
        format!("{count:.0} checks waited for {what}, {mean_ms:.1} ms on average, 99 % {p99_bound}")
    }
}

impl ServedFacts {
    async fn of(service: &Served) -> anyhow::Result<ServedFacts> {
        let text = service.metrics().await?;
        let mut facts = ServedFacts::default();
        for line in text.lines() {
            if line.starts_with("tally_admission_wait_seconds") {
                if line.contains("for=\"notices\"") {
                    facts.notices.take(line);
                } else if line.contains("for=\"checkpoint\"") {
                    facts.checkpoint.take(line);
                }
                continue;
            }
            let Some(rest) = line.strip_prefix("tally_admission_check_facts_total{") else {
                continue;
            };
            let Some((labels, value)) = rest.split_once('}') else {
                continue;
            };
            let count: f64 = value.trim().parse().unwrap_or(0.0);
            facts.all += count;
            if labels.contains("source=\"memory\"") {
                facts.memory += count;
            }
        }
        Ok(facts)
    }

    /// Which of the checks since `before` were answered from facts kept in memory, and how
    /// many waited for the projection.
    fn since(&self, before: &ServedFacts) -> String {
        let (hits, all) = (self.memory - before.memory, self.all - before.all);
        format!(
            "facts from memory for {:.1} % ({hits:.0} of {all:.0}); {}; {}",
            hits * 100.0 / all.max(1.0),
            self.notices.since(&before.notices, "round notices"),
            self.checkpoint.since(&before.checkpoint, "the checkpoint"),
        )
    }
}

/// Which of a phase's checks were answered from facts kept in memory.
fn facts_in_memory(before: CacheStats, after: CacheStats) -> String {
    let (hits, misses) = (after.hits - before.hits, after.misses - before.misses);
    format!(
        "facts from memory for {:.1} % ({hits} of {})",
        hits as f64 * 100.0 / (hits + misses).max(1) as f64,
        hits + misses
    )
}

/// The library's `admission::check` called in the bench's own process, without HTTP: by a
/// checker that keeps facts in memory (its cache listens for changes, as the service's
/// does), then by one on the same pool that does not (its cache never listens), so that
/// every check reads Postgres as it would after a change. Neither waits: the bench's own
/// record of acknowledged events is empty.
async fn measure_direct(
    service: &Served,
    pool: &sqlx::PgPool,
    probes: &[Probe],
) -> anyhow::Result<Vec<Line>> {
    let mut lines = Vec::with_capacity(4);
    let (_head, freshness) = acknowledged_nothing();
    let in_memory = Checker::new(pool.clone(), freshness.clone(), Clock::system());
    let stop_listening = tokio_util::sync::CancellationToken::new();
    let _listener = crate::AbortOnDrop(tokio::spawn(tally::admission::cache::listen(
        pool.clone(),
        in_memory.cache().clone(),
        stop_listening.clone(),
    )));
    let postgres_only = Checker::new(pool.clone(), freshness, Clock::system());
    for (checker, facts) in [
        (&in_memory, "facts kept in memory"),
        (&postgres_only, "facts read from Postgres"),
    ] {
        lines.extend(measure_checker(service, pool, checker, facts, probes).await?);
    }
    stop_listening.cancel();
    Ok(lines)
}

/// A record of acknowledged events that holds none, and the head it watches (kept so that
/// the watch stays open).
fn acknowledged_nothing() -> (tokio::sync::watch::Sender<i64>, Freshness) {
    let (head, watched) = tokio::sync::watch::channel(0);
    let freshness = Freshness::new(watched, Arc::new(Mutex::new(Acknowledged::default())));
    (head, freshness)
}

/// `checker` from 64 tasks for its throughput, then one at a time for its latency next to
/// a plan-versions statement alone and a bare checkpoint read, on `pool`.
async fn measure_checker(
    service: &Served,
    pool: &sqlx::PgPool,
    checker: &Checker,
    facts: &str,
    probes: &[Probe],
) -> anyhow::Result<[Line; 2]> {
    let requests: Arc<Vec<Request>> = Arc::new(
        probes
            .iter()
            .map(Probe::request)
            .collect::<anyhow::Result<_>>()?,
    );
    let count = requests.len();
    eprintln!(
        "bench: admission: {count} admission::check calls ({facts}) from {CLIENTS} tasks, no HTTP"
    );
    let facts_before = checker.cache().stats();
    let next = Arc::new(AtomicUsize::new(0));
    let cpu_before = CpuTime::now(service);
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for _ in 0..CLIENTS {
        let (next, requests) = (next.clone(), requests.clone());
        let checker = checker.clone();
        tasks.spawn(async move {
            while let Some(request) = requests.get(next.fetch_add(1, Ordering::Relaxed)) {
                checker.check(request).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.context("a task panicked")??;
    }
    let elapsed = started.elapsed();
    let concurrent = Line {
        figure: Figure::new(
            format!("admission::check, {facts}, {CLIENTS} tasks (library in the bench, no HTTP)"),
            count,
            elapsed,
        )
        .with_note(format!(
            "pool of {} connections",
            pool.options().get_max_connections()
        ))
        .with_note(facts_in_memory(facts_before, checker.cache().stats()))
        .with_note(CpuTime::describe(
            cpu_before,
            CpuTime::now(service),
            elapsed,
        ))
        .with_note(format!("load average {}", load_average())),
        target: "-".to_owned(),
    };

    let plan = PlanId::parse(TEAM_PLAN)?;
    let mut check_latencies = Vec::with_capacity(DIRECT_REQUESTS);
    let mut fresh_latencies = Vec::with_capacity(DIRECT_REQUESTS);
    let mut versions_latencies = Vec::with_capacity(DIRECT_REQUESTS);
    for request in requests.iter().take(DIRECT_REQUESTS) {
        let sent = Instant::now();
        checker.check(request).await?;
        check_latencies.push(sent.elapsed());
        let sent = Instant::now();
        let mut connection = pool.acquire().await?;
        store::checkpoint(&mut connection, LIVE).await?;
        drop(connection);
        fresh_latencies.push(sent.elapsed());
        let sent = Instant::now();
        plans::versions(pool, &plan).await?;
        versions_latencies.push(sent.elapsed());
    }
    let p50 = |latencies: &[Duration]| percentile_ms(latencies, 0.50);
    let sequential = Line {
        figure: Figure::new(
            format!("admission::check, {facts}, one at a time (library in the bench, no HTTP)"),
            check_latencies.len(),
            check_latencies.iter().sum(),
        )
        .with_latencies(&check_latencies)
        .with_note(format!(
            "a read is 1 statement (facts, checkpoint and plan versions together); for scale, \
             p50 of a plan-versions query alone {:.3} ms, of a bare checkpoint read {:.3} ms",
            p50(&versions_latencies),
            p50(&fresh_latencies)
        )),
        target: "-".to_owned(),
    };
    Ok([concurrent, sequential])
}

/// What read-your-writes costs a check while events arrive: admission has no
/// `consistency=eventual`, so the comparison is between two of the library's checkers in the
/// bench's process that both read Postgres for every check (neither keeps facts): one
/// waits, as the service's does, until the projection holds every event the bench was
/// acknowledged for the check's org (it sees the child's projector through the checkpoint
/// row, as a second instance would); the other is given an empty record of acknowledged
/// events, so it never waits. They answer the same probes in turn, one at a time, while
/// [`stream_commands`] posts events through the child.
async fn measure_waits(
    service: &Served,
    pool: &sqlx::PgPool,
    token: &str,
    population: &Population,
    probes: &[Probe],
    checks: &mut Vec<Check>,
) -> anyhow::Result<[Line; 2]> {
    let acknowledged = Arc::new(Mutex::new(Acknowledged::default()));
    let (_head, watched) = tokio::sync::watch::channel(0);
    let waiting = Checker::new(
        pool.clone(),
        Freshness::new(watched, Arc::clone(&acknowledged)),
        Clock::system(),
    );
    let (_nothing_head, appended_nothing) = acknowledged_nothing();
    let not_waiting = Checker::new(pool.clone(), appended_nothing, Clock::system());
    let requests: Vec<Request> = probes
        .iter()
        .take(DIRECT_REQUESTS)
        .map(Probe::request)
        .collect::<anyhow::Result<_>>()?;
    eprintln!(
        "bench: admission: {} admission::check calls from Postgres, waiting for this \
         instance's appends and not, in turn, while {STREAM_EVENTS_PER_SECOND} events/s arrive",
        requests.len()
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let head_before = ledger_head(&service.pool).await?;
    let started = Instant::now();
    let alternate = async {
        let timed = async {
            let mut waited = Vec::with_capacity(requests.len());
            let mut not_waited = Vec::with_capacity(requests.len());
            for request in &requests {
                let sent = Instant::now();
                waiting.check(request).await?;
                waited.push(sent.elapsed());
                let sent = Instant::now();
                not_waiting.check(request).await?;
                not_waited.push(sent.elapsed());
            }
            anyhow::Ok((waited, not_waited))
        }
        .await;
        stop.cancel();
        timed
    };
    let (timed, streamed) = tokio::join!(
        alternate,
        stream_commands(service, token, population, Some(&acknowledged), &stop)
    );
    let elapsed = started.elapsed();
    let (waited, not_waited) = timed?;
    let streamed = streamed?;
    checks.push(Check {
        description: format!(
            "the {streamed} events posted during the checks from Postgres were appended"
        ),
        passed: ledger_head(&service.pool).await? - head_before == i64::try_from(streamed)?,
    });
    let ratio = |fraction: f64| {
        percentile_ms(&waited, fraction) / percentile_ms(&not_waited, fraction).max(f64::EPSILON)
    };
    let count = requests.len();
    let line = |label: &str, latencies: &[Duration], note: String| Line {
        figure: Figure::new(
            format!(
                "admission::check {label} while {STREAM_EVENTS_PER_SECOND} events/s arrive \
                 (library in the bench, no HTTP)"
            ),
            count,
            latencies.iter().sum(),
        )
        .with_latencies(latencies)
        .with_note(note),
        target: "-".to_owned(),
    };
    Ok([
        line(
            "from Postgres, waiting for the bench's acknowledged appends",
            &waited,
            format!(
                "as a check on another instance waits (it neither hurries the child's \
                 projector nor is woken by its rounds, so it sees them through the checkpoint \
                 row); one at a time, in turn with the line below, over {:.1} s; {streamed} \
                 command events posted meanwhile; max {:.2} ms; load average {}",
                elapsed.as_secs_f64(),
                max_ms(&waited),
                load_average()
            ),
        ),
        line(
            "from Postgres, waiting for nothing",
            &not_waited,
            format!(
                "as on an instance that appended none of the events (the nearest to \
                 consistency=eventual); waiting / not: p50 {:.2} x, p99 {:.2} x; max {:.2} ms",
                ratio(0.50),
                ratio(0.99),
                max_ms(&not_waited)
            ),
        ),
    ])
}

/// Everything the admission table prints.
struct Report {
    lines: Vec<Line>,
    checks: Vec<Check>,
    /// The rows of the targets table that admission gives.
    targets: Vec<Row>,
    /// The `tally serve` child's, over the whole part.
    service: Option<child::ProcessUsage>,
}

impl Report {
    fn print(&self, args: &AdmissionArgs, database_url: &str, scratch: &Scratch) {
        println!();
        println!(
            "tally-bench, admission: Postgres {database_url} (scratch database {}); {} orgs, \
             {CONTAINERS_PER_ORG} containers each; one org in {FULL_ONE_IN} at its {MAX_RUNNING} \
             running slots, one in {TRIAL_ONE_IN} past its allowance; random create, resume, run \
             and publish_port",
            scratch.database_name, args.admission_orgs,
        );
        println!();
        print_lines(&self.lines, self.service, &self.checks);
    }
}

/// The admission workload through one instance or several on the same database: what
/// `--instances` compares.
pub(crate) struct Through {
    /// Checks as fast as answered from [`CLIENTS`] connections.
    pub(crate) closed: Figure,
    /// Checks paced at `rate` from [`PACED_CLIENTS`] connections.
    pub(crate) paced: Figure,
    /// The paced rate, a second.
    pub(crate) rate: f64,
    pub(crate) checks: Vec<Check>,
}

/// The population posted round-robin over `services`, then the sample checks on every
/// instance, the closed-loop checks (every answer compared with the population) and the
/// paced checks, each client's connection to instance `client % services.len()`. Paced at
/// `rate` when given (so that two runs compare at one rate), else at half the closed-loop
/// throughput, as the admission part paces.
// Long: the phases in the order they run, each a few lines, as in `measure`.
pub(crate) async fn measure_through(
    services: &[Served],
    token: &str,
    args: &AdmissionArgs,
    rate: Option<f64>,
) -> anyhow::Result<Through> {
    let addresses: Vec<std::net::SocketAddr> = services.iter().map(|s| s.address).collect();
    let pool = &services[0].pool;
    let mut checks = Vec::new();
    let population = Population::generate(args.admission_orgs, Utc::now());
    let mut connection = HttpConnection::open(addresses[0], "/healthz", token).await?;
    define_plans(&mut connection).await?;
    let endpoint = Endpoint {
        addresses: addresses.clone(),
        url: "/v1/events".to_owned(),
        token: token.to_owned(),
    };
    endpoint
        .post_all(&population.bodies, POPULATION_CLIENTS.max(services.len()))
        .await?;
    let head = ledger_head(pool).await?;
    wait_for_projection(pool, head).await?;
    sqlx::query("ANALYZE").execute(pool).await?;
    checks.push(Check {
        description: format!(
            "2 plans and {} population events appended (ledger head {head}) and projected",
            population.events
        ),
        passed: head == i64::try_from(population.events)? + 2,
    });
    checks.extend(samples_on_every_instance(&addresses, token, &population, "").await?);

    let measured = closed_loop(
        &addresses,
        token,
        &population,
        args.admission_checks,
        format!("admission checks, {CLIENTS} clients, closed loop"),
        &format!("admission through {} instances", services.len()),
        &SplitMeter(services),
    )
    .await?;
    checks.push(measured.verified.check);
    let closed = measured
        .figure
        .with_notes(measured.notes)
        .with_note(format!("load average {}", load_average()));
    let (bodies, check) = (measured.bodies, Target::check());

    let rate = rate.unwrap_or((closed.per_second() / 2.0).max(1.0));
    let paced_count = ((rate * args.admission_paced_seconds as f64) as usize).max(1);
    eprintln!(
        "bench: admission through {} instances: {paced_count} checks paced at {rate:.0}/s",
        services.len()
    );
    let split_before = crate::cpu::CpuSplit::now(services);
    let sent = send_all(
        &addresses,
        token,
        Load::paced(&check, &bodies, paced_count, rate),
    )
    .await?;
    let paced = Figure::new(
        format!("admission checks paced at {rate:.0}/s, {PACED_CLIENTS} clients, open loop"),
        paced_count,
        sent.elapsed,
    )
    .with_latencies(&sent.latencies)
    .with_note(format!(
        "from when due p50 {:.2} ms, p99 {:.2} ms",
        percentile_ms(&sent.latencies_from_due, 0.50),
        percentile_ms(&sent.latencies_from_due, 0.99)
    ))
    .with_note(crate::cpu::CpuSplit::describe(
        split_before,
        crate::cpu::CpuSplit::now(services),
    ))
    .with_note(format!("load average {}", load_average()));
    checks.extend(
        samples_on_every_instance(&addresses, token, &population, "after the load, ").await?,
    );
    Ok(Through {
        closed,
        paced,
        rate,
        checks,
    })
}

/// [`sample_checks`] on every instance, one check an instance, naming the first sample
/// answered otherwise than expected.
async fn samples_on_every_instance(
    addresses: &[std::net::SocketAddr],
    token: &str,
    population: &Population,
    when: &str,
) -> anyhow::Result<Vec<Check>> {
    let mut checks = Vec::with_capacity(addresses.len());
    for (index, address) in addresses.iter().enumerate() {
        let mut connection = HttpConnection::open(*address, "/healthz", token).await?;
        let samples = sample_checks(&mut connection, population).await?;
        let wrong = samples.iter().find(|sample| !sample.passed);
        checks.push(Check {
            description: format!(
                "{when}instance {}: {} of the {} sample checks answer as the population \
                 implies{}",
                index + 1,
                samples.iter().filter(|sample| sample.passed).count(),
                samples.len(),
                wrong.map_or(String::new(), |w| format!("; not {}", w.description))
            ),
            passed: wrong.is_none(),
        });
    }
    Ok(checks)
}

/// The population's two plans, defined through the API.
async fn define_plans(connection: &mut HttpConnection) -> anyhow::Result<()> {
    for (plan, included_seconds) in [
        (TEAM_PLAN, TEAM_INCLUDED_SECONDS),
        (TRIAL_PLAN, TRIAL_INCLUDED_SECONDS),
    ] {
        connection
            .expect(
                &hyper::Method::PUT,
                &format!("/v1/plans/{plan}").parse()?,
                plan_body(included_seconds),
                hyper::StatusCode::CREATED,
            )
            .await?;
    }
    Ok(())
}
