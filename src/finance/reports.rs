//! Provider report import (contract §5): streamed, all-or-nothing, stored immutably by the
//! sha256 of its CSV text.
//!
//! The bytes arrive in chunks (an HTTP body, a file). A blocking task inflates them when
//! they are gzip and reads them as CSV — hashing the text as it goes
//! ([`report_input`](super::report_input)) — and hands parsed lines over in batches to the
//! async side, which inserts each batch inside one transaction. Memory holds a few batches,
//! whatever the report's size. A bad line refuses the report: the parser stops handing
//! lines over, reads on to list every bad line (up to
//! [`REPORT_ERRORS_MAX`](crate::billing::report::reader::REPORT_ERRORS_MAX)), and the
//! transaction is rolled back: nothing of the report is stored. At the end, a report whose
//! sha256 is already stored is the same report: the transaction is rolled back and the
//! stored one returned.

use chrono::{DateTime, Utc};
use sqlx::{Connection, PgPool};
use tokio::sync::mpsc;
use uuid::Uuid;

use super::report_input::{ChunkReader, CsvText, InputError};
use crate::billing::report::reader::{ReadError, Records, Refusal};
use crate::billing::report::ParsedLine;

pub use super::report_input::Encoding;

/// Lines per insert.
pub const IMPORT_BATCH_LINES: usize = 5_000;
/// Chunks of input waiting for the parser, and batches waiting for the database: a few
/// of each bound the memory an import holds.
const CHANNEL_DEPTH: usize = 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredReport {
    pub id: Uuid,
    pub lines: i64,
    pub sha256: String,
    pub window_start: DateTime<Utc>,
    pub window_end: DateTime<Utc>,
}

#[derive(Debug)]
pub enum Imported {
    /// A new report.
    Created(StoredReport),
    /// The same CSV text was imported before (compressed or not).
    Existing(StoredReport),
}

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The report's text is refused: its header, or every bad line.
    #[error(transparent)]
    Invalid(#[from] Refusal),
    /// Its bytes could not be read to their end: too many, bad gzip, a failed read.
    #[error(transparent)]
    Input(#[from] InputError),
    #[error(transparent)]
    Store(#[from] sqlx::Error),
}

/// The sizes an import refuses past.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Bytes received, compressed or not.
    pub max_bytes: u64,
    /// CSV text inflated from a gzip report.
    pub max_inflated_bytes: u64,
}

/// The span of a report's lines: the first start, the last end.
type Window = (DateTime<Utc>, DateTime<Utc>);

/// What the parser reports at the end.
struct Parsed {
    sha256: [u8; 32],
    lines: i64,
    window: (DateTime<Utc>, DateTime<Utc>),
}

/// Imports the report whose bytes, in `encoding`, `chunks` yields, within `limits`.
pub async fn import<S, E>(
    pool: &PgPool,
    chunks: S,
    encoding: Encoding,
    limits: Limits,
    actor: &str,
) -> Result<Imported, ImportError>
where
    S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    // A session of its own, outside the pool: an import cut off mid-`COPY` (the request
    // deadline, a client gone) leaves its session amid the copy protocol, which sqlx 0.8
    // cannot bring back in step. Dropping it with the import closes it, which ends the
    // copy and its transaction on the server; a pooled one went back to the pool out of
    // step with Postgres and gave other requests' statements the answers of others.
    let mut session = pool.acquire().await?.detach();
    let imported = import_on(&mut session, pool, chunks, (encoding, limits), actor).await;
    let _ = session.close().await;
    imported
}

async fn import_on<S, E>(
    session: &mut sqlx::PgConnection,
    pool: &PgPool,
    chunks: S,
    (encoding, limits): (Encoding, Limits),
    actor: &str,
) -> Result<Imported, ImportError>
where
    S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    let (chunk_sender, chunk_receiver) = mpsc::channel(CHANNEL_DEPTH);
    let (batch_sender, mut batches) = mpsc::channel::<Vec<ParsedLine>>(CHANNEL_DEPTH);
    let max_inflated_bytes = limits.max_inflated_bytes;
    let parser = tokio::task::spawn_blocking(move || {
        let chunks = ChunkReader::new(chunk_receiver);
        parse(chunks, encoding, max_inflated_bytes, batch_sender)
    });

    let report_id = Uuid::now_v7();
    let mut transaction = session.begin().await?;
    // Feeding the parser and inserting run side by side, not in turns: while Postgres
    // inserts one batch, the parser reads and checks the next lines, instead of stopping
    // once the few chunks in its channel are used up.
    let feed = feed(chunks, chunk_sender, limits.max_bytes);
    let store = async {
        while let Some(batch) = batches.recv().await {
            insert(&mut transaction, report_id, &batch).await?;
        }
        Ok::<(), ImportError>(())
    };
    // A failed insert returns at once, dropping the batch receiver, which stops the parser.
    let (too_large, ()) = tokio::try_join!(feed, store)?;
    let parsed = parser
        .await
        .map_err(|error| InputError::Read(error.to_string()))?;
    if too_large {
        return Err(InputError::TooLarge(limits.max_bytes).into());
    }
    let parsed = parsed?;

    if let Some(existing) = find(pool, &parsed.sha256).await? {
        transaction.rollback().await?;
        return Ok(Imported::Existing(existing));
    }
    store_report(pool, transaction, report_id, &parsed, actor).await
}

