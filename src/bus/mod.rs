//! NATS JetStream: the streams of `streams/*.json` (created or updated at start-up), the
//! relay that publishes the committed ledger, the check of that copy against the ledger,
//! and the ingest consumer.

pub mod check;
mod dead_letter;
pub mod ingest;
pub mod relay;
pub mod status;
pub mod unreadable;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::context::CreateStreamErrorKind;
use async_nats::jetstream::{self, stream};

use crate::config::STREAM_REPLICAS_MAX;

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
/// The ingest stream's durable consumer.
pub const INGEST_CONSUMER: &str = "tally-ingest";
/// Unacknowledged messages the server lets the ingest consumer hold, over all instances.
/// Each instance's pipeline ([`ingest`]) holds at most four batches (one fetched ahead, one
/// being prepared, one queued and waiting to be settled, one committing or being settled),
/// 4 000 messages at the default [`crate::config::INGEST_FETCH_MAX`]: this leaves room for
/// several instances, a larger configured fetch, and the messages of a stopped instance
/// until they are redelivered.
pub const INGEST_ACK_PENDING_MAX: i64 = 20_000;

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

/// Tally's streams as this deployment has them: their names and subject prefixes, with the
/// optional namespace applied, and the copies the cluster keeps of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    namespace: String,
    replicas: usize,
}

impl Names {
    /// `namespace` must be empty or a single subject token of `[A-Za-z0-9_-]`. The streams
    /// keep one copy unless [`Names::with_replicas`] says otherwise.
    pub fn new(namespace: &str) -> Result<Names, Error> {
        if !namespace.is_empty() {
            crate::event::OrgId::parse(namespace)
                .map_err(|e| Error::Setting(format!("TALLY_NATS_NAMESPACE {e}")))?;
        }
        Ok(Names {
            namespace: namespace.to_owned(),
            replicas: 1,
        })
    }

    /// Every stream with `replicas` copies (`TALLY_STREAM_REPLICAS`, 1 to
    /// [`STREAM_REPLICAS_MAX`]) in place of the `num_replicas` of its file: applying the
    /// streams creates them so, or changes an existing stream's copies to it (decision
    /// 0030). More than one needs a JetStream cluster of at least that many servers.
    pub fn with_replicas(self, replicas: usize) -> Result<Names, Error> {
        if !(1..=STREAM_REPLICAS_MAX).contains(&replicas) {
            return Err(Error::Setting(format!(
                "TALLY_STREAM_REPLICAS {replicas}: a whole number from 1 to {STREAM_REPLICAS_MAX}"
            )));
        }
        Ok(Names { replicas, ..self })
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

    /// The stream configurations from `streams/`, renamed into the namespace, with this
    /// deployment's replica count.
    pub fn stream_configs(&self) -> Result<Vec<stream::Config>, Error> {
        STREAM_FILES
            .iter()
            .map(|(name, text)| {
                let mut config: stream::Config = serde_json::from_str(text).map_err(|e| {
                    Error::Setting(format!("streams/{name}.json is not a stream config: {e}"))
                })?;
                config.name = self.stream(&config.name);
                config.subjects = config.subjects.iter().map(|s| self.subject(s)).collect();
                config.num_replicas = self.replicas;
                Ok(config)
            })
            .collect()
    }
}

/// Servers `NATS_URL` may name: a cluster of up to 5 JetStream nodes plus leaf or
/// gateway entry points fits many times over, and each entry costs a connection attempt
/// when the client goes round the list after losing its server.
pub const NATS_SERVERS_MAX: usize = 16;

/// The servers of `NATS_URL`, one or several separated by commas
/// (`nats://a:4222,nats://b:4222`, as the `nats` tools take them), parsed, with the one user
/// and password they carry (`None` when none does).
#[derive(Debug, Clone, PartialEq)]
pub struct Servers {
    addresses: Vec<async_nats::ServerAddr>,
    credentials: Option<(String, String)>,
}

impl Servers {
    /// Each entry must be a NATS URL (`nats://`, `tls://`, `ws://`, `wss://`; the scheme and
    /// port 4222 may be left out); none may be empty; at most [`NATS_SERVERS_MAX`]; the
    /// entries that carry a user and password must all carry the same ones, since the
    /// client sends one set to whichever server it reaches. An error names the entry by
    /// its place and its text, with any password hidden.
    pub fn parse(list: &str) -> Result<Servers, Error> {
        let entries: Vec<&str> = list.split(',').map(str::trim).collect();
        if entries.len() > NATS_SERVERS_MAX {
            return Err(Error::Setting(format!(
                "NATS_URL names {} servers; at most {NATS_SERVERS_MAX}",
                entries.len()
            )));
        }
        let mut addresses = Vec::with_capacity(entries.len());
        let mut credentials: Option<(String, String)> = None;
        for (index, entry) in entries.iter().enumerate() {
            let place = format!("NATS_URL entry {} ({:?})", index + 1, hide_password(entry));
            if entry.is_empty() {
                return Err(Error::Setting(format!(
                    "NATS_URL entry {} is empty: servers are separated by single commas",
                    index + 1
                )));
            }
            let address: async_nats::ServerAddr = entry
                .parse()
                .map_err(|error| Error::Setting(format!("{place} is not a NATS URL: {error}")))?;
            if let Some(user) = address.username() {
                let password = address.password().unwrap_or_default();
                let given = (percent_decoded(user)?, percent_decoded(password)?);
                match &credentials {
                    Some(first) if *first != given => {
                        return Err(Error::Setting(format!(
                            "{place} names another user or password than an entry before it; \
                             the client sends one to every server"
                        )))
                    }
                    _ => credentials = Some(given),
                }
            }
            addresses.push(address);
        }
        if addresses.iter().any(|a| a.is_websocket()) && !addresses.iter().all(|a| a.is_websocket())
        {
            return Err(Error::Setting(
                "NATS_URL mixes websocket (ws://, wss://) and other servers; the client cannot"
                    .into(),
            ));
        }
        Ok(Servers {
            addresses,
            credentials,
        })
    }

