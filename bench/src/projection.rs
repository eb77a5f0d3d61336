//! `tally-bench`, second part: how fast the projection is rebuilt, read and kept current.
//!
//! It runs after the ingest table has printed, in a scratch database and NATS namespace of
//! its own (the ingest part's are gone by then), which it removes at the end, also when a
//! step fails or the run is interrupted.
//!
//! Flow: plan a month of history — many orgs, plus `org_big` with thousands of containers —
//! and `COPY` it straight into `ledger` with a valid hash chain (nothing of that is timed)
//! → time `tally replay` as a child process and, separately and on purpose in the bench's
//! own process, how that time splits between reading, folding and writing (the library's
//! functions) → start `tally serve` as a child process on that database → the usage of
//! `org_big` in the default mode and with `consistency=eventual`, and `/healthz`, from one
//! keep-alive connection, and the library's usage query alone in the bench's process → paced HTTP ingest while a monitor watches the projection's checkpoint, for
//! the lag from acknowledgement to visible → the same load again while paced readers read
//! `org_big`'s usage in both modes → the table.

use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use bytes::Bytes;
use chrono::{DateTime, SubsecRound, Utc};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::Rng;
use serde::Deserialize;
use serde_json::json;
use sqlx::{Connection, PgConnection};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::{
    checkpoint, copy_into_ledger, load_average, max_ms, measured_then_cleaned, part_finished,
    percentile_ms, print_lines, seed_ledger_stream, verdict, AbortOnDrop, Check, Figure,
    HttpConnection, Line, Scratch, IMAGES, PORTS, SETTLE_TIMEOUT_MS, STOP_REASONS,
};
use tally::config::Config;
use tally::event::canonical;
use tally::projection::gather;
use tally::projection::model::Changes;
use tally::projection::query;
use tally::projection::store::{self, LIVE};
use tally::runtime::Period;

use crate::child::{self, Served};
use crate::targets::{per_second, Bound, Figure as TargetFigure, Row};

/// Events in the replayed ledger: a million, a few months of a busy platform.
const REPLAY_EVENTS: usize = 1_000_000;
/// Containers of `org_big`, the org whose usage is queried: a large tenant, so that a query
/// whose cost grew with the org's containers would show.
const USAGE_CONTAINERS: usize = 10_000;
/// Events per second posted while lag is measured: a sustained production rate.
const LAG_RATE: u64 = 10_000;
/// How long the lag load lasts: long enough for a stable p99 (a thousand batches).
const LAG_SECONDS: u64 = 10;
/// Events per paced batch: at the default rate, one batch every 10 ms, like a producer
/// that flushes a small buffer often.
const LAG_BATCH_EVENTS: usize = 100;
/// Connections the paced batches are sent on: a batch waits for no earlier one unless all
/// of them are still waiting for their commit.
const LAG_CLIENTS: usize = 8;
/// How often each paced reader reads `org_big`'s usage during the second lag load: a
/// dashboard refreshing briskly, a few reads per projector round.
const LAG_READ_INTERVAL_MS: u64 = 20;
/// How often the monitor reads the checkpoint; the lag figures are this coarse.
const CHECKPOINT_POLL_MS: u64 = 2;
/// Deadline for one checkpoint read by the monitor.
const CHECKPOINT_QUERY_TIMEOUT_MS: u64 = 1_000;
/// How far before the send a lag event occurred: producers send shortly after the fact,
/// so events reach a container mostly, but not always, in order.
const LAG_OCCURRED_JITTER_MS: i64 = 50;
/// Usage (and `/healthz`) requests measured, one after the other.
const USAGE_REQUESTS: usize = 2_000;
/// Requests of each kind before measuring, so that connections, caches and plans are warm.
const USAGE_WARMUP_REQUESTS: usize = 200;
/// How far back the planned history starts: a month, inside the 35-day backdate bound.
const HISTORY_DAYS: i64 = 30;
/// Every planned event is at least this old when the run starts, so that "as of now" is
/// after every org's latest event: the fast path of the usage query.
const HISTORY_END_MARGIN_MS: i64 = 60_000;
/// A running session lasts between these.
const SESSION_MIN_MS: i64 = 60_000;
const SESSION_MAX_MS: i64 = 8 * 60 * 60 * 1000;
/// A stopped container is resumed after between these, if at all.
const GAP_MIN_MS: i64 = 10 * 60 * 1000;
const GAP_MAX_MS: i64 = 3 * 24 * 60 * 60 * 1000;
/// Commands per session, at most.
const COMMANDS_PER_SESSION_MAX: usize = 12;
/// One container in this many is left running at the end of its history.
const RUNNING_ONE_IN: u32 = 10;
/// How long after an event occurred the planned ledger records it.
const RECORDED_DELAY_MS: i64 = 25;
/// Planned events turned into ledger rows and sent to `COPY` at a time: bounds the memory
/// that rows and CSV take, however large the ledger.
const COPY_CHUNK_EVENTS: usize = 10_000;
/// The org whose usage is queried.
const BIG_ORG: &str = "org_big";
/// `org_big` among the org indexes of the plan.
const BIG_ORG_INDEX: u32 = u32::MAX;
/// Targets.
pub(crate) const REPLAY_TARGET_EVENTS_PER_SECOND: u64 = 500_000;
const USAGE_TARGET_P99_MS: u64 = 5;
const LAG_TARGET_P99_MS: u64 = 250;
/// The lag target holds only at the requested rate; the pacer may fall this far short.
const LAG_RATE_SHORTFALL_PERCENT_MAX: u64 = 5;

#[derive(Debug, Clone, clap::Args)]
pub struct ProjectionArgs {
    /// Events in the ledger that the projection is replayed from.
    #[arg(long, default_value_t = REPLAY_EVENTS)]
    pub replay_events: usize,

    /// Containers of `org_big`, whose usage is queried.
    #[arg(long, default_value_t = USAGE_CONTAINERS)]
    pub usage_containers: usize,

    /// Events per second posted while projection lag is measured.
    #[arg(long, default_value_t = LAG_RATE)]
    pub lag_rate: u64,

    /// Seconds the lag load lasts.
    #[arg(long, default_value_t = LAG_SECONDS)]
    pub lag_seconds: u64,
}

