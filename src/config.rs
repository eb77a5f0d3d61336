//! Configuration: every setting comes from the environment (or the matching flag), has a
//! default that works on a developer machine, and carries its unit in its name.

use std::net::SocketAddr;
use std::time::Duration;

/// Postgres pool size: the relay holds one, the projector one per round, requests the rest;
/// the appender has one more of its own, outside the pool. Postgres itself defaults to 100
/// connections; several instances must fit under that.
pub const DB_POOL_MAX: u32 = 16;
/// How long a request waits for a pool connection before failing with 503: long enough to
/// ride out a burst, short enough that a dead database fails requests fast.
pub const DB_ACQUIRE_TIMEOUT_MS: u64 = 3_000;
/// Upper bound on any one statement, so that a stuck query cannot hold the ledger lock.
pub const DB_STATEMENT_TIMEOUT_MS: u64 = 15_000;
/// Largest request body, in bytes: a full batch of 1 000 events at maximal field lengths
/// is about 3 MiB.
pub const BODY_MAX_BYTES: usize = 4 * 1024 * 1024;
/// Events per ingest batch (contract §6).
pub const BATCH_EVENTS_MAX: usize = 1_000;
/// Append requests waiting for the appender; past it, producers get 503 and retry
/// rather than queueing without bound.
pub const APPEND_QUEUE_MAX: usize = 8_192;
/// Events in one group commit: large enough to amortize the commit, small enough that one
/// transaction stays in the low tens of milliseconds.
pub const APPEND_GROUP_EVENTS_MAX: usize = 10_000;
/// Whole-request deadline, in milliseconds.
pub const REQUEST_TIMEOUT_MS: u64 = 30_000;
/// Requests in progress at once; past it a request is shed at once with 503 and
/// `Retry-After` rather than queued. Far above what two cores serve (a request takes about
/// a millisecond), low enough that a flood cannot hold unbounded memory.
pub const HTTP_CONCURRENCY_MAX: usize = 1_024;
/// The largest provider report accepted, in bytes: imports stream, so this bounds disk
/// and time, not memory. Over HTTP an import must also finish within the request
/// timeout; `tally reports import` has none.
/// The largest audit page (`limit`); contract §6 caps it at 1000, so this may only lower it.
pub const PAGE_EVENTS_MAX: usize = 1_000;
pub const REPORT_MAX_BYTES: u64 = 2 * 1024 * 1024 * 1024;
/// The largest CSV text a gzip report may inflate to, in bytes: eight times the largest
/// report, above what exports compress to (CSV gzips about 5 to 10 to 1), and a bound on
/// the disk and time a small compressed body can take. Memory does not grow with it:
/// inflating streams.
pub const REPORT_MAX_INFLATED_BYTES: u64 = 8 * REPORT_MAX_BYTES;
/// Default backdate bound (contract §2).
pub const BACKDATE_DAYS: u32 = 35;
/// Ledger rows the relay reads and publishes per round.
pub const RELAY_BATCH_MAX: usize = 1_000;
/// How often the relay looks for events appended by other instances when nothing woke it.
pub const RELAY_POLL_MS: u64 = 250;
/// Messages the ingest consumer pulls per fetch.
pub const INGEST_FETCH_MAX: usize = 1_000;
/// Ledger events the projector applies per transaction: large enough to keep up with
/// bursts in few transactions, small enough that one round stays well under a second.
pub const PROJECTOR_BATCH_MAX: usize = 5_000;
/// How often the projector looks for events appended by other instances when nothing
/// woke it.
pub const PROJECTOR_POLL_MS: u64 = 250;
/// How long the first commit not yet projected waits for more before the projector
/// projects, so that one round carries many group commits under load. Counted from when it
/// began to wait: after a round that long, the next starts at once. A reader waiting for
/// freshness (admission's read-your-writes) cuts the wait short.
pub const PROJECTOR_LINGER_MS: u64 = 50;
/// How long a request's head (request line and headers) may take to arrive, counted from
/// its first byte, or from the accept for a new connection: a client on any real network
/// sends a head in well under a second, and a connection that trickles it holds a file
/// descriptor for nothing.
pub const HTTP_HEADER_READ_TIMEOUT_MS: u64 = 5_000;
/// How long a request body may send nothing while the handler waits for it (a gap between
/// chunks, not a deadline for the whole body, so a steady 2 GiB report upload is never cut
/// off); past it the request is answered 408 `body_timeout` and its request slot freed.
pub const HTTP_BODY_READ_TIMEOUT_MS: u64 = 10_000;
/// How long a keep-alive connection may wait between requests before it is closed: longer
/// than the 60 s idle timeout of common load balancers, so that the balancer, not tally,
/// closes a shared idle connection (closing it from this side races the balancer's next
/// request on it).
pub const HTTP_IDLE_TIMEOUT_MS: u64 = 75_000;
/// Connections open at once. Each holds a file descriptor and up to a few tens of KiB of
/// buffers; 4 096 is far above what a producer fleet behind a few proxies opens and well
/// under the open-files limit tally raises itself to at start (the limit is lowered to fit
/// when the process may not open that many files). Past it, the longest-waiting connection
/// without a request in progress is closed to make room; when every connection has one,
/// the new one is answered 503 `too_many_connections` and closed.
pub const HTTP_CONNECTIONS_MAX: usize = 4_096;
/// How long a response may wait for the client to read any of it (a gap, not a deadline
/// for the whole response, so a long export to a slow reader goes through): a client that
/// reads nothing for this long is gone or holding the connection on purpose, and a
/// connection with a response in progress cannot be closed to make room for another.
pub const HTTP_WRITE_TIMEOUT_MS: u64 = 30_000;

