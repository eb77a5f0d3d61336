//! `tally-bench --instances N`: the ingest part's workload (HTTP batches, single HTTP
//! events, NATS ingest) and the admission workload through one `tally serve` and then
//! through N of them on one database and one nats-server, side by side, with the ratio of
//! the N-instance figure to the one-instance figure. On a machine of two cores the point is
//! what coordination costs (the appenders take turns under one advisory lock, one relay and
//! one projector run at a time), not that more instances are faster.
//!
//! Each run has a scratch database and namespace of its own, removed at the end. The
//! instances start one after the other on the same database and namespace; HTTP clients
//! are spread over them round-robin (client `i` to instance `i % N`), and every instance
//! fetches from the one durable ingest consumer, so JetStream spreads the NATS messages.
//! Every check of the ingest part's ledger and streams (but the baseline tables', which
//! this part does not build) and of the admission answers holds for every run, also the
//! N-instance one; the run fails otherwise.
//!
//! Flow per run: generate the workload → start the instances → HTTP batches → single
//! events → NATS ingest → the ledger and stream checks and the storage per event → the
//! admission population, sample checks on every instance, closed-loop and paced checks →
//! stop the instances → the table of both runs.

use async_nats::jetstream;

use crate::admission::{self, Through};
use crate::child::{self, Served};
use crate::{
    ledger_checks, measured_then_cleaned, print_checks, print_table, wait_for_streams, BenchArgs,
    Check, Figure, GroupCommits, Phases, Scratch, Workload,
};
use tally::bus::Names;
use tally::config::Config;

/// Instances a run may start: each holds a pool of `TALLY_DB_POOL_MAX` connections and
/// its own appender, relay and projector connections, and eight already outnumber the
/// cores of any machine this bench runs on several times over.
pub(crate) const INSTANCES_MAX: usize = 8;

/// Fails unless `instances` is within 1..=[`INSTANCES_MAX`].
pub(crate) fn check_instances(instances: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=INSTANCES_MAX).contains(&instances),
        "--instances must be between 1 and {INSTANCES_MAX}, got {instances}"
    );
    Ok(())
}

/// One run's figures and checks.
struct Run {
    instances: usize,
    batch: Figure,
    single: Figure,
    nats: Figure,
    nats_batched: Figure,
    admission: Through,
    storage: Storage,
    /// Events each instance's appender committed during the ingest phases.
    appended: Vec<u64>,
    checks: Vec<Check>,
    /// Each instance's CPU time and peak memory over the ingest workload, then over the
    /// admission workload.
    usage: [Vec<child::ProcessUsage>; 2],
}

/// The rows of the table, one per [`Run::figures`].
const FIGURES: usize = 6;

impl Run {
    /// The table's rows, in order.
    fn figures(&self) -> [&Figure; FIGURES] {
        [
            &self.batch,
            &self.single,
            &self.nats,
            &self.nats_batched,
            &self.admission.closed,
            &self.admission.paced,
        ]
    }
}

/// The ingest workload's part of a run.
struct Ingested {
    batch: Figure,
    single: Figure,
    nats: Figure,
    nats_batched: Figure,
    storage: Storage,
    appended: Vec<u64>,
    checks: Vec<Check>,
}

/// Runs the workloads through one instance and, when `instances` is more, through that
/// many; prints both side by side.
pub(super) async fn run(
    binary: &std::path::Path,
    config: Config,
    args: &BenchArgs,
    instances: usize,
    nats: &jetstream::Context,
) -> anyhow::Result<()> {
    check_instances(instances)?;
    let counts: Vec<usize> = if instances == 1 {
        vec![1]
    } else {
        vec![1, instances]
    };
    let mut runs: Vec<Run> = Vec::with_capacity(counts.len());
    for count in counts {
        // The ingest workload's orgs and containers have the admission population's names,
        // so each workload has a database of its own, as the ingest and admission parts do.
        let mut ingest_config = config.clone();
        let (scratch, _) =
            Scratch::for_part(&format!("{count} instance(s), ingest"), &mut ingest_config)?;
        let workload = Workload::generate(&ingest_config, args)?;
        let (ingested, ingest_usage) = measured_then_cleaned(&scratch, nats, async {
            let services = start_all(binary, &ingest_config, count).await?;
            let outcome = interruptible(measure_ingest(
                binary,
                &ingest_config,
                args,
                &services,
                &scratch,
                &workload,
                nats,
            ))
            .await;
            let usage = stop_all(services).await;
            anyhow::Ok((outcome?, usage?))
        })
        .await?;
        removed(&scratch);

        let mut admission_config = config.clone();
        let (scratch, _) = Scratch::for_part(
            &format!("{count} instance(s), admission"),
            &mut admission_config,
        )?;
        // Both runs' admission checks are paced at the one-instance run's rate.
        let rate = runs.first().map(|run| run.admission.rate);
        let (admission, admission_usage) = measured_then_cleaned(&scratch, nats, async {
            let services = start_all(binary, &admission_config, count).await?;
            let outcome = interruptible(async {
                wait_for_streams(nats, &scratch.names).await?;
                admission::measure_through(&services, &scratch.token, &args.admission, rate).await
            })
            .await;
            let usage = stop_all(services).await;
            anyhow::Ok((outcome?, usage?))
        })
        .await?;
        removed(&scratch);

        let mut checks = ingested.checks;
        checks.extend(admission.checks.iter().map(|check| Check {
            description: check.description.clone(),
            passed: check.passed,
        }));
        runs.push(Run {
            instances: count,
            batch: ingested.batch,
            single: ingested.single,
            nats: ingested.nats,
            nats_batched: ingested.nats_batched,
            admission,
            storage: ingested.storage,
            appended: ingested.appended,
            checks,
            usage: [ingest_usage, admission_usage],
        });
    }
    print(&runs, args);
    anyhow::ensure!(
        runs.iter()
            .all(|run| run.checks.iter().all(|check| check.passed)),
        "a check of the instances part failed; see the table"
    );
    Ok(())
}

