//! `tally-bench`, fourth part: audit pages and verification on a ledger of millions of
//! events.
//!
//! It runs after the admission part, in a scratch database and NATS namespace of its own,
//! which it removes at the end, also when a step fails or the run is interrupted.
//!
//! Flow: `COPY` seventy-five days of history straight into `ledger` (so at least three of its
//! monthly partitions, whatever the day) — many orgs, each with dozens of
//! containers, and `org_big` with a hundredth of all events — generated and written in
//! chunks, then `VACUUM (ANALYZE)` (nothing of that is timed) → start `tally serve` as a
//! child process on that database → org pages at random cursors and container pages from
//! one keep-alive connection, every page checked against the ledger → the same pages
//! through the library's `read_filtered` in the bench's process, without HTTP (on purpose:
//! what the query costs apart from serving it), and the plan of one page of each kind → a
//! full verification pass (`tally verify`, a child process) → ten thousand events appended
//! over HTTP → an incremental pass (`tally verify --incremental`) → the table.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream;
use bytes::Bytes;
use chrono::{DateTime, SubsecRound, Utc};
use rand::Rng;
use serde::Deserialize;
use sqlx::{Connection, PgConnection};

use crate::{
    checkpoint, container_data, copy_into_ledger, envelope, ledger_head, load_average, max_ms,
    measured_then_cleaned, part_finished, percentile_ms, print_lines, ran_note, seed_ledger_stream,
    verdict, verify_ledger, wait_for_projection, Check, Endpoint, Figure, HttpConnection, Line,
    Scratch,
};
use tally::config::Config;
use tally::ledger::read::{self, Filter};
use tally::projection::store::LIVE;

use crate::child::{self, Served};
use crate::projection::REPLAY_TARGET_EVENTS_PER_SECOND;

/// Events in the audited ledger: ten million, a year or more of a busy platform, where a
/// page that scanned an org's history instead of seeking it would show.
const EVENTS: usize = 10_000_000;
/// Orgs besides `org_big`.
const ORGS: usize = 1_000;
/// Containers of each of those orgs: at the default size, about 200 events each, so that a
/// container page is a full page.
const CONTAINERS_PER_ORG: usize = 50;
/// `org_big`'s containers, and its share of the events: one in a hundred, 100 000 at the
/// default size, spread over its containers as the other orgs' are.
const BIG_CONTAINERS: usize = 500;
const BIG_ONE_IN: u32 = 100;
const BIG_ORG: &str = "org_big";
/// One org page in this many is `org_big`'s.
const BIG_PAGE_ONE_IN: u32 = 10;
/// How far back the history starts: longer than any two months, so that the ledger spans
/// at least [`PARTITIONS_MIN`] of its monthly partitions and pages, verification and
/// replay read across them. Each event was within the backdate bound when it was recorded.
const HISTORY_DAYS: i64 = 75;
/// Monthly partitions the generated ledger must have rows in.
const PARTITIONS_MIN: usize = 3;
/// The newest generated event is this old when the run starts.
const HISTORY_END_MARGIN_MS: i64 = 60_000;
/// How long after an event occurred the generated ledger records it.
const RECORDED_DELAY_MS: i64 = 25;
/// Events generated, turned into rows and sent to `COPY` at a time: bounds the memory the
/// generation takes, however large the ledger.
const COPY_CHUNK_EVENTS: usize = 10_000;
/// How often the build reports its progress: a line every ten seconds or so.
const PROGRESS_EVENTS: usize = 1_000_000;
/// Requests of each kind measured, one after the other on one connection.
const REQUESTS: usize = 2_000;
/// Requests of each kind before measuring, so that the connection, the pool, plans and
/// Postgres's buffers are warm.
const WARMUP_REQUESTS: usize = 200;
/// Events per page asked for: the default page.
const PAGE_EVENTS: usize = 100;
/// Events appended before the incremental pass, in batches of the service's maximum.
const APPENDED_EVENTS: usize = 10_000;
const APPEND_CLIENTS: usize = 4;
/// Target.
const TARGET_PAGE_P99_MS: f64 = 10.0;

#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Events in the ledger that audit pages and verification are measured on.
    #[arg(long, default_value_t = EVENTS)]
    pub audit_events: usize,

    /// Orgs of that ledger besides `org_big`.
    #[arg(long, default_value_t = ORGS)]
    pub audit_orgs: usize,

    /// Org pages and container pages measured, each.
    #[arg(long, default_value_t = REQUESTS)]
    pub audit_requests: usize,
}

