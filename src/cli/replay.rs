//! `tally replay`: rebuilds every projection from the ledger.

use std::process::ExitCode;

use crate::config::Config;
use crate::ledger::db;

/// `tally replay`.
pub async fn run(config: &Config) -> anyhow::Result<ExitCode> {
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