/// Requests in progress at once from one token; past it that token's requests get 429
/// `too_many_requests` with `Retry-After` while other tokens are served. A quarter of
/// [`HTTP_CONCURRENCY_MAX`], so that it takes four tokens to fill every slot; well above
/// the 64 clients `tally-bench` runs with one token.
pub const TOKEN_CONCURRENCY_MAX: usize = 256;

/// Orgs a period close or usage export reads, prices and writes per batch: a batch is a few
/// statements of a few milliseconds each and its rows are a few hundred kilobytes, so
/// memory stays bounded whatever the number of orgs while round trips stay few.
pub const FINANCE_BATCH_ORGS: u32 = 1_000;

/// How long a read of derived figures waits for the projection to reach the position it
/// needs (contract §8) before answering 503 `projection_lagging`: the projection trails the
/// ledger by tens of milliseconds, so two seconds is far past normal lag and still short
/// enough for a caller to retry.
pub const READ_WAIT_MS: u64 = 2_000;
/// The longest read wait that may be set: an hour. (Also the bound of a correction's wait
/// for another, whose lock timeout 0 would mean no bound at all.)
pub const READ_WAIT_MS_MAX: u64 = 3_600_000;

/// Connections to the read database (`TALLY_READ_DATABASE_URL`): audit pages and exports
/// are the only reads sent there, and each holds one connection for its length, so a few
/// carry them; a small pool also keeps several instances far under the replica's
/// `max_connections` (which a hot standby needs at least as high as the primary's).
pub const READ_DB_POOL_MAX: u32 = 4;
/// The largest `TALLY_READ_DB_POOL_MAX` accepted: Postgres's default `max_connections` is
/// 100, so a larger pool per instance would let two instances exhaust a default replica.
pub const READ_DB_POOL_LIMIT: u32 = 48;

