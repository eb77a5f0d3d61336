//! `tally migrate`: creates the database if needed and applies the migrations.

use std::process::ExitCode;

use crate::config::Config;
use crate::ledger::db;

/// `tally migrate`: prints `migrated` once the schema is current.
pub async fn run(config: &Config) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    pool.close().await;
    println!("migrated");
    Ok(ExitCode::SUCCESS)
}
