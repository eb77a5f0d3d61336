//! The canonical encoding of a ledger record, which the hash chain and idempotency hash.
//!
//! Encoding: a JSON object with keys sorted by their UTF-8 bytes at every level, no
//! whitespace, strings escaped as `serde_json` escapes them, integers in plain decimal,
//! timestamps as RFC 3339 UTC with exactly three fractional digits and `Z`. Absent
//! optional members are written as `null`, so that every record has the same keys:
//!
//! ```text
//! {"container_id":…,"data":{…},"id":"<uuid>","occurred_at":"…Z","org_id":"…",
//!  "origin":null|{"id":…,"source":…},"position":N,"recorded_at":"…Z","type":"…"}
//! ```
//!
//! A CloudEvent that carried optional or extension attributes (decision 0023) has one more
//! member, `"attributes":{…}` (an object of strings), written first as sorting puts it,
//! and only then: a record without attributes is written exactly as above.
//!
//! The *content* of an event (what idempotency compares) is the same object without
//! `position`, `recorded_at` and `attributes`. The chain is
//! `hash = sha256(prev_hash ‖ canonical bytes)` with 32 zero bytes before the first record. Written by hand rather than via a map type
//! so that no crate feature (such as `serde_json/preserve_order`) can change the bytes.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::Value;
use sha2::{Digest, Sha256};
use uuid::Uuid;

/// The `prev_hash` of the first record.
pub const GENESIS_HASH: [u8; 32] = [0; 32];

/// The fields of a ledger record that the chain covers.
#[derive(Debug, Clone, Copy)]
pub struct RecordFields<'a> {
    pub id: Uuid,
    pub event_type: &'a str,
    pub org_id: &'a str,
    pub container_id: Option<&'a str>,
    pub occurred_at: DateTime<Utc>,
    pub data: &'a Value,
    pub origin_source: Option<&'a str>,
    pub origin_id: Option<&'a str>,
    /// A CloudEvent's kept attributes (an object of strings), or `None`: covered by the
    /// chain, not by the content digest.
    pub attributes: Option<&'a Value>,
}

pub fn timestamp(value: DateTime<Utc>) -> String {
    value.to_rfc3339_opts(SecondsFormat::Millis, true)
}

fn write_string(out: &mut Vec<u8>, value: &str) {
    serde_json::to_writer(&mut *out, value).expect("writing to a Vec cannot fail");
}

/// Writes any JSON value with object keys sorted, recursively.
fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort_unstable_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
            out.push(b'{');
            for (i, key) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(out, key);
                out.push(b':');
                write_value(out, &map[key]);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        other => serde_json::to_writer(&mut *out, other).expect("writing to a Vec cannot fail"),
    }
}

fn write_optional(out: &mut Vec<u8>, value: Option<&str>) {
    match value {
        Some(text) => write_string(out, text),
        None => out.extend_from_slice(b"null"),
    }
}

/// Writes the record; `placement` is `(position, recorded_at)` for the chain, `None` for
/// the content digest, which leaves the attributes out too. Keys are emitted in sorted
/// order by construction.
fn write_record(out: &mut Vec<u8>, fields: &RecordFields, placement: Option<(i64, DateTime<Utc>)>) {
    out.push(b'{');
    if let (Some(attributes), Some(_)) = (fields.attributes, placement) {
        out.extend_from_slice(b"\"attributes\":");
        write_value(out, attributes);
        out.push(b',');
    }
    out.extend_from_slice(b"\"container_id\":");
    write_optional(out, fields.container_id);
    out.extend_from_slice(b",\"data\":");
    write_value(out, fields.data);
    out.extend_from_slice(b",\"id\":");
    write_string(out, &fields.id.hyphenated().to_string());
    out.extend_from_slice(b",\"occurred_at\":");
    write_string(out, &timestamp(fields.occurred_at));
    out.extend_from_slice(b",\"org_id\":");
    write_string(out, fields.org_id);
    out.extend_from_slice(b",\"origin\":");
    match (fields.origin_source, fields.origin_id) {
        (Some(source), Some(id)) => {
            out.extend_from_slice(b"{\"id\":");
            write_string(out, id);
            out.extend_from_slice(b",\"source\":");
            write_string(out, source);
            out.push(b'}');
        }
        _ => out.extend_from_slice(b"null"),
    }
    if let Some((position, recorded_at)) = placement {
        out.extend_from_slice(b",\"position\":");
        out.extend_from_slice(position.to_string().as_bytes());
        out.extend_from_slice(b",\"recorded_at\":");
        write_string(out, &timestamp(recorded_at));
    }
    out.extend_from_slice(b",\"type\":");
    write_string(out, fields.event_type);
    out.push(b'}');
}

/// The canonical bytes of a record at a position.
pub fn record_bytes(fields: &RecordFields, position: i64, recorded_at: DateTime<Utc>) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    write_record(&mut out, fields, Some((position, recorded_at)));
    out
}