/// Measures the projection and prints its table. `config` is the service configuration of
/// the ingest part: only its server addresses and credentials are used.
pub(super) async fn run(
    binary: &std::path::Path,
    mut config: Config,
    args: &ProjectionArgs,
    orgs: usize,
    nats: &jetstream::Context,
) -> anyhow::Result<Vec<Row>> {
    check_args(args)?;
    let (scratch, shown_database_url) = Scratch::for_part("projections", &mut config)?;

    let report = measured_then_cleaned(
        &scratch,
        nats,
        prepare_and_measure(binary, &config, args, orgs, &scratch, nats),
    )
    .await?;
    report.print(args, &shown_database_url, &scratch);
    part_finished("projection", &scratch, &report.checks)?;
    let replay = &report.replay.figure;
    Ok(vec![Row::new(
        TargetFigure::Replay,
        format!(
            "{} ({} events)",
            per_second(replay.per_second()),
            replay.count
        ),
        replay.per_second(),
        REPLAY_TARGET_EVENTS_PER_SECOND as f64,
        Bound::AtLeast(1.0),
        format!("≥ {REPLAY_TARGET_EVENTS_PER_SECOND} events/s"),
    )])
}

fn check_args(args: &ProjectionArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.replay_events > 0, "--replay-events must be at least 1");
    anyhow::ensure!(
        args.usage_containers > 0,
        "--usage-containers must be at least 1"
    );
    anyhow::ensure!(args.lag_rate > 0, "--lag-rate must be at least 1");
    anyhow::ensure!(args.lag_seconds > 0, "--lag-seconds must be at least 1");
    anyhow::ensure!(
        lag_batches(args) > 0,
        "--lag-rate × --lag-seconds must be at least one batch of {LAG_BATCH_EVENTS} events"
    );
    Ok(())
}

fn lag_batches(args: &ProjectionArgs) -> usize {
    let events = args.lag_rate.saturating_mul(args.lag_seconds);
    usize::try_from(events).unwrap_or(usize::MAX) / LAG_BATCH_EVENTS
}

