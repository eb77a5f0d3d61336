//! `tally replay`: rebuilds every projection from the ledger.

use std::process::ExitCode;

use sqlx::Connection;

use crate::config::Config;
use crate::ledger::db;

/// `tally replay`.
pub async fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    // Two connections of their own, with the pool's settings, whatever the pool's size.
    let options = pool.connect_options();
    let mut connection = db::connect_one(&options).await?;
    let mut helper = db::connect_one(&options).await?;
    let report = crate::projection::replay(&mut connection, &mut helper).await?;
    connection.close().await?;
    helper.close().await?;
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
