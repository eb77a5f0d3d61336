//! Replay's read: every ledger event up to a head, gathered into each container's history
//! and each org's account entries.
//!
//! A replay reads the whole ledger, so what each row costs tally counts. Row by row through
//! sqlx, each value would be checked against its column's type and decoded through a
//! generic decoder, and each row would allocate its strings and a key of two more to find
//! its container: tally's side would set the read's pace. So this read asks Postgres for
//! `COPY … (FORMAT binary)` and decodes the tuples itself: each value is taken from the
//! bytes where it lies, strings are borrowed from the message, and a container is looked
//! up by borrowed strings, allocating only the first time it is seen. The query casts every
//! column to the type decoded here, so a change of a column's type cannot be misread, and
//! each value's length is checked against its type.

use std::hash::{Hash, Hasher};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures::TryStreamExt;
use sqlx::PgConnection;
use uuid::Uuid;

use super::model::ContainerKey;
use super::store::EventFields;
use super::Error;
use crate::runtime::{AccountEntry, ContainerEntry};

/// The histories of every container, by container.
pub type Histories = hashbrown::HashMap<ContainerKey, Vec<ContainerEntry>>;

/// What replay reads from the ledger, voided events still in.
#[derive(Debug, Default)]
pub struct Gathered {
    pub histories: Histories,
    pub accounts: Vec<(String, AccountEntry)>,
    /// `(voided event, position of the void)`.
    pub voided: Vec<(Uuid, i64)>,
    /// Events read, of every type.
    pub events: u64,
}

/// The columns read, in the order [`Tuple::decode`] takes them, each cast to the type it
/// decodes. Each value of `data` is taken out only for the event type that reads it
/// ([`EventFields::entries`]); for the others it is NULL, so a row costs Postgres at most
/// one JSON look-up. Only a row holding a value Postgres cannot cast under a key its type
/// does not read would read differently: the projector's read would fail on it, replay's
/// not.
const COLUMNS: [&str; COLUMN_COUNT] = [
    "position::int8",
    "id::uuid",
    "type::text",
    "org_id::text",
    "container_id::text",
    "occurred_at::timestamptz",
    "CASE WHEN type = 'container.command_ran' THEN (data->>'duration_ms')::int8 END",
    "CASE WHEN type = 'container.port_published' THEN (data->>'port')::int4 END",
    "CASE WHEN type = 'org.plan_changed' THEN data->>'plan' END",
    "CASE WHEN type = 'org.verification_changed' THEN (data->>'verified')::bool END",
    "CASE WHEN type = 'org.billing_eligibility_changed' THEN (data->>'eligible')::bool END",
    "CASE WHEN type = 'ledger.event_voided' THEN (data->>'event_id')::uuid END",
];
const COLUMN_COUNT: usize = 12;

/// Every event of the ledger up to and including `head`, gathered. The ledger is read in
/// two halves by position, each on its connection, at once: Postgres's side of the read
/// (the scan, the JSON look-ups, sending each value) costs about as much as decoding it
/// here, so one backend alone would set the pace.
pub async fn gather(
    first: &mut PgConnection,
    second: &mut PgConnection,
    head: i64,
) -> Result<Gathered, Error> {
    let middle = head / 2;
    // Both halves run to their end even when one fails, so that neither connection is
    // left in the middle of its COPY.
    let (earlier, later) = tokio::join!(
        gather_range(first, 0, middle),
        gather_range(second, middle, head)
    );
    let mut gathered = earlier?;
    gathered.append(later?);
    Ok(gathered)
}

/// The events at positions after `after`, up to and including `until`.
async fn gather_range(
    connection: &mut PgConnection,
    after: i64,
    until: i64,
) -> Result<Gathered, Error> {
    let statement = format!(
        "COPY (SELECT {} FROM ledger WHERE position > {after} AND position <= {until}) \
         TO STDOUT (FORMAT binary)",
        COLUMNS.join(", ")
    );
    let mut stream = connection.copy_out_raw(&statement).await?;
    let mut gathered = Gathered::default();
    let mut reader = TupleReader::default();
    let mut failed = None;
    while let Some(chunk) = stream.try_next().await? {
        if failed.is_none() {
            if let Err(error) = reader.feed(chunk, |tuple| gathered.add(tuple)) {
                failed = Some(error);
            }
        }
    }
    // Read to the end even after a failure, so that the connection is left ready for the
    // next statement.
    if let Some(error) = failed {
        return Err(error);
    }
    reader.finish()?;
    Ok(gathered)
}

