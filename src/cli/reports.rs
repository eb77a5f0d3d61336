//! `tally reports`: provider usage reports.

use std::process::ExitCode;

use crate::billing::report::reader::Refusal;
use crate::config::Config;
use crate::finance::reports::{self, Encoding, ImportError, Imported, Limits};
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
    // The operator's own file: no limit on its size, but the one on what gzip inflates to
    // holds, as over HTTP.
    let limits = Limits {
        max_bytes: u64::MAX,
        max_inflated_bytes: config.report_max_inflated_bytes,
    };
    let imported = reports::import(&pool, chunks, encoding(file), limits, "cli").await;
    pool.close().await;
    let (report, new) = match imported {
        Ok(Imported::Created(report)) => (report, true),
        Ok(Imported::Existing(report)) => (report, false),
        Err(ImportError::Invalid(refusal)) => {
            eprint!("{}", refused(&refusal));
            return Ok(ExitCode::from(1));
        }
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

/// A file named `.gz` is gzip; any other is gzip when its bytes begin as gzip does.
fn encoding(file: &std::path::Path) -> Encoding {
    let gz = file
        .extension()
        .is_some_and(|extension| extension.eq_ignore_ascii_case("gz"));
    if gz {
        Encoding::Gzip
    } else {
        Encoding::Detect
    }
}

/// The refusal as printed: a summary line, then one line per listed bad line, then the
/// count of those not listed.
fn refused(refusal: &Refusal) -> String {
    use std::fmt::Write as _;

    let mut text = format!("import refused, nothing stored: {refusal}\n");
    if refusal.total() > 1 {
        for error in refusal.errors() {
            let _ = writeln!(text, "  {error} [{}]", error.code);
        }
    }
    if refusal.more_errors() > 0 {
        let _ = writeln!(
            text,
            "  and {} more bad lines, not listed",
            refusal.more_errors()
        );
    }
    text
}
