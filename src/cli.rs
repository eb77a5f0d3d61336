//! The command line: `tally serve | migrate | verify | replay | audit | export | reports |
//! periods`.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;
use crate::ledger::{db, verify};
use crate::startup::Service;

#[derive(Debug, Parser)]
#[command(
    name = "tally",
    version,
    about = "An event-sourced usage and billing ledger"
)]
pub struct Cli {
    #[command(flatten)]
    pub config: Config,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Migrate, apply the JetStream streams, serve the API until SIGINT or SIGTERM.
    Serve,
    /// Create the database if needed and apply the migrations.
    Migrate,
    /// Recompute the ledger's hash chain: exit 0 when intact, 1 when broken.
    Verify {
        /// Only the rows after the last verified checkpoint (default: every row).
        #[arg(long)]
        incremental: bool,
        /// Also compare every row with its `TALLY_LEDGER` message (id, position, hash,
        /// content), which catches a rewrite that recomputed the chain (needs NATS_URL).
        #[arg(long)]
        stream: bool,
    },
    /// Rebuild every projection from the ledger (into fresh tables, then swapped in).
    Replay,
    /// Print ledger events as a readable timeline, filtered, in position order. Reads the
    /// ledger itself, so every acknowledged event: the head at the start goes to standard
    /// error as `# ledger head N`, and the timeline stops at it.
    Audit(crate::audit::AuditArgs),
    /// Finance exports to standard output.
    Export {
        #[command(subcommand)]
        command: ExportCommand,
    },
    /// Provider usage reports.
    Reports {
        #[command(subcommand)]
        command: ReportsCommand,
    },
    /// Finance periods.
    Periods {
        #[command(subcommand)]
        command: PeriodsCommand,
    },
}

#[derive(Debug, Subcommand)]
pub enum PeriodsCommand {
    /// Close a finished period (YYYY-MM) here, however long it takes, and print the closed
    /// period as JSON (`position`: the ledger position its snapshot reflects); an already
    /// closed period prints as it is. The projection is first brought to the ledger head, so
    /// every event recorded before the command is in the snapshot. Exit 1 when the period is
    /// still running or another process is closing it.
    Close { period: String },
}