/// Measures audit and verification and prints their table. `config` is the service
/// configuration of the ingest part: only its server addresses and credentials are used.
pub(super) async fn run(
    binary: &std::path::Path,
    mut config: Config,
    args: &AuditArgs,
    nats: &jetstream::Context,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.audit_events >= 100_000,
        "--audit-events must be at least 100000, so that every container has a history"
    );
    anyhow::ensure!(args.audit_orgs > 0, "--audit-orgs must be at least 1");
    anyhow::ensure!(
        args.audit_requests > 0,
        "--audit-requests must be at least 1"
    );
    let (scratch, shown_database_url) = Scratch::for_part("audit", &mut config)?;

    let report = measured_then_cleaned(
        &scratch,
        nats,
        prepare_and_measure(binary, &config, args, &scratch, nats),
    )
    .await?;
    report.print(args, &shown_database_url, &scratch);
    part_finished("audit", &scratch, &report.checks)
}

/// Builds the ledger, then runs the service on it and stops it whatever happened, so that
/// nothing of it outlives the run and recreates a stream after clean-up.
async fn prepare_and_measure(
    binary: &std::path::Path,
    config: &Config,
    args: &AuditArgs,
    scratch: &Scratch,
    nats: &jetstream::Context,
) -> anyhow::Result<Report> {
    let (ledger, build) = tokio::select! {
        prepared = prepare(binary, config, args, scratch, nats) => prepared?,
        _ = tokio::signal::ctrl_c() => anyhow::bail!("interrupted"),
    };
    let service = Served::start(binary, config).await?;
    let outcome = tokio::select! {
        outcome = measure(binary, config, &service, args, scratch, &ledger, build) => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    };
    eprintln!("bench: audit: stopping the service");
    let usage = service.stop().await;
    let mut report = outcome?;
    report.service = Some(usage?);
    Ok(report)
}

/// What the generated ledger holds, to check pages against: the org and container
/// indexes below are those of [`Ledger::org_id`] and [`Ledger::container_id`].
struct Ledger {
    orgs: usize,
    head: i64,
    /// Events of each org; `org_big` last.
    org_events: Vec<u64>,
    /// The last position of each org: a cursor before it has a non-empty page.
    org_last: Vec<i64>,
    /// Events of each container: the orgs' in order, `org_big`'s last.
    container_events: Vec<u32>,
}

impl Ledger {
    fn big(&self) -> usize {
        self.orgs
    }

    fn org_id(&self, org: usize) -> String {
        if org == self.big() {
            BIG_ORG.to_owned()
        } else {
            format!("org_{org}")
        }
    }

    fn containers(&self, org: usize) -> std::ops::Range<usize> {
        if org == self.big() {
            let first = self.orgs * CONTAINERS_PER_ORG;
            first..first + BIG_CONTAINERS
        } else {
            org * CONTAINERS_PER_ORG..(org + 1) * CONTAINERS_PER_ORG
        }
    }

    /// The org of a container index, and the container's id.
    fn container(&self, container: usize) -> (usize, String) {
        let big_first = self.orgs * CONTAINERS_PER_ORG;
        if container >= big_first {
            (self.big(), format!("ctr_big_{}", container - big_first))
        } else {
            let org = container / CONTAINERS_PER_ORG;
            (org, format!("ctr_{org}_{}", container % CONTAINERS_PER_ORG))
        }
    }
}

/// One container event as a producer would send it: mostly commands, the lifecycle around
/// them. The ledger takes events in any lifecycle order, and audit reads them as stored, so
/// the order within a container is left to chance.
fn event_body(
    rng: &mut impl Rng,
    org_id: &str,
    container_id: &str,
    occurred_at: DateTime<Utc>,
) -> String {
    let event_type = match rng.random_range(0..100) {
        0..=9 => "container.created",
        10..=69 => "container.command_ran",
        70..=79 => "container.stopped",
        80..=89 => "container.resumed",
        _ => "container.port_published",
    };
    let data = container_data(rng, event_type, container_id);
    envelope(org_id, container_id, event_type, occurred_at, data)
}

/// What building the ledger took; not a measurement of the service.
struct Build {
    copy: Duration,
    vacuum: Duration,
    /// Bytes of the table and of its indexes, over all its partitions.
    table_bytes: i64,
    index_bytes: i64,
    /// The monthly partitions that hold rows, each with its row count, in month order.
    partitions: Vec<(String, i64)>,
}