/// Hands the input's chunks to the parser until the input ends, the parser stops or
/// `max_bytes` is passed; `true` in the last case. Dropping `sender` at the end ends the
/// parser's input.
async fn feed<S, E>(
    mut chunks: S,
    sender: mpsc::Sender<Result<bytes::Bytes, InputError>>,
    max_bytes: u64,
) -> Result<bool, ImportError>
where
    S: futures::Stream<Item = Result<bytes::Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    use futures::StreamExt;

    let mut read = 0u64;
    loop {
        let chunk = tokio::select! {
            chunk = chunks.next() => chunk,
            // The parser stopped: its error says why.
            () = sender.closed() => return Ok(false),
        };
        match chunk {
            Some(Ok(chunk)) => {
                read += chunk.len() as u64;
                if read > max_bytes {
                    let _ = sender.send(Err(InputError::TooLarge(max_bytes))).await;
                    return Ok(true);
                }
                if sender.send(Ok(chunk)).await.is_err() {
                    return Ok(false);
                }
            }
            Some(Err(error)) => {
                let _ = sender.send(Err(InputError::Read(error.to_string()))).await;
                return Ok(false);
            }
            None => return Ok(false),
        }
    }
}

/// Stores the report's row beside its lines, inserted in `transaction`; when the same
/// bytes were imported concurrently and committed first, that report instead.
async fn store_report(
    pool: &PgPool,
    mut transaction: sqlx::Transaction<'_, sqlx::Postgres>,
    report_id: Uuid,
    parsed: &Parsed,
    actor: &str,
) -> Result<Imported, ImportError> {
    let stored = StoredReport {
        id: report_id,
        lines: parsed.lines,
        sha256: hex::encode(parsed.sha256),
        window_start: parsed.window.0,
        window_end: parsed.window.1,
    };
    let inserted = sqlx::query(
        "INSERT INTO provider_report (id, sha256, lines, window_start, window_end, imported_at, imported_by) \
         VALUES ($1, $2, $3, $4, $5, now(), $6) ON CONFLICT (sha256) DO NOTHING",
    )
    .bind(report_id)
    .bind(&parsed.sha256[..])
    .bind(parsed.lines)
    .bind(parsed.window.0)
    .bind(parsed.window.1)
    .bind(actor)
    .execute(&mut *transaction)
    .await?;
    if inserted.rows_affected() == 0 {
        // The same bytes were imported concurrently and committed first.
        transaction.rollback().await?;
        let existing = find(pool, &parsed.sha256).await?.ok_or_else(|| {
            InputError::Read("a concurrent import of the same report vanished".into())
        })?;
        return Ok(Imported::Existing(existing));
    }
    transaction.commit().await?;
    Ok(Imported::Created(stored))
}

/// Reads the report's text, handing its lines over in batches; its sha256, line count and
/// window at the end.
fn parse(
    chunks: ChunkReader,
    encoding: Encoding,
    max_inflated_bytes: u64,
    batches: mpsc::Sender<Vec<ParsedLine>>,
) -> Result<Parsed, ImportError> {
    let mut text = CsvText::new(chunks, encoding, max_inflated_bytes)?;
    let read = read_lines(&mut text, batches);
    let (lines, window) = match read {
        Ok(read) => read,
        Err(ReadError::Refused(refusal)) => return Err(refusal.into()),
        Err(ReadError::Input(error)) => return Err(text.error(error).into()),
    };
    Ok(Parsed {
        sha256: text.finish()?,
        lines,
        window,
    })
}

/// Reads every record of `text`, handing the good lines over in batches until a bad one
/// is seen; the count and window of the lines at the end, or the refusal.
fn read_lines(
    text: &mut CsvText,
    batches: mpsc::Sender<Vec<ParsedLine>>,
) -> Result<(i64, Window), ReadError> {
    let stopped = || {
        ReadError::Input(std::io::Error::other(InputError::Read(
            "the import stopped".into(),
        )))
    };
    let mut records = Records::new(&mut *text)?;
    // Dropped at the first bad line: the inserts stop, the reading goes on.
    let mut batches = Some(batches);
    let mut batch = Vec::with_capacity(IMPORT_BATCH_LINES);
    let mut lines = 0i64;
    let mut window: Option<(DateTime<Utc>, DateTime<Utc>)> = None;
    while let Some(parsed) = records.next_line()? {
        if records.is_refused() {
            batches = None;
            batch.clear();
            continue;
        }
        let (start, end) = parsed.span();
        window = Some(widened(window, start, end));
        lines += 1;
        batch.push(parsed);
        if batch.len() == IMPORT_BATCH_LINES {
            let full = std::mem::replace(&mut batch, Vec::with_capacity(IMPORT_BATCH_LINES));
            let sender = batches.as_ref().expect("batches are sent until a bad line");
            sender.blocking_send(full).map_err(|_| stopped())?;
        }
    }
    records.finish()?;
    let window = window.expect("a report without a bad line has a line");
    if !batch.is_empty() {
        let sender = batches.expect("batches are sent until a bad line");
        sender.blocking_send(batch).map_err(|_| stopped())?;
    }
    Ok((lines, window))
}

