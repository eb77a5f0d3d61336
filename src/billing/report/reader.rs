//! A provider report read record by record (contract §5): the header first, then each
//! record through [`Header::line`]. A bad line does not stop the reading: it is noted and
//! the next line is read, so that a refused report names every bad line up to
//! [`REPORT_ERRORS_MAX`], with the count of the rest. A bad header, a record past
//! [`RECORD_MAX_BYTES`] and an input that fails stop at once.
//!
//! Pure over any `Read`: the import hands it the report's streamed (and inflated) text,
//! tests hand it a string.

use std::collections::VecDeque;
use std::io::Read;

use super::{csv_error, Header, ParsedLine, ReportError};
use crate::error_code::ErrorCode;

/// Bad lines listed in a refusal; past it they are only counted. A finance user fixing an
/// export sees the shape of what is wrong from a hundred lines, and the answer stays small
/// (about 200 bytes a line).
pub const REPORT_ERRORS_MAX: usize = 100;
/// The longest record, in bytes: a FOCUS line is a few hundred bytes, a few kilobytes with
/// long tags. The CSV reader holds one record in memory whole, so without this bound one
/// endless line (a few kilobytes gzipped) would take memory up to the report's size.
pub const RECORD_MAX_BYTES: u64 = 1024 * 1024;
/// The CSV reader's buffer: how far it reads ahead of the record it parses.
const BUFFER_BYTES: usize = 64 * 1024;
/// An error message quotes the bad cell; a listed message is cut to this many characters,
/// so that a hundred errors on long cells stay a small answer.
const MESSAGE_MAX_CHARS: usize = 300;

/// Why a report is refused: its bad lines in file order, at most [`REPORT_ERRORS_MAX`],
/// and how many more there are. Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    errors: Vec<ReportError>,
    more_errors: u64,
}

impl Refusal {
    /// The first error: what the refusal's code and message say.
    pub fn first(&self) -> &ReportError {
        &self.errors[0]
    }

    pub fn errors(&self) -> &[ReportError] {
        &self.errors
    }

    /// Bad lines beyond those listed.
    pub fn more_errors(&self) -> u64 {
        self.more_errors
    }

    /// Every bad line, listed or not.
    pub fn total(&self) -> u64 {
        self.errors.len() as u64 + self.more_errors
    }
}

impl From<ReportError> for Refusal {
    fn from(error: ReportError) -> Self {
        Refusal {
            errors: vec![error],
            more_errors: 0,
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}", self.first())?;
        match self.total() {
            1 => Ok(()),
            2 => write!(formatter, " (and 1 more bad line)"),
            total => write!(formatter, " (and {} more bad lines)", total - 1),
        }
    }
}

impl std::error::Error for Refusal {}

/// Why reading stopped before the end of the report.
#[derive(Debug)]
pub enum ReadError {
    /// The report is refused: its header, an over-long record, or (at the end) its lines.
    Refused(Refusal),
    /// The input itself failed; its error is passed on as it came.
    Input(std::io::Error),
}

impl From<Refusal> for ReadError {
    fn from(refusal: Refusal) -> Self {
        ReadError::Refused(refusal)
    }
}

impl From<ReportError> for ReadError {
    fn from(error: ReportError) -> Self {
        ReadError::Refused(error.into())
    }
}

/// The bad lines seen so far.
#[derive(Debug, Default)]
struct Faults {
    errors: Vec<ReportError>,
    more_errors: u64,
}

impl Faults {
    fn push(&mut self, mut error: ReportError) {
        if self.errors.len() == REPORT_ERRORS_MAX {
            self.more_errors += 1;
            return;
        }
        if let Some((cut, _)) = error.message.char_indices().nth(MESSAGE_MAX_CHARS) {
            error.message.truncate(cut);
            error.message.push('…');
        }
        self.errors.push(error);
    }

    fn refusal(self) -> Option<Refusal> {
        (!self.errors.is_empty()).then_some(Refusal {
            errors: self.errors,
            more_errors: self.more_errors,
        })
    }
}

