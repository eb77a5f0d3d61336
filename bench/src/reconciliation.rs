//! `tally-bench`, fifth part: importing and reconciling a provider report of a million
//! lines against a ledger of ten million events.
//!
//! It runs after the audit part, in a scratch database and NATS namespace of its own, which
//! it removes at the end with the report file, also when a step fails or the run is
//! interrupted. Import and reconciliation run in the `tally` binary: `tally reports import`
//! as a child process, then `POST /v1/reconciliations` to a `tally serve` child.
//!
//! Flow: plan containers over the last 30 days → `COPY` their lifecycles into `ledger` day
//! by day, in time order, then `VACUUM (ANALYZE)` and `tally replay` → write a FOCUS report
//! of one line per container-day from the same plan, with discrepancies of every kind
//! planted (nothing of that is timed) → `tally reports import FILE` (timed, the child's
//! peak RSS) → the parse alone, with the library in the bench's process (on purpose: the
//! parser's share of import) → start `tally serve` → `POST /v1/reconciliations` (timed, the
//! child's peak RSS over the request), whose counts must be exactly the planted ones → the
//! table.

use std::collections::HashSet;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use async_nats::jetstream;
use chrono::{DateTime, DurationRound, Utc};
use rand::rngs::StdRng;
use rand::seq::IndexedRandom;
use rand::{Rng, SeedableRng};
use rust_decimal::{Decimal, RoundingStrategy};
use serde_json::json;
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use crate::{
    checkpoint, copy_into_ledger, excerpt, measured_then_cleaned, part_finished, print_checks,
    print_table, verdict, Check, Figure, Line, Scratch, PORTS, STOP_REASONS,
};
use tally::billing::report;
use tally::config::Config;
use tally::event::canonical;

use crate::child::{self, Served};
use crate::HttpConnection;

/// Events in the ledger: ten million, a month of a busy platform.
const EVENTS: usize = 10_000_000;
/// Lines in the provider report: a million, one per container and day it ran.
const REPORT_LINES: usize = 1_000_000;
/// Orgs the containers belong to, round-robin.
const ORGS: u32 = 1_000;
/// Days of history, each a charge period of the report: ending at today's midnight, inside
/// the 35-day backdate bound.
const HISTORY_DAYS: u32 = 30;
const DAY_MS: i64 = 24 * 60 * 60 * 1000;
/// Days a container runs on, at most (at least one): about ten on average, so that the
/// default sizes give about ten events a container-day.
const ACTIVE_DAYS_MAX: u32 = 19;
/// A day's session starts before this time of day and lasts between these bounds, so it
/// ends the same day: one line per container-day, whose runtime the plan knows exactly.
const SESSION_START_LATEST_MS: i64 = 20 * 60 * 60 * 1000;
const SESSION_MIN_MS: i64 = 10 * 60 * 1000;
const SESSION_MAX_MS: i64 = 4 * 60 * 60 * 1000;
/// One container in this many is still running: started yesterday and never stopped, so
/// its last line ends at the report's end while its interval is still open.
const RUNNING_ONE_IN: u32 = 50;
/// One container in this many is left out of the report: `missing_in_provider`.
const OMITTED_ONE_IN: usize = 500;
/// One line in this many is about a container the ledger never saw: `missing_in_ledger`.
const GHOST_ONE_IN: usize = 1_000;
/// Of every thousand lines of known containers, so many are planted discrepancies; the
/// others match within a second either way (the tolerance is at least 2 s).
const OVER_PER_MILLE: u32 = 5;
const UNDER_PER_MILLE: u32 = 5;
const MISMATCH_PER_MILLE: u32 = 2;
/// One line in this many gives its quantity in hours rather than seconds.
const HOURS_ONE_IN: u32 = 10;
/// The provider's price, USD per hour of runtime.
const PRICE_PER_HOUR_MICROS: i64 = 48_000;
/// Events generated, turned into rows and sent to `COPY` at a time.
const COPY_CHUNK_EVENTS: usize = 10_000;
/// Bytes read from the report file at a time: what an HTTP body's chunks come to.
const READ_CHUNK_BYTES: usize = 64 * 1024;
/// Targets.
const TARGET_IMPORT_ROWS_PER_SECOND: f64 = 200_000.0;
const TARGET_RECONCILE_SECONDS: f64 = 30.0;
const TARGET_PEAK_RSS_MB: f64 = 300.0;

#[derive(Debug, Clone, clap::Args)]
pub struct ReconciliationArgs {
    /// Events in the ledger that the provider report is reconciled against.
    #[arg(long, default_value_t = EVENTS)]
    pub reconcile_events: usize,

    /// Lines of the provider report imported and reconciled.
    #[arg(long, default_value_t = REPORT_LINES)]
    pub report_lines: usize,
}