    /// The servers without their credentials, comma-separated, for messages and logs.
    pub fn shown(&self) -> String {
        self.addresses
            .iter()
            .map(redacted)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// An entry as written, with whatever stands between `://` (or the start) and `@` cut to
/// the user, so that a message naming a bad entry does not print its password.
fn hide_password(entry: &str) -> String {
    let Some(at) = entry.rfind('@') else {
        return entry.to_owned();
    };
    let start = entry.find("://").map_or(0, |scheme| scheme + 3).min(at);
    let user = entry[start..at].split(':').next().unwrap_or_default();
    format!("{}{user}:***{}", &entry[..start], &entry[at..])
}

/// Connects without waiting for a server: when NATS is down at start-up the client keeps
/// retrying in the background and HTTP ingest works meanwhile. With several servers it
/// connects to any one of them and, when that one goes away, reconnects to any other (and
/// to the servers the cluster announces). A user and password in the URLs
/// (`nats://user:pass@host:4222`, percent-encoded) are sent to the server: the client
/// library parses them but does not use them by itself.
pub async fn connect(url: &str) -> Result<async_nats::Client, Error> {
    connect_as(url, "tally", async_nats::ConnectOptions::new()).await
}

/// [`connect`] as the client `name`, starting from `options` (an event callback, say).
pub async fn connect_as(
    url: &str,
    name: &str,
    mut options: async_nats::ConnectOptions,
) -> Result<async_nats::Client, Error> {
    let servers = Servers::parse(url)?;
    let shown = servers.shown();
    if let Some((user, password)) = servers.credentials {
        options = options.user_and_password(user, password);
    }
    options
        .name(name)
        .custom_inbox_prefix(INBOX_PREFIX)
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(5))
        .request_timeout(Some(Duration::from_millis(REQUEST_TIMEOUT_MS)))
        .connect(servers.addresses)
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
/// its definition in `streams/` when it differs, with `names`' replica count: a stream
/// created with one copy is scaled to three by the cluster, which copies its messages to
/// the new replicas while it keeps serving.
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

/// The streams the server refused to create or update as tally defines them (a replica
/// count the cluster cannot keep, a limit the account does not allow), each with the
/// server's answer; shared by the relay and the ingest consumer, which apply the streams,
/// with `/readyz`, which is not ready while any is refused. A request that timed out or
/// found no server is no refusal: that is NATS being down, which `/readyz` says apart.
#[derive(Debug, Clone, Default)]
pub struct StreamHealth(Arc<Mutex<BTreeMap<String, String>>>);

impl StreamHealth {
    /// [`apply_streams`], noting which stream the server refused and clearing `streams`
    /// once applied.
    pub async fn apply(
        &self,
        context: &jetstream::Context,
        names: &Names,
        streams: &[&str],
    ) -> Result<(), Error> {
        let applied = apply_streams(context, names, streams).await;
        let mut refused = self.0.lock().expect("the stream health lock");
        match &applied {
            Ok(()) => {
                for stream in streams {
                    refused.remove(&names.stream(stream));
                }
            }
            Err(Error::Stream { name, source })
                if matches!(source.kind(), CreateStreamErrorKind::JetStream(_)) =>
            {
                refused.insert(
                    name.clone(),
                    format!("{source} (TALLY_STREAM_REPLICAS {})", names.replicas),
                );
            }
            Err(_) => {}
        }
        applied
    }

    /// Each refused stream with the server's answer, as `"NAME: answer"`.
    pub fn refused(&self) -> Vec<String> {
        let refused = self.0.lock().expect("the stream health lock");
        refused
            .iter()
            .map(|(name, answer)| format!("{name}: {answer}"))
            .collect()
    }
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

    fn setting_error(list: &str) -> String {
        match Servers::parse(list) {
            Err(Error::Setting(message)) => message,
            other => panic!("{list:?} was accepted: {other:?}"),
        }
    }

    #[test]
    fn nats_url_takes_one_server_or_several_separated_by_commas() {
        let one = Servers::parse("nats://127.0.0.1:4222").unwrap();
        assert_eq!(one.shown(), "nats://127.0.0.1:4222");
        let three = Servers::parse("nats://a:4222, nats://b:5222 ,c").unwrap();
        assert_eq!(three.shown(), "nats://a:4222,nats://b:5222,nats://c:4222");
        assert_eq!(three.credentials, None);
    }

    #[test]
    fn nats_url_takes_sixteen_servers_and_refuses_seventeen() {
        let list = |count: usize| {
            (0..count)
                .map(|n| format!("nats://10.0.0.{n}:4222"))
                .collect::<Vec<_>>()
                .join(",")
        };
        assert_eq!(
            Servers::parse(&list(NATS_SERVERS_MAX))
                .unwrap()
                .addresses
                .len(),
            NATS_SERVERS_MAX
        );
        assert_eq!(
            setting_error(&list(NATS_SERVERS_MAX + 1)),
            "NATS_URL names 17 servers; at most 16"
        );
    }

    #[test]
    fn a_bad_entry_is_named_by_its_place_and_text_without_its_password() {
        let message = setting_error("nats://a:4222,http://tally:s3cret@b:4222");
        assert!(
            message
                .starts_with("NATS_URL entry 2 (\"http://tally:***@b:4222\") is not a NATS URL: "),
            "{message}"
        );
        assert!(!message.contains("s3cret"), "{message}");
        assert_eq!(
            setting_error("nats://a:4222,,nats://b:4222"),
            "NATS_URL entry 2 is empty: servers are separated by single commas"
        );
        assert_eq!(
            setting_error("nats://a:4222,"),
            "NATS_URL entry 2 is empty: servers are separated by single commas"
        );
        assert!(
            setting_error("nats://a:99999").starts_with("NATS_URL entry 1 (\"nats://a:99999\")")
        );
        assert!(setting_error("nats://a:4222,ws://b:8080").contains("mixes websocket"));
    }

    #[test]
    fn the_servers_share_one_user_and_password() {
        let servers =
            Servers::parse("nats://tally:p%40ss@a:4222,nats://b:4222,nats://tally:p%40ss@c")
                .unwrap();
        assert_eq!(
            servers.credentials,
            Some(("tally".to_owned(), "p@ss".to_owned()))
        );
        assert_eq!(servers.shown(), "nats://a:4222,nats://b:4222,nats://c:4222");
        let message = setting_error("nats://tally:one@a:4222,nats://tally:two@b:4222");
        assert!(
            message
                .starts_with("NATS_URL entry 2 (\"nats://tally:***@b:4222\") names another user"),
            "{message}"
        );
    }

    #[test]
    fn the_replica_count_replaces_the_files_and_is_one_to_five() {
        let names = Names::new("").unwrap();
        assert!(names
            .stream_configs()
            .unwrap()
            .iter()
            .all(|c| c.num_replicas == 1));
        let three = names.clone().with_replicas(3).unwrap();
        assert!(three
            .stream_configs()
            .unwrap()
            .iter()
            .all(|c| c.num_replicas == 3));
        for refused in [0, STREAM_REPLICAS_MAX + 1] {
            assert!(names.clone().with_replicas(refused).is_err(), "{refused}");
        }
        assert!(names.with_replicas(STREAM_REPLICAS_MAX).is_ok());
    }
}