/// The input under the CSV reader, refusing to read more than [`RECORD_MAX_BYTES`] (plus
/// the reader's buffer) past the start of the record being parsed, and counting its lines.
struct Bounded<R> {
    inner: R,
    read_bytes: u64,
    record_start_bytes: u64,
    lines: Lines,
}

/// The input's physical lines, counted as it is read. The CSV reader counts a line at each
/// `\n` only, and the `\n` of a `\r\n` only when it reads the next record: its numbers
/// would be one short on a report with Windows line endings, and would not move at all
/// with `\r` alone. Here `\r\n`, `\n` and `\r` each end one line.
#[derive(Default)]
struct Lines {
    /// The offsets of the line-ending bytes (`\r`, `\n`) not yet passed, each with
    /// [`ENDS_LINE`] set when it ends a line (the `\n` of a `\r\n` does not). Those of the
    /// record being read and of what the reader has read ahead: up to about a record's
    /// limit of them, 8 bytes each (blank lines before a record are passed as they are
    /// read).
    endings: VecDeque<u64>,
    /// Lines ended before the first of `endings`.
    ended: u64,
    /// Whether the last byte read was a `\r`.
    after_cr: bool,
}

/// The flag of an ending in [`Lines::endings`] that ends a line; offsets stay below it
/// (an input is far shorter than 2^63 bytes).
const ENDS_LINE: u64 = 1 << 63;

impl Lines {
    /// Notes the line endings among `bytes`, read at `offset`.
    fn read(&mut self, offset: u64, bytes: &[u8]) {
        for (at, byte) in (offset..).zip(bytes) {
            match byte {
                b'\r' => {
                    self.endings.push_back(at | ENDS_LINE);
                    self.after_cr = true;
                }
                b'\n' => {
                    self.endings
                        .push_back(if self.after_cr { at } else { at | ENDS_LINE });
                    self.after_cr = false;
                }
                _ => self.after_cr = false,
            }
        }
    }

    /// Counts and forgets the endings before `offset`: the record that ends there was read
    /// whole. Gives back the room of a record that held many.
    fn pass(&mut self, offset: u64) {
        while let Some(&ending) = self.endings.front() {
            if ending & !ENDS_LINE >= offset {
                break;
            }
            self.ended += u64::from(ending & ENDS_LINE != 0);
            self.endings.pop_front();
        }
        if self.endings.capacity() > 4 * BUFFER_BYTES {
            self.endings.shrink_to(BUFFER_BYTES);
        }
    }

    /// Where the next record begins when the last one ended at `offset`: past the line
    /// endings read so far that follow it without a byte between (blank lines).
    fn after_blank_lines(&self, offset: u64) -> u64 {
        let mut start = offset;
        for ending in &self.endings {
            if ending & !ENDS_LINE != start {
                break;
            }
            start += 1;
        }
        start
    }

    /// The line of the record whose bytes begin at `offset`: the line of its first byte
    /// that ends no line (the reader skips line endings before a record), counted from 1.
    /// Forgets the endings before that byte; records are asked for in order.
    fn of_record_at(&mut self, offset: u64) -> u64 {
        let mut first = offset;
        while let Some(&ending) = self.endings.front() {
            let at = ending & !ENDS_LINE;
            if at > first {
                break;
            }
            if at == first {
                first += 1;
            }
            self.ended += u64::from(ending & ENDS_LINE != 0);
            self.endings.pop_front();
        }
        self.ended + 1
    }
}

/// The input error of a record past [`RECORD_MAX_BYTES`]: [`Records`] turns it into a
/// refusal of that record's line.
#[derive(Debug, thiserror::Error)]
#[error("a record is longer than {RECORD_MAX_BYTES} bytes")]
struct RecordTooLong;

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        let allowed = (self.record_start_bytes + RECORD_MAX_BYTES + BUFFER_BYTES as u64)
            .saturating_sub(self.read_bytes);
        if allowed == 0 {
            return Err(std::io::Error::other(RecordTooLong));
        }
        let wanted = buffer
            .len()
            .min(usize::try_from(allowed).unwrap_or(usize::MAX));
        let read = self.inner.read(&mut buffer[..wanted])?;
        self.lines.read(self.read_bytes, &buffer[..read]);
        if self.record_start_bytes == self.read_bytes {
            // Blank lines before a record are no part of it: its length starts after them.
            let blank = buffer[..read]
                .iter()
                .take_while(|byte| matches!(byte, b'\r' | b'\n'))
                .count();
            self.record_start_bytes += blank as u64;
            // Counted and forgotten at once, so a run of them holds no memory.
            self.lines.pass(self.record_start_bytes);
        }
        self.read_bytes += read as u64;
        Ok(read)
    }
}