/// Measures import and reconciliation and prints their table. `config` is the service
/// configuration of the ingest part: only its server addresses and credentials are used.
pub(super) async fn run(
    binary: &std::path::Path,
    mut config: Config,
    args: &ReconciliationArgs,
    nats: &jetstream::Context,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.report_lines >= GHOST_ONE_IN,
        "--report-lines must be at least {GHOST_ONE_IN}, so that every kind of discrepancy \
         is planted"
    );
    let (scratch, shown_database_url) = Scratch::for_part("reconciliation", &mut config)?;
    let report_file =
        ReportFile(std::env::temp_dir().join(format!("{}_report.csv", scratch.database_name)));
    eprintln!("bench: reconciliation: report {}", report_file.0.display());

    let measure = async {
        let outcome = tokio::select! {
            outcome = prepare_and_measure(binary, &config, args, &scratch, &report_file) => outcome,
            _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
        };
        drop(report_file);
        outcome
    };
    let report = measured_then_cleaned(&scratch, nats, measure).await?;
    report.print(args, &shown_database_url, &scratch);
    part_finished("reconciliation", &scratch, &report.checks)
}

/// The report's temporary file, removed when dropped.
struct ReportFile(PathBuf);

impl Drop for ReportFile {
    fn drop(&mut self) {
        if let Err(error) = std::fs::remove_file(&self.0) {
            if error.kind() != std::io::ErrorKind::NotFound {
                eprintln!("bench: cannot remove {}: {error}", self.0.display());
            }
        }
    }
}

/// One container of the plan.
#[derive(Debug, Clone, Copy)]
struct Container {
    /// Bit `d` set: the container runs on history day `d`.
    days: u32,
    /// Left out of the report.
    omitted: bool,
}

impl Container {
    fn runs_on(self, day: u32) -> bool {
        self.days & (1 << day) != 0
    }

    fn first_day(self) -> u32 {
        self.days.trailing_zeros()
    }
}

/// Who runs when, from which every container-day's session is derived again on demand
/// (a seeded generator per container and day), so neither the ledger nor the report is
/// ever held in memory.
struct Plan {
    seed: u64,
    containers: Vec<Container>,
    /// Day 0's midnight.
    history_start: DateTime<Utc>,
    container_days: u64,
    ghost_lines: usize,
    /// Events of each container-day, in the ledger's (day, container) order: `base`, and
    /// one more for the first `extra`.
    events_base: u64,
    events_extra: u64,
    /// Containers still running: their last day is yesterday, where their session never
    /// stops.
    running: HashSet<usize>,
}

/// A container-day's session: where it starts in the day, how long it runs.
#[derive(Debug, Clone, Copy)]
struct Session {
    start_ms: i64,
    length_ms: i64,
}

impl Plan {
    fn generate(args: &ReconciliationArgs) -> anyhow::Result<Plan> {
        let mut rng = rand::rng();
        let ghost_lines = args.report_lines / GHOST_ONE_IN;
        let reported_target = (args.report_lines - ghost_lines) as u64;
        let mut containers = Vec::new();
        let mut running = HashSet::new();
        let mut reported = 0_u64;
        let mut container_days = 0_u64;
        while reported < reported_target {
            let index = containers.len();
            let omitted = index % OMITTED_ONE_IN == OMITTED_ONE_IN - 1;
            let keeps_running = rng.random_ratio(1, RUNNING_ONE_IN);
            let count = rng.random_range(1..=ACTIVE_DAYS_MAX);
            let mut days = 0_u32;
            if keeps_running {
                days |= 1 << (HISTORY_DAYS - 1);
            }
            let others = if keeps_running { count - 1 } else { count };
            let span = if keeps_running {
                HISTORY_DAYS - 1
            } else {
                HISTORY_DAYS
            };
            for day in rand::seq::index::sample(&mut rng, span as usize, others as usize) {
                days |= 1 << day;
            }
            if !omitted {
                // The last container takes only the days the report still has room for,
                // its earliest ones.
                while u64::from(days.count_ones()) > reported_target - reported {
                    days &= !(1 << (31 - days.leading_zeros()));
                }
                reported += u64::from(days.count_ones());
            }
            if days & (1 << (HISTORY_DAYS - 1)) != 0 && keeps_running {
                running.insert(index);
            }
            container_days += u64::from(days.count_ones());
            containers.push(Container { days, omitted });
        }
        let events = u64::try_from(args.reconcile_events)?;
        let events_base = events / container_days;
        anyhow::ensure!(
            events_base >= 2,
            "--reconcile-events must be at least twice the {container_days} container-days \
             that --report-lines {} takes",
            args.report_lines
        );
        let today = Utc::now().duration_trunc(chrono::Duration::days(1))?;
        Ok(Plan {
            seed: rng.random(),
            containers,
            history_start: today - chrono::Duration::days(i64::from(HISTORY_DAYS)),
            container_days,
            ghost_lines,
            events_base,
            events_extra: events % container_days,
            running,
        })
    }