#[derive(Debug, Subcommand)]
pub enum ExportCommand {
    /// Usage per org for a period, as CSV (`--format json` for JSON lines). The projection is
    /// first brought to the ledger head; the position the figures reflect goes to standard
    /// error as `position N`.
    Usage {
        #[arg(long)]
        period: String,
        #[arg(long, default_value = "csv")]
        format: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ReportsCommand {
    /// Import a FOCUS CSV report (streamed; all-or-nothing; the same bytes again find the
    /// same report). Prints the report as JSON.
    Import {
        /// The CSV file; `-` reads standard input.
        file: std::path::PathBuf,
    },
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let config = &cli.config;
    match cli.command {
        Command::Serve => {
            Service::start(cli.config).await?.run_until_signal().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate => {
            let pool = db::prepare(config).await?;
            pool.close().await;
            println!("migrated");
            Ok(ExitCode::SUCCESS)
        }
        Command::Verify {
            incremental,
            stream,
        } => verify_ledger(config, incremental, stream).await,
        Command::Replay => replay(config).await,
        Command::Audit(args) => {
            let pool = db::prepare(config).await?;
            let (mut out, mut notes) = (std::io::stdout(), std::io::stderr());
            let printed = crate::audit::print_timeline(&pool, &args, &mut out, &mut notes).await;
            pool.close().await;
            printed?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Export {
            command: ExportCommand::Usage { period, format },
        } => export_usage(config, &period, &format).await,
        Command::Reports {
            command: ReportsCommand::Import { file },
        } => import_report(config, &file).await,
        Command::Periods {
            command: PeriodsCommand::Close { period },
        } => close_period(config, &period).await,
    }
}

/// `tally verify [--incremental] [--stream]`: exit 0 when intact, 1 when broken.
async fn verify_ledger(
    config: &Config,
    incremental: bool,
    stream: bool,
) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    let mut report = if incremental {
        verify::verify_incremental(&pool).await?
    } else {
        verify::verify(&pool).await?
    };
    if stream {
        let names = crate::bus::Names::new(&config.nats_namespace)?;
        let client = crate::bus::connect(&config.nats_url).await?;
        let context = crate::bus::jetstream(client);
        let compared = crate::bus::check::verify_stream(&pool, &context, &names).await?;
        report = report.with_stream(compared);
    }
    pool.close().await;
    println!("{}", serde_json::to_string_pretty(&report)?);
    match report.first_bad_position {
        None => {
            eprintln!("ledger intact: {} events checked", report.events_checked);
            Ok(ExitCode::SUCCESS)
        }
        Some(position) => {
            eprintln!(
                "ledger broken at position {position}: {}",
                report.problem.as_deref().unwrap_or("")
            );
            Ok(ExitCode::from(1))
        }
    }
}

/// `tally replay`.
async fn replay(config: &Config) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    let mut connection = pool.acquire().await?;
    let report = crate::projection::replay(&mut connection).await?;
    drop(connection);
    pool.close().await;
    println!(
        "replayed {} events ({} containers) up to position {} in {:.2} s: {:.0} events/s",
        report.events,
        report.containers,
        report.position,
        report.elapsed.as_secs_f64(),
        report.events_per_second()
    );
    Ok(ExitCode::SUCCESS)
}

/// `tally export usage --period YYYY-MM [--format csv|json]`, to standard output.
async fn export_usage(config: &Config, period: &str, format: &str) -> anyhow::Result<ExitCode> {
    use futures::StreamExt;
    use std::io::Write;
    let period = crate::runtime::Period::parse(period)?;
    let json = match format {
        "csv" => false,
        "json" => true,
        other => anyhow::bail!("--format {other:?}: csv or json"),
    };
    let pool = db::prepare(config).await?;
    // No projector runs here: every event acknowledged before now is projected first.
    to_head(&pool, config).await?;
    let as_of = chrono::Utc::now().min(period.end());
    let batch_orgs = i64::from(config.finance_batch_orgs);
    let export =
        crate::finance::export::usage_export(&pool, period, as_of, batch_orgs, None).await?;
    eprintln!("position {}", export.position);
    let mut parts = std::pin::pin!(export.parts);
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if !json {
        writeln!(out, "{}", crate::finance::pricing::USAGE_CSV_HEADER)?;
    }
    while let Some(part) = parts.next().await {
        match part? {
            crate::finance::export::Part::Rows(rows) => {
                for row in rows {
                    if json {
                        writeln!(out, "{}", row.json())?;
                    } else {
                        write!(out, "{}", row.csv())?;
                    }
                }
            }
            crate::finance::export::Part::Adjustments(adjustments) => {
                for adjustment in adjustments {
                    if json {
                        writeln!(out, "{}", adjustment.json())?;
                    } else {
                        write!(out, "{}", adjustment.delta.csv())?;
                    }
                }
            }
        }
    }
    out.flush()?;
    drop(out);
    pool.close().await;
    Ok(ExitCode::SUCCESS)
}

/// `tally reports import FILE|-`: exit 1 when the report is refused.
async fn import_report(config: &Config, file: &std::path::Path) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    let reader: Box<dyn tokio::io::AsyncRead + Unpin + Send> = if file.as_os_str() == "-" {
        Box::new(tokio::io::stdin())
    } else {
        Box::new(tokio::fs::File::open(&file).await?)
    };
    let chunks = tokio_util::io::ReaderStream::new(reader);
    let imported = crate::finance::reports::import(&pool, chunks, u64::MAX, "cli").await;
    pool.close().await;
    let (report, new) = match imported {
        Ok(crate::finance::reports::Imported::Created(report)) => (report, true),
        Ok(crate::finance::reports::Imported::Existing(report)) => (report, false),
        Err(error) => {
            eprintln!("import refused, nothing stored: {error}");
            return Ok(ExitCode::from(1));
        }
    };
    println!(
        "{}",
        serde_json::json!({
            "report_id": report.id, "lines": report.lines, "sha256": report.sha256,
            "window_start": crate::event::canonical::timestamp(report.window_start),
            "window_end": crate::event::canonical::timestamp(report.window_end),
            "new": new,
        })
    );
    Ok(ExitCode::SUCCESS)
}

/// Brings the projection to the ledger head taken now (see src/projection/catch_up.rs),
/// waiting at most `TALLY_READ_WAIT_MS` for a running service's projector.
async fn to_head(pool: &sqlx::PgPool, config: &Config) -> anyhow::Result<i64> {
    let wait = std::time::Duration::from_millis(config.read_wait_ms);
    Ok(crate::projection::catch_up::to_head(pool, config.projector_batch_max, wait).await?)
}

/// `tally periods close YYYY-MM`: the same close as the HTTP job, run to its end here.
async fn close_period(config: &Config, period: &str) -> anyhow::Result<ExitCode> {
    use crate::finance::periods::{self, CloseError, JobStatus, Start};
    let period = crate::runtime::Period::parse(period)?;
    let pool = db::prepare(config).await?;
    // No projector runs here: every event acknowledged before now goes in the snapshot.
    to_head(&pool, config).await?;
    let started = periods::start(
        &pool,
        period,
        chrono::Utc::now(),
        "cli",
        i64::from(config.finance_batch_orgs),
    )
    .await;
    let outcome = match started {
        Ok(Start::Claimed(claim)) => {
            eprintln!("closing {period} (job {})", claim.job.id);
            claim.run().await.map(|closed| Some(closed.json()))
        }
        Ok(Start::Existing(job)) if job.status == JobStatus::Done => {
            eprintln!("period {period} was already closed");
            Ok(job.closed.map(|closed| closed.json()))
        }
        Ok(Start::Existing(job)) => {
            eprintln!("period {period} is being closed by job {}", job.id);
            Ok(None)
        }
        Err(error) => Err(error),
    };
    pool.close().await;
    match outcome {
        Ok(Some(closed)) => {
            println!("{}", serde_json::to_string_pretty(&closed)?);
            Ok(ExitCode::SUCCESS)
        }
        Ok(None) => Ok(ExitCode::from(1)),
        Err(error @ (CloseError::Running(..) | CloseError::Starting(_))) => {
            eprintln!("{error}");
            Ok(ExitCode::from(1))
        }
        Err(error) => Err(anyhow::Error::new(error).context(format!("closing {period}"))),
    }
}
