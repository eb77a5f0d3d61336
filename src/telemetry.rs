//! Telemetry: structured logs through `tracing`, metrics through the `metrics` facade with a
//! process-wide Prometheus recorder that `GET /metrics` renders.

use std::sync::OnceLock;

use metrics::{Label, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{fmt, EnvFilter};

use crate::error_code::ErrorCode;

/// Logs as JSON lines (one object per event) unless `TALLY_LOG_FORMAT=text`; the level
/// comes from `RUST_LOG` (default `info`).
pub fn init_logs() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let text = std::env::var("TALLY_LOG_FORMAT").is_ok_and(|v| v == "text");
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // Logging set up twice (tests start many services in one process) is not an error.
    let _ = if text {
        builder.try_init()
    } else {
        builder.json().flatten_event(true).try_init()
    };
}

/// Durations of append groups, projection rounds and admission checks' waits for them, in
/// seconds: group commits take a few milliseconds, a round of a large backlog seconds.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Events per append group or projection round: from one event to a full group.
const BATCH_BUCKETS_EVENTS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
];
/// Admission checks answered by one read: from one to a full group (64).
const GROUP_BUCKETS_CHECKS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0];

/// The Prometheus type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    /// As the `# TYPE` line spells it.
    pub const fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// The series a family has from start-up, each at zero.
#[derive(Debug, Clone, Copy)]
pub enum Series {
    /// One series without labels.
    Unlabelled,
    /// One series per label set, in the label order of the call sites.
    Labelled(&'static [&'static [(&'static str, &'static str)]]),
    /// One series per error code of the contract plus `unavailable` (a refusal that is
    /// worth retrying), each with these labels before `code`.
    ErrorCodes(&'static [(&'static str, &'static str)]),
}

/// The `code` of a refusal that is worth retrying, beside the error codes.
pub const CODE_UNAVAILABLE: &str = "unavailable";

/// One metric family: its name, type, unit, help text, series and (histograms) buckets.
#[derive(Debug)]
pub struct Family {
    pub name: &'static str,
    pub kind: Kind,
    /// `Seconds` and `Bytes` families end in `_seconds` and `_bytes` (before `_total`).
    pub unit: Unit,
    pub help: &'static str,
    pub series: Series,
    /// The upper bounds of the buckets of a histogram; empty for the other kinds.
    pub buckets: &'static [f64],
}

/// Declares a `pub const` per family name and [`FAMILIES`], the one list of every family
/// tally exports: the call sites name families through the constants, start-up describes
/// and registers every entry, the exporter gets every histogram's buckets from it, and the
/// tests check the scrape and `docs/operations.md` against it.
macro_rules! families {
    ($($constant:ident = $name:literal, $kind:ident, $unit:ident, $series:expr, $buckets:expr, $help:literal;)*) => {
        $(
            #[doc = $help]
            pub const $constant: &str = $name;
        )*
        /// Every family tally exports, in the order of `docs/operations.md`.
        pub const FAMILIES: &[Family] = &[$(Family {
            name: $constant,
            kind: Kind::$kind,
            unit: Unit::$unit,
            help: $help,
            series: $series,
            buckets: $buckets,
        }),*];
    };
}

const ONE: Series = Series::Unlabelled;
const NONE: &[f64] = &[];