fn removed(scratch: &Scratch) {
    eprintln!(
        "bench: removed database {} and the {} streams",
        scratch.database_name, scratch.namespace
    );
}

/// Starts `count` instances on `config`'s database and namespace, one after the other:
/// the first migrates the scratch database, and an instance that fails to start fails the
/// run (the ones started are killed as they are dropped).
async fn start_all(
    binary: &std::path::Path,
    config: &Config,
    count: usize,
) -> anyhow::Result<Vec<Served>> {
    let mut services = Vec::with_capacity(count);
    for _ in 0..count {
        services.push(Served::start(binary, config).await?);
    }
    Ok(services)
}

/// `measure`, unless Ctrl-C comes first.
async fn interruptible<T>(
    measure: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::select! {
        outcome = measure => outcome,
        _ = tokio::signal::ctrl_c() => Err(anyhow::anyhow!("interrupted")),
    }
}

/// Stops every instance, whatever happened, so that no relay or consumer outlives the run
/// and recreates a stream after clean-up; each one's CPU time and peak memory.
async fn stop_all(services: Vec<Served>) -> anyhow::Result<Vec<child::ProcessUsage>> {
    eprintln!("bench: stopping {} instance(s)", services.len());
    let mut usage = Vec::with_capacity(services.len());
    let mut stopped = Ok(());
    for service in services {
        match service.stop().await {
            Ok(one) => usage.push(one),
            Err(error) => stopped = Err(error),
        }
    }
    stopped.map(|()| usage)
}

/// The ingest part's three phases through `services`, then each instance's appended
/// events, the ledger and stream checks, and the storage.
async fn measure_ingest(
    binary: &std::path::Path,
    config: &Config,
    args: &BenchArgs,
    services: &[Served],
    scratch: &Scratch,
    workload: &Workload,
    nats: &jetstream::Context,
) -> anyhow::Result<Ingested> {
    let phases = Phases::new(services, nats, scratch).await?;
    let figures = phases.ingest(workload, args).await?;
    let mut appended = Vec::with_capacity(services.len());
    for service in services {
        let commits = GroupCommits::of(std::slice::from_ref(service)).await?;
        appended.push(commits.events as u64);
    }
    eprintln!("bench: checking the ledger");
    let pool = &services[0].pool;
    let checks = ledger_checks(binary, config, pool, nats, &scratch.names, workload).await?;
    let storage = Storage::measure(pool, nats, &scratch.names).await?;
    Ok(Ingested {
        batch: figures.batch,
        single: figures.single,
        nats: figures.nats,
        nats_batched: figures.nats_batched,
        storage,
        appended,
        checks,
    })
}

/// What the ledger, the projection and the ledger stream hold, after the ingest phases.
struct Storage {
    events: i64,
    /// The ledger's heap, TOAST and maps, over every partition when it is partitioned.
    ledger_table_bytes: i64,
    ledger_index_bytes: i64,
    /// Every table of the projection's schema, with its indexes.
    projection_bytes: i64,
    stream_bytes: u64,
    stream_messages: u64,
}

impl Storage {
    async fn measure(
        pool: &sqlx::PgPool,
        nats: &jetstream::Context,
        names: &Names,
    ) -> anyhow::Result<Storage> {
        // A partitioned table's own sizes are 0 and its partitions are in
        // `pg_partition_tree`; a plain table's tree is empty.
        let (events, ledger_table_bytes, ledger_index_bytes): (i64, i64, i64) = sqlx::query_as(
            "WITH parts AS (SELECT 'ledger'::regclass::oid AS relid \
             UNION SELECT relid::oid FROM pg_partition_tree('ledger')) \
             SELECT (SELECT count(*) FROM ledger), \
                    sum(pg_table_size(relid))::bigint, sum(pg_indexes_size(relid))::bigint \
             FROM parts",
        )
        .fetch_one(pool)
        .await?;
        let projection_bytes: i64 = sqlx::query_scalar(
            "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::bigint FROM pg_class c \
             JOIN pg_namespace n ON n.oid = c.relnamespace \
             WHERE n.nspname = $1 AND c.relkind = 'r'",
        )
        .bind(tally::projection::store::LIVE)
        .fetch_one(pool)
        .await?;
        let mut stream = nats.get_stream(names.ledger_stream()).await?;
        let state = &stream.info().await?.state;
        Ok(Storage {
            events,
            ledger_table_bytes,
            ledger_index_bytes,
            projection_bytes,
            stream_bytes: state.bytes,
            stream_messages: state.messages,
        })
    }

