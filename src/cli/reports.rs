//! `tally reports`: provider usage reports.

use std::process::ExitCode;

use crate::billing::reconcile::Tolerance;
use crate::billing::report::exact_decimal;
use crate::billing::report::reader::Refusal;
use crate::config::Config;
use crate::finance::reconciliation::{self, ReconcileError};
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

/// `tally reports reconcile REPORT_ID`: exit 1 for a caller's mistake or amounts that
/// cannot be reconciled, with the reason on standard error.
pub async fn reconcile(
    config: &Config,
    report_id: &str,
    tolerance_ms: Option<u64>,
    tolerance_ratio: Option<&str>,
) -> anyhow::Result<ExitCode> {
    let refused = |why: String| {
        eprintln!("reconciliation refused, nothing stored: {why}");
        Ok(ExitCode::from(1))
    };
    let Ok(report_id) = uuid::Uuid::try_parse(report_id) else {
        return refused(format!("{report_id:?} is not a report id (a UUID)"));
    };
    let ratio = match tolerance_ratio.map(|text| exact_decimal(text).ok_or(text)) {
        None => None,
        Some(Ok(ratio)) => Some(ratio),
        Some(Err(text)) => {
            return refused(format!(
                "tolerance_ratio: {text:?} is not a decimal of at most 28 significant digits"
            ))
        }
    };
    let tolerance = match Tolerance::asked(tolerance_ms, ratio) {
        Ok(tolerance) => tolerance,
        Err(why) => return refused(why),
    };
    let pool = db::prepare(config).await?;
    super::to_head(&pool, config).await?;
    let asked = reconciliation::Asked {
        report_id,
        tolerance,
        actor: "cli".to_owned(),
    };
    let summary = reconciliation::run(&pool, &asked, config.clock.now()).await;
    pool.close().await;
    match summary {
        Ok(summary) => {
            println!(
                "{}",
                serde_json::json!({
                    "reconciliation_id": summary.id, "counts": summary.counts,
                    "totals": summary.totals, "position": summary.position,
                })
            );
            Ok(ExitCode::SUCCESS)
        }
        Err(error @ (ReconcileError::UnknownReport(_) | ReconcileError::OutOfRange(_))) => {
            refused(error.to_string())
        }
        Err(ReconcileError::Store(error)) => Err(error.into()),
    }
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