/// The report's window so far, widened to take in one more line's span: its billing
/// period (the lines of an export normally share one) and its charge period.
fn widened(
    window: Option<(DateTime<Utc>, DateTime<Utc>)>,
    start: DateTime<Utc>,
    end: DateTime<Utc>,
) -> (DateTime<Utc>, DateTime<Utc>) {
    match window {
        None => (start, end),
        Some((first, last)) => (first.min(start), last.max(end)),
    }
}

/// The columns each line is copied into, in the order [`write_copy_row`] writes them.
const LINE_COLUMNS: &str = "report_id, line, charge_period_start, charge_period_end, \
     resource_id, org_id, consumed_quantity, consumed_unit, billed_cost, billing_currency, \
     provider_name, charge_category, charge_class, billing_period_start, billing_period_end";

/// Inserts a batch with one `COPY`: Postgres takes CSV rows several times faster than it
/// takes the same rows bound as arrays to `INSERT … UNNEST`, which made import half as fast
/// as its target.
async fn insert(
    transaction: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    report_id: Uuid,
    batch: &[ParsedLine],
) -> Result<(), ImportError> {
    let report_id = report_id.hyphenated().to_string();
    let mut rows = String::with_capacity(batch.len() * 192);
    for line in batch {
        write_copy_row(&mut rows, &report_id, line);
    }
    let mut copy = transaction
        .copy_in_raw(&format!(
            "COPY provider_report_line ({LINE_COLUMNS}) FROM STDIN WITH (FORMAT csv)"
        ))
        .await?;
    copy.send(rows.into_bytes()).await?;
    let copied = copy.finish().await?;
    assert_eq!(
        copied,
        batch.len() as u64,
        "COPY stores every line of a batch"
    );
    Ok(())
}

/// One line as a `COPY … (FORMAT csv)` row: text quoted with `"` doubled, so that an
/// unquoted empty field can only be a NULL; decimals as written (their scale kept), and
/// instants at microseconds as the binary encoding sends them.
fn write_copy_row(out: &mut String, report_id: &str, line: &ParsedLine) {
    use std::fmt::Write as _;

    fn text(out: &mut String, value: Option<&str>) {
        if let Some(value) = value {
            out.push('"');
            out.push_str(&value.replace('"', "\"\""));
            out.push('"');
        }
    }
    fn instant(out: &mut String, value: DateTime<Utc>) {
        // What sqlx sends for a `TIMESTAMPTZ`: whole microseconds since 2000, truncated.
        let epoch = DateTime::<Utc>::from_timestamp(946_684_800, 0).expect("a valid instant");
        let micros = (value - epoch)
            .num_microseconds()
            .expect("a report instant is within Postgres's range");
        let value = epoch + chrono::Duration::microseconds(micros);
        out.push_str(&value.to_rfc3339_opts(chrono::SecondsFormat::Micros, true));
    }
    let report = &line.report;
    let _ = write!(out, "{report_id},{},", line.line);
    instant(out, report.charge_period.start());
    out.push(',');
    instant(out, report.charge_period.end());
    out.push(',');
    text(out, report.resource_id.as_deref());
    out.push(',');
    text(out, report.org_id.as_deref());
    out.push(',');
    if let Some(quantity) = report.quantity {
        let _ = write!(out, "{quantity}");
    }
    out.push(',');
    text(out, report.unit.as_deref());
    let _ = write!(out, ",{},", report.billed_cost);
    text(out, Some(&report.currency));
    out.push(',');
    text(out, line.provider_name.as_deref());
    out.push(',');
    text(out, Some(&report.charge_category));
    out.push(',');
    text(out, report.charge_class.as_deref());
    out.push(',');
    if let Some(billing) = line.billing_period {
        instant(out, billing.start());
        out.push(',');
        instant(out, billing.end());
    } else {
        out.push(',');
    }
    out.push('\n');
}

#[derive(sqlx::FromRow)]
struct ReportRow {
    id: Uuid,
    lines: i64,
    sha256: Vec<u8>,
    window_start: DateTime<Utc>,
    window_end: DateTime<Utc>,
}

async fn find(pool: &PgPool, sha256: &[u8; 32]) -> Result<Option<StoredReport>, sqlx::Error> {
    let row: Option<ReportRow> = sqlx::query_as(
        "SELECT id, lines, sha256, window_start, window_end FROM provider_report WHERE sha256 = $1",
    )
    .bind(&sha256[..])
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|row| StoredReport {
        id: row.id,
        lines: row.lines,
        sha256: hex::encode(row.sha256),
        window_start: row.window_start,
        window_end: row.window_end,
    }))
}
