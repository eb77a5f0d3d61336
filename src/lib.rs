//! tally: an event-sourced usage and billing ledger. Modules in reading order. "contract §N"
//! in comments is section N of `docs/contract.md`, the public contract.

/// Admission against the database: facts, reservations (grant, release, consume).
pub mod admission;
/// `tally audit`: the ledger as a readable timeline.
pub mod audit;
/// Plans with decimal money and the admission decision (pure).
pub mod billing;
/// NATS JetStream: stream definitions, the ledger relay, the ingest consumer.
pub mod bus;
/// The command line.
pub mod cli;
/// What "now" is for the rules: the system clock, or a set instant in tests.
pub mod clock;
/// Settings from the environment, each with its unit and the reason for its default.
pub mod config;
/// The event: ids, schema, validation, CloudEvents, canonical bytes (pure).
pub mod event;
/// Finance: provider reports, reconciliation, priced usage, the usage export, period close.
pub mod finance;
/// The HTTP API: one module per feature, mapped errors, operations endpoints.
pub mod http;
/// The Postgres ledger: database set-up, group-commit appender, reads, chain verification.
pub mod ledger;
/// Projections of the ledger (runtime, usage, container timelines), the projector, replay.
pub mod projection;
/// The runtime rules of contract §3: intervals, anomalies, periods, usage, account state (pure).
pub mod runtime;
/// Wiring: starts every component of `tally serve` and stops them in order.
pub mod startup;
/// Logs (structured `tracing`) and the Prometheus recorder.
pub mod telemetry;