    fn is_running(&self, container: usize) -> bool {
        self.running.contains(&container)
    }

    fn org_id(container: usize) -> String {
        format!("org_{}", container as u32 % ORGS)
    }

    fn container_id(container: usize) -> String {
        format!("ctr_{container}")
    }

    fn day_start(&self, day: u32) -> DateTime<Utc> {
        self.history_start + chrono::Duration::days(i64::from(day))
    }

    /// The generator of one container-day: the same for the ledger and the report.
    fn rng(&self, container: usize, day: u32) -> StdRng {
        StdRng::seed_from_u64(self.seed ^ ((container as u64) << 8 | u64::from(day)))
    }

    fn session(rng: &mut StdRng) -> Session {
        Session {
            start_ms: rng.random_range(0..SESSION_START_LATEST_MS),
            length_ms: rng.random_range(SESSION_MIN_MS..=SESSION_MAX_MS),
        }
    }

    /// The runtime the ledger has for a container on a day, in ms.
    fn runtime_ms(&self, container: usize, day: u32) -> i64 {
        let session = Self::session(&mut self.rng(container, day));
        if self.is_running(container) && day == HISTORY_DAYS - 1 {
            DAY_MS - session.start_ms
        } else {
            session.length_ms
        }
    }

    fn omitted(&self) -> usize {
        self.containers.iter().filter(|c| c.omitted).count()
    }
}

/// What an event of a session is.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Created,
    Resumed,
    Command,
    Port,
    Stopped,
}

/// The events of one day, in time order, as (occurred at, container, kind).
fn day_events(plan: &Plan, day: u32, container_day: &mut u64) -> Vec<(i64, usize, Kind)> {
    let day_start_ms = plan.day_start(day).timestamp_millis();
    let mut events = Vec::new();
    for (index, container) in plan.containers.iter().enumerate() {
        if !container.runs_on(day) {
            continue;
        }
        let count = plan.events_base + u64::from(*container_day < plan.events_extra);
        *container_day += 1;
        let mut rng = plan.rng(index, day);
        let session = Plan::session(&mut rng);
        let start_ms = day_start_ms + session.start_ms;
        let first = if container.first_day() == day {
            Kind::Created
        } else {
            Kind::Resumed
        };
        events.push((start_ms, index, first));
        let stops = !(plan.is_running(index) && day == HISTORY_DAYS - 1);
        let middle = count - 1 - u64::from(stops);
        // Evenly spread with a little jitter: distinct instants strictly inside the session.
        let spacing = session.length_ms / (middle as i64 + 1);
        for step in 0..middle as i64 {
            let at_ms = start_ms + spacing * (step + 1) + rng.random_range(0..spacing / 2);
            let kind = if rng.random_ratio(1, 10) {
                Kind::Port
            } else {
                Kind::Command
            };
            events.push((at_ms, index, kind));
        }
        if stops {
            events.push((start_ms + session.length_ms, index, Kind::Stopped));
        }
    }
    events.sort_unstable_by_key(|(at_ms, container, _)| (*at_ms, *container));
    events
}

/// One event as a producer would send it.
fn event_body(rng: &mut impl Rng, container: usize, kind: Kind, at_ms: i64) -> String {
    let container_id = Plan::container_id(container);
    let (event_type, data) = match kind {
        Kind::Created => (
            "container.created",
            json!({"name": format!("task-{container}"), "image": "python:3.12-slim"}),
        ),
        Kind::Resumed => ("container.resumed", json!({})),
        Kind::Command => (
            "container.command_ran",
            json!({
                "command_id": format!("cmd_{:016x}", rng.random::<u64>()),
                "exit_code": *[0, 0, 0, 0, 0, 1].choose(rng).expect("a non-empty list"),
                "duration_ms": rng.random_range(5..60_000u64),
            }),
        ),
        Kind::Port => {
            let port = *PORTS.choose(rng).expect("a non-empty list");
            (
                "container.port_published",
                json!({
                    "port": port,
                    "url": format!("https://{container_id}-{port}.sandbox.example.com"),
                }),
            )
        }
        Kind::Stopped => (
            "container.stopped",
            json!({"reason": STOP_REASONS.choose(rng).expect("a non-empty list")}),
        ),
    };
    let occurred_at = DateTime::from_timestamp_millis(at_ms).expect("recent instants");
    json!({
        "id": Uuid::now_v7().hyphenated().to_string(),
        "type": event_type,
        "org_id": Plan::org_id(container),
        "container_id": container_id,
        "occurred_at": canonical::timestamp(occurred_at),
        "data": data,
    })
    .to_string()
}