families! {
    // Ingest.
    INGEST_EVENTS = "tally_ingest_events_total", Counter, Count,
        Series::Labelled(&[
            &[("source", "http"), ("outcome", "stored")],
            &[("source", "http"), ("outcome", "duplicate")],
            &[("source", "nats"), ("outcome", "stored")],
            &[("source", "nats"), ("outcome", "dead_lettered")],
        ]), NONE,
        "Events received, by source and outcome: stored, duplicate (HTTP; over NATS a duplicate counts as stored) or dead_lettered (NATS messages).";
    INGEST_REQUESTS_REJECTED = "tally_ingest_requests_rejected_total", Counter, Count,
        Series::ErrorCodes(&[("source", "http")]), NONE,
        "POST /v1/events requests refused, by error code (unavailable: worth retrying).";
    // The ledger's appender.
    APPEND_EVENTS = "tally_append_events_total", Counter, Count, ONE, NONE,
        "Events appended to the ledger (new rows, duplicates excluded).";
    APPEND_BATCH_EVENTS = "tally_append_batch_events", Histogram, Count, ONE, BATCH_BUCKETS_EVENTS,
        "Events per committed append group.";
    APPEND_BATCH_SECONDS = "tally_append_batch_seconds", Histogram, Seconds, ONE, LATENCY_BUCKETS_SECONDS,
        "Time to commit an append group, from its first statement to its commit.";
    APPEND_FAILURES = "tally_append_failures_total", Counter, Count, ONE, NONE,
        "Append groups that failed as a whole (Postgres unreachable or failing); their requests get 503.";
    APPEND_ISOLATIONS = "tally_append_isolations_total", Counter, Count, ONE, NONE,
        "Append groups Postgres refused for their content, split to find the refused requests.";
    APPEND_UNSTORABLE_REQUESTS = "tally_append_unstorable_requests_total", Counter, Count, ONE, NONE,
        "Requests whose content Postgres refuses on its own (422 unstorable_event).";
    APPEND_LOCKED_FALLBACKS = "tally_append_locked_fallbacks_total", Counter, Count, ONE, NONE,
        "Append groups committed under the ledger lock after the lock-free path kept finding a moved head.";
    // The relay.
    RELAY_PUBLISHED = "tally_relay_published_total", Counter, Count, ONE, NONE,
        "Ledger rows published to the TALLY_LEDGER stream.";
    RELAY_ROWS = "tally_relay_rows_total", Counter, Count,
        Series::Labelled(&[&[("from", "memory")], &[("from", "ledger")]]), NONE,
        "Rows the relay took from this instance's commits in memory or read from the ledger.";
    RELAY_PUBLISHED_POSITION = "tally_relay_published_position", Gauge, Count, ONE, NONE,
        "Ledger position of the last row the relay published.";
    RELAY_LAG_EVENTS = "tally_relay_lag_events", Gauge, Count, ONE, NONE,
        "Rows committed by this instance and not yet published to the stream.";
    RELAY_HALTED = "tally_relay_halted", Gauge, Count, ONE, NONE,
        "1 when the relay halted on a stream message it did not write; 0 otherwise.";
    RELAY_HALTED_POSITION = "tally_relay_halted_position", Gauge, Count, ONE, NONE,
        "Ledger position of the stream message the relay halted on; 0 when not halted.";
    RELAY_ERRORS = "tally_relay_errors_total", Counter, Count, ONE, NONE,
        "Relay rounds interrupted by an error (NATS or Postgres); the relay resumes after a pause.";
    // The projection.
    PROJECTION_POSITION = "tally_projection_position", Gauge, Count, ONE, NONE,
        "Ledger position the projection has reached.";
    PROJECTION_LAG_POSITIONS = "tally_projection_lag_positions", Gauge, Count, ONE, NONE,
        "Ledger positions committed by this instance and not yet projected.";
    PROJECTION_LAG_SECONDS = "tally_projection_lag_seconds", Gauge, Seconds, ONE, NONE,
        "Age of the last projected event when projected (0 when caught up).";
    PROJECTION_ROUND_EVENTS = "tally_projection_round_events", Histogram, Count, ONE, BATCH_BUCKETS_EVENTS,
        "Events per projection round.";
    PROJECTION_ROUND_SECONDS = "tally_projection_round_seconds", Histogram, Seconds, ONE, LATENCY_BUCKETS_SECONDS,
        "Time of a projection round, from its first read to its commit.";
    PROJECTION_ROWS = "tally_projection_rows_total", Counter, Count,
        Series::Labelled(&[&[("from", "memory")], &[("from", "ledger")]]), NONE,
        "Events the projector took from this instance's commits in memory or read from the ledger.";
    PROJECTION_REFOLDS = "tally_projection_refolds_total", Counter, Count, ONE, NONE,
        "Containers whose history was folded again because an event arrived late.";
    PROJECTION_REFOLD_EVENTS = "tally_projection_refold_events_total", Counter, Count, ONE, NONE,
        "Events read again to fold containers for late events: their lifecycle events and \
         up to 10 000 commands outside their intervals, or their whole history when a void \
         reached them.";
    PROJECTION_ERRORS = "tally_projection_errors_total", Counter, Count, ONE, NONE,
        "Projection rounds that failed; the projector retries after a pause.";
    READ_LAGGING = "tally_read_lagging_total", Counter, Count, ONE, NONE,
        "Reads answered 503 projection_lagging because the projection did not reach the wanted position in time.";
    READ_REPLICA_LAGGING = "tally_read_replica_lagging_total", Counter, Count, ONE, NONE,
        "Audit pages and exports answered 503 replica_lagging because the read database had not replayed what they need in time.";
    // Admission.
    ADMISSION_CHECKS = "tally_admission_checks_total", Counter, Count,
        Series::Labelled(&[&[("allowed", "true")], &[("allowed", "false")]]), NONE,
        "Admission checks answered, by whether the action was allowed.";
    ADMISSION_CHECK_FACTS = "tally_admission_check_facts_total", Counter, Count,
        Series::Labelled(&[&[("source", "memory")], &[("source", "postgres")]]), NONE,
        "Admission checks by where their facts came from: memory (the cache) or postgres.";
    ADMISSION_GROUP_CHECKS = "tally_admission_group_checks", Histogram, Count, ONE, GROUP_BUCKETS_CHECKS,
        "Admission checks answered by one Postgres read.";
    ADMISSION_WAIT_SECONDS = "tally_admission_wait_seconds", Histogram, Seconds,
        Series::Labelled(&[&[("for", "notices")], &[("for", "checkpoint")]]), LATENCY_BUCKETS_SECONDS,
        "Time an admission check waited for the projection to hold its org's acknowledged events (read-your-writes), by what it waited for: the notices of this instance's rounds (facts kept in memory) or the stored checkpoint (facts read from Postgres); checks that did not wait are not counted.";
    ADMISSION_LISTENER_LOSSES = "tally_admission_listener_losses_total", Counter, Count, ONE, NONE,
        "Times the admission cache lost its Postgres notification listener; checks read Postgres until it listens again.";
    RESERVATIONS = "tally_reservations_total", Counter, Count,
        Series::Labelled(&[&[("outcome", "granted")], &[("outcome", "refused")]]), NONE,
        "Reservation requests, by outcome (granted, refused).";
    RESERVATIONS_CONSUMED = "tally_reservations_consumed_total", Counter, Count, ONE, NONE,
        "Reservations consumed by the start of the container they held a slot for.";
    // HTTP.
    HTTP_CONNECTIONS_OPEN = "tally_http_connections_open", Gauge, Count, ONE, NONE,
        "HTTP connections open.";
    HTTP_CONNECTIONS_REFUSED = "tally_http_connections_refused_total", Counter, Count, ONE, NONE,
        "HTTP connections refused at the connection cap (no idle connection to evict).";
    HTTP_CONNECTIONS_EVICTED = "tally_http_connections_evicted_total", Counter, Count, ONE, NONE,
        "Idle HTTP connections closed to make room for a new one at the connection cap.";
    HTTP_REQUEST_LINE_REFUSED = "tally_http_request_line_refused_total", Counter, Count, ONE, NONE,
        "HTTP requests refused because their request line was too long.";
    HTTP_HEADS_REFUSED = "tally_http_heads_refused_total", Counter, Count, ONE, NONE,
        "HTTP requests refused because their head had too many header fields or too many bytes.";
    HTTP_SHED = "tally_http_shed_total", Counter, Count, ONE, NONE,
        "HTTP requests shed (503 overloaded) because too many were in progress.";
    HTTP_TOKEN_LIMITED = "tally_http_token_limited_total", Counter, Count, ONE, NONE,
        "HTTP requests refused because their token had too many requests in progress.";
    VERIFY_REFUSED = "tally_verify_refused_total", Counter, Count, ONE, NONE,
        "Ledger verify requests refused because another verify pass was running.";
    // Finance.
    RECONCILIATIONS_RUNNING = "tally_reconciliations_running", Gauge, Count, ONE, NONE,
        "Reconciliations running on this instance, each on a database session of its own.";
    RECONCILIATIONS = "tally_reconciliations_total", Counter, Count,
        Series::Labelled(&[&[("outcome", "done")], &[("outcome", "failed")], &[("outcome", "refused")]]), NONE,
        "Reconciliations asked of this instance, by outcome: done (stored), failed (nothing stored) or refused (reconciliations_busy).";
}

