//! Telemetry: structured logs through `tracing`, metrics through the `metrics` facade with a
//! process-wide Prometheus recorder that `GET /metrics` renders.

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{fmt, EnvFilter};

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

/// Append latency buckets, in seconds: group commits take a few milliseconds.
const LATENCY_BUCKETS_SECONDS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];
/// Append batch-size buckets, in events: from one event to a full group.
const BATCH_BUCKETS_EVENTS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0,
];

/// The process-wide recorder; installed once, shared by every service in the process.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("seconds".into()), LATENCY_BUCKETS_SECONDS)
                .expect("buckets are not empty")
                .set_buckets_for_metric(
                    Matcher::Full("tally_append_batch_events".into()),
                    BATCH_BUCKETS_EVENTS,
                )
                .expect("buckets are not empty")
                .install_recorder()
                .expect("the metrics recorder is installed once")
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