/// What the planted report must reconcile to, status by status.
#[derive(Debug, Default, Clone, Copy)]
struct Expected {
    matched: u64,
    provider_over: u64,
    provider_under: u64,
    missing_in_ledger: u64,
    org_mismatch: u64,
    missing_in_provider: u64,
}

impl Expected {
    fn pairs(&self) -> [(&'static str, u64); 6] {
        [
            ("matched", self.matched),
            ("provider_over", self.provider_over),
            ("provider_under", self.provider_under),
            ("missing_in_ledger", self.missing_in_ledger),
            ("org_mismatch", self.org_mismatch),
            ("missing_in_provider", self.missing_in_provider),
        ]
    }

    fn lines(&self) -> u64 {
        self.pairs().iter().map(|(_, count)| count).sum()
    }
}

/// Writes the report: for each day, a line per container that ran on it (the omitted
/// ones aside), then that day's share of ghost lines. Returns what it must reconcile to.
fn write_report(plan: &Plan, path: &std::path::Path) -> anyhow::Result<(Expected, u64)> {
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    writeln!(
        out,
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,\
         BilledCost,BillingCurrency,Tags,ProviderName,ChargeCategory"
    )?;
    let mut rng = rand::rng();
    let mut expected = Expected {
        missing_in_ledger: plan.ghost_lines as u64,
        missing_in_provider: plan.omitted() as u64,
        ..Expected::default()
    };
    let price_per_hour = Decimal::new(PRICE_PER_HOUR_MICROS, 6);
    let line = |out: &mut std::io::BufWriter<std::fs::File>,
                rng: &mut rand::rngs::ThreadRng,
                day: u32,
                container_id: &str,
                org_id: &str,
                provider_ms: i64|
     -> std::io::Result<()> {
        let start = plan.day_start(day);
        let end = start + chrono::Duration::days(1);
        let quantity = if rng.random_ratio(1, HOURS_ONE_IN) {
            // Ten decimals of an hour round back to the exact millisecond.
            let hours = (Decimal::from(provider_ms) / Decimal::from(3_600_000))
                .round_dp_with_strategy(10, RoundingStrategy::MidpointAwayFromZero);
            format!("{hours},Hours")
        } else {
            format!("{}.{:03},Seconds", provider_ms / 1000, provider_ms % 1000)
        };
        let cost = (Decimal::from(provider_ms) * price_per_hour / Decimal::from(3_600_000))
            .round_dp_with_strategy(6, RoundingStrategy::MidpointAwayFromZero);
        writeln!(
            out,
            "{},{},{container_id},{quantity},{cost},USD,\"{{\"\"org_id\"\":\"\"{org_id}\"\"}}\",\
             bench-cloud,Usage",
            canonical::timestamp(start),
            canonical::timestamp(end)
        )
    };
    let mut ghosts_written = 0_usize;
    for day in 0..HISTORY_DAYS {
        for (index, container) in plan.containers.iter().enumerate() {
            if !container.runs_on(day) || container.omitted {
                continue;
            }
            let runtime_ms = plan.runtime_ms(index, day);
            let mut org = index as u32 % ORGS;
            let draw = rng.random_range(0..1000);
            let provider_ms = if draw < OVER_PER_MILLE {
                expected.provider_over += 1;
                runtime_ms + runtime_ms / 10 + 60_000
            } else if draw < OVER_PER_MILLE + UNDER_PER_MILLE {
                expected.provider_under += 1;
                runtime_ms / 2
            } else {
                if draw < OVER_PER_MILLE + UNDER_PER_MILLE + MISMATCH_PER_MILLE {
                    expected.org_mismatch += 1;
                    org = (org + 1) % ORGS;
                } else {
                    expected.matched += 1;
                }
                runtime_ms + rng.random_range(-1_000..=1_000)
            };
            line(
                &mut out,
                &mut rng,
                day,
                &Plan::container_id(index),
                &format!("org_{org}"),
                provider_ms,
            )?;
        }
        // Ghosts spread over the days, the last day taking what is left.
        let ghosts_until = if day == HISTORY_DAYS - 1 {
            plan.ghost_lines
        } else {
            plan.ghost_lines * (day as usize + 1) / HISTORY_DAYS as usize
        };
        while ghosts_written < ghosts_until {
            let runtime_ms = rng.random_range(SESSION_MIN_MS..=SESSION_MAX_MS);
            let org_id = format!("org_{}", ghosts_written as u32 % ORGS);
            line(
                &mut out,
                &mut rng,
                day,
                &format!("ghost_{ghosts_written}"),
                &org_id,
                runtime_ms,
            )?;
            ghosts_written += 1;
        }
    }
    let file = out.into_inner().map_err(|error| error.into_error())?;
    file.sync_all()?;
    let bytes = file.metadata()?.len();
    Ok((expected, bytes))
}

/// A process's resident memory as the kernel counts it, in MB: now and the peak since the
/// last [`reset_peak`].
#[derive(Debug, Clone, Copy)]
struct Memory {
    rss_mb: f64,
    peak_mb: f64,
}

impl Memory {
    fn of(pid: u32) -> anyhow::Result<Memory> {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
            .context("peak RSS is read from /proc/<pid>/status (Linux only)")?;
        let field = |name: &str| -> anyhow::Result<f64> {
            let kilobytes: f64 = status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
                .with_context(|| format!("/proc/{pid}/status has no {name}"))?;
            Ok(kilobytes / 1024.0)
        };
        Ok(Memory {
            rss_mb: field("VmRSS:")?,
            peak_mb: field("VmHWM:")?,
        })
    }
}

/// Starts a new peak of process `pid`: the kernel sets VmHWM back to the current RSS
/// (`clear_refs` 5, Linux 4.0+). No call gives free memory back first: `tally` allocates
/// with mimalloc (see its `main.rs`), which purges pages that become wholly free by itself,
/// 10 ms after (its `purge_delay` default).
fn reset_peak(pid: u32) -> anyhow::Result<Memory> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")
        .with_context(|| format!("cannot reset the peak RSS through /proc/{pid}/clear_refs"))?;
    Memory::of(pid)
}