/// The CSV reader over the input, and the bad lines it has seen.
struct Input<R> {
    csv: csv::Reader<Bounded<R>>,
    record: csv::StringRecord,
    faults: Faults,
    /// The line the last record read (or refused) begins on.
    record_line: u64,
}

impl<R: Read> Input<R> {
    /// Reads the next record into `self.record`: `false` at the end. A record that is not
    /// CSV (or not UTF-8) is noted and the one after it read.
    fn read(&mut self) -> Result<bool, ReadError> {
        loop {
            let read = self.csv.read_record(&mut self.record);
            let error = match read {
                Ok(more) => {
                    // The input stops a record only a buffer past the limit; one read
                    // whole under that margin is refused here, by its length.
                    let length = self.csv.position().byte() - self.csv.get_ref().record_start_bytes;
                    self.advance();
                    if more && length > RECORD_MAX_BYTES {
                        self.faults.push(ReportError::new(
                            self.record_line,
                            None,
                            ErrorCode::RecordTooLong,
                            format!("a record is longer than {RECORD_MAX_BYTES} bytes ({length})"),
                        ));
                        continue;
                    }
                    return Ok(more);
                }
                Err(error) => error,
            };
            if !matches!(error.kind(), csv::ErrorKind::Io(_)) {
                // The whole record was read, and refused.
                self.advance();
                let mut fault = csv_error(&error);
                fault.line = self.record_line;
                self.faults.push(fault);
                continue;
            }
            let csv::ErrorKind::Io(input) = error.into_kind() else {
                unreachable!("the error was seen to be an input error")
            };
            if input
                .get_ref()
                .is_some_and(|inner| inner.is::<RecordTooLong>())
            {
                let start = self.csv.get_ref().record_start_bytes;
                let line = self.csv.get_mut().lines.of_record_at(start);
                self.faults.push(ReportError::new(
                    line,
                    None,
                    ErrorCode::RecordTooLong,
                    format!(
                        "a record is longer than {RECORD_MAX_BYTES} bytes; reading stopped here"
                    ),
                ));
                let refusal = std::mem::take(&mut self.faults).refusal();
                return Err(refusal.expect("the long record was just noted").into());
            }
            return Err(ReadError::Input(input));
        }
    }

    /// A record was read whole: its line is the one its first byte is on, and the next
    /// one starts where the reader now is.
    fn advance(&mut self) {
        let end = self.csv.position().byte();
        let input = self.csv.get_mut();
        self.record_line = input.lines.of_record_at(input.record_start_bytes);
        input.lines.pass(end);
        input.record_start_bytes = input.lines.after_blank_lines(end);
        input.lines.pass(input.record_start_bytes);
    }
}

/// A report's records after its header, read one at a time.
pub struct Records<R> {
    input: Input<R>,
    header: Header,
    /// The header's line: 1, unless blank lines came before it.
    header_line: u64,
    good_lines: u64,
}