/// Generates the ledger chunk by chunk into `COPY`, vacuums and analyzes it, and seeds the
/// ledger stream so that the relay starts caught up.
async fn prepare(
    binary: &std::path::Path,
    config: &Config,
    args: &AuditArgs,
    scratch: &Scratch,
    nats: &jetstream::Context,
) -> anyhow::Result<(Ledger, Build)> {
    // Migrates the scratch database; the service later finds it migrated.
    child::run_cli(binary, config, &["migrate"]).await?;
    let mut connection = PgConnection::connect(&scratch.database_url)
        .await
        .context("cannot connect to the scratch database")?;
    let orgs = args.audit_orgs;
    let containers = orgs * CONTAINERS_PER_ORG + BIG_CONTAINERS;
    let mut ledger = Ledger {
        orgs,
        head: 0,
        org_events: vec![0; orgs + 1],
        org_last: vec![0; orgs + 1],
        container_events: vec![0; containers],
    };
    let now_ms = Utc::now().timestamp_millis();
    let start_ms = now_ms - HISTORY_DAYS * 24 * 60 * 60 * 1000;
    let span_ms = i128::from(now_ms - HISTORY_END_MARGIN_MS - start_ms);
    let total = args.audit_events;
    let mut rng = rand::rng();
    let mut generated = 0_usize;
    eprintln!("bench: audit: writing {total} events into the ledger with COPY");
    let started = Instant::now();
    let head = {
        let ledger = &mut ledger;
        let history_from = DateTime::from_timestamp_millis(start_ms).expect("a recent instant");
        copy_into_ledger(&mut connection, config, history_from, || {
            if generated == total {
                return None;
            }
            let chunk_events = COPY_CHUNK_EVENTS.min(total - generated);
            let mut chunk = Vec::with_capacity(chunk_events);
            for _ in 0..chunk_events {
                // Evenly over the history, in position order, as a live ledger grows.
                let offset_ms = i128::try_from(generated).expect("fits") * span_ms
                    / i128::try_from(total).expect("fits");
                let occurred_at = DateTime::from_timestamp_millis(
                    start_ms + i64::try_from(offset_ms).expect("within the history"),
                )
                .expect("recent instants")
                .trunc_subsecs(3);
                let org = if rng.random_ratio(1, BIG_ONE_IN) {
                    ledger.big()
                } else {
                    rng.random_range(0..orgs)
                };
                let container = rng.random_range(ledger.containers(org));
                let (_, container_id) = ledger.container(container);
                generated += 1;
                let position = i64::try_from(generated).expect("fits");
                ledger.org_events[org] += 1;
                ledger.org_last[org] = position;
                ledger.container_events[container] += 1;
                let body = event_body(&mut rng, &ledger.org_id(org), &container_id, occurred_at);
                let recorded_at = occurred_at + chrono::Duration::milliseconds(RECORDED_DELAY_MS);
                chunk.push((body, recorded_at));
                if generated.is_multiple_of(PROGRESS_EVENTS) {
                    eprintln!(
                        "bench: audit: {generated} events after {:.0} s",
                        started.elapsed().as_secs_f64()
                    );
                }
            }
            Some(chunk)
        })
        .await?
    };
    let copy = started.elapsed();
    anyhow::ensure!(
        head == i64::try_from(total)?,
        "COPY wrote {head} events of {total}"
    );
    ledger.head = head;
    // A ledger that has been live for a year has been vacuumed and analyzed; pages should
    // not pay for setting the hint bits of freshly loaded rows.
    let started = Instant::now();
    sqlx::query("VACUUM (ANALYZE) ledger")
        .execute(&mut connection)
        .await?;
    checkpoint(&mut connection).await;
    let vacuum = started.elapsed();
    // A partitioned table's own sizes are 0: its partitions are in `pg_partition_tree`.
    let (table_bytes, index_bytes): (i64, i64) = sqlx::query_as(
        "SELECT sum(pg_table_size(relid))::bigint, sum(pg_indexes_size(relid))::bigint \
         FROM pg_partition_tree('ledger')",
    )
    .fetch_one(&mut connection)
    .await?;
    let partitions: Vec<(String, i64)> = sqlx::query_as(
        "SELECT tableoid::regclass::text, count(*) FROM ledger GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(&mut connection)
    .await?;
    eprintln!(
        "bench: audit: COPY of {head} events took {:.1} s, VACUUM (ANALYZE) and CHECKPOINT \
         {:.1} s; table {:.2} GB, indexes {:.2} GB",
        copy.as_secs_f64(),
        vacuum.as_secs_f64(),
        gigabytes(table_bytes),
        gigabytes(index_bytes)
    );
    seed_ledger_stream(&mut connection, nats, scratch, head).await?;
    // The projection is not what this part measures: the projector starts at the head, as
    // if it had kept up all along, instead of folding the whole ledger while pages are
    // timed. Its tables stay empty; the appended events are projected as usual.
    sqlx::query(&format!("UPDATE {LIVE}.checkpoint SET position = $1"))
        .bind(head)
        .execute(&mut connection)
        .await?;
    connection.close().await?;
    Ok((
        ledger,
        Build {
            copy,
            vacuum,
            table_bytes,
            index_bytes,
            partitions,
        },
    ))
}

fn gigabytes(bytes: i64) -> f64 {
    bytes as f64 / 1e9
}

/// An audit page as the API answers it; only what the checks need.
#[derive(Debug, Deserialize)]
struct Page {
    events: Vec<PageEvent>,
    next_after: i64,
}

#[derive(Debug, Deserialize)]
struct PageEvent {
    position: i64,
    org_id: String,
    container_id: Option<String>,
}

/// One page asked for, and what came back.
#[derive(Debug, Clone)]
struct Asked {
    org: usize,
    /// A container index for a container page.
    container: Option<usize>,
    after: i64,
    events: usize,
    next_after: i64,
}

/// What was wrong with the pages, counted, with the first instance described.
#[derive(Debug, Default)]
struct Problems {
    count: usize,
    first: Option<String>,
}

impl Problems {
    fn add(&mut self, problem: String) {
        self.count += 1;
        self.first.get_or_insert(problem);
    }

    fn describe(&self) -> String {
        match &self.first {
            None => String::new(),
            Some(first) => format!("; {} problems, first: {first}", self.count),
        }
    }
}

/// A random org page: one in [`BIG_PAGE_ONE_IN`] of `org_big`, the others of any org, each
/// after a cursor anywhere before the org's last event, so that the page is not empty.
fn random_org_page(rng: &mut impl Rng, ledger: &Ledger) -> (usize, i64) {
    let org = if rng.random_ratio(1, BIG_PAGE_ONE_IN) {
        ledger.big()
    } else {
        rng.random_range(0..ledger.orgs)
    };
    (org, rng.random_range(0..ledger.org_last[org]))
}

/// Checks what can be checked from the page alone: non-empty, at most a page, strictly
/// after the cursor in position order, of the org (and container) asked for, and a
/// `next_after` at its last event.
fn check_page(
    ledger: &Ledger,
    asked: &Asked,
    page: &Page,
    container_id: Option<&str>,
) -> Option<String> {
    let org_id = ledger.org_id(asked.org);
    let what = || match container_id {
        Some(container_id) => format!("the page of {container_id}"),
        None => format!("the page of {org_id} after {}", asked.after),
    };
    if page.events.is_empty() || page.events.len() > PAGE_EVENTS {
        return Some(format!("{} holds {} events", what(), page.events.len()));
    }
    let mut previous = asked.after;
    for event in &page.events {
        if event.position <= previous {
            return Some(format!(
                "{} has position {} after {previous}",
                what(),
                event.position
            ));
        }
        previous = event.position;
        if event.org_id != org_id {
            return Some(format!("{} holds an event of {}", what(), event.org_id));
        }
        if container_id.is_some() && event.container_id.as_deref() != container_id {
            return Some(format!(
                "{} holds an event of {:?}",
                what(),
                event.container_id
            ));
        }
    }
    (page.next_after != previous).then(|| {
        format!(
            "{} has next_after {} but ends at {previous}",
            what(),
            page.next_after
        )
    })
}

async fn measure(
    binary: &std::path::Path,
    config: &Config,
    service: &Served,
    args: &AuditArgs,
    scratch: &Scratch,
    ledger: &Ledger,
    build: Build,
) -> anyhow::Result<Report> {
    let months: Vec<String> = build
        .partitions
        .iter()
        .map(|(partition, rows)| format!("{partition} {rows}"))
        .collect();
    let mut checks = vec![Check {
        description: format!(
            "the ledger has rows in {} monthly partitions (at least {PARTITIONS_MIN}): {}",
            build.partitions.len(),
            months.join(", ")
        ),
        passed: build.partitions.len() >= PARTITIONS_MIN
            && build.partitions.iter().map(|(_, rows)| rows).sum::<i64>() == ledger.head,
    }];
    let build_line = Line {
        figure: Figure::new(
            "ledger written with COPY (not timed)",
            usize::try_from(ledger.head)?,
            build.copy,
        )
        .with_note(format!(
            "generated, parsed and chained in chunks of {COPY_CHUNK_EVENTS} while COPY ran; \
             then VACUUM (ANALYZE) and CHECKPOINT {:.1} s; table {:.2} GB, indexes {:.2} GB, \
             in {} monthly partitions",
            build.vacuum.as_secs_f64(),
            gigabytes(build.table_bytes),
            gigabytes(build.index_bytes),
            build.partitions.len()
        )),
        target: "-".to_owned(),
    };
    let pages = measure_pages(service, args, scratch, ledger, &mut checks).await?;
    let direct = measure_direct(service, &pages, ledger).await?;
    let verification =
        measure_verify(binary, config, service, scratch, ledger, &mut checks).await?;
    let replay =
        measure_replay(binary, config, service, build.partitions.len(), &mut checks).await?;
    Ok(Report {
        build: build_line,
        org_pages: pages.org_line,
        container_pages: pages.container_line,
        direct,
        verification,
        replay,
        checks,
        service: None,
    })
}

/// The timed pages and what they asked for.
struct Pages {
    org_line: Line,
    container_line: Line,
    org_asked: Vec<Asked>,
    container_asked: Vec<Asked>,
}

/// Org pages and container pages, alternately on one keep-alive connection, so that both
/// see the same conditions; each page checked on its own while timing stops, and against
/// the ledger after the phase.
async fn measure_pages(
    service: &Served,
    args: &AuditArgs,
    scratch: &Scratch,
    ledger: &Ledger,
    checks: &mut Vec<Check>,
) -> anyhow::Result<Pages> {
    let requests = args.audit_requests;
    let mut connection =
        HttpConnection::open(service.address, "/v1/events", &scratch.token).await?;
    let mut rng = rand::rng();
    eprintln!("bench: audit: {WARMUP_REQUESTS} + {requests} org pages and as many container pages");
    let mut org_latencies = Vec::with_capacity(requests);
    let mut big_latencies = Vec::new();
    let mut container_latencies = Vec::with_capacity(requests);
    let mut org_asked = Vec::with_capacity(requests);
    let mut container_asked = Vec::with_capacity(requests);
    let mut problems = Problems::default();
    // Container pages are asked of containers that have events: on a small ledger some of
    // `org_big`'s containers (one event in a hundred over 500 of them) have none, and an
    // empty page is what the check below treats as a fault.
    let with_events: Vec<usize> = (0..ledger.container_events.len())
        .filter(|&container| ledger.container_events[container] > 0)
        .collect();
    anyhow::ensure!(!with_events.is_empty(), "no container has an event");
    for round in 0..WARMUP_REQUESTS + requests {
        let measured = round >= WARMUP_REQUESTS;

        let (org, after) = random_org_page(&mut rng, ledger);
        let uri: hyper::Uri = format!(
            "/v1/events?org_id={}&after={after}&limit={PAGE_EVENTS}",
            ledger.org_id(org)
        )
        .parse()?;
        let sent = Instant::now();
        let answer = connection.get(&uri).await?;
        let latency = sent.elapsed();
        let page: Page = serde_json::from_slice(&answer).context("an org page does not parse")?;
        let asked = Asked {
            org,
            container: None,
            after,
            events: page.events.len(),
            next_after: page.next_after,
        };
        if let Some(problem) = check_page(ledger, &asked, &page, None) {
            problems.add(problem);
        }
        if measured {
            org_latencies.push(latency);
            if org == ledger.big() {
                big_latencies.push(latency);
            }
            org_asked.push(asked);
        }

        let container = with_events[rng.random_range(0..with_events.len())];
        let (org, container_id) = ledger.container(container);
        let uri: hyper::Uri =
            format!("/v1/containers/{container_id}/events?limit={PAGE_EVENTS}").parse()?;
        let sent = Instant::now();
        let answer = connection.get(&uri).await?;
        let latency = sent.elapsed();
        let page: Page =
            serde_json::from_slice(&answer).context("a container page does not parse")?;
        let asked = Asked {
            org,
            container: Some(container),
            after: 0,
            events: page.events.len(),
            next_after: page.next_after,
        };
        if let Some(problem) = check_page(ledger, &asked, &page, Some(&container_id)) {
            problems.add(problem);
        }
        // The ledger says exactly how long a container's first page is.
        let expected = PAGE_EVENTS.min(ledger.container_events[container] as usize);
        if page.events.len() != expected {
            problems.add(format!(
                "the page of {container_id} holds {} events, expected {expected}",
                page.events.len()
            ));
        }
        if measured {
            container_latencies.push(latency);
            container_asked.push(asked);
        }
    }

    // Every org page must be the org's events right after the cursor, none left out: as
    // many in the ledger between the cursor and `next_after`, and a short page only at the
    // org's end.
    eprintln!("bench: audit: checking the pages against the ledger");
    for asked in &org_asked {
        let org_id = ledger.org_id(asked.org);
        let (between, beyond): (i64, bool) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM ledger WHERE org_id = $1 AND position > $2 \
                 AND position <= $3), \
             EXISTS (SELECT 1 FROM ledger WHERE org_id = $1 AND position > $3)",
        )
        .bind(&org_id)
        .bind(asked.after)
        .bind(asked.next_after)
        .fetch_one(&service.pool)
        .await?;
        if between != asked.events as i64 || (asked.events < PAGE_EVENTS && beyond) {
            problems.add(format!(
                "the page of {org_id} after {} holds {} events up to {}; the ledger has \
                 {between} there{}",
                asked.after,
                asked.events,
                asked.next_after,
                if beyond { " and more after" } else { "" }
            ));
        }
    }
    let big_pages = big_latencies.len();
    let full_pages = org_asked
        .iter()
        .filter(|asked| asked.events == PAGE_EVENTS)
        .count();
    checks.push(Check {
        description: format!(
            "{} org pages ({big_pages} of {BIG_ORG}, {full_pages} full) and {} container pages \
             non-empty, in position order after the cursor, of the org or container asked \
             for, with next_after at the last event, and equal to the ledger's events there{}",
            org_asked.len(),
            container_asked.len(),
            problems.describe()
        ),
        passed: problems.count == 0,
    });

    let total = |latencies: &[Duration]| latencies.iter().sum::<Duration>();
    let mean_events = |asked: &[Asked]| {
        asked.iter().map(|asked| asked.events).sum::<usize>() as f64 / asked.len() as f64
    };
    let page_line = |figure: Figure| {
        let met = figure
            .latency_ms
            .is_some_and(|(_, p99)| p99 <= TARGET_PAGE_P99_MS);
        Line {
            figure,
            target: format!("p99 ≤ {TARGET_PAGE_P99_MS} ms: {}", verdict(met)),
        }
    };
    let big_note = if big_latencies.is_empty() {
        String::new()
    } else {
        format!(
            "; {BIG_ORG}'s {big_pages}: p50 {:.2} ms, p99 {:.2} ms",
            percentile_ms(&big_latencies, 0.50),
            percentile_ms(&big_latencies, 0.99)
        )
    };
    let org_line = page_line(
        Figure::new(
            format!("GET /v1/events?org_id&after&limit={PAGE_EVENTS}"),
            org_asked.len(),
            total(&org_latencies),
        )
        .with_latencies(&org_latencies)
        .with_note(format!(
            "max {:.2} ms; {:.1} events a page; random cursor before the org's last \
             event{big_note}; one connection, sequential; load average {}",
            max_ms(&org_latencies),
            mean_events(&org_asked),
            load_average()
        )),
    );
    let container_line = page_line(
        Figure::new(
            format!("GET /v1/containers/{{id}}/events?limit={PAGE_EVENTS}"),
            container_asked.len(),
            total(&container_latencies),
        )
        .with_latencies(&container_latencies)
        .with_note(format!(
            "max {:.2} ms; {:.1} events a page; random container of {}; alternating with \
             the org pages",
            max_ms(&container_latencies),
            mean_events(&container_asked),
            ledger.container_events.len()
        )),
    );
    Ok(Pages {
        org_line,
        container_line,
        org_asked,
        container_asked,
    })
}