/// sha256 of the event's content alone: equal digests mean "the same event".
pub fn content_digest(fields: &RecordFields) -> [u8; 32] {
    let mut out = Vec::with_capacity(256);
    write_record(&mut out, fields, None);
    Sha256::digest(&out).into()
}

/// One link of the chain.
pub fn chain_hash(prev_hash: &[u8; 32], record_bytes: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(prev_hash);
    hasher.update(record_bytes);
    hasher.finalize().into()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields(data: &Value) -> RecordFields<'_> {
        RecordFields {
            id: Uuid::parse_str("0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55").unwrap(),
            event_type: "container.created",
            org_id: "org_8f2k",
            container_id: Some("ctr_51x"),
            occurred_at: "2026-11-29T10:00:00.123Z".parse().unwrap(),
            data,
            origin_source: None,
            origin_id: None,
            attributes: None,
        }
    }

    #[test]
    fn the_canonical_bytes_are_pinned() {
        let data = json!({"name": "analysis-task", "image": "py:3\"12"});
        let bytes = record_bytes(&fields(&data), 7, "2026-11-29T10:00:01Z".parse().unwrap());
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            r#"{"container_id":"ctr_51x","data":{"image":"py:3\"12","name":"analysis-task"},"id":"0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55","occurred_at":"2026-11-29T10:00:00.123Z","org_id":"org_8f2k","origin":null,"position":7,"recorded_at":"2026-11-29T10:00:01.000Z","type":"container.created"}"#
        );
    }

    #[test]
    fn key_order_of_the_input_does_not_change_the_bytes() {
        let a: Value =
            serde_json::from_str(r#"{"b": {"y": 1, "x": [true, null]}, "a": -3}"#).unwrap();
        let b: Value =
            serde_json::from_str(r#"{"a": -3, "b": {"x": [true, null], "y": 1}}"#).unwrap();
        let at = "2026-11-29T10:00:01Z".parse().unwrap();
        assert_eq!(
            record_bytes(&fields(&a), 1, at),
            record_bytes(&fields(&b), 1, at)
        );
        assert_eq!(content_digest(&fields(&a)), content_digest(&fields(&b)));
    }

    #[test]
    fn every_field_changes_the_content_digest() {
        let data = json!({"name": "x"});
        let base = fields(&data);
        let digest = content_digest(&base);
        let other_data = json!({"name": "y"});
        let variants = [
            RecordFields {
                event_type: "container.resumed",
                ..base
            },
            RecordFields {
                org_id: "org_other",
                ..base
            },
            RecordFields {
                container_id: None,
                ..base
            },
            RecordFields {
                occurred_at: "2026-11-29T10:00:00.124Z".parse().unwrap(),
                ..base
            },
            RecordFields {
                data: &other_data,
                ..base
            },
            RecordFields {
                origin_source: Some("s"),
                origin_id: Some("i"),
                ..base
            },
            RecordFields {
                id: Uuid::nil(),
                ..base
            },
        ];
        for variant in variants {
            assert_ne!(content_digest(&variant), digest, "{variant:?}");
        }
    }

    #[test]
    fn attributes_are_chained_but_are_not_content() {
        let data = json!({"name": "x"});
        let attributes = json!({"traceparent": "00-ab-cd-01", "dataschema": "https://s"});
        let plain = RecordFields {
            origin_source: Some("/src"),
            origin_id: Some("e1"),
            ..fields(&data)
        };
        let with = RecordFields {
            attributes: Some(&attributes),
            ..plain
        };
        let at = "2026-11-29T10:00:01Z".parse().unwrap();
        assert_eq!(content_digest(&with), content_digest(&plain));
        assert_ne!(record_bytes(&with, 3, at), record_bytes(&plain, 3, at));
        assert_eq!(
            String::from_utf8(record_bytes(&with, 3, at)).unwrap(),
            r#"{"attributes":{"dataschema":"https://s","traceparent":"00-ab-cd-01"},"container_id":"ctr_51x","data":{"name":"x"},"id":"0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55","occurred_at":"2026-11-29T10:00:00.123Z","org_id":"org_8f2k","origin":{"id":"e1","source":"/src"},"position":3,"recorded_at":"2026-11-29T10:00:01.000Z","type":"container.created"}"#
        );
    }

    #[test]
    fn the_chain_depends_on_the_previous_hash() {
        let a = chain_hash(&GENESIS_HASH, b"record");
        let b = chain_hash(&a, b"record");
        assert_ne!(a, b);
        assert_eq!(a, chain_hash(&GENESIS_HASH, b"record"));
        assert_eq!(
            hex::encode(chain_hash(&GENESIS_HASH, b"")),
            // sha256 of 32 zero bytes
            "66687aadf862bd776c8fc18b8e9f8e20089714856ee233b3902a591d0d5f2925"
        );
    }
}
