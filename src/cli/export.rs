//! `tally export`: finance exports to standard output.

use std::process::ExitCode;

use crate::config::Config;
use crate::ledger::db;

/// `tally export usage --period YYYY-MM [--format csv|json]`, to standard output.
pub async fn usage(config: &Config, period: &str, format: &str) -> anyhow::Result<ExitCode> {
    use futures::StreamExt;
    use std::io::Write;
    // A caller's mistake exits 1, as the API's 422; 2 is for an export that could not run.
    let refused = |why: String| {
        eprintln!("tally: {why}");
        Ok(ExitCode::from(1))
    };
    let period = match crate::runtime::Period::parse(period) {
        Ok(period) => period,
        Err(error) => return refused(format!("--period {period:?}: {error}")),
    };
    if period.start() > chrono::Utc::now() {
        return refused(format!(
            "--period {period}: has not begun; it has no usage to export"
        ));
    }
    let json = match format {
        "csv" => false,
        "json" => true,
        other => return refused(format!("--format {other:?}: csv or json")),
    };
    let pool = db::prepare(config).await?;
    // No projector runs here: every event acknowledged before now is projected first.
    super::to_head(&pool, config).await?;
    let as_of = chrono::Utc::now().min(period.end());
    let batch_orgs = i64::from(config.finance_batch_orgs);
    let export =
        crate::finance::export::usage_export(&pool, period, as_of, batch_orgs, None).await?;
    eprintln!("position {}", export.position);
    let mut parts = std::pin::pin!(export.parts);
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if !json {
        writeln!(out, "{}", crate::finance::pricing::USAGE_CSV_HEADER)?;
    }
    while let Some(part) = parts.next().await {
        match part? {
            crate::finance::export::Part::Rows(rows) => {
                for row in rows {
                    if json {
                        writeln!(out, "{}", row.json())?;
                    } else {
                        write!(out, "{}", row.csv())?;
                    }
                }
            }
            crate::finance::export::Part::Adjustments(adjustments) => {
                for adjustment in adjustments {
                    if json {
                        writeln!(out, "{}", adjustment.json())?;
                    } else {
                        write!(out, "{}", adjustment.delta.csv())?;
                    }
                }
            }
        }
    }
    out.flush()?;
    drop(out);
    pool.close().await;
    Ok(ExitCode::SUCCESS)
}