impl<R: Read> Records<R> {
    /// Reads the header: an empty input or a bad header refuses the report at once.
    pub fn new(input: R) -> Result<Records<R>, ReadError> {
        // Flexible: a record's length is checked here, against the header's, so that the
        // error names the line and both counts.
        let csv = csv::ReaderBuilder::new()
            .has_headers(false)
            .flexible(true)
            .buffer_capacity(BUFFER_BYTES)
            .from_reader(Bounded {
                inner: input,
                read_bytes: 0,
                record_start_bytes: 0,
                lines: Lines::default(),
            });
        let mut input = Input {
            csv,
            record: csv::StringRecord::new(),
            faults: Faults::default(),
            record_line: 1,
        };
        let read = input.read()?;
        if let Some(refusal) = std::mem::take(&mut input.faults).refusal() {
            // The header is not CSV: no line after it can be read against it.
            return Err(refusal.into());
        }
        if !read {
            return Err(
                ReportError::new(1, None, ErrorCode::EmptyReport, "the report is empty").into(),
            );
        }
        let header = Header::parse(&input.record, input.record_line)?;
        Ok(Records {
            header_line: input.record_line,
            input,
            header,
            good_lines: 0,
        })
    }

    /// The next good line; bad lines on the way are noted and skipped. `None` at the end
    /// of the input.
    pub fn next_line(&mut self) -> Result<Option<ParsedLine>, ReadError> {
        while self.input.read()? {
            let record = &self.input.record;
            let line = self.input.record_line;
            let expected = self.header.columns();
            if record.len() != expected {
                let found = record.len();
                self.input.faults.push(ReportError::new(
                    line,
                    None,
                    ErrorCode::WrongFieldCount,
                    format!("expected {expected} fields, as the header has, found {found}"),
                ));
                continue;
            }
            match self.header.line(record, line) {
                Ok(parsed) => {
                    self.good_lines += 1;
                    return Ok(Some(parsed));
                }
                Err(error) => self.input.faults.push(error),
            }
        }
        Ok(None)
    }

    /// Whether a bad line has been seen: the report will be refused, whatever follows.
    pub fn is_refused(&self) -> bool {
        !self.input.faults.errors.is_empty()
    }