/// The same pages through the library's `read_filtered`, in the bench's own process and on
/// its own connections, without HTTP and JSON,
/// and the plan and buffers of one page of each kind, so that what the query costs and
/// what serving it costs can be told apart.
async fn measure_direct(
    service: &Served,
    pages: &Pages,
    ledger: &Ledger,
) -> anyhow::Result<[Line; 2]> {
    eprintln!("bench: audit: the same pages through read_filtered, without HTTP");
    let mut lines = Vec::new();
    for (asked, kind) in [
        (&pages.org_asked, "org"),
        (&pages.container_asked, "container"),
    ] {
        let mut latencies = Vec::with_capacity(asked.len());
        for page in asked {
            let org_id = ledger.org_id(page.org);
            let container_id = page
                .container
                .map(|container| ledger.container(container).1);
            let filter = Filter {
                org_id: container_id.is_none().then_some(org_id.as_str()),
                container_id: container_id.as_deref(),
                event_type: None,
            };
            let sent = Instant::now();
            let rows = read::read_filtered(&service.pool, &filter, page.after, PAGE_EVENTS).await?;
            latencies.push(sent.elapsed());
            anyhow::ensure!(
                rows.len() == page.events,
                "read_filtered found {} events where the API answered {}",
                rows.len(),
                page.events
            );
        }
        // The plan of the page at the median cursor, as a custom plan with its values.
        let median = &asked[asked.len() / 2];
        let plan = explain(service, ledger, median).await?;
        lines.push(Line {
            figure: Figure::new(
                format!("read_filtered alone, {kind} pages (library in the bench, no HTTP)"),
                asked.len(),
                latencies.iter().sum(),
            )
            .with_latencies(&latencies)
            .with_note(format!("max {:.2} ms; {plan}", max_ms(&latencies))),
            target: "-".to_owned(),
        });
    }
    let [org, container] = <[Line; 2]>::try_from(lines).ok().expect("two kinds");
    Ok([org, container])
}

