//! The `tally-bench` binary: the configuration as `tally` reads it (`DATABASE_URL`,
//! `NATS_URL`, …), the bench's own options, then every part or those named by `--only`.

use std::process::ExitCode;

use clap::Parser;

/// The service's allocator: the bench runs the service in-process, and its figures are
/// meant to describe the `tally` binary, which uses mimalloc (see its `main.rs`).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "tally-bench",
    version,
    about = "Measure tally against raw Postgres and JetStream baselines (uses scratch databases)"
)]
struct Cli {
    #[command(flatten)]
    config: tally::config::Config,
    #[command(flatten)]
    args: tally_bench::BenchArgs,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    tally::telemetry::init_logs();
    match tally_bench::run(cli.config, cli.args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "tally-bench failed");
            eprintln!("tally-bench: {error:#}");
            ExitCode::from(2)
        }
    }
}