/// Builds the ledger, replays it and writes the report (not timed), then measures.
async fn prepare_and_measure(
    binary: &std::path::Path,
    config: &Config,
    args: &ReconciliationArgs,
    scratch: &Scratch,
    report_file: &ReportFile,
) -> anyhow::Result<Report> {
    let started = Instant::now();
    let plan = Plan::generate(args)?;
    eprintln!(
        "bench: reconciliation: planned {} containers, {} container-days, {} events each, in \
         {:.1} s",
        plan.containers.len(),
        plan.container_days,
        plan.events_base,
        started.elapsed().as_secs_f64()
    );
    child::run_cli(binary, config, &["migrate"]).await?;
    let mut connection = PgConnection::connect(&scratch.database_url)
        .await
        .context("cannot connect to the scratch database")?;

    eprintln!(
        "bench: reconciliation: writing {} events into the ledger with COPY",
        args.reconcile_events
    );
    let started = Instant::now();
    let head = {
        let mut rng = rand::rng();
        let mut day = 0_u32;
        let mut container_day = 0_u64;
        let mut pending: std::vec::IntoIter<(i64, usize, Kind)> = Vec::new().into_iter();
        copy_into_ledger(&mut connection, config, plan.history_start, || {
            while pending.len() == 0 {
                if day == HISTORY_DAYS {
                    return None;
                }
                pending = day_events(&plan, day, &mut container_day).into_iter();
                day += 1;
            }
            let chunk = pending
                .by_ref()
                .take(COPY_CHUNK_EVENTS)
                .map(|(at_ms, container, kind)| {
                    let body = event_body(&mut rng, container, kind, at_ms);
                    let recorded_at =
                        DateTime::from_timestamp_millis(at_ms + 25).expect("recent instants");
                    (body, recorded_at)
                })
                .collect();
            Some(chunk)
        })
        .await?
    };
    let copy = started.elapsed();
    anyhow::ensure!(
        head == i64::try_from(args.reconcile_events)?,
        "COPY wrote {head} events of {}",
        args.reconcile_events
    );
    let started = Instant::now();
    sqlx::query("VACUUM (ANALYZE) ledger")
        .execute(&mut connection)
        .await?;
    let vacuum = started.elapsed();
    eprintln!(
        "bench: reconciliation: COPY took {:.1} s, VACUUM (ANALYZE) {:.1} s; replaying",
        copy.as_secs_f64(),
        vacuum.as_secs_f64()
    );
    // The relay starts caught up, as the audit part's does: publishing the whole COPY-built
    // ledger would compete with the import and the reconciliation.
    let nats = async_nats::connect(&config.nats_url)
        .await
        .context("cannot connect to NATS")?;
    crate::seed_ledger_stream(
        &mut connection,
        &async_nats::jetstream::new(nats),
        scratch,
        head,
    )
    .await?;
    connection.close().await?;
    let replayed = crate::replay(binary, config).await?;
    let mut connection = PgConnection::connect(&scratch.database_url).await?;
    checkpoint(&mut connection).await;
    connection.close().await?;
    let mut checks = vec![Check {
        description: format!(
            "replay projected {} events of {} containers up to {}; the plan has {} and {}",
            replayed.events,
            replayed.containers,
            replayed.position,
            head,
            plan.containers.len()
        ),
        passed: replayed.position == head && replayed.containers == plan.containers.len(),
    }];

    eprintln!("bench: reconciliation: writing the report");
    let started = Instant::now();
    let (expected, report_bytes) = write_report(&plan, &report_file.0)?;
    let written = started.elapsed();
    anyhow::ensure!(
        expected.lines() - expected.missing_in_provider == args.report_lines as u64,
        "the report has {} lines, not {}",
        expected.lines() - expected.missing_in_provider,
        args.report_lines
    );
    let build = Line {
        figure: Figure::new(
            "ledger written with COPY (not timed)",
            usize::try_from(head)?,
            copy,
        )
        .with_note(format!(
            "{} containers of {ORGS} orgs over {HISTORY_DAYS} days, {} container-days, one \
             session each; day by day in time order, generated, parsed and chained in chunks \
             of {COPY_CHUNK_EVENTS}; VACUUM (ANALYZE) {:.1} s",
            plan.containers.len(),
            plan.container_days,
            vacuum.as_secs_f64()
        )),
        target: "-".to_owned(),
    };
    let replay = Line {
        figure: Figure::new(
            format!(
                "tally replay (not timed), {} containers",
                replayed.containers
            ),
            usize::try_from(replayed.events)?,
            replayed.elapsed,
        )
        .with_note("the projection reconciliation reads".to_owned()),
        target: "-".to_owned(),
    };
    let report = Line {
        figure: Figure::new(
            "report written to a file (not timed)",
            args.report_lines,
            written,
        )
        .with_note(format!(
            "{:.0} MB; planted: {} provider_over, {} provider_under, {} org_mismatch, {} \
             missing_in_ledger, {} containers left out",
            report_bytes as f64 / 1e6,
            expected.provider_over,
            expected.provider_under,
            expected.org_mismatch,
            expected.missing_in_ledger,
            expected.missing_in_provider
        )),
        target: "-".to_owned(),
    };
    drop(plan);

    let mut connection = PgConnection::connect(&scratch.database_url).await?;
    checkpoint(&mut connection).await;
    eprintln!("bench: reconciliation: importing with tally reports import");
    let path = report_file
        .0
        .to_str()
        .context("the report's path is not UTF-8")?;
    let ran = child::run_cli(binary, config, &["reports", "import", path]).await?;
    let import_elapsed = ran.elapsed;
    let stored: ImportAnswer = serde_json::from_str(&ran.stdout)
        .with_context(|| format!("tally reports import printed {:?}", ran.stdout.trim()))?;
    checks.push(Check {
        description: format!(
            "the import stored {} lines over {} .. {} (new: {})",
            stored.lines, stored.window_start, stored.window_end, stored.new
        ),
        passed: stored.new && stored.lines == args.report_lines as i64,
    });
    let import_rate = args.report_lines as f64 / import_elapsed.as_secs_f64();
    let import = Line {
        figure: Figure::new(
            "tally reports import FILE (file streamed)",
            args.report_lines,
            import_elapsed,
        )
        .with_note(format!(
            "a child process, start-up included; parse and sha256 on a blocking thread, \
             batches of {} inserted in one transaction; {}",
            tally::finance::reports::IMPORT_BATCH_LINES,
            crate::ran_note(&ran)
        )),
        target: format!(
            "≥ {TARGET_IMPORT_ROWS_PER_SECOND:.0} rows/s: {}",
            verdict(import_rate >= TARGET_IMPORT_ROWS_PER_SECOND)
        ),
    };

    eprintln!("bench: reconciliation: parsing the report alone");
    let parse = parse_alone(report_file.0.clone(), args.report_lines).await?;

    checkpoint(&mut connection).await;
    let (summary, reconcile_elapsed, before_reconcile, after_reconcile, service) =
        reconcile_served(binary, config, scratch, stored.report_id).await?;
    let counted = |status: &str| summary.counts[status].as_u64().unwrap_or(0);
    let mismatches: Vec<String> = expected
        .pairs()
        .iter()
        .filter(|(status, count)| counted(status) != *count)
        .map(|(status, count)| format!("{status} {} (planted {count})", counted(status)))
        .collect();
    checks.push(Check {
        description: format!(
            "the reconciliation counts {}{}",
            expected
                .pairs()
                .iter()
                .map(|(status, _)| format!("{} {status}", counted(status)))
                .collect::<Vec<_>>()
                .join(", "),
            if mismatches.is_empty() {
                ", exactly as planted".to_owned()
            } else {
                format!("; differs from the plan: {}", mismatches.join(", "))
            }
        ),
        passed: mismatches.is_empty(),
    });
    let (stored_lines,): (i64,) =
        sqlx::query_as("SELECT count(*) FROM reconciliation_line WHERE reconciliation_id = $1")
            .bind(summary.reconciliation_id)
            .fetch_one(&mut connection)
            .await?;
    checks.push(Check {
        description: format!(
            "{stored_lines} reconciliation lines stored, {} expected",
            expected.lines()
        ),
        passed: stored_lines == expected.lines() as i64,
    });
    connection.close().await?;
    let reconcile = Line {
        figure: Figure::new(
            "POST /v1/reconciliations",
            usize::try_from(expected.lines())?,
            reconcile_elapsed,
        )
        .with_note(format!(
            "to tally serve, a child process; every line against the projection, then the \
             containers the report leaves out; {} lines stored; matched provider cost {} USD",
            stored_lines,
            summary.totals["currencies"]["USD"]["by_status"]["matched"]["provider_cost"]
                .as_str()
                .unwrap_or("?")
        )),
        target: format!(
            "≤ {TARGET_RECONCILE_SECONDS:.0} s: {}",
            verdict(reconcile_elapsed.as_secs_f64() <= TARGET_RECONCILE_SECONDS)
        ),
    };
    Ok(Report {
        lines: vec![build, replay, report, import, parse, reconcile],
        memory: vec![
            MemoryLine {
                label: "peak RSS of tally reports import".to_owned(),
                peak_mb: ran.usage.peak_mb,
                note: "VmHWM of the child process while it ran, start-up included".to_owned(),
            },
            MemoryLine {
                label: "peak RSS of tally serve during the reconciliation".to_owned(),
                peak_mb: after_reconcile.peak_mb,
                note: format!(
                    "VmHWM {:.0} MB, {:+.0} MB over the {:.0} MB resident before the request; \
                     {:.0} MB resident after",
                    after_reconcile.peak_mb,
                    after_reconcile.peak_mb - before_reconcile.rss_mb,
                    before_reconcile.rss_mb,
                    after_reconcile.rss_mb
                ),
            },
        ],
        checks,
        service: Some(service),
    })
}