impl Gathered {
    /// Adds what was gathered from later positions.
    fn append(&mut self, later: Gathered) {
        for (key, entries) in later.histories {
            self.histories.entry(key).or_default().extend(entries);
        }
        self.accounts.extend(later.accounts);
        self.voided.extend(later.voided);
        self.events += later.events;
    }

    fn add(&mut self, tuple: &Tuple<'_>) -> Result<(), Error> {
        let row = tuple.decode()?;
        self.events += 1;
        let (account, container) = row.fields.entries()?;
        if let Some(target) = row.voids {
            self.voided.push((target, row.fields.position));
        }
        if let Some(entry) = account {
            self.accounts.push((row.org_id.to_owned(), entry));
        }
        if let (Some(container_id), Some(entry)) = (row.container_id, container) {
            let key = BorrowedKey {
                org_id: row.org_id,
                container_id,
            };
            match self.histories.get_mut(&key) {
                Some(history) => history.push(entry),
                None => {
                    self.histories.insert(
                        ContainerKey {
                            org_id: row.org_id.to_owned(),
                            container_id: container_id.to_owned(),
                        },
                        vec![entry],
                    );
                }
            }
        }
        Ok(())
    }
}

/// A [`ContainerKey`] of borrowed strings, which hashes and compares as the owned one.
struct BorrowedKey<'a> {
    org_id: &'a str,
    container_id: &'a str,
}

impl Hash for BorrowedKey<'_> {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // As `#[derive(Hash)]` on `ContainerKey` does: each field in order, and a `String`
        // hashes as its `str`.
        self.org_id.hash(state);
        self.container_id.hash(state);
    }
}

impl hashbrown::Equivalent<ContainerKey> for BorrowedKey<'_> {
    fn equivalent(&self, key: &ContainerKey) -> bool {
        self.org_id == key.org_id && self.container_id == key.container_id
    }
}

/// One decoded row.
struct Row<'a> {
    fields: EventFields<'a>,
    org_id: &'a str,
    container_id: Option<&'a str>,
    voids: Option<Uuid>,
}

/// One tuple of the binary COPY format: each column's bytes, `None` for NULL.
struct Tuple<'a> {
    values: [Option<&'a [u8]>; COLUMN_COUNT],
}

impl<'a> Tuple<'a> {
    fn decode(&self) -> Result<Row<'a>, Error> {
        let [position, id, event_type, org_id, container_id, occurred_at, duration_ms, port, plan, verified, eligible, voids] =
            self.values;
        let position = position
            .and_then(int8)
            .ok_or_else(|| malformed("a row without a position"))?;
        let fields = EventFields {
            position,
            id: required(id, uuid, position, "id")?,
            event_type: required(event_type, text, position, "type")?,
            occurred_at: required(occurred_at, timestamptz, position, "occurred_at")?,
            duration_ms: optional(duration_ms, int8, position, "duration_ms")?,
            port: optional(port, int4, position, "port")?,
            plan: optional(plan, text, position, "plan")?,
            verified: optional(verified, boolean, position, "verified")?,
            eligible: optional(eligible, boolean, position, "eligible")?,
        };
        Ok(Row {
            fields,
            org_id: required(org_id, text, position, "org_id")?,
            container_id: optional(container_id, text, position, "container_id")?,
            voids: optional(voids, uuid, position, "the voided event_id")?,
        })
    }
}

/// A value that must be there and decode.
fn required<'a, T>(
    value: Option<&'a [u8]>,
    decode: fn(&'a [u8]) -> Option<T>,
    position: i64,
    column: &str,
) -> Result<T, Error> {
    optional(value, decode, position, column)?
        .ok_or_else(|| Error::Corrupt(format!("position {position}: no {column}")))
}

