//! tally: an event-sourced usage and billing ledger. "contract §N" in comments is section N
//! of `docs/contract.md`, the public contract.
//!
//! The modules are listed in the order data flows through them: an event is parsed and
//! checked (`event`), appended to the hash-chained ledger (`ledger`), relayed to NATS and
//! taken in from it (`bus`), folded into the projections (`projection`) by the runtime rules
//! (`runtime`), priced and admitted against its plan (`billing`, `admission`), reconciled,
//! exported and closed (`finance`) and served over HTTP (`http`). The process around them
//! comes last: start-up and shutdown (`startup`), the command line (`cli`, where `tally
//! audit` reads the ledger back as a timeline), settings (`config`), logs and metrics (`telemetry`).

/// Every error code the service answers, as one closed enum (contract §7); below every layer.
pub mod error_code;

/// What "now" is for the rules: the system clock, or a set instant in tests.
pub mod clock;

/// The event: ids, schema, validation, CloudEvents, canonical bytes (pure).
pub mod event;

/// The Postgres ledger: database set-up, group-commit appender, reads, chain verification.
pub mod ledger;

/// NATS JetStream: stream definitions, the ledger relay, the ingest consumer.
pub mod bus;

/// Projections of the ledger (runtime, usage, container timelines), the projector, replay.
pub mod projection;

/// The runtime rules of contract §3: intervals, anomalies, periods, usage, account state (pure).
pub mod runtime;

/// Plans with decimal money and the admission decision (pure).
pub mod billing;

/// Admission against the database: facts, reservations (grant, release, consume).
pub mod admission;

/// Finance: provider reports, reconciliation, priced usage, the usage export, period close.
pub mod finance;

/// The HTTP API: one router per feature, each with its OpenAPI paths; mapped errors.
pub mod http;

/// Wiring: starts every component of `tally serve` and stops them in order.
pub mod startup;

/// A component on a thread of its own, with a runtime of its own (the appender, the
/// projector).
pub mod own_thread;

/// The command line: the clap definition, the dispatch, one module per subcommand.
pub mod cli;

/// Settings from the environment, each with its unit and the reason for its default.
pub mod config;

/// Logs (structured `tracing`) and the Prometheus recorder.
pub mod telemetry;