/// What `tally reports import` prints.
#[derive(serde::Deserialize)]
struct ImportAnswer {
    report_id: uuid::Uuid,
    lines: i64,
    window_start: String,
    window_end: String,
    new: bool,
}

/// `POST /v1/reconciliations`' answer.
#[derive(serde::Deserialize)]
struct Reconciled {
    reconciliation_id: uuid::Uuid,
    counts: serde_json::Value,
    totals: serde_json::Value,
}

/// Starts `tally serve`, asks it to reconcile `report_id` with the default tolerance, and
/// stops it; returns the answer, the request's time, the child's memory just before and
/// just after it (the peak restarted at the request) and its CPU and peak over the run.
async fn reconcile_served(
    binary: &std::path::Path,
    config: &Config,
    scratch: &Scratch,
    report_id: uuid::Uuid,
) -> anyhow::Result<(
    Reconciled,
    std::time::Duration,
    Memory,
    Memory,
    child::ProcessUsage,
)> {
    let service = Served::start(binary, config).await?;
    let outcome = async {
        let mut connection =
            HttpConnection::open(service.address, "/v1/reconciliations", &scratch.token).await?;
        let before = reset_peak(service.pid())?;
        eprintln!(
            "bench: reconciliation: POST /v1/reconciliations (tally serve RSS {:.0} MB)",
            before.rss_mb
        );
        let started = Instant::now();
        let (status, mut answer) = connection
            .round_trip(
                &hyper::Method::POST,
                &"/v1/reconciliations".parse()?,
                json!({ "report_id": report_id }).to_string().into(),
            )
            .await?;
        match status {
            hyper::StatusCode::CREATED => {}
            // Still running past half the request deadline: read it until it is done.
            hyper::StatusCode::ACCEPTED => answer = finished(&mut connection, &answer).await?,
            other => anyhow::bail!(
                "POST /v1/reconciliations answered {other}: {}",
                excerpt(&answer)
            ),
        }
        let elapsed = started.elapsed();
        let after = Memory::of(service.pid())?;
        let reconciled: Reconciled =
            serde_json::from_slice(&answer).context("the reconciliation answer does not parse")?;
        anyhow::Ok((reconciled, elapsed, before, after))
    }
    .await;
    eprintln!("bench: reconciliation: stopping the service");
    let usage = service.stop().await;
    let (reconciled, elapsed, before, after) = outcome?;
    Ok((reconciled, elapsed, before, after, usage?))
}