/// A value that decodes when it is not NULL.
fn optional<'a, T>(
    value: Option<&'a [u8]>,
    decode: fn(&'a [u8]) -> Option<T>,
    position: i64,
    column: &str,
) -> Result<Option<T>, Error> {
    value
        .map(|bytes| {
            decode(bytes).ok_or_else(|| {
                Error::Corrupt(format!("position {position}: the {column} does not decode"))
            })
        })
        .transpose()
}

fn int8(bytes: &[u8]) -> Option<i64> {
    Some(i64::from_be_bytes(bytes.try_into().ok()?))
}

fn int4(bytes: &[u8]) -> Option<i32> {
    Some(i32::from_be_bytes(bytes.try_into().ok()?))
}

fn boolean(bytes: &[u8]) -> Option<bool> {
    match bytes {
        [0] => Some(false),
        [1] => Some(true),
        _ => None,
    }
}

fn uuid(bytes: &[u8]) -> Option<Uuid> {
    Some(Uuid::from_bytes(bytes.try_into().ok()?))
}

fn text(bytes: &[u8]) -> Option<&str> {
    std::str::from_utf8(bytes).ok()
}

/// Microseconds since 2000-01-01 00:00:00 UTC, Postgres's epoch; `None` for `±infinity`.
fn timestamptz(bytes: &[u8]) -> Option<DateTime<Utc>> {
    const POSTGRES_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;
    let micros = int8(bytes)?;
    DateTime::from_timestamp_micros(micros.checked_add(POSTGRES_EPOCH_UNIX_MICROS)?)
}

/// The binary COPY format, fed in the chunks Postgres sends it (one message a row, the
/// header in the first): the 11-byte signature, flags and a header extension, then tuples,
/// each a field count and each field's length (`-1` for NULL) and bytes, then a trailer,
/// a field count of `-1`. A tuple split over chunks waits in `pending` for the rest.
#[derive(Default)]
struct TupleReader {
    pending: Vec<u8>,
    header_read: bool,
    ended: bool,
}

const SIGNATURE: &[u8; 11] = b"PGCOPY\n\xff\r\n\0";

impl TupleReader {
    /// Hands each whole tuple in `chunk` (after what is pending) to `each`.
    fn feed(
        &mut self,
        chunk: Bytes,
        mut each: impl FnMut(&Tuple<'_>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let mut pending = std::mem::take(&mut self.pending);
        let input: &[u8] = if pending.is_empty() {
            &chunk
        } else {
            pending.extend_from_slice(&chunk);
            &pending
        };
        let used = self.read(input, &mut each)?;
        let rest = input[used..].to_vec();
        self.pending = rest;
        Ok(())
    }

    /// Reads what `input` holds whole; the bytes used.
    fn read(
        &mut self,
        input: &[u8],
        each: &mut impl FnMut(&Tuple<'_>) -> Result<(), Error>,
    ) -> Result<usize, Error> {
        let mut at = 0;
        if !self.header_read {
            let Some(length) = header_length(input)? else {
                return Ok(0);
            };
            self.header_read = true;
            at = length;
        }
        loop {
            if self.ended {
                if at < input.len() {
                    return Err(malformed("bytes after the trailer"));
                }
                return Ok(at);
            }
            match tuple_at(&input[at..])? {
                Parsed::Incomplete => return Ok(at),
                Parsed::Trailer => {
                    self.ended = true;
                    at += 2;
                }
                Parsed::Tuple(tuple, length) => {
                    each(&tuple)?;
                    at += length;
                }
            }
        }
    }

    /// Checks that the data ended with its trailer, nothing left over.
    fn finish(self) -> Result<(), Error> {
        if !self.ended || !self.pending.is_empty() {
            return Err(malformed("the data ended before its trailer"));
        }
        Ok(())
    }
}

enum Parsed<'a> {
    Incomplete,
    Trailer,
    /// A tuple and the bytes it took.
    Tuple(Tuple<'a>, usize),
}

/// The length of the header at the start of `input`, `None` when it is not all there.
fn header_length(input: &[u8]) -> Result<Option<usize>, Error> {
    let fixed = SIGNATURE.len() + 8;
    if input.len() < fixed {
        return Ok(None);
    }
    if &input[..SIGNATURE.len()] != SIGNATURE {
        return Err(malformed("no binary COPY signature"));
    }
    let extension = read_i32(input, SIGNATURE.len() + 4).expect("the fixed header is there");
    let extension = usize::try_from(extension).map_err(|_| malformed("a negative extension"))?;
    Ok((input.len() >= fixed + extension).then_some(fixed + extension))
}

fn tuple_at(input: &[u8]) -> Result<Parsed<'_>, Error> {
    let Some(count) = input.get(..2) else {
        return Ok(Parsed::Incomplete);
    };
    let count = i16::from_be_bytes([count[0], count[1]]);
    if count == -1 {
        return Ok(Parsed::Trailer);
    }
    if usize::try_from(count) != Ok(COLUMN_COUNT) {
        return Err(malformed(&format!(
            "a tuple of {count} fields, not {COLUMN_COUNT}"
        )));
    }
    let mut values = [None; COLUMN_COUNT];
    let mut at = 2;
    for value in &mut values {
        let Some(length) = read_i32(input, at) else {
            return Ok(Parsed::Incomplete);
        };
        at += 4;
        if length == -1 {
            continue;
        }
        let length = usize::try_from(length).map_err(|_| malformed("a negative length"))?;
        let Some(bytes) = input.get(at..at + length) else {
            return Ok(Parsed::Incomplete);
        };
        *value = Some(bytes);
        at += length;
    }
    Ok(Parsed::Tuple(Tuple { values }, at))
}

fn read_i32(input: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_be_bytes(input.get(at..at + 4)?.try_into().ok()?))
}