/// Fills and replays the scratch ledger, then runs the service on it and stops it whatever
/// happened, so that nothing of it outlives the run and recreates a stream after clean-up.
async fn prepare_and_measure(
    binary: &std::path::Path,
    config: &Config,
    args: &ProjectionArgs,
    orgs: usize,
    scratch: &Scratch,
    nats: &jetstream::Context,
) -> anyhow::Result<Report> {
    let prepared = tokio::select! {
        prepared = prepare(binary, config, args, orgs, scratch, nats) => prepared?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
    };
    let service = Served::start(binary, config).await?;
    let outcome = tokio::select! {
        outcome = measure_service(binary, config, &service, args, scratch, prepared) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    eprintln!("bench: projections: stopping the service");
    let usage = service.stop().await;
    let mut report = outcome?;
    report.service = Some(usage?);
    Ok(report)
}

/// What the service phases start from.
struct Prepared {
    plan: Plan,
    replay: Line,
    checks: Vec<Check>,
}

async fn prepare(
    binary: &std::path::Path,
    config: &Config,
    args: &ProjectionArgs,
    orgs: usize,
    scratch: &Scratch,
    nats: &jetstream::Context,
) -> anyhow::Result<Prepared> {
    let started = Instant::now();
    let plan = Plan::generate(args, orgs)?;
    eprintln!(
        "bench: projections: planned {} events of {} containers ({} of {BIG_ORG}) in {:.1} s",
        plan.events.len(),
        plan.containers,
        args.usage_containers,
        started.elapsed().as_secs_f64()
    );
    // Migrates the scratch database; the service later finds it migrated.
    child::run_cli(binary, config, &["migrate"]).await?;
    let mut connection = PgConnection::connect(&scratch.database_url)
        .await
        .context("cannot connect to the scratch database")?;
    let started = Instant::now();
    let head = copy_plan_into_ledger(&mut connection, config, &plan).await?;
    // A ledger that has been live for a month has been vacuumed and analyzed; a replay
    // should not pay for setting the hint bits of freshly loaded rows.
    sqlx::query("VACUUM (ANALYZE) ledger")
        .execute(&mut connection)
        .await?;
    eprintln!(
        "bench: projections: wrote {head} ledger rows with COPY and vacuumed them in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    seed_ledger_stream(&mut connection, nats, scratch, head).await?;
    checkpoint(&mut connection).await;

    eprintln!("bench: projections: replay of {head} events");
    let replayed = crate::replay(binary, config).await?;
    let report = &replayed;
    let projected = store::checkpoint(&mut connection, LIVE).await?;
    let expected_events = u64::try_from(plan.events.len())?;
    let mut checks = vec![Check {
        description: format!(
            "replay read {} events of {} containers and set the checkpoint to {projected}; \
                 the ledger holds {expected_events} events of {} containers, head {head}",
            report.events, report.containers, plan.containers
        ),
        passed: report.events == expected_events
            && report.containers == plan.containers
            && report.position == head
            && projected == head,
    }];
    eprintln!("bench: projections: timing replay's parts separately");
    let mut second = PgConnection::connect(&scratch.database_url)
        .await
        .context("cannot connect to the scratch database")?;
    let parts = ReplayParts::measure(&mut connection, &mut second, head).await?;
    second.close().await?;
    let write = report.elapsed.saturating_sub(parts.read + parts.fold);
    checks.push(Check {
        description: format!(
            "the separate read and fold saw {} events of {} containers, as replay did",
            parts.events, parts.containers
        ),
        passed: parts.events == report.events && parts.containers == report.containers,
    });
    connection.close().await?;

    let meets = u128::from(report.events) * 1_000_000
        >= u128::from(REPLAY_TARGET_EVENTS_PER_SECOND) * report.elapsed.as_micros();
    let figure = Figure::new(
        format!("tally replay, {} containers", report.containers),
        usize::try_from(report.events)?,
        report.elapsed,
    )
    .with_note(format!(
        "replay's own time; the process took {:.2} s in all, {}; measured apart with the \
         library in the bench's process: read and gather {:.2} s, fold {:.2} s; so write and \
         swap ≈ {:.2} s",
        report.ran.elapsed.as_secs_f64(),
        crate::ran_note(&report.ran),
        parts.read.as_secs_f64(),
        parts.fold.as_secs_f64(),
        write.as_secs_f64()
    ));
    let replay = Line {
        figure,
        target: format!(
            "≥ {REPLAY_TARGET_EVENTS_PER_SECOND} events/s: {}",
            verdict(meets)
        ),
    };
    Ok(Prepared {
        plan,
        replay,
        checks,
    })
}

/// One step of a container's planned history.
#[derive(Debug, Clone, Copy)]
enum Step {
    Created,
    CommandRan { duration_ms: u32, exit_code: i32 },
    PortPublished { port: u16 },
    Stopped { reason: &'static str },
    Resumed,
}

impl Step {
    /// A step drawn from the audit part's mix: mostly commands, the lifecycle around them.
    fn random(rng: &mut impl Rng) -> Step {
        match rng.random_range(0..100) {
            0..=9 => Step::Created,
            10..=69 => Step::command(rng),
            70..=79 => Step::Stopped {
                reason: STOP_REASONS.choose(rng).expect("a non-empty list"),
            },
            80..=89 => Step::Resumed,
            _ => Step::PortPublished {
                port: *PORTS.choose(rng).expect("a non-empty list"),
            },
        }
    }

    fn command(rng: &mut impl Rng) -> Step {
        Step::CommandRan {
            duration_ms: rng.random_range(5..120_000),
            exit_code: *[0, 0, 0, 0, 0, 0, 0, 1, 2, 137]
                .choose(rng)
                .expect("a non-empty list"),
        }
    }
}

/// One planned event.
#[derive(Debug, Clone, Copy)]
struct Planned {
    at_ms: i64,
    org: u32,
    container: u32,
    step: Step,
}

fn org_id(org: u32) -> String {
    if org == BIG_ORG_INDEX {
        BIG_ORG.to_owned()
    } else {
        format!("org_{org}")
    }
}

/// The container ids follow the ingest part's, so that the ids of one org never collide.
fn container_id(org: u32, container: u32) -> String {
    if org == BIG_ORG_INDEX {
        format!("ctr_big_{container}")
    } else {
        format!("ctr_{org}_{container}")
    }
}

/// The native envelope of one event, as a producer would send it.
fn event_json(
    rng: &mut impl Rng,
    org: u32,
    container: u32,
    occurred_at: DateTime<Utc>,
    step: Step,
) -> serde_json::Value {
    let container_id = container_id(org, container);
    let (event_type, data) = match step {
        Step::Created => (
            "container.created",
            json!({
                "name": format!("task-{container}"),
                "image": IMAGES[container as usize % IMAGES.len()],
            }),
        ),
        Step::CommandRan {
            duration_ms,
            exit_code,
        } => {
            let mut data = json!({
                "command_id": format!("cmd_{:016x}", rng.random::<u64>()),
                "exit_code": exit_code,
                "duration_ms": duration_ms,
            });
            if exit_code == 137 {
                data["timed_out"] = json!(true);
            }
            ("container.command_ran", data)
        }
        Step::PortPublished { port } => (
            "container.port_published",
            json!({
                "port": port,
                "url": format!("https://{container_id}-{port}.sandbox.example.com"),
            }),
        ),
        Step::Stopped { reason } => ("container.stopped", json!({ "reason": reason })),
        Step::Resumed => ("container.resumed", json!({})),
    };
    json!({
        "id": Uuid::now_v7().hyphenated().to_string(),
        "type": event_type,
        "org_id": org_id(org),
        "container_id": container_id,
        "occurred_at": canonical::timestamp(occurred_at),
        "data": data,
    })
}

/// The replayed ledger, in position order, and what `org_big`'s usage must come to.
struct Plan {
    events: Vec<Planned>,
    containers: usize,
    /// Containers of every other org (`ctr_{org}_{0..n}`), which the lag events reach.
    containers_per_org: u32,
    orgs: u32,
    big: Expected,
}

impl Plan {
    /// `org_big`'s containers first, then containers spread round-robin over the other
    /// orgs until the ledger has `replay_events`; the last history may be cut short, which
    /// leaves a valid prefix. Then everything in `occurred_at` order, as it would have
    /// arrived.
    fn generate(args: &ProjectionArgs, orgs: usize) -> anyhow::Result<Plan> {
        let orgs = u32::try_from(orgs).context("--orgs is too large")?;
        let now_ms = Utc::now().timestamp_millis();
        let window = (
            now_ms - HISTORY_DAYS * 24 * 60 * 60 * 1000,
            now_ms - HISTORY_END_MARGIN_MS,
        );
        let mut rng = rand::rng();
        let mut events = Vec::with_capacity(args.replay_events);
        let mut big = Expected::default();
        let usage_containers =
            u32::try_from(args.usage_containers).context("--usage-containers is too large")?;
        for container in 0..usage_containers {
            let first = events.len();
            plan_container(
                &mut rng,
                window,
                container % RUNNING_ONE_IN == 0,
                BIG_ORG_INDEX,
                container,
                &mut events,
            );
            big.add(&events[first..]);
        }
        anyhow::ensure!(
            events.len() <= args.replay_events,
            "{BIG_ORG}'s {} containers take {} events, more than --replay-events {}; \
             raise it or lower --usage-containers",
            args.usage_containers,
            events.len(),
            args.replay_events
        );
        let mut containers = args.usage_containers;
        let mut history = Vec::new();
        let mut index = 0_u32;
        while events.len() < args.replay_events {
            let (org, container) = (index % orgs, index / orgs);
            history.clear();
            plan_container(
                &mut rng,
                window,
                container % RUNNING_ONE_IN == 0,
                org,
                container,
                &mut history,
            );
            let room = args.replay_events - events.len();
            events.extend_from_slice(&history[..history.len().min(room)]);
            containers += 1;
            index += 1;
        }
        // Within a container, times strictly increase, so this keeps each history's order.
        events.sort_unstable_by_key(|event| (event.at_ms, event.org, event.container));
        Ok(Plan {
            events,
            containers,
            containers_per_org: (index / orgs).max(1),
            orgs,
            big,
        })
    }
}

/// One container's history in `window` (epoch ms): created, then sessions of commands and
/// the odd port publication, each ended by a stop and perhaps followed by a resume.
/// Every step is at a millisecond of its own, after the one before.
fn plan_container(
    rng: &mut impl Rng,
    (window_start_ms, window_end_ms): (i64, i64),
    keep_running: bool,
    org: u32,
    container: u32,
    out: &mut Vec<Planned>,
) {
    let mut push = |at_ms: i64, step: Step| {
        out.push(Planned {
            at_ms,
            org,
            container,
            step,
        })
    };
    let mut ports = PORTS.to_vec();
    ports.shuffle(rng);
    let mut at_ms = rng.random_range(window_start_ms..window_end_ms - SESSION_MAX_MS);
    push(at_ms, Step::Created);
    let mut session: Vec<(i64, Step)> = Vec::with_capacity(COMMANDS_PER_SESSION_MAX + 1);
    loop {
        let end_ms = (at_ms + rng.random_range(SESSION_MIN_MS..=SESSION_MAX_MS)).min(window_end_ms);
        session.clear();
        for _ in 0..rng.random_range(0..=COMMANDS_PER_SESSION_MAX) {
            session.push((rng.random_range(at_ms + 1..end_ms), Step::command(rng)));
        }
        if rng.random_ratio(1, 3) {
            if let Some(port) = ports.pop() {
                session.push((
                    rng.random_range(at_ms + 1..end_ms),
                    Step::PortPublished { port },
                ));
            }
        }
        session.sort_unstable_by_key(|(at_ms, _)| *at_ms);
        session.dedup_by_key(|(at_ms, _)| *at_ms);
        for (at_ms, step) in &session {
            push(*at_ms, *step);
        }
        push(
            end_ms,
            Step::Stopped {
                reason: STOP_REASONS.choose(rng).expect("a non-empty list"),
            },
        );
        let resume_ms = end_ms + rng.random_range(GAP_MIN_MS..=GAP_MAX_MS);
        if resume_ms + SESSION_MIN_MS >= window_end_ms || rng.random_ratio(2, 5) {
            break;
        }
        at_ms = resume_ms;
        push(at_ms, Step::Resumed);
    }
    if keep_running {
        let last = out.pop();
        assert!(
            matches!(
                last,
                Some(Planned {
                    step: Step::Stopped { .. },
                    ..
                })
            ),
            "a history ends with a stop"
        );
    }
}

/// `org_big`'s history reduced to what its usage is made of, to check the service's answers
/// against arithmetic that shares no code with the projection.
#[derive(Debug, Default)]
struct Expected {
    /// Running intervals, epoch ms; the end is `None` while running.
    intervals: Vec<(i64, Option<i64>)>,
    /// (occurred_at ms, duration_ms) of each command.
    commands: Vec<(i64, i64)>,
    /// occurred_at ms of each publication; no container publishes a port twice.
    ports: Vec<i64>,
    containers: usize,
    running: u64,
}

/// An org's usage in a period as the API answers it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
struct UsageAnswer {
    as_of: String,
    runtime_ms: i64,
    commands: u64,
    command_ms: i64,
    ports_published: u64,
    running_containers: u64,
}

impl Expected {
    /// Adds one container's whole history, in time order.
    fn add(&mut self, history: &[Planned]) {
        self.containers += 1;
        let mut open: Option<i64> = None;
        for event in history {
            match event.step {
                Step::Created | Step::Resumed => {
                    assert!(open.is_none(), "the plan starts only stopped containers");
                    open = Some(event.at_ms);
                }
                Step::Stopped { .. } => {
                    let start = open.take().expect("the plan stops only running containers");
                    self.intervals.push((start, Some(event.at_ms)));
                }
                Step::CommandRan { duration_ms, .. } => {
                    self.commands.push((event.at_ms, i64::from(duration_ms)));
                }
                Step::PortPublished { .. } => self.ports.push(event.at_ms),
            }
        }
        if let Some(start) = open {
            self.intervals.push((start, None));
            self.running += 1;
        }
    }

    /// The usage in `period` as of `as_of` (after every event, as the plan guarantees).
    fn usage(&self, period: Period, as_of: DateTime<Utc>) -> UsageAnswer {
        let start = period.start().timestamp_millis();
        let end = period
            .end()
            .timestamp_millis()
            .min(as_of.timestamp_millis());
        let in_period = |at: i64| at >= start && at < period.end().timestamp_millis();
        let runtime_ms = self
            .intervals
            .iter()
            .map(|(from, to)| {
                let to = to.unwrap_or(i64::MAX).min(end);
                (to - (*from).max(start)).max(0)
            })
            .sum();
        let commands: Vec<i64> = self
            .commands
            .iter()
            .filter(|(at, _)| in_period(*at))
            .map(|(_, duration_ms)| *duration_ms)
            .collect();
        UsageAnswer {
            as_of: canonical::timestamp(as_of),
            runtime_ms,
            commands: commands.len() as u64,
            command_ms: commands.iter().sum(),
            ports_published: self.ports.iter().filter(|at| in_period(**at)).count() as u64,
            running_containers: self.running,
        }
    }
}

/// Writes the plan into `ledger` with `COPY`, in chunks of [`COPY_CHUNK_EVENTS`]; returns
/// the head.
async fn copy_plan_into_ledger(
    connection: &mut PgConnection,
    config: &Config,
    plan: &Plan,
) -> anyhow::Result<i64> {
    let mut rng = rand::rng();
    let mut chunks = plan.events.chunks(COPY_CHUNK_EVENTS);
    // A day before the plan's window, which was taken a moment before this.
    let history_from = Utc::now() - chrono::Duration::days(HISTORY_DAYS + 1);
    copy_into_ledger(connection, config, history_from, || {
        let chunk = chunks.next()?;
        Some(
            chunk
                .iter()
                .map(|planned| {
                    let occurred_at = DateTime::from_timestamp_millis(planned.at_ms)
                        .expect("planned instants are recent");
                    let body = event_json(
                        &mut rng,
                        planned.org,
                        planned.container,
                        occurred_at,
                        planned.step,
                    )
                    .to_string();
                    let recorded_at =
                        occurred_at + chrono::Duration::milliseconds(RECORDED_DELAY_MS);
                    (body, recorded_at)
                })
                .collect(),
        )
    })
    .await
}

/// Replay's work done again in parts, each timed: reading the ledger (decoded and gathered
/// by container as it arrives), then folding. What replay took beyond these is writing
/// and swapping.
struct ReplayParts {
    read: Duration,
    fold: Duration,
    events: u64,
    containers: usize,
}

impl ReplayParts {
    async fn measure(
        connection: &mut PgConnection,
        second: &mut PgConnection,
        head: i64,
    ) -> anyhow::Result<ReplayParts> {
        let started = Instant::now();
        let gathered = gather::gather(connection, second, head).await?;
        let read = started.elapsed();
        let containers = gathered.histories.len();
        let started = Instant::now();
        let changes = Changes::from_histories_in_parts(
            gathered.histories,
            gathered.accounts,
            tally::projection::replay::fold_parts(),
        );
        let fold = started.elapsed();
        drop(changes);
        Ok(ReplayParts {
            read,
            fold,
            events: gathered.events,
            containers,
        })
    }
}

async fn measure_service(
    binary: &std::path::Path,
    config: &Config,
    service: &Served,
    args: &ProjectionArgs,
    scratch: &Scratch,
    prepared: Prepared,
) -> anyhow::Result<Report> {
    let Prepared {
        plan,
        replay,
        mut checks,
    } = prepared;
    let [usage, eventual, query, healthz] =
        measure_usage(service, scratch, &plan, &mut checks).await?;
    let mut lag = measure_lag(service, args, scratch, &plan, &mut checks, false).await?;
    lag.extend(measure_lag(service, args, scratch, &plan, &mut checks, true).await?);

    eprintln!("bench: projections: verifying the ledger");
    let (verified, ran) = crate::verify_ledger(binary, config, false).await?;
    checks.push(Check {
        description: format!(
            "hash chain recomputed by tally verify over {} events (planned, then posted) in \
             {:.1} s: {}",
            verified.events_checked,
            ran.elapsed.as_secs_f64(),
            match verified.first_bad_position {
                None => "intact".to_owned(),
                Some(position) => format!("broken at {position}"),
            }
        ),
        passed: verified.ok,
    });
    Ok(Report {
        replay,
        usage,
        eventual,
        query,
        healthz,
        lag,
        checks,
        service: None,
    })
}

/// `org_big`'s usage for the current period in the default mode (which waits for the
/// projection to reach the ledger head), the same with `consistency=eventual` (which does
/// not wait), and `/healthz`, in turn on one keep-alive connection, so that all three see
/// the same conditions: the two usage reads differ by what the guarantee costs, and
/// `/healthz` is the floor (HTTP, routing and the client, without the query). Every usage
/// answer is checked exactly.
async fn measure_usage(
    service: &Served,
    scratch: &Scratch,
    plan: &Plan,
    checks: &mut Vec<Check>,
) -> anyhow::Result<[Line; 4]> {
    let period = Period::containing(Utc::now());
    let eventual_uri = usage_uri(period, ReadMode::Eventual)?;
    let usage_uri = usage_uri(period, ReadMode::Default)?;
    let healthz_uri: hyper::Uri = "/healthz".parse()?;
    let mut connection = HttpConnection::open(service.address, "/healthz", &scratch.token).await?;
    eprintln!(
        "bench: projections: {USAGE_REQUESTS} usage queries for {BIG_ORG} in {period} in the \
         default mode, as many with consistency=eventual, and as many GET /healthz"
    );
    for _ in 0..USAGE_WARMUP_REQUESTS {
        connection.get(&usage_uri).await?;
        connection.get(&eventual_uri).await?;
        connection.get(&healthz_uri).await?;
    }
    let mut usage_latencies = Vec::with_capacity(USAGE_REQUESTS);
    let mut eventual_latencies = Vec::with_capacity(USAGE_REQUESTS);
    let mut healthz_latencies = Vec::with_capacity(USAGE_REQUESTS);
    let mut wrong: Vec<(UsageAnswer, UsageAnswer)> = Vec::new();
    let mut first: Option<UsageAnswer> = None;
    for _ in 0..USAGE_REQUESTS {
        let sent = Instant::now();
        let answer = connection.get(&usage_uri).await?;
        usage_latencies.push(sent.elapsed());
        let sent = Instant::now();
        let eventual = connection.get(&eventual_uri).await?;
        eventual_latencies.push(sent.elapsed());
        let sent = Instant::now();
        connection.get(&healthz_uri).await?;
        healthz_latencies.push(sent.elapsed());

        for answer in [&answer, &eventual] {
            let (answer, expected) = answer_and_expected(plan, period, answer)?;
            if answer != expected {
                wrong.push((answer.clone(), expected));
            }
            first.get_or_insert(answer);
        }
    }
    let first = first.expect("at least one request");
    let answers = 2 * USAGE_REQUESTS;
    checks.push(Check {
        description: format!(
            "{} of {answers} usage answers (both modes) equal {BIG_ORG}'s usage computed from \
             the plan (first: runtime {} ms, {} commands, {} command ms, {} ports, {} running of \
             {} containers){}",
            answers - wrong.len(),
            first.runtime_ms,
            first.commands,
            first.command_ms,
            first.ports_published,
            first.running_containers,
            plan.big.containers,
            wrong
                .first()
                .map(|(got, expected)| format!("; e.g. got {got:?}, expected {expected:?}"))
                .unwrap_or_default()
        ),
        passed: wrong.is_empty()
            && first.runtime_ms > 0
            && first.commands > 0
            && first.running_containers == plan.big.running
            && first.running_containers > 0,
    });
    let elapsed = |latencies: &[Duration]| latencies.iter().sum::<Duration>();
    let usage = Figure::new(
        format!("usage of {BIG_ORG}, {period}"),
        USAGE_REQUESTS,
        elapsed(&usage_latencies),
    )
    .with_latencies(&usage_latencies);
    let meets = usage
        .latency_ms
        .is_some_and(|(_, p99)| p99 <= USAGE_TARGET_P99_MS as f64);
    let usage = Line {
        figure: usage.with_note(format!(
            "default mode (waits for the ledger head); max {:.2} ms; {} containers, {} \
             running; one connection, sequential; load average {}",
            max_ms(&usage_latencies),
            plan.big.containers,
            plan.big.running,
            load_average()
        )),
        target: format!("p99 ≤ {USAGE_TARGET_P99_MS} ms: {}", verdict(meets)),
    };
    let eventual = Figure::new(
        format!("usage of {BIG_ORG}, {period}, consistency=eventual"),
        USAGE_REQUESTS,
        elapsed(&eventual_latencies),
    )
    .with_latencies(&eventual_latencies);
    let eventual = Line {
        figure: eventual.with_note(format!(
            "max {:.2} ms; same connection, in turn with the default reads; default / \
             eventual: p50 {:.2} x, p99 {:.2} x",
            max_ms(&eventual_latencies),
            percentile_ms(&usage_latencies, 0.50) / percentile_ms(&eventual_latencies, 0.50),
            percentile_ms(&usage_latencies, 0.99) / percentile_ms(&eventual_latencies, 0.99)
        )),
        target: "-".to_owned(),
    };
    let healthz = Figure::new(
        "GET /healthz (the floor)",
        USAGE_REQUESTS,
        elapsed(&healthz_latencies),
    )
    .with_latencies(&healthz_latencies)
    .with_note("same connection, in turn with the usage queries".to_owned());
    let healthz = Line {
        figure: healthz,
        target: "-".to_owned(),
    };

    // The same query without HTTP: the service's own function, called here, so that
    // what the query costs and what serving it costs can be told apart.
    let mut query_latencies = Vec::with_capacity(USAGE_REQUESTS);
    for round in 0..USAGE_WARMUP_REQUESTS + USAGE_REQUESTS {
        let as_of = Utc::now().trunc_subsecs(3);
        let sent = Instant::now();
        let found = query::usage(&service.pool, BIG_ORG, period, as_of).await?;
        if round >= USAGE_WARMUP_REQUESTS {
            query_latencies.push(sent.elapsed());
        }
        anyhow::ensure!(
            found.running_containers == plan.big.running,
            "the usage query found {} running containers, expected {}",
            found.running_containers,
            plan.big.running
        );
    }
    let query = Line {
        figure: Figure::new(
            "usage query alone (library in the bench, no HTTP)",
            USAGE_REQUESTS,
            elapsed(&query_latencies),
        )
        .with_latencies(&query_latencies)
        .with_note(format!(
            "max {:.2} ms; `projection::query::usage` in the bench's process, on its own pool",
            max_ms(&query_latencies)
        )),
        target: "-".to_owned(),
    };
    Ok([usage, eventual, query, healthz])
}

/// How a usage read asks for its figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReadMode {
    /// No parameter: the figures reflect every event acknowledged before the read.
    Default,
    /// `consistency=eventual`: the figures as projected, at once.
    Eventual,
}

impl ReadMode {
    fn describe(self) -> &'static str {
        match self {
            ReadMode::Default => "default mode",
            ReadMode::Eventual => "consistency=eventual",
        }
    }
}

/// `org_big`'s usage in `period`, read in `mode`.
fn usage_uri(period: Period, mode: ReadMode) -> anyhow::Result<hyper::Uri> {
    let consistency = match mode {
        ReadMode::Default => "",
        ReadMode::Eventual => "&consistency=eventual",
    };
    Ok(format!("/v1/orgs/{BIG_ORG}/usage?period={period}{consistency}").parse()?)
}

/// A usage answer of `org_big`, and what the plan says it must be at its `as_of`.
fn answer_and_expected(
    plan: &Plan,
    period: Period,
    answer: &[u8],
) -> anyhow::Result<(UsageAnswer, UsageAnswer)> {
    let answer: UsageAnswer =
        serde_json::from_slice(answer).context("the usage answer does not parse")?;
    let as_of = DateTime::parse_from_rfc3339(&answer.as_of)
        .context("the usage answer's as_of")?
        .with_timezone(&Utc);
    let expected = plan.big.usage(period, as_of);
    Ok((answer, expected))
}

/// One paced batch, acknowledged.
#[derive(Debug, Clone, Copy)]
struct Acked {
    acked: Instant,
    latency: Duration,
    /// The highest position the service returned for the batch.
    position: i64,
}

#[derive(Deserialize)]
struct Appended {
    results: Vec<AppendedEvent>,
}

#[derive(Deserialize)]
struct AppendedEvent {
    position: i64,
    duplicate: bool,
}

/// Posts `lag_rate` events a second for `lag_seconds` in paced batches while a monitor
/// reads the projection's checkpoint every few milliseconds; a batch's lag runs from the
/// instant its acknowledgement arrived to the first read that shows the checkpoint at or
/// past its highest position.
///
/// Lag is measured from the HTTP acknowledgement, which the service sends just after the
/// commit: the time from the commit to the projection is at most a little longer (by the
/// answer's trip back), and the time the producer sees is exactly this.
///
/// With `readers`, two paced readers read `org_big`'s usage meanwhile, one in the default
/// mode and one with `consistency=eventual` (see [`read_during_lag`]); their lines follow
/// the lag's. A default read hurries the projector, so this lag is not the one without
/// readers, which is measured in a run of its own.
async fn measure_lag(
    service: &Served,
    args: &ProjectionArgs,
    scratch: &Scratch,
    plan: &Plan,
    checks: &mut Vec<Check>,
    readers: bool,
) -> anyhow::Result<Vec<Line>> {
    let batches = lag_batches(args);
    let events = batches * LAG_BATCH_EVENTS;
    let interval_ns = (LAG_BATCH_EVENTS as u64).saturating_mul(1_000_000_000) / args.lag_rate;
    // The appender learns the head at its first commit; before that, ask the ledger.
    let head_before: i64 = sqlx::query_scalar("SELECT COALESCE(max(position), 0) FROM ledger")
        .fetch_one(&service.pool)
        .await?;
    eprintln!(
        "bench: projections: lag at {} events/s: {batches} batches of {LAG_BATCH_EVENTS}, one \
         every {:.1} ms, from {LAG_CLIENTS} connections",
        args.lag_rate,
        interval_ns as f64 / 1e6
    );
    // Every change of the checkpoint during the phase is one sample; a bound far above
    // what the polling interval allows keeps a runaway from eating memory.
    let samples_max =
        usize::try_from((args.lag_seconds * 1000 + SETTLE_TIMEOUT_MS) / CHECKPOINT_POLL_MS + 1)?;
    let monitor_connection = PgConnection::connect(&scratch.database_url)
        .await
        .context("cannot connect the checkpoint monitor")?;
    let stop = CancellationToken::new();
    let (seen_sender, mut seen) = watch::channel(0_i64);
    let mut monitor = AbortOnDrop(tokio::spawn(watch_checkpoint(
        monitor_connection,
        stop.clone(),
        seen_sender,
        samples_max,
    )));
    let rounds_before = ProjectorRounds::of(service).await?;

    let started = tokio::time::Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    // The highest position acknowledged to any lag client so far.
    let acknowledged = Arc::new(AtomicI64::new(head_before));
    // A JoinSet aborts the other clients as soon as one fails and this returns.
    let mut clients = JoinSet::new();
    for _ in 0..LAG_CLIENTS {
        let (next, acknowledged) = (next.clone(), acknowledged.clone());
        let (address, token) = (service.address, scratch.token.clone());
        let (orgs, containers_per_org) = (plan.orgs, plan.containers_per_org);
        clients.spawn(async move {
            let uri: hyper::Uri = "/v1/events".parse()?;
            let mut connection = HttpConnection::open(address, "/v1/events", &token).await?;
            let mut acked = Vec::new();
            loop {
                let index = next.fetch_add(1, Ordering::Relaxed);
                if index >= batches {
                    break;
                }
                let due = started + Duration::from_nanos(interval_ns.saturating_mul(index as u64));
                tokio::time::sleep_until(due).await;
                let body = lag_batch(&mut rand::rng(), orgs, containers_per_org);
                let sent = Instant::now();
                let answer = connection
                    .expect(&hyper::Method::POST, &uri, body, hyper::StatusCode::OK)
                    .await?;
                let latency = sent.elapsed();
                let answer: Appended =
                    serde_json::from_slice(&answer).context("the append answer does not parse")?;
                anyhow::ensure!(
                    answer.results.len() == LAG_BATCH_EVENTS
                        && answer.results.iter().all(|event| !event.duplicate),
                    "a batch of {LAG_BATCH_EVENTS} new events was not appended as such"
                );
                let position = answer
                    .results
                    .iter()
                    .map(|event| event.position)
                    .max()
                    .expect("a non-empty batch");
                acknowledged.fetch_max(position, Ordering::SeqCst);
                acked.push(Acked {
                    acked: Instant::now(),
                    latency,
                    position,
                });
            }
            anyhow::Ok(acked)
        });
    }
    let reading = CancellationToken::new();
    let collect = async {
        let collected = async {
            let mut acked = Vec::with_capacity(batches);
            while let Some(joined) = clients.join_next().await {
                acked.extend(joined.context("a lag client panicked")??);
            }
            anyhow::Ok(acked)
        }
        .await;
        reading.cancel();
        collected
    };
    let period = Period::containing(Utc::now());
    let read = |mode| {
        let (acknowledged, reading) = (&acknowledged, &reading);
        async move {
            if !readers {
                return Ok(None);
            }
            read_during_lag(service, scratch, plan, period, mode, acknowledged, reading)
                .await
                .map(Some)
        }
    };
    let (acked, default_reads, eventual_reads) =
        tokio::join!(collect, read(ReadMode::Default), read(ReadMode::Eventual));
    let acked = acked?;
    let reads = [default_reads?, eventual_reads?];
    let last_ack = acked.iter().map(|batch| batch.acked).max();
    let posted = last_ack.map_or(Duration::ZERO, |last| {
        last.saturating_duration_since(started.into_std())
    });
    let head = crate::ledger_head(&service.pool).await?;
    tokio::time::timeout(
        Duration::from_millis(SETTLE_TIMEOUT_MS),
        seen.wait_for(|position| *position >= head),
    )
    .await
    .with_context(|| format!("the projection did not reach {head} within {SETTLE_TIMEOUT_MS} ms"))?
    .context("the checkpoint monitor stopped")?;
    stop.cancel();
    let samples = (&mut monitor.0)
        .await
        .context("the checkpoint monitor failed")??;
    let rounds = ProjectorRounds::of(service).await?.since(rounds_before);

    checks.push(Check {
        description: format!(
            "{} of {batches} lag batches acknowledged, each with {LAG_BATCH_EVENTS} new \
             positions; the ledger head moved from {head_before} to {head} (+{events} \
             expected) and the checkpoint reached it",
            acked.len()
        ),
        passed: acked.len() == batches && head - head_before == i64::try_from(events)?,
    });
    let mut lags = Vec::with_capacity(acked.len());
    for batch in &acked {
        let index = samples.partition_point(|(_, position)| *position < batch.position);
        let (visible, _) = samples
            .get(index)
            .context("the monitor never saw a batch's position")?;
        // A round can commit before the answer reaches the client; that lag is zero.
        lags.push(visible.saturating_duration_since(batch.acked));
    }
    let latencies: Vec<Duration> = acked.iter().map(|batch| batch.latency).collect();
    let with_readers = if readers {
        format!(", with usage reads every {LAG_READ_INTERVAL_MS} ms")
    } else {
        String::new()
    };
    let figure = Figure::new(
        format!(
            "projection lag, ack → visible, {} events/s{with_readers}",
            args.lag_rate
        ),
        events,
        posted,
    )
    .with_latencies(&lags);
    let rate_met = u128::try_from(events)? * 1_000_000 * 100
        >= u128::from(args.lag_rate)
            * u128::from(100 - LAG_RATE_SHORTFALL_PERCENT_MAX)
            * posted.as_micros();
    let lag_met = figure
        .latency_ms
        .is_some_and(|(_, p99)| p99 <= LAG_TARGET_P99_MS as f64);
    let advances = samples.len().saturating_sub(1).max(1);
    let target = format!(
        "p99 ≤ {LAG_TARGET_P99_MS} ms at ≥ {} % of the rate: {}",
        100 - LAG_RATE_SHORTFALL_PERCENT_MAX,
        verdict(lag_met && rate_met)
    );
    let figure = figure
        .with_note(format!(
            "max {:.1} ms; load average {}; POST p50 {:.1} ms, p99 {:.1} ms; checkpoint moved {} times, \
             {} events each on average",
            max_ms(&lags),
            load_average(),
            percentile_ms(&latencies, 0.50),
            percentile_ms(&latencies, 0.99),
            samples.len().saturating_sub(1),
            events / advances
        ))
        .with_note(rounds.describe(posted));
    let mut lines = vec![Line { figure, target }];
    for reads in reads.into_iter().flatten() {
        checks.push(reads.check());
        lines.push(reads.line(args, posted));
    }
    Ok(lines)
}

/// The usage reads of one paced reader during the lag load.
struct LagReads {
    mode: ReadMode,
    /// From the send to the whole answer, 503s included.
    latencies: Vec<Duration>,
    /// Answered 503 `projection_lagging`.
    lagging: usize,
    /// Answered with a position short of the last batch acknowledged before the send.
    behind: usize,
    /// Answers unlike `org_big`'s usage computed from the plan, and the first of them.
    wrong: usize,
    first_wrong: Option<(UsageAnswer, UsageAnswer)>,
}

impl LagReads {
    fn check(&self) -> Check {
        let reads = self.latencies.len();
        let answered = reads - self.lagging;
        let wrong = self
            .first_wrong
            .as_ref()
            .map(|(got, expected)| format!("; e.g. got {got:?}, expected {expected:?}"))
            .unwrap_or_default();
        match self.mode {
            ReadMode::Default => Check {
                description: format!(
                    "{reads} default-mode usage reads during the lag load: {} of the \
                     {answered} answers at a position short of the last batch acknowledged \
                     before the read was sent, {} unlike the plan{wrong}; {} answered 503 \
                     projection_lagging",
                    self.behind, self.wrong, self.lagging
                ),
                passed: reads > 0 && self.behind == 0 && self.wrong == 0,
            },
            ReadMode::Eventual => Check {
                description: format!(
                    "{reads} consistency=eventual usage reads during the lag load: {} of the \
                     {answered} answers unlike the plan{wrong}; {} answered 503",
                    self.wrong, self.lagging
                ),
                passed: reads > 0 && self.wrong == 0 && self.lagging == 0,
            },
        }
    }

    fn line(&self, args: &ProjectionArgs, phase: Duration) -> Line {
        let reads = self.latencies.len();
        let figure = Figure::new(
            format!(
                "usage of {BIG_ORG} while {} events/s arrive, {}",
                args.lag_rate,
                self.mode.describe()
            ),
            reads,
            phase,
        )
        .with_latencies(&self.latencies)
        .with_note(format!(
            "max {:.1} ms; one read every {LAG_READ_INTERVAL_MS} ms on a connection of its \
             own; {} of {reads} answered 503 projection_lagging; {} behind the last batch \
             acknowledged before the read",
            max_ms(&self.latencies),
            self.lagging,
            self.behind
        ));
        Line {
            figure,
            target: "-".to_owned(),
        }
    }
}

/// The position an answer reflects.
#[derive(Deserialize)]
struct Positioned {
    position: i64,
}

#[derive(Deserialize)]
struct ErrorAnswer {
    error: ErrorCode,
}

#[derive(Deserialize)]
struct ErrorCode {
    code: String,
}

/// Reads `org_big`'s usage in `mode` every [`LAG_READ_INTERVAL_MS`] on a connection of its
/// own until `stop`, as a dashboard would while events arrive. Each answer is checked
/// against the plan (the lag load touches other orgs only) and its position against the
/// highest position `acknowledged` to a lag client before the read was sent: a default
/// read must reflect it.
async fn read_during_lag(
    service: &Served,
    scratch: &Scratch,
    plan: &Plan,
    period: Period,
    mode: ReadMode,
    acknowledged: &AtomicI64,
    stop: &CancellationToken,
) -> anyhow::Result<LagReads> {
    let uri = usage_uri(period, mode)?;
    let mut connection = HttpConnection::open(service.address, "/healthz", &scratch.token).await?;
    let mut reads = LagReads {
        mode,
        latencies: Vec::new(),
        lagging: 0,
        behind: 0,
        wrong: 0,
        first_wrong: None,
    };
    let mut ticks = tokio::time::interval(Duration::from_millis(LAG_READ_INTERVAL_MS));
    // A read that waited long is followed by the next one, not by a burst.
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = ticks.tick() => {}
        }
        let acknowledged_before = acknowledged.load(Ordering::SeqCst);
        let sent = Instant::now();
        let (status, answer) = connection
            .round_trip(&hyper::Method::GET, &uri, Bytes::new())
            .await?;
        reads.latencies.push(sent.elapsed());
        match status {
            hyper::StatusCode::OK => {
                let position = serde_json::from_slice::<Positioned>(&answer)
                    .context("the usage answer has no position")?
                    .position;
                if position < acknowledged_before {
                    reads.behind += 1;
                }
                let (answer, expected) = answer_and_expected(plan, period, &answer)?;
                if answer != expected {
                    reads.wrong += 1;
                    reads.first_wrong.get_or_insert((answer, expected));
                }
            }
            hyper::StatusCode::SERVICE_UNAVAILABLE => {
                let code = serde_json::from_slice::<ErrorAnswer>(&answer)
                    .context("the 503 answer does not parse")?
                    .error
                    .code;
                anyhow::ensure!(
                    code == "projection_lagging",
                    "GET {uri} answered 503 {code}"
                );
                reads.lagging += 1;
            }
            _ => anyhow::bail!("GET {uri} answered {status}: {}", crate::excerpt(&answer)),
        }
    }
    Ok(reads)
}