/// How often a running reconciliation is read until it is done.
const POLL_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// The reconciliation whose running job `accepted` is, read until it is done; an error
/// when it failed.
async fn finished(
    connection: &mut HttpConnection,
    accepted: &[u8],
) -> anyhow::Result<hyper::body::Bytes> {
    let job: serde_json::Value =
        serde_json::from_slice(accepted).context("the running job does not parse")?;
    let uri: hyper::Uri = format!(
        "/v1/reconciliations/{}",
        job["reconciliation_id"]
            .as_str()
            .context("no reconciliation_id")?
    )
    .parse()?;
    loop {
        let answer = connection.get(&uri).await?;
        let state: serde_json::Value =
            serde_json::from_slice(&answer).context("the reconciliation does not parse")?;
        match state["status"].as_str() {
            Some("running") => tokio::time::sleep(POLL_EVERY).await,
            Some("done") => return Ok(answer),
            _ => anyhow::bail!("the reconciliation did not finish: {state}"),
        }
    }
}

/// What import's parser alone costs: the file read, hashed and every line checked as
/// `reports::import` does on its blocking thread, without the database.
async fn parse_alone(path: PathBuf, lines: usize) -> anyhow::Result<Line> {
    struct Hashing<R> {
        inner: R,
        hasher: Sha256,
    }
    impl<R: std::io::Read> std::io::Read for Hashing<R> {
        fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
            let n = self.inner.read(buffer)?;
            self.hasher.update(&buffer[..n]);
            Ok(n)
        }
    }
    let elapsed = tokio::task::spawn_blocking(move || -> anyhow::Result<_> {
        let started = Instant::now();
        let file = std::fs::File::open(&path)?;
        let mut reader = Hashing {
            inner: std::io::BufReader::with_capacity(READ_CHUNK_BYTES, file),
            hasher: Sha256::new(),
        };
        let mut csv = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .from_reader(&mut reader);
        let mut record = csv::StringRecord::new();
        anyhow::ensure!(csv.read_record(&mut record)?, "the report is empty");
        let header = report::Header::parse(&record, 1)?;
        let mut parsed = 0_usize;
        while csv.read_record(&mut record)? {
            let line = record.position().map_or(0, |position| position.line());
            std::hint::black_box(header.line(&record, line)?);
            parsed += 1;
        }
        drop(csv);
        std::hint::black_box(reader.hasher.finalize());
        anyhow::ensure!(parsed == lines, "parsed {parsed} lines of {lines}");
        Ok(started.elapsed())
    })
    .await??;
    Ok(Line {
        figure: Figure::new(
            "the same parse alone (library in the bench, no database)",
            lines,
            elapsed,
        )
        .with_note(
            "csv records, Header::line and sha256 on one thread: the parser's share of import"
                .to_owned(),
        ),
        target: "-".to_owned(),
    })
}

