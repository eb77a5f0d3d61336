//! `tally serve`: the service, until SIGINT or SIGTERM.

use std::process::ExitCode;

use crate::config::Config;
use crate::startup::Service;

/// `tally serve`: migrates, applies the JetStream streams, serves until a signal.
pub async fn run(config: Config) -> anyhow::Result<ExitCode> {
    Service::start(config).await?.run_until_signal().await;
    Ok(ExitCode::SUCCESS)
}