/// `EXPLAIN (ANALYZE, BUFFERS)` of one page's statement, reduced to its scan, buffers and
/// time; the whole plan goes to stderr.
async fn explain(service: &Served, ledger: &Ledger, asked: &Asked) -> anyhow::Result<String> {
    let condition = match asked.container {
        Some(container) => format!("container_id = '{}'", ledger.container(container).1),
        None => format!("org_id = '{}'", ledger.org_id(asked.org)),
    };
    // The statement `read_filtered` builds, with the values in place of the parameters
    // (generated ids, nothing to quote).
    let statement = format!(
        "EXPLAIN (ANALYZE, BUFFERS) SELECT {} FROM ledger WHERE position > {} AND {condition} \
         ORDER BY position LIMIT {PAGE_EVENTS}",
        read::ROW_COLUMNS,
        asked.after
    );
    let lines: Vec<String> = sqlx::query_scalar(&statement)
        .fetch_all(&service.pool)
        .await?;
    eprintln!("bench: audit: {condition} after {}:", asked.after);
    for line in &lines {
        eprintln!("    {line}");
    }
    // The plan's nodes from the top, e.g. `Limit → Index Scan using … on ledger`.
    let nodes: Vec<&str> = lines
        .iter()
        .filter(|line| line.contains("(cost="))
        .map(|line| {
            let node = line.trim().trim_start_matches("->").trim_start();
            node.split("  (").next().unwrap_or(node)
        })
        .collect();
    let find = |needle: &str| {
        lines
            .iter()
            .find(|line| line.contains(needle))
            .map_or("", |line| line.trim())
    };
    Ok(format!(
        "plan of the median cursor: {}; {}; {}",
        nodes.join(" → "),
        find("Buffers:"),
        find("Execution Time")
    ))
}

