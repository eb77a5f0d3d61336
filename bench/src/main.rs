//! The `tally-bench` binary: the configuration as `tally` reads it (`DATABASE_URL`,
//! `NATS_URL`, …), the bench's own options, then every part or those named by `--only`.

use std::process::ExitCode;

use clap::Parser;

/// The `tally` binary's allocator (see its `main.rs`): the service itself runs as a child
/// process, but the lines marked "library in the bench" call the service's functions
/// (`admission::check`, the usage query, `read_filtered`, replay's parts, the report
/// parser) in this process, and they stand for those functions as the binary runs them.
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
        Ok(_) => ExitCode::SUCCESS,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "tally-bench failed");
            eprintln!("tally-bench: {error:#}");
            ExitCode::from(2)
        }
    }
}