/// The exporter, with every histogram's buckets, so that none renders as a summary.
fn builder() -> PrometheusBuilder {
    FAMILIES
        .iter()
        .filter(|family| family.kind == Kind::Histogram)
        .fold(PrometheusBuilder::new(), |builder, family| {
            builder
                .set_buckets_for_metric(Matcher::Full(family.name.into()), family.buckets)
                .expect("every histogram has buckets")
        })
}

/// Gives every family its help text and unit, and creates its start-up series at zero, in
/// the recorder in use: a scrape before any traffic shows every family.
pub fn describe() {
    for family in FAMILIES {
        let (name, unit, help) = (family.name, family.unit, family.help);
        match family.kind {
            Kind::Counter => metrics::describe_counter!(name, unit, help),
            Kind::Gauge => metrics::describe_gauge!(name, unit, help),
            Kind::Histogram => metrics::describe_histogram!(name, unit, help),
        }
        for labels in series(family.series) {
            match family.kind {
                Kind::Counter => {
                    let _ = metrics::counter!(name, labels);
                }
                Kind::Gauge => {
                    let _ = metrics::gauge!(name, labels);
                }
                Kind::Histogram => {
                    let _ = metrics::histogram!(name, labels);
                }
            }
        }
    }
}

/// The label sets of a family's start-up series.
fn series(series: Series) -> Vec<Vec<Label>> {
    let labels = |pairs: &[(&'static str, &'static str)]| -> Vec<Label> {
        pairs
            .iter()
            .map(|&(key, value)| Label::new(key, value))
            .collect()
    };
    match series {
        Series::Unlabelled => vec![Vec::new()],
        Series::Labelled(sets) => sets.iter().map(|set| labels(set)).collect(),
        Series::ErrorCodes(before) => ErrorCode::ALL
            .iter()
            .map(|code| code.as_str())
            .chain([CODE_UNAVAILABLE])
            .map(|code| {
                let mut set = labels(before);
                set.push(Label::new("code", code));
                set
            })
            .collect(),
    }
}

