//! `tally periods`: finance periods.

use std::process::ExitCode;

use crate::config::Config;
use crate::ledger::db;

/// `tally periods close YYYY-MM`: the same close as the HTTP job, run to its end here.
pub async fn close(config: &Config, period: &str) -> anyhow::Result<ExitCode> {
    use crate::finance::periods::{self, CloseError, JobStatus, Start};
    let period = crate::runtime::Period::parse(period)?;
    let pool = db::prepare(config).await?;
    // No projector runs here: every event acknowledged before now goes in the snapshot.
    super::to_head(&pool, config).await?;
    let started = periods::start(
        &pool,
        period,
        config.clock.now(),
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