/// A full pass over the ledger, then [`APPENDED_EVENTS`] appended over HTTP and an
/// incremental pass, which must check only those.
async fn measure_verify(
    binary: &std::path::Path,
    config: &Config,
    service: &Served,
    scratch: &Scratch,
    ledger: &Ledger,
    checks: &mut Vec<Check>,
) -> anyhow::Result<[Line; 3]> {
    eprintln!("bench: audit: full verification of {} events", ledger.head);
    let (full, full_ran) = verify_ledger(binary, config, false).await?;
    let full_elapsed = full_ran.elapsed;
    checks.push(Check {
        description: format!(
            "the full pass checked {} events from {} to head {}: {}",
            full.events_checked,
            full.from_position,
            full.head_position,
            full.problem.as_deref().unwrap_or("intact")
        ),
        passed: full.ok
            && full.from_position == 0
            && full.head_position == ledger.head
            && full.events_checked == u64::try_from(ledger.head)?,
    });
    let full_line = Line {
        figure: Figure::new(
            "tally verify, full pass",
            usize::try_from(full.events_checked)?,
            full_elapsed,
        )
        .with_note(format!(
            "tally verify, a child process (start-up included); one streamed statement; every \
             hash recomputed from the stored columns; {}",
            ran_note(&full_ran)
        )),
        target: "-".to_owned(),
    };

    eprintln!("bench: audit: appending {APPENDED_EVENTS} events over HTTP");
    let bodies = appended_bodies(ledger);
    let endpoint = Endpoint {
        addresses: vec![service.address],
        url: "/v1/events".to_owned(),
        token: scratch.token.clone(),
    };
    let posted = endpoint
        .post_all(&std::sync::Arc::new(bodies), APPEND_CLIENTS)
        .await?;
    let expected_head = ledger.head + i64::try_from(APPENDED_EVENTS)?;
    // Every answer came after its commit, so the head is already there.
    let head = ledger_head(&service.pool).await?;
    anyhow::ensure!(
        head == expected_head,
        "the ledger head is {head} after the append, expected {expected_head}"
    );
    let append_line = Line {
        figure: Figure::new(
            format!(
                "HTTP append, batches of {}, {APPEND_CLIENTS} clients",
                tally::config::BATCH_EVENTS_MAX
            ),
            APPENDED_EVENTS,
            posted.elapsed,
        )
        .with_latencies(&posted.latencies)
        .with_note("the events the incremental pass checks".to_owned()),
        target: "-".to_owned(),
    };

    eprintln!("bench: audit: incremental verification");
    let (incremental, incremental_ran) = verify_ledger(binary, config, true).await?;
    let incremental_elapsed = incremental_ran.elapsed;
    checks.push(Check {
        description: format!(
            "the incremental pass started at the full pass's head {} and checked {} events to \
             {}: {}",
            incremental.from_position,
            incremental.events_checked,
            incremental.head_position,
            incremental.problem.as_deref().unwrap_or("intact")
        ),
        passed: incremental.ok
            && incremental.from_position == ledger.head
            && incremental.head_position == expected_head
            && incremental.events_checked == APPENDED_EVENTS as u64,
    });
    let only_new = incremental.events_checked == APPENDED_EVENTS as u64;
    let incremental_line = Line {
        figure: Figure::new(
            "tally verify --incremental after the append",
            usize::try_from(incremental.events_checked)?,
            incremental_elapsed,
        )
        .with_note(format!(
            "{:.1} ms in all, process start-up and checkpoint row included; the full pass \
             would take ≈ {:.1} s now; {}",
            incremental_elapsed.as_secs_f64() * 1000.0,
            full_elapsed.as_secs_f64() * expected_head as f64 / ledger.head as f64,
            ran_note(&incremental_ran)
        )),
        target: format!("checks only the new rows: {}", verdict(only_new)),
    };
    // So that the projector is idle when the service stops.
    wait_for_projection(&service.pool, expected_head).await?;
    Ok([full_line, append_line, incremental_line])
}