#[derive(Debug, Clone, clap::Args)]
pub struct Config {
    /// Postgres URL; the database is created when missing.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/tally"
    )]
    pub database_url: String,

    /// NATS server URL (JetStream enabled), or several separated by commas
    /// (`nats://a:4222,nats://b:4222`, at most 16): tally connects to any and reconnects to
    /// any other when it loses one.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,

    /// Address the HTTP API listens on.
    #[arg(long, env = "TALLY_LISTEN", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,

    /// The admin bearer token for `/v1/*`. Without it every `/v1/*` request is refused.
    #[arg(long, env = "TALLY_BOOTSTRAP_TOKEN", hide_env_values = true)]
    pub bootstrap_token: Option<String>,

    /// Prefix for JetStream stream names and subjects, to share one NATS server between
    /// several tally deployments (the benchmark uses it). Empty in production.
    #[arg(long, env = "TALLY_NATS_NAMESPACE", default_value = "")]
    pub nats_namespace: String,

    /// Events older than this many days are refused (outside the correction flow).
    #[arg(long, env = "TALLY_BACKDATE_DAYS", default_value_t = BACKDATE_DAYS)]
    pub backdate_days: u32,

    #[arg(long, env = "TALLY_DB_POOL_MAX", default_value_t = DB_POOL_MAX)]
    pub db_pool_max: u32,

    #[arg(long, env = "TALLY_DB_ACQUIRE_TIMEOUT_MS", default_value_t = DB_ACQUIRE_TIMEOUT_MS)]
    pub db_acquire_timeout_ms: u64,

    #[arg(long, env = "TALLY_DB_STATEMENT_TIMEOUT_MS", default_value_t = DB_STATEMENT_TIMEOUT_MS)]
    pub db_statement_timeout_ms: u64,

    #[arg(long, env = "TALLY_BODY_MAX_BYTES", default_value_t = BODY_MAX_BYTES)]
    pub body_max_bytes: usize,

    #[arg(long, env = "TALLY_BATCH_EVENTS_MAX", default_value_t = BATCH_EVENTS_MAX)]
    pub batch_events_max: usize,

    #[arg(long, env = "TALLY_APPEND_QUEUE_MAX", default_value_t = APPEND_QUEUE_MAX)]
    pub append_queue_max: usize,

    #[arg(long, env = "TALLY_APPEND_GROUP_EVENTS_MAX", default_value_t = APPEND_GROUP_EVENTS_MAX)]
    pub append_group_events_max: usize,

    #[arg(long, env = "TALLY_REQUEST_TIMEOUT_MS", default_value_t = REQUEST_TIMEOUT_MS)]
    pub request_timeout_ms: u64,

    #[arg(long, env = "TALLY_HTTP_CONCURRENCY_MAX", default_value_t = HTTP_CONCURRENCY_MAX)]
    pub http_concurrency_max: usize,

    #[arg(long, env = "TALLY_REPORT_MAX_BYTES", default_value_t = REPORT_MAX_BYTES)]
    pub report_max_bytes: u64,

    #[arg(long, env = "TALLY_REPORT_MAX_INFLATED_BYTES", default_value_t = REPORT_MAX_INFLATED_BYTES)]
    pub report_max_inflated_bytes: u64,

    #[arg(long, env = "TALLY_PAGE_EVENTS_MAX", default_value_t = PAGE_EVENTS_MAX, value_parser = page_events_max)]
    pub page_events_max: usize,

    #[arg(long, env = "TALLY_RELAY_BATCH_MAX", default_value_t = RELAY_BATCH_MAX)]
    pub relay_batch_max: usize,

    #[arg(long, env = "TALLY_RELAY_POLL_MS", default_value_t = RELAY_POLL_MS)]
    pub relay_poll_ms: u64,

    #[arg(long, env = "TALLY_INGEST_FETCH_MAX", default_value_t = INGEST_FETCH_MAX)]
    pub ingest_fetch_max: usize,

    #[arg(long, env = "TALLY_PROJECTOR_BATCH_MAX", default_value_t = PROJECTOR_BATCH_MAX)]
    pub projector_batch_max: usize,

    #[arg(long, env = "TALLY_PROJECTOR_POLL_MS", default_value_t = PROJECTOR_POLL_MS)]
    pub projector_poll_ms: u64,

    #[arg(long, env = "TALLY_PROJECTOR_LINGER_MS", default_value_t = PROJECTOR_LINGER_MS)]
    pub projector_linger_ms: u64,

    #[arg(long, env = "TALLY_TOKEN_CONCURRENCY_MAX", default_value_t = TOKEN_CONCURRENCY_MAX)]
    pub token_concurrency_max: usize,

    #[arg(long, env = "TALLY_HTTP_HEADER_READ_TIMEOUT_MS", default_value_t = HTTP_HEADER_READ_TIMEOUT_MS)]
    pub http_header_read_timeout_ms: u64,

    #[arg(long, env = "TALLY_HTTP_BODY_READ_TIMEOUT_MS", default_value_t = HTTP_BODY_READ_TIMEOUT_MS)]
    pub http_body_read_timeout_ms: u64,

    #[arg(long, env = "TALLY_HTTP_IDLE_TIMEOUT_MS", default_value_t = HTTP_IDLE_TIMEOUT_MS)]
    pub http_idle_timeout_ms: u64,

    #[arg(long, env = "TALLY_HTTP_CONNECTIONS_MAX", default_value_t = HTTP_CONNECTIONS_MAX)]
    pub http_connections_max: usize,

    #[arg(long, env = "TALLY_HTTP_WRITE_TIMEOUT_MS", default_value_t = HTTP_WRITE_TIMEOUT_MS)]
    pub http_write_timeout_ms: u64,

    #[arg(long, env = "TALLY_FINANCE_BATCH_ORGS", default_value_t = FINANCE_BATCH_ORGS,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub finance_batch_orgs: u32,

    #[arg(long, env = "TALLY_READ_WAIT_MS", default_value_t = READ_WAIT_MS,
          value_parser = clap::value_parser!(u64).range(1..=READ_WAIT_MS_MAX))]
    pub read_wait_ms: u64,

    /// What "now" is for the service's rules: the system clock, unless a test sets it.
    #[arg(skip)]
    pub clock: crate::clock::Clock,

    // Scale-out: streams replicated over a JetStream cluster.
    /// Copies a JetStream cluster keeps of each of tally's streams, 1 to 5; overrides the
    /// `num_replicas` of `streams/*.json` when tally creates or updates them. 3 on a
    /// 3-node cluster; 1 on a single server, which refuses more (decision 0030).
    #[arg(long, env = "TALLY_STREAM_REPLICAS", default_value_t = STREAM_REPLICAS,
          value_parser = stream_replicas)]
    pub stream_replicas: usize,

    // Reads from a replica.
    /// A streaming replica of `DATABASE_URL`: audit pages and exports read there (waiting
    /// until it has replayed what they need); unset or empty, they read the primary.
    #[arg(long, env = "TALLY_READ_DATABASE_URL", hide_env_values = true)]
    pub read_database_url: Option<String>,

    #[arg(long, env = "TALLY_READ_DB_POOL_MAX", default_value_t = READ_DB_POOL_MAX,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(READ_DB_POOL_LIMIT)))]
    pub read_db_pool_max: u32,

    // The partitioned ledger (docs/decisions/0029-ledger-partitions.md).
    /// What the appender dates rows with (`recorded_at`, so also which month's table they
    /// go to) and what the upkeep of the ledger's months looks ahead from: the system
    /// clock, unless a test sets it. Not a setting, like `clock`.
    #[arg(skip)]
    pub ledger_clock: crate::clock::Clock,
}

