//! The command line: `tally serve | migrate | verify | replay | audit | export | reports
//! (import, reconcile) | periods | openapi`. This module holds the clap definition and the dispatch; each
//! subcommand is a module of its own.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::config::Config;

pub mod audit;
pub mod export;
pub mod migrate;
pub mod periods;
pub mod replay;
pub mod reports;
pub mod serve;
pub mod verify;

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
    Audit(audit::AuditArgs),
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
    /// Print the OpenAPI document that `GET /openapi.json` serves, as JSON. Needs neither
    /// Postgres nor NATS.
    Openapi,
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
    /// Usage per org for a period, as CSV (`--format json` for JSON lines); a closed period
    /// as its close froze it. The projection is first brought to the ledger head; the
    /// position the figures reflect goes to standard error as `position N`.
    Usage {
        #[arg(long)]
        period: String,
        #[arg(long, default_value = "csv")]
        format: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum ReportsCommand {
    /// Import a FOCUS CSV report, plain or gzipped (streamed; all-or-nothing; the same
    /// CSV text again finds the same report). Prints the report as JSON; a refused report
    /// prints every bad line (up to 100) and the count of the rest on standard error.
    Import {
        /// The CSV file (gzip when its name ends in `.gz` or its bytes begin as gzip
        /// does); `-` reads standard input.
        file: std::path::PathBuf,
    },
    /// Reconcile a stored report with the ledger, here, however long it takes (over HTTP a
    /// reconciliation must end within `TALLY_REQUEST_TIMEOUT_MS`). The projection is first
    /// brought to the ledger head; prints what `POST /v1/reconciliations` answers, as JSON.
    /// Exit 1 when the report is unknown, a tolerance is out of its limits or the amounts
    /// cannot be reconciled (nothing is stored).
    Reconcile {
        report_id: String,
        /// Default 2000, at most 86 400 000.
        #[arg(long)]
        tolerance_ms: Option<u64>,
        /// A decimal from 0 to 1, read exactly; default 0.005.
        #[arg(long)]
        tolerance_ratio: Option<String>,
    },
}

pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let config = &cli.config;
    match cli.command {
        Command::Serve => serve::run(cli.config).await,
        Command::Migrate => migrate::run(config).await,
        Command::Verify {
            incremental,
            stream,
        } => verify::run(config, incremental, stream).await,
        Command::Replay => replay::run(config).await,
        Command::Audit(args) => audit::run(config, &args).await,
        Command::Export {
            command: ExportCommand::Usage { period, format },
        } => export::usage(config, &period, &format).await,
        Command::Reports {
            command: ReportsCommand::Import { file },
        } => reports::import(config, &file).await,
        Command::Reports {
            command:
                ReportsCommand::Reconcile {
                    report_id,
                    tolerance_ms,
                    tolerance_ratio,
                },
        } => reports::reconcile(config, &report_id, tolerance_ms, tolerance_ratio.as_deref()).await,
        Command::Periods {
            command: PeriodsCommand::Close { period },
        } => periods::close(config, &period).await,
        Command::Openapi => openapi(),
    }
}

/// `tally openapi`: the document, as the service serves it, on standard output.
fn openapi() -> anyhow::Result<ExitCode> {
    let document = serde_json::to_string_pretty(&crate::http::openapi())?;
    println!("{document}");
    Ok(ExitCode::SUCCESS)
}

/// Brings the projection to the ledger head taken now (see src/projection/catch_up.rs),
/// waiting at most `TALLY_READ_WAIT_MS` for a running service's projector: `export` and
/// `periods` run no projector of their own.
async fn to_head(pool: &sqlx::PgPool, config: &Config) -> anyhow::Result<i64> {
    let wait = std::time::Duration::from_millis(config.read_wait_ms);
    Ok(crate::projection::catch_up::to_head(pool, config.projector_batch_max, wait).await?)
}