    /// After the last line: the refusal when a line was bad or there was none, else the
    /// input, for whatever follows the last record.
    pub fn finish(self) -> Result<R, Refusal> {
        if let Some(refusal) = self.input.faults.refusal() {
            return Err(refusal);
        }
        if self.good_lines == 0 {
            return Err(ReportError::new(
                self.header_line + 1,
                None,
                ErrorCode::EmptyReport,
                "the report has a header and no lines",
            )
            .into());
        }
        Ok(self.input.csv.into_inner().inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEADER: &str = "ChargeCategory,ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency";
    const GOOD: &str = "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD";
    const BAD_NUMBER: &str =
        "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,ten,Seconds,0.5,USD";

    /// Every good line, or the refusal.
    fn read_all(text: &[u8]) -> Result<Vec<ParsedLine>, Refusal> {
        let refused = |error: ReadError| match error {
            ReadError::Refused(refusal) => refusal,
            ReadError::Input(error) => panic!("the input failed: {error}"),
        };
        let mut records = Records::new(text).map_err(refused)?;
        let mut lines = Vec::new();
        while let Some(line) = records.next_line().map_err(refused)? {
            lines.push(line);
        }
        records.finish()?;
        Ok(lines)
    }

    fn report(lines: &[String]) -> String {
        std::iter::once(HEADER.to_owned())
            .chain(lines.iter().cloned())
            .collect::<Vec<_>>()
            .join("\n")
    }

    #[test]
    fn every_bad_line_is_listed_up_to_the_limit_and_the_rest_counted() {
        let lines: Vec<String> = (0..250)
            .map(|n| if n % 2 == 0 { GOOD } else { BAD_NUMBER }.to_owned())
            .collect();
        let refusal = read_all(report(&lines).as_bytes()).unwrap_err();
        assert_eq!(refusal.errors().len(), REPORT_ERRORS_MAX);
        assert_eq!(refusal.more_errors(), 125 - REPORT_ERRORS_MAX as u64);
        assert_eq!(refusal.total(), 125);
        // Line 1 is the header, the first bad record is the second one: line 3.
        let listed: Vec<u64> = refusal.errors().iter().map(|error| error.line).collect();
        let expected: Vec<u64> = (0..REPORT_ERRORS_MAX as u64).map(|n| 3 + 2 * n).collect();
        assert_eq!(listed, expected);
        assert_eq!(refusal.first().code, ErrorCode::InvalidNumber);
        assert!(
            refusal.to_string().ends_with("(and 124 more bad lines)"),
            "{refusal}"
        );
    }

    #[test]
    fn a_record_with_too_few_or_too_many_fields_is_refused_naming_both_counts() {
        let short =
            "Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5".to_owned();
        let long = format!("{GOOD},extra");
        let refusal =
            read_all(report(&[GOOD.into(), short, GOOD.into(), long]).as_bytes()).unwrap_err();
        let found: Vec<(u64, ErrorCode, &str)> = refusal
            .errors()
            .iter()
            .map(|error| (error.line, error.code, error.message.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                (
                    3,
                    ErrorCode::WrongFieldCount,
                    "expected 8 fields, as the header has, found 7"
                ),
                (
                    5,
                    ErrorCode::WrongFieldCount,
                    "expected 8 fields, as the header has, found 9"
                ),
            ]
        );
    }

    #[test]
    fn a_bad_header_stops_at_once() {
        let text = format!("ChargePeriodStart,ResourceId\n{BAD_NUMBER}\n{BAD_NUMBER}\n");
        let refusal = read_all(text.as_bytes()).unwrap_err();
        assert_eq!(refusal.total(), 1);
        assert_eq!(refusal.first().code, ErrorCode::MissingColumn);
    }

    #[test]
    fn a_line_that_is_not_utf8_is_listed_and_reading_goes_on() {
        let mut text = format!("{HEADER}\n{GOOD}\n").into_bytes();
        text.extend_from_slice(b"Usage,\xff\xfe,2026-11-01T01:00:00Z,c1,1,Seconds,1,USD\n");
        text.extend_from_slice(format!("{BAD_NUMBER}\n").as_bytes());
        let refusal = read_all(&text).unwrap_err();
        let found: Vec<(u64, ErrorCode)> = refusal
            .errors()
            .iter()
            .map(|error| (error.line, error.code))
            .collect();
        assert_eq!(
            found,
            [(3, ErrorCode::MalformedCsv), (4, ErrorCode::InvalidNumber)]
        );
    }

    /// The line and code of each bad line the refusal of `text` lists.
    fn refused_lines(text: &[u8]) -> Vec<(u64, ErrorCode)> {
        let refusal = read_all(text).unwrap_err();
        refusal
            .errors()
            .iter()
            .map(|error| (error.line, error.code))
            .collect()
    }

    #[test]
    fn a_record_past_the_length_limit_stops_the_reading_naming_its_line() {
        let endless = "x".repeat(RECORD_MAX_BYTES as usize + 2 * BUFFER_BYTES);
        let text = report(&[BAD_NUMBER.into(), GOOD.into(), endless]);
        let found = refused_lines(text.as_bytes());
        assert_eq!(
            found,
            [(2, ErrorCode::InvalidNumber), (4, ErrorCode::RecordTooLong)]
        );
    }

    #[test]
    fn a_record_just_under_the_length_limit_is_read() {
        // A long unknown column: the record is read whole and the line kept.
        let header = format!("{HEADER},Notes");
        let notes = "n".repeat(RECORD_MAX_BYTES as usize - GOOD.len() - 2);
        let text = format!("{header}\n{GOOD},{notes}\n{GOOD},\n");
        assert_eq!(read_all(text.as_bytes()).unwrap().len(), 2);
    }

    #[test]
    fn a_record_a_byte_past_the_length_limit_is_refused_however_the_input_is_buffered() {
        let header = format!("{HEADER},Notes");
        let notes = "n".repeat(RECORD_MAX_BYTES as usize - GOOD.len() - 1);
        let text = format!("{header}\n{GOOD},\n{GOOD},{notes}\n{GOOD},\n");
        let found = refused_lines(text.as_bytes());
        assert_eq!(found, [(3, ErrorCode::RecordTooLong)]);
    }

    #[test]
    fn bad_lines_are_numbered_alike_with_any_line_ending_blank_lines_and_quoted_ones() {
        let lines = [
            GOOD.to_owned(),
            BAD_NUMBER.to_owned(),
            String::new(),
            GOOD.replace("Usage", "\"Us\nage\""),
            BAD_NUMBER.to_owned(),
        ];
        for ending in ["\n", "\r\n", "\r"] {
            let text = report(&lines).replace('\n', ending);
            let refusal = read_all(text.as_bytes()).unwrap_err();
            let found: Vec<u64> = refusal.errors().iter().map(|error| error.line).collect();
            // Header 1, good 2, bad 3, blank 4, a record over lines 5 and 6, bad 7.
            assert_eq!(found, [3, 7], "{ending:?}");
        }
    }

    #[test]
    fn a_run_of_blank_lines_is_counted_as_read_and_held_nowhere() {
        let blank = vec![b'\n'; 3_000_000];
        let mut input = Bounded {
            inner: &blank[..],
            read_bytes: 0,
            record_start_bytes: 0,
            lines: Lines::default(),
        };
        let mut buffer = vec![0; BUFFER_BYTES];
        while input.read(&mut buffer).expect("blank lines are no record") > 0 {
            assert!(
                input.lines.endings.len() <= BUFFER_BYTES,
                "{}",
                input.lines.endings.len()
            );
        }
        assert_eq!(
            (input.lines.ended, input.lines.endings.len()),
            (3_000_000, 0)
        );
    }

    #[test]
    fn blank_lines_before_a_record_do_not_count_in_its_length() {
        for ending in ["\n", "\r\n"] {
            let blank = ending.repeat(1_100_000);
            let text = format!("{HEADER}{ending}{GOOD}{ending}{blank}{GOOD}");
            let lines = read_all(text.as_bytes()).expect("two good lines");
            assert_eq!(lines.len(), 2, "{ending:?}");
        }
        // A long record is still refused by its own length.
        let long = format!("{GOOD},{}", "x".repeat(RECORD_MAX_BYTES as usize));
        let refusal = read_all(format!("{HEADER}\n\n\n{long}").as_bytes()).unwrap_err();
        assert_eq!(
            (refusal.first().line, refusal.first().code),
            (4, ErrorCode::RecordTooLong)
        );
    }

    #[test]
    fn a_header_after_blank_lines_is_named_by_its_own_line_and_so_is_the_line_it_lacks() {
        let missing = HEADER.replace(",BillingCurrency", "");
        for ending in ["\n", "\r\n", "\r"] {
            let text = format!("{ending}{ending}{missing}{ending}{GOOD}");
            let refusal = read_all(text.as_bytes()).unwrap_err();
            assert_eq!(
                (refusal.first().line, refusal.first().code),
                (3, ErrorCode::MissingColumn),
                "{ending:?}"
            );
            let text = format!("{ending}{ending}{HEADER}{ending}");
            let refusal = read_all(text.as_bytes()).unwrap_err();
            assert_eq!(
                (refusal.first().line, refusal.first().code),
                (4, ErrorCode::EmptyReport),
                "{ending:?}"
            );
        }
    }

    #[test]
    fn line_endings_are_forgotten_once_their_record_is_read_and_their_room_given_back() {
        let mut lines = Lines::default();
        // A record of 200 000 quoted line breaks, a blank line, then the next record.
        let record = format!("\"{}\"\r\n", "\r\n".repeat(200_000));
        let next = record.len() as u64;
        lines.read(0, record.as_bytes());
        lines.read(next, b"\r\nx\n");
        assert_eq!(lines.of_record_at(0), 1);
        lines.pass(next);
        assert_eq!(lines.endings.len(), 3, "only what was read ahead");
        assert!(lines.endings.capacity() <= 4 * BUFFER_BYTES);
        assert_eq!(lines.of_record_at(next), 200_003);
    }

    #[test]
    fn a_long_message_is_cut_in_the_list() {
        let cell = "9".repeat(10_000) + "x";
        let line =
            format!("Usage,2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,{cell},Seconds,0.5,USD");
        let refusal = read_all(report(&[line]).as_bytes()).unwrap_err();
        let message = &refusal.first().message;
        assert_eq!(message.chars().count(), MESSAGE_MAX_CHARS + 1, "{message}");
        assert!(message.ends_with('…'));
    }
}