/// One copy of each stream: what a single nats-server can hold.
pub const STREAM_REPLICAS: usize = 1;
/// The most copies JetStream keeps of a stream (its own limit on `num_replicas`).
pub const STREAM_REPLICAS_MAX: usize = 5;

/// 1 to 5: JetStream keeps no more copies of a stream.
fn stream_replicas(value: &str) -> Result<usize, String> {
    value
        .parse::<usize>()
        .ok()
        .filter(|replicas| (1..=STREAM_REPLICAS_MAX).contains(replicas))
        .ok_or_else(|| format!("{value:?}: a whole number from 1 to {STREAM_REPLICAS_MAX}"))
}

/// 1 to 1000: contract §6 allows no larger page.
fn page_events_max(value: &str) -> Result<usize, String> {
    value
        .parse::<usize>()
        .ok()
        .filter(|max| (1..=PAGE_EVENTS_MAX).contains(max))
        .ok_or_else(|| format!("{value:?}: a whole number from 1 to {PAGE_EVENTS_MAX}"))
}

impl Config {
    /// The defaults, for a given database and NATS server (tests and the benchmark).
    pub fn new(database_url: impl Into<String>, nats_url: impl Into<String>) -> Config {
        Config {
            database_url: database_url.into(),
            nats_url: nats_url.into(),
            listen: "127.0.0.1:0".parse().expect("a literal address"),
            bootstrap_token: None,
            nats_namespace: String::new(),
            backdate_days: BACKDATE_DAYS,
            db_pool_max: DB_POOL_MAX,
            db_acquire_timeout_ms: DB_ACQUIRE_TIMEOUT_MS,
            db_statement_timeout_ms: DB_STATEMENT_TIMEOUT_MS,
            body_max_bytes: BODY_MAX_BYTES,
            batch_events_max: BATCH_EVENTS_MAX,
            append_queue_max: APPEND_QUEUE_MAX,
            append_group_events_max: APPEND_GROUP_EVENTS_MAX,
            request_timeout_ms: REQUEST_TIMEOUT_MS,
            http_concurrency_max: HTTP_CONCURRENCY_MAX,
            report_max_bytes: REPORT_MAX_BYTES,
            report_max_inflated_bytes: REPORT_MAX_INFLATED_BYTES,
            page_events_max: PAGE_EVENTS_MAX,
            relay_batch_max: RELAY_BATCH_MAX,
            relay_poll_ms: RELAY_POLL_MS,
            ingest_fetch_max: INGEST_FETCH_MAX,
            projector_batch_max: PROJECTOR_BATCH_MAX,
            projector_poll_ms: PROJECTOR_POLL_MS,
            projector_linger_ms: PROJECTOR_LINGER_MS,
            token_concurrency_max: TOKEN_CONCURRENCY_MAX,
            http_header_read_timeout_ms: HTTP_HEADER_READ_TIMEOUT_MS,
            http_body_read_timeout_ms: HTTP_BODY_READ_TIMEOUT_MS,
            http_idle_timeout_ms: HTTP_IDLE_TIMEOUT_MS,
            http_connections_max: HTTP_CONNECTIONS_MAX,
            http_write_timeout_ms: HTTP_WRITE_TIMEOUT_MS,
            finance_batch_orgs: FINANCE_BATCH_ORGS,
            read_wait_ms: READ_WAIT_MS,
            clock: crate::clock::Clock::system(),
            // Scale-out.
            stream_replicas: STREAM_REPLICAS,
            // Reads from a replica.
            read_database_url: None,
            read_db_pool_max: READ_DB_POOL_MAX,
            // The partitioned ledger.
            ledger_clock: crate::clock::Clock::system(),
        }
    }