/// `tally replay` of the whole ledger (after the append), while the service runs on.
async fn measure_replay(
    binary: &std::path::Path,
    config: &Config,
    service: &Served,
    partitions: usize,
    checks: &mut Vec<Check>,
) -> anyhow::Result<Line> {
    let head = ledger_head(&service.pool).await?;
    eprintln!("bench: audit: replay of {head} events");
    let replayed = crate::replay(binary, config).await?;
    checks.push(Check {
        description: format!(
            "replay read {} events up to position {}; the ledger's head is {head}",
            replayed.events, replayed.position
        ),
        passed: replayed.events == u64::try_from(head)? && replayed.position == head,
    });
    let meets = u128::from(replayed.events) * 1_000_000
        >= u128::from(REPLAY_TARGET_EVENTS_PER_SECOND) * replayed.elapsed.as_micros();
    Ok(Line {
        figure: Figure::new(
            format!("tally replay, {} containers", replayed.containers),
            usize::try_from(replayed.events)?,
            replayed.elapsed,
        )
        .with_note(format!(
            "replay's own time, over {partitions} monthly partitions; the process took {:.2} s \
             in all, {}",
            replayed.ran.elapsed.as_secs_f64(),
            ran_note(&replayed.ran)
        )),
        target: format!(
            "≥ {REPLAY_TARGET_EVENTS_PER_SECOND} events/s: {}",
            verdict(meets)
        ),
    })
}

