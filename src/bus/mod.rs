//! NATS JetStream: the streams of `streams/*.json` (created or updated at start-up), the
//! relay that publishes the committed ledger, the check of that copy against the ledger,
//! and the ingest consumer.

pub mod check;
pub mod ingest;
pub mod relay;
pub mod status;

use std::time::Duration;

use async_nats::jetstream::{self, stream};

/// The stream definitions, in the `nats stream add --config` format, built into the binary
/// so that what runs is what was reviewed.
const STREAM_FILES: [(&str, &str); 3] = [
    (
        "TALLY_LEDGER",
        include_str!("../../streams/TALLY_LEDGER.json"),
    ),
    (
        "TALLY_INGEST",
        include_str!("../../streams/TALLY_INGEST.json"),
    ),
    ("TALLY_DLQ", include_str!("../../streams/TALLY_DLQ.json")),
];

/// How long one JetStream API request may take before it counts as failed.
pub const REQUEST_TIMEOUT_MS: u64 = 5_000;

/// The subject prefix of tally's reply inboxes. Not the default `_INBOX`: under the shipped
/// permissions (`deploy/nats/tally.conf`) producers may subscribe to `_INBOX.>` for their
/// publish acknowledgements, and tally's replies (pulled ingest messages, stream reads)
/// must not reach them.
/// Header carrying the ledger position of a message of the ledger stream.
pub const POSITION_HEADER: &str = "Tally-Position";
/// Header carrying the ledger hash of a message of the ledger stream (hex), so that a
/// message can be checked against its row without parsing the payload.
pub const HASH_HEADER: &str = "Tally-Hash";

pub const INBOX_PREFIX: &str = "_INBOX_tally";

/// Setting up NATS failed: a setting it cannot use, the server, or a stream. Only start-up
/// and the command line set it up; no HTTP answer carries one.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The namespace, the URL or a stream file.
    #[error("{0}")]
    Setting(String),
    #[error("cannot use NATS at {address}")]
    Connect {
        address: String,
        #[source]
        source: async_nats::ConnectError,
    },
    #[error("cannot create or update stream {name}")]
    Stream {
        name: String,
        #[source]
        source: jetstream::context::CreateStreamError,
    },
}

/// A failure to read or write a stream: what was being done, and why it failed (no cause
/// when the stream answered but not as expected). The stream check and the relay both
/// carry it.
#[derive(Debug, thiserror::Error)]
#[error("{what}")]
pub struct StreamFailure {
    what: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl StreamFailure {
    /// The stream answered, but not as expected.
    pub fn new(what: impl Into<String>) -> StreamFailure {
        StreamFailure {
            what: what.into(),
            source: None,
        }
    }

    /// For `map_err`: `what` was being done when `error` happened.
    pub fn doing<E: Into<Box<dyn std::error::Error + Send + Sync>>>(
        what: impl Into<String>,
    ) -> impl FnOnce(E) -> StreamFailure {
        let what = what.into();
        move |error| StreamFailure {
            what,
            source: Some(error.into()),
        }
    }
}

/// Stream names and subject prefixes, with the optional namespace applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    namespace: String,
}

impl Names {
    /// `namespace` must be empty or a single subject token of `[A-Za-z0-9_-]`.
    pub fn new(namespace: &str) -> Result<Names, Error> {
        if !namespace.is_empty() {
            crate::event::OrgId::parse(namespace)
                .map_err(|e| Error::Setting(format!("TALLY_NATS_NAMESPACE {e}")))?;
        }
        Ok(Names {
            namespace: namespace.to_owned(),
        })
    }

    pub fn stream(&self, name: &str) -> String {
        if self.namespace.is_empty() {
            name.to_owned()
        } else {
            format!("{}_{name}", self.namespace)
        }
    }

    pub fn subject(&self, subject: &str) -> String {
        if self.namespace.is_empty() {
            subject.to_owned()
        } else {
            format!("{}.{subject}", self.namespace)
        }
    }

    pub fn ledger_stream(&self) -> String {
        self.stream("TALLY_LEDGER")
    }
    pub fn ingest_stream(&self) -> String {
        self.stream("TALLY_INGEST")
    }
    pub fn dlq_stream(&self) -> String {
        self.stream("TALLY_DLQ")
    }
    /// `tally.ledger.<org_id>.<type>`
    pub fn ledger_subject(&self, org_id: &str, event_type: &str) -> String {
        self.subject(&format!("tally.ledger.{org_id}.{event_type}"))
    }
    pub fn ingest_prefix(&self) -> String {
        self.subject("tally.ingest.")
    }
    pub fn dlq_prefix(&self) -> String {
        self.subject("tally.dlq.")
    }

    /// The stream configurations from `streams/`, renamed into the namespace.
    pub fn stream_configs(&self) -> Result<Vec<stream::Config>, Error> {
        STREAM_FILES
            .iter()
            .map(|(name, text)| {
                let mut config: stream::Config = serde_json::from_str(text).map_err(|e| {
                    Error::Setting(format!("streams/{name}.json is not a stream config: {e}"))
                })?;
                config.name = self.stream(&config.name);
                config.subjects = config.subjects.iter().map(|s| self.subject(s)).collect();
                Ok(config)
            })
            .collect()
    }
}