/// The body of one lag batch: new events on the planned containers of the other orgs,
/// each occurred a moment ago.
fn lag_batch(rng: &mut impl Rng, orgs: u32, containers_per_org: u32) -> Bytes {
    let now = Utc::now();
    let events: Vec<serde_json::Value> = (0..LAG_BATCH_EVENTS)
        .map(|_| {
            let occurred_at =
                now - chrono::Duration::milliseconds(rng.random_range(0..LAG_OCCURRED_JITTER_MS));
            let step = Step::random(rng);
            let org = rng.random_range(0..orgs);
            let container = rng.random_range(0..containers_per_org);
            event_json(rng, org, container, occurred_at, step)
        })
        .collect();
    Bytes::from(json!({ "events": events }).to_string())
}

/// Reads the live checkpoint every [`CHECKPOINT_POLL_MS`] until stopped; returns each
/// change with the instant its read returned, and publishes the latest position.
async fn watch_checkpoint(
    mut connection: PgConnection,
    stop: CancellationToken,
    seen: watch::Sender<i64>,
    samples_max: usize,
) -> anyhow::Result<Vec<(Instant, i64)>> {
    let mut samples: Vec<(Instant, i64)> = Vec::with_capacity(samples_max.min(1 << 16));
    let mut ticks = tokio::time::interval(Duration::from_millis(CHECKPOINT_POLL_MS));
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !stop.is_cancelled() {
        ticks.tick().await;
        let position = tokio::time::timeout(
            Duration::from_millis(CHECKPOINT_QUERY_TIMEOUT_MS),
            store::checkpoint(&mut connection, LIVE),
        )
        .await
        .context("reading the checkpoint timed out")??;
        let read_at = Instant::now();
        match samples.last() {
            Some((_, last)) if *last == position => continue,
            Some((_, last)) => assert!(*last < position, "the checkpoint only moves forward"),
            None => {}
        }
        anyhow::ensure!(
            samples.len() < samples_max,
            "the checkpoint moved more than {samples_max} times"
        );
        samples.push((read_at, position));
        seen.send_replace(position);
    }
    connection.close().await?;
    Ok(samples)
}

