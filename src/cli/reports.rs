//! `tally reports`: provider usage reports.

use std::process::ExitCode;

use crate::config::Config;
use crate::ledger::db;

/// `tally reports import FILE|-`: exit 1 when the report is refused.
pub async fn import(config: &Config, file: &std::path::Path) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    let reader: Box<dyn tokio::io::AsyncRead + Unpin + Send> = if file.as_os_str() == "-" {
        Box::new(tokio::io::stdin())
    } else {
        Box::new(tokio::fs::File::open(&file).await?)
    };
    let chunks = tokio_util::io::ReaderStream::new(reader);
    let imported = crate::finance::reports::import(&pool, chunks, u64::MAX, "cli").await;
    pool.close().await;
    let (report, new) = match imported {
        Ok(crate::finance::reports::Imported::Created(report)) => (report, true),
        Ok(crate::finance::reports::Imported::Existing(report)) => (report, false),
        Err(error) => {
            eprintln!("import refused, nothing stored: {error}");
            return Ok(ExitCode::from(1));
        }
    };
    println!(
        "{}",
        serde_json::json!({
            "report_id": report.id, "lines": report.lines, "sha256": report.sha256,
            "window_start": crate::event::canonical::timestamp(report.window_start),
            "window_end": crate::event::canonical::timestamp(report.window_end),
            "new": new,
        })
    );
    Ok(ExitCode::SUCCESS)
}