    pub fn backdate_max(&self) -> chrono::Duration {
        chrono::Duration::days(i64::from(self.backdate_days))
    }

    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// The read database's URL, when one is set (an empty value is none).
    pub fn read_database(&self) -> Option<&str> {
        self.read_database_url
            .as_deref()
            .filter(|url| !url.trim().is_empty())
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        config: Config,
    }

    fn parse(flags: &[&str]) -> Result<Config, clap::Error> {
        Flags::try_parse_from(std::iter::once("tally").chain(flags.iter().copied()))
            .map(|flags| flags.config)
    }

    #[test]
    fn the_read_pool_takes_one_to_its_limit_and_refuses_past_it() {
        assert_eq!(
            parse(&["--read-db-pool-max", "1"])
                .unwrap()
                .read_db_pool_max,
            1
        );
        let limit = READ_DB_POOL_LIMIT.to_string();
        assert_eq!(
            parse(&["--read-db-pool-max", &limit])
                .unwrap()
                .read_db_pool_max,
            READ_DB_POOL_LIMIT
        );
        let past = (READ_DB_POOL_LIMIT + 1).to_string();
        for bad in ["0", past.as_str(), "x"] {
            assert!(parse(&["--read-db-pool-max", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_read_wait_takes_a_millisecond_to_an_hour_and_refuses_past_it() {
        let max = READ_WAIT_MS_MAX.to_string();
        for (flag, wait) in [("1", 1), (max.as_str(), READ_WAIT_MS_MAX)] {
            assert_eq!(parse(&["--read-wait-ms", flag]).unwrap().read_wait_ms, wait);
        }
        let past = (READ_WAIT_MS_MAX + 1).to_string();
        for bad in ["0", past.as_str(), "-1"] {
            assert!(parse(&["--read-wait-ms", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_empty_read_database_url_means_none() {
        let mut config = Config::new("postgres://primary/tally", "nats://unused");
        assert_eq!(config.read_database(), None);
        config.read_database_url = Some(" ".into());
        assert_eq!(config.read_database(), None);
        config.read_database_url = Some("postgres://replica/tally".into());
        assert_eq!(config.read_database(), Some("postgres://replica/tally"));
    }
}
