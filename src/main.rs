//! The `tally` binary: parse the command line, set up telemetry, run the subcommand.

use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = tally::cli::Cli::parse();
    tally::telemetry::init_logs();
    match tally::cli::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "tally failed");
            eprintln!("tally: {error:#}");
            ExitCode::from(2)
        }
    }
}