    fn describe(&self) -> String {
        let per_event = |bytes: i64| bytes as f64 / self.events.max(1) as f64;
        format!(
            "{} events: ledger {:.0} B/event ({:.0} table and TOAST + {:.0} indexes), \
             projection tables {:.0} B/event (they grow with containers and ports, not \
             events); TALLY_LEDGER {:.0} B/message over {} messages",
            self.events,
            per_event(self.ledger_table_bytes + self.ledger_index_bytes),
            per_event(self.ledger_table_bytes),
            per_event(self.ledger_index_bytes),
            per_event(self.projection_bytes),
            self.stream_bytes as f64 / self.stream_messages.max(1) as f64,
            self.stream_messages
        )
    }
}

/// The figures of each run in columns, the ratio of the last run to the first after them,
/// then each run's notes, storage, instances and checks.
fn print(runs: &[Run], args: &BenchArgs) {
    let last = &runs[runs.len() - 1];
    println!();
    println!(
        "tally-bench, instances: the ingest workload ({} HTTP events in batches of {} from {} \
         clients, {} single events from {} clients, {} NATS messages and as many events in \
         messages of {}) and the admission \
         workload ({} orgs, {} checks) through 1{} tally serve on one database and one \
         nats-server; HTTP clients spread round-robin over the instances, NATS messages \
         fetched by each from the one ingest consumer",
        args.http_events,
        args.http_batch_events,
        args.http_batch_clients,
        args.single_events,
        args.single_clients,
        args.nats_events,
        args.nats_batch_events,
        args.admission.admission_orgs,
        args.admission.admission_checks,
        if runs.len() > 1 {
            format!(" and through {}", last.instances)
        } else {
            String::new()
        },
    );
    println!();
    let mut header = vec!["measurement".to_owned()];
    for run in runs {
        let name = instances_name(run.instances);
        header.push(format!("{name}: per second"));
        header.push(format!("{name}: p99 ms"));
    }
    if runs.len() > 1 {
        let ratio = format!("{} / 1", last.instances);
        header.push(format!("per second, {ratio}"));
        header.push(format!("p99, {ratio}"));
    }
    let figures: Vec<[&Figure; FIGURES]> = runs.iter().map(Run::figures).collect();
    let cells: Vec<Vec<String>> = (0..FIGURES)
        .map(|row| {
            let mut cells = vec![figures[0][row].label.clone()];
            for run in &figures {
                let figure = &run[row];
                cells.push(format!("{:.0}", figure.per_second()));
                cells.push(
                    figure
                        .latency_ms
                        .map_or("-".to_owned(), |(_, p99)| format!("{p99:.1}")),
                );
            }
            if runs.len() > 1 {
                let (one, many) = (&figures[0][row], &figures[figures.len() - 1][row]);
                cells.push(format!("{:.2}", many.per_second() / one.per_second()));
                cells.push(match (one.latency_ms, many.latency_ms) {
                    (Some((_, one)), Some((_, many))) => format!("{:.2}", many / one),
                    _ => "-".to_owned(),
                });
            }
            cells
        })
        .collect();
    let header: Vec<&str> = header.iter().map(String::as_str).collect();
    print_table(&header, &cells);
    println!();
    for (run, figures) in runs.iter().zip(&figures) {
        let name = instances_name(run.instances);
        for figure in figures {
            println!("- {name}, {}: {}", figure.label, figure.notes.join("; "));
        }
        println!("- {name}, storage: {}", run.storage.describe());
        let appended: Vec<String> = run.appended.iter().map(u64::to_string).collect();
        println!(
            "- {name}: events appended by each instance's appender during ingest: {}",
            appended.join(", ")
        );
        for (workload, usage) in ["ingest", "admission"].iter().zip(&run.usage) {
            let each: Vec<String> = usage
                .iter()
                .map(|usage| {
                    format!(
                        "{:.1} s CPU, peak RSS {:.0} MiB",
                        usage.cpu.as_secs_f64(),
                        usage.peak_mb
                    )
                })
                .collect();
            println!(
                "- {name}: each instance over the {workload} workload: {}",
                each.join("; ")
            );
        }
    }
    println!();
    for run in runs {
        println!("{}:", instances_name(run.instances));
        print_checks(&run.checks);
    }
}

fn instances_name(count: usize) -> String {
    if count == 1 {
        "1 instance".to_owned()
    } else {
        format!("{count} instances")
    }
}