/// A child's peak memory over one measured step.
struct MemoryLine {
    label: String,
    peak_mb: f64,
    note: String,
}

/// Everything the reconciliation table prints.
struct Report {
    lines: Vec<Line>,
    memory: Vec<MemoryLine>,
    checks: Vec<Check>,
    /// The `tally serve` child's, over the reconciliation.
    service: Option<child::ProcessUsage>,
}

impl Report {
    fn print(&self, args: &ReconciliationArgs, database_url: &str, scratch: &Scratch) {
        println!();
        println!(
            "tally-bench, reconciliation: Postgres {database_url} (scratch database {}); ledger \
             of {} events over {HISTORY_DAYS} days, provider report of {} lines",
            scratch.database_name, args.reconcile_events, args.report_lines,
        );
        println!();
        let header = [
            "measurement",
            "count",
            "seconds",
            "per second",
            "target",
            "notes",
        ];
        let mut cells: Vec<Vec<String>> = self
            .lines
            .iter()
            .map(|Line { figure, target }| {
                vec![
                    figure.label.clone(),
                    figure.count.to_string(),
                    format!("{:.2}", figure.elapsed.as_secs_f64()),
                    format!("{:.0}", figure.per_second()),
                    target.clone(),
                    figure.notes.join("; "),
                ]
            })
            .collect();
        for line in &self.memory {
            let met = line.peak_mb <= TARGET_PEAK_RSS_MB;
            cells.push(vec![
                line.label.clone(),
                "-".to_owned(),
                "-".to_owned(),
                "-".to_owned(),
                format!("≤ {TARGET_PEAK_RSS_MB:.0} MB: {}", verdict(met)),
                format!("{:.0} MB; {}", line.peak_mb, line.note),
            ]);
        }
        print_table(&header, &cells);
        println!();
        if let Some(usage) = self.service {
            crate::print_service_usage(usage);
        }
        print_checks(&self.checks);
    }
}