/// Connects without waiting for the server: when NATS is down at start-up the client keeps
/// retrying in the background and HTTP ingest works meanwhile. A user and password in the
/// URL (`nats://user:pass@host:4222`, percent-encoded) are sent to the server: the client
/// library parses them but does not use them by itself.
pub async fn connect(url: &str) -> Result<async_nats::Client, Error> {
    let address: async_nats::ServerAddr = url
        .parse()
        .map_err(|error| Error::Setting(format!("NATS_URL is not a NATS URL: {error}")))?;
    let shown = redacted(&address);
    let mut options = async_nats::ConnectOptions::new();
    if let Some(user) = address.username() {
        let password = address.password().unwrap_or_default();
        options = options.user_and_password(percent_decoded(user)?, percent_decoded(password)?);
    }
    options
        .name("tally")
        .custom_inbox_prefix(INBOX_PREFIX)
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(Duration::from_millis(REQUEST_TIMEOUT_MS)))
        .connect(address)
        .await
        .map_err(|source| Error::Connect {
            address: shown,
            source,
        })
}

/// The server's address without its credentials, for messages and logs.
fn redacted(address: &async_nats::ServerAddr) -> String {
    format!(
        "{}://{}:{}",
        address.scheme(),
        address.host(),
        address.port()
    )
}

/// `%XX` sequences decoded, as URLs carry reserved characters in a user or password.
fn percent_decoded(text: &str) -> Result<String, Error> {
    let bad = |what: &str| Error::Setting(format!("{what} in NATS_URL"));
    let mut bytes = Vec::with_capacity(text.len());
    let mut rest = text.as_bytes();
    while let Some((&byte, tail)) = rest.split_first() {
        if byte == b'%' && tail.len() >= 2 {
            let hex = std::str::from_utf8(&tail[..2]).map_err(|_| bad("a bad %-escape"))?;
            bytes.push(u8::from_str_radix(hex, 16).map_err(|_| bad("a bad %-escape"))?);
            rest = &tail[2..];
        } else {
            bytes.push(byte);
            rest = tail;
        }
    }
    String::from_utf8(bytes).map_err(|_| bad("credentials that are not UTF-8"))
}

pub fn jetstream(client: async_nats::Client) -> jetstream::Context {
    let mut context = jetstream::new(client);
    context.set_timeout(Duration::from_millis(REQUEST_TIMEOUT_MS));
    context
}

/// Creates each of `streams` (unprefixed names, such as `TALLY_LEDGER`), or updates it to
/// its definition in `streams/` when it differs.
#[tracing::instrument(skip_all)]
pub async fn apply_streams(
    context: &jetstream::Context,
    names: &Names,
    streams: &[&str],
) -> Result<(), Error> {
    let wanted: Vec<String> = streams.iter().map(|s| names.stream(s)).collect();
    for config in names.stream_configs()? {
        if !wanted.contains(&config.name) {
            continue;
        }
        let name = config.name.clone();
        context
            .create_or_update_stream(config)
            .await
            .map_err(|source| Error::Stream {
                name: name.clone(),
                source,
            })?;
        tracing::info!(stream = name, "stream applied");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_files_parse_and_cover_the_three_subject_spaces() {
        let configs = Names::new("").unwrap().stream_configs().unwrap();
        let found: Vec<_> = configs
            .iter()
            .map(|c| (c.name.as_str(), c.subjects.clone()))
            .collect();
        assert_eq!(
            found,
            vec![
                ("TALLY_LEDGER", vec!["tally.ledger.>".to_string()]),
                ("TALLY_INGEST", vec!["tally.ingest.>".to_string()]),
                ("TALLY_DLQ", vec!["tally.dlq.>".to_string()]),
            ]
        );
        assert_eq!(
            configs[0].max_age,
            Duration::ZERO,
            "the ledger stream keeps everything"
        );
    }

    #[test]
    fn credentials_in_a_url_are_percent_decoded() {
        assert_eq!(percent_decoded("p%40ss%3Aw0rd").unwrap(), "p@ss:w0rd");
        assert_eq!(percent_decoded("plain").unwrap(), "plain");
        assert!(percent_decoded("bad%zz").is_err());
    }

    #[test]
    fn a_namespace_prefixes_streams_and_subjects() {
        let names = Names::new("bench1").unwrap();
        let configs = names.stream_configs().unwrap();
        assert_eq!(configs[0].name, "bench1_TALLY_LEDGER");
        assert_eq!(
            configs[0].subjects,
            vec!["bench1.tally.ledger.>".to_string()]
        );
        assert_eq!(
            names.ledger_subject("org_1", "container.created"),
            "bench1.tally.ledger.org_1.container.created"
        );
        assert!(Names::new("a.b").is_err());
    }
}
