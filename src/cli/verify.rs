//! `tally verify`: recomputes the ledger's hash chain, and with `--stream` compares every row
//! with its `TALLY_LEDGER` message.

use std::process::ExitCode;

use crate::config::Config;
use crate::ledger::{db, verify};

/// `tally verify [--incremental] [--stream]`: exit 0 when intact, 1 when broken.
pub async fn run(config: &Config, incremental: bool, stream: bool) -> anyhow::Result<ExitCode> {
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