/// The process-wide recorder; installed once, shared by every service in the process, with
/// every family described and present from then on.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let handle = builder()
                .install_recorder()
                .expect("the metrics recorder is installed once");
            describe();
            handle
        })
        .clone()
}

/// `error` and its causes, each after a colon: what a log needs to name a failure.
pub fn cause_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut chain = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        chain.push_str(": ");
        chain.push_str(&cause.to_string());
        source = cause.source();
    }
    chain
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a fresh recorder renders after start-up's `describe`, before any use.
    fn start_up_scrape() -> String {
        let recorder = builder().build_recorder();
        metrics::with_local_recorder(&recorder, describe);
        recorder.handle().render()
    }

    /// `name{labels}` as the exporter writes a series of a family's start-up set.
    fn series_name(name: &str, labels: &[Label]) -> String {
        if labels.is_empty() {
            return name.to_owned();
        }
        let labels: Vec<String> = labels
            .iter()
            .map(|label| format!("{}=\"{}\"", label.key(), label.value()))
            .collect();
        format!("{name}{{{}}}", labels.join(","))
    }

    #[test]
    fn every_family_has_help_and_type_and_its_series_at_zero_before_any_use() {
        let scrape = start_up_scrape();
        let lines: Vec<&str> = scrape.lines().collect();
        for family in FAMILIES {
            let help = format!("# HELP {} {}", family.name, family.help);
            assert!(lines.contains(&help.as_str()), "no {help:?} in\n{scrape}");
            let kind = format!("# TYPE {} {}", family.name, family.kind.as_str());
            assert!(lines.contains(&kind.as_str()), "no {kind:?} in\n{scrape}");
            let sets = series(family.series);
            assert!(!sets.is_empty(), "{} has no start-up series", family.name);
            for labels in sets {
                let zero = match family.kind {
                    Kind::Counter | Kind::Gauge => {
                        format!("{} 0", series_name(family.name, &labels))
                    }
                    Kind::Histogram => {
                        format!(
                            "{} 0",
                            series_name(&format!("{}_count", family.name), &labels)
                        )
                    }
                };
                assert!(lines.contains(&zero.as_str()), "no {zero:?} in\n{scrape}");
            }
        }
    }

    #[test]
    fn every_histogram_renders_its_buckets_and_nothing_renders_as_a_summary() {
        let scrape = start_up_scrape();
        assert!(!scrape.contains(" summary\n"), "{scrape}");
        for family in FAMILIES.iter().filter(|f| f.kind == Kind::Histogram) {
            let buckets = scrape
                .lines()
                .filter(|line| line.starts_with(&format!("{}_bucket{{", family.name)))
                .count();
            // Each bound, and +Inf, for each series.
            let series = series(family.series).len();
            assert_eq!(
                buckets,
                (family.buckets.len() + 1) * series,
                "{}",
                family.name
            );
        }
    }

    #[test]
    fn the_error_code_family_starts_with_every_code_and_unavailable() {
        let scrape = start_up_scrape();
        for code in ErrorCode::ALL.iter().map(|code| code.as_str()) {
            let line = format!("{INGEST_REQUESTS_REJECTED}{{source=\"http\",code=\"{code}\"}} 0");
            assert!(scrape.contains(&line), "no {line:?}");
        }
        let line =
            format!("{INGEST_REQUESTS_REJECTED}{{source=\"http\",code=\"{CODE_UNAVAILABLE}\"}} 0");
        assert!(scrape.contains(&line), "no {line:?}");
    }

    #[test]
    fn family_names_follow_the_prometheus_conventions_for_suffixes_and_base_units() {
        let mut names: Vec<&str> = FAMILIES.iter().map(|family| family.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), FAMILIES.len(), "a family is listed twice");
        for family in FAMILIES {
            let name = family.name;
            assert!(name.starts_with("tally_"), "{name}");
            assert!(
                name.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'),
                "{name} is not snake_case"
            );
            let base = match family.kind {
                Kind::Counter => name
                    .strip_suffix("_total")
                    .unwrap_or_else(|| panic!("counter {name} does not end in _total")),
                Kind::Gauge | Kind::Histogram => {
                    assert!(!name.ends_with("_total"), "{name} is not a counter");
                    name
                }
            };
            let not_base = [
                "ms",
                "millis",
                "milliseconds",
                "us",
                "microseconds",
                "minutes",
            ];
            assert!(
                !base.split('_').any(|word| not_base.contains(&word)),
                "{name}: not in a base unit"
            );
            match family.unit {
                Unit::Seconds => assert!(base.ends_with("_seconds"), "{name}"),
                Unit::Bytes => assert!(base.ends_with("_bytes"), "{name}"),
                Unit::Count => assert!(
                    !base.ends_with("_seconds") && !base.ends_with("_bytes"),
                    "{name} names a unit it does not declare"
                ),
                other => panic!("{name}: unit {other:?} is not a base unit of Prometheus"),
            }
            assert!(
                family.help.ends_with('.') && !family.help.contains('\n'),
                "{name}: help is one sentence"
            );
        }
    }

    #[test]
    fn histograms_and_only_histograms_have_increasing_buckets() {
        for family in FAMILIES {
            if family.kind != Kind::Histogram {
                assert!(family.buckets.is_empty(), "{}", family.name);
                continue;
            }
            assert!(!family.buckets.is_empty(), "{}", family.name);
            assert!(
                family.buckets.windows(2).all(|pair| pair[0] < pair[1]),
                "{}",
                family.name
            );
        }
    }

    #[test]
    fn the_operations_guide_lists_every_family_and_no_other() {
        let guide = include_str!("../docs/operations.md");
        let section = guide
            .split("\n## ")
            .find(|section| section.starts_with("Health and metrics"))
            .expect("docs/operations.md has a Health and metrics section");
        let listed: Vec<&str> = section
            .split('`')
            .skip(1)
            .step_by(2)
            .filter(|quoted| quoted.starts_with("tally_"))
            .map(|quoted| quoted.split('{').next().unwrap_or(quoted))
            .collect();
        for family in FAMILIES {
            assert!(
                listed.contains(&family.name),
                "{} is not in the guide",
                family.name
            );
        }
        for name in listed {
            assert!(
                FAMILIES.iter().any(|family| family.name == name),
                "the guide lists {name}, which is no family"
            );
        }
    }
}