/// The projector's round histograms, read from the child's `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
struct ProjectorRounds {
    rounds: u64,
    events: u64,
    seconds: f64,
}

impl ProjectorRounds {
    async fn of(service: &Served) -> anyhow::Result<ProjectorRounds> {
        let text = service.metrics().await?;
        let value = |name: &str| -> Option<&str> {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
                .map(str::trim)
        };
        Ok(ProjectorRounds {
            rounds: value("tally_projection_round_seconds_count")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            events: value("tally_projection_round_events_sum")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            seconds: value("tally_projection_round_seconds_sum")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0),
        })
    }

    fn since(self, before: ProjectorRounds) -> ProjectorRounds {
        ProjectorRounds {
            rounds: self.rounds - before.rounds,
            events: self.events - before.events,
            seconds: self.seconds - before.seconds,
        }
    }

    fn describe(self, phase: Duration) -> String {
        if self.rounds == 0 {
            return "no projector rounds recorded".to_owned();
        }
        format!(
            "{} projector rounds of {} events and {:.1} ms on average, busy {:.0} % of the phase",
            self.rounds,
            self.events / self.rounds,
            self.seconds / self.rounds as f64 * 1000.0,
            self.seconds / phase.as_secs_f64().max(f64::EPSILON) * 100.0
        )
    }
}

/// Everything the projection table prints.
struct Report {
    replay: Line,
    usage: Line,
    eventual: Line,
    query: Line,
    healthz: Line,
    /// The lag alone, then the lag and the usage reads during a second load.
    lag: Vec<Line>,
    checks: Vec<Check>,
    /// The `tally serve` child's, over the reads and the lag loads.
    service: Option<child::ProcessUsage>,
}

impl Report {
    fn print(&self, args: &ProjectionArgs, database_url: &str, scratch: &Scratch) {
        println!();
        println!(
            "tally-bench, projections: Postgres {database_url} (scratch database {}); ledger of \
             {} events over {HISTORY_DAYS} days, {BIG_ORG} with {} containers; lag load \
             {} events/s for {} s",
            scratch.database_name,
            args.replay_events,
            args.usage_containers,
            args.lag_rate,
            args.lag_seconds
        );
        println!();
        let lines = [
            &self.replay,
            &self.usage,
            &self.eventual,
            &self.query,
            &self.healthz,
        ]
        .into_iter()
        .chain(&self.lag);
        print_lines(lines, self.service, &self.checks);
    }
}