fn malformed(what: &str) -> Error {
    Error::Corrupt(format!("replay's read of the ledger: {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tuple in the binary COPY format, each value's bytes or NULL.
    fn tuple(values: &[Option<Vec<u8>>]) -> Vec<u8> {
        let mut bytes = i16::try_from(values.len()).unwrap().to_be_bytes().to_vec();
        for value in values {
            match value {
                None => bytes.extend((-1_i32).to_be_bytes()),
                Some(value) => {
                    bytes.extend(i32::try_from(value.len()).unwrap().to_be_bytes());
                    bytes.extend(value);
                }
            }
        }
        bytes
    }

    /// A container event's columns, as the statement casts them.
    fn container_event(position: i64, event_type: &str, container: &str) -> Vec<Option<Vec<u8>>> {
        let mut values = vec![
            Some(position.to_be_bytes().to_vec()),
            Some(Uuid::now_v7().as_bytes().to_vec()),
            Some(event_type.as_bytes().to_vec()),
            Some(b"org_a".to_vec()),
            Some(container.as_bytes().to_vec()),
            // 2026-12-01 00:00:00 UTC, in microseconds since 2000-01-01.
            Some(849_398_400_000_000_i64.to_be_bytes().to_vec()),
        ];
        values.extend(std::iter::repeat_n(None, COLUMN_COUNT - values.len()));
        if event_type == "container.command_ran" {
            values[6] = Some(1_500_i64.to_be_bytes().to_vec());
        }
        values
    }

    /// The header, then each tuple, then the trailer.
    fn copy_data(tuples: &[Vec<Option<Vec<u8>>>]) -> Vec<u8> {
        let mut bytes = SIGNATURE.to_vec();
        bytes.extend(0_i32.to_be_bytes());
        // A header extension of three bytes, which a reader skips.
        bytes.extend(3_i32.to_be_bytes());
        bytes.extend(b"ext");
        for values in tuples {
            bytes.extend(tuple(values));
        }
        bytes.extend((-1_i16).to_be_bytes());
        bytes
    }

    /// Feeds `chunks` in order, then finishes: what was gathered, or the first error.
    fn read(chunks: &[&[u8]]) -> Result<Gathered, Error> {
        let mut reader = TupleReader::default();
        let mut gathered = Gathered::default();
        for chunk in chunks {
            reader.feed(Bytes::copy_from_slice(chunk), |tuple| gathered.add(tuple))?;
        }
        reader.finish()?;
        Ok(gathered)
    }

    fn summary(gathered: &Gathered) -> Vec<(String, Vec<i64>)> {
        let mut summary: Vec<_> = gathered
            .histories
            .iter()
            .map(|(key, entries)| {
                let positions = entries.iter().map(|entry| entry.position).collect();
                (key.container_id.clone(), positions)
            })
            .collect();
        summary.sort();
        summary
    }

    #[test]
    fn the_data_cut_into_chunks_at_any_byte_is_read_as_when_it_comes_whole() {
        let data = copy_data(&[
            container_event(1, "container.created", "box"),
            container_event(2, "container.command_ran", "box"),
            container_event(3, "container.created", "other"),
            container_event(4, "container.stopped", "box"),
        ]);
        let whole = read(&[&data]).unwrap();
        assert_eq!(whole.events, 4);
        assert_eq!(
            summary(&whole),
            vec![
                ("box".to_owned(), vec![1, 2, 4]),
                ("other".to_owned(), vec![3])
            ]
        );
        for cut in 0..=data.len() {
            for second_cut in [cut, (cut + 7).min(data.len())] {
                let chunks = [&data[..cut], &data[cut..second_cut], &data[second_cut..]];
                let gathered = read(&chunks).unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
                assert_eq!(gathered.events, 4, "cut at {cut}");
                assert_eq!(summary(&gathered), summary(&whole), "cut at {cut}");
            }
        }
    }

    #[test]
    fn data_that_stops_before_its_trailer_is_refused() {
        let data = copy_data(&[container_event(1, "container.created", "box")]);
        let error = read(&[&data[..data.len() - 2]]).unwrap_err();
        assert!(error.to_string().contains("before its trailer"), "{error}");
        let error = read(&[&data[..data.len() - 5]]).unwrap_err();
        assert!(error.to_string().contains("before its trailer"), "{error}");
    }

    #[test]
    fn data_without_the_signature_or_with_bytes_after_its_trailer_is_refused() {
        let mut data = copy_data(&[]);
        data[0] = b'X';
        let error = read(&[&data]).unwrap_err();
        assert!(error.to_string().contains("signature"), "{error}");

        let mut data = copy_data(&[]);
        data.push(0);
        let error = read(&[&data]).unwrap_err();
        assert!(error.to_string().contains("after the trailer"), "{error}");
    }

    #[test]
    fn a_tuple_of_another_number_of_columns_is_refused() {
        let mut values = container_event(1, "container.created", "box");
        values.pop();
        let error = read(&[&copy_data(&[values])]).unwrap_err();
        assert!(
            error.to_string().contains("of 11 fields, not 12"),
            "{error}"
        );
    }

    #[test]
    fn a_value_of_another_length_than_its_type_names_its_position_and_column() {
        let mut values = container_event(7, "container.command_ran", "box");
        values[6] = Some(1_500_i32.to_be_bytes().to_vec());
        let error = read(&[&copy_data(&[values])]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "position 7: the duration_ms does not decode"
        );

        let mut values = container_event(8, "container.created", "box");
        values[4] = Some(vec![0xff, 0xfe]);
        let error = read(&[&copy_data(&[values])]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "position 8: the container_id does not decode"
        );

        let mut values = container_event(9, "container.created", "box");
        values[1] = None;
        let error = read(&[&copy_data(&[values])]).unwrap_err();
        assert_eq!(error.to_string(), "position 9: no id");
    }

    #[test]
    fn a_timestamp_is_read_from_postgres_epoch_in_microseconds_and_infinity_is_refused() {
        let at = timestamptz(&849_398_400_000_001_i64.to_be_bytes()).unwrap();
        assert_eq!(at.to_rfc3339(), "2026-12-01T00:00:00.000001+00:00");
        assert_eq!(timestamptz(&i64::MAX.to_be_bytes()), None);
        assert_eq!(timestamptz(&i64::MIN.to_be_bytes()), None);
    }

    #[test]
    fn a_borrowed_key_finds_the_container_its_owned_key_was_stored_under() {
        let mut histories = Histories::default();
        let owned = ContainerKey {
            org_id: "org_a".to_owned(),
            container_id: "box".to_owned(),
        };
        histories.insert(owned, Vec::new());
        let found = |org_id, container_id| {
            histories.contains_key(&BorrowedKey {
                org_id,
                container_id,
            })
        };
        assert!(found("org_a", "box"));
        assert!(!found("org_b", "box"));
        assert!(!found("org_abo", "x"), "the field boundary counts");
    }
}