/// Batches of new events on the ledger's containers, each occurred a moment ago.
fn appended_bodies(ledger: &Ledger) -> Vec<Bytes> {
    let mut rng = rand::rng();
    let now = Utc::now();
    let events: Vec<String> = (0..APPENDED_EVENTS)
        .map(|_| {
            let container = rng.random_range(0..ledger.container_events.len());
            let (org, container_id) = ledger.container(container);
            event_body(&mut rng, &ledger.org_id(org), &container_id, now)
        })
        .collect();
    events
        .chunks(tally::config::BATCH_EVENTS_MAX)
        .map(|chunk| Bytes::from(format!("{{\"events\":[{}]}}", chunk.join(","))))
        .collect()
}

/// Everything the audit table prints.
struct Report {
    build: Line,
    org_pages: Line,
    container_pages: Line,
    direct: [Line; 2],
    verification: [Line; 3],
    replay: Line,
    checks: Vec<Check>,
    /// The `tally serve` child's, over the pages, the append and its projection.
    service: Option<child::ProcessUsage>,
}

impl Report {
    fn print(&self, args: &AuditArgs, database_url: &str, scratch: &Scratch) {
        println!();
        println!(
            "tally-bench, audit and verification: Postgres {database_url} (scratch database {}); \
             ledger of {} events over {HISTORY_DAYS} days, {} orgs of {CONTAINERS_PER_ORG} \
             containers and {BIG_ORG} of {BIG_CONTAINERS} with 1 in {BIG_ONE_IN} events",
            scratch.database_name, args.audit_events, args.audit_orgs,
        );
        println!();
        let lines = [&self.build, &self.org_pages, &self.container_pages]
            .into_iter()
            .chain(&self.direct)
            .chain(&self.verification)
            .chain([&self.replay]);
        print_lines(lines, self.service, &self.checks);
    }
}
