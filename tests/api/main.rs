//! Integration tests against real Postgres and real nats-server, in one binary.

mod helpers;

mod admission;
mod admission_cache;
mod admission_consistency;
mod anomalies;
mod append_isolation;
mod audit;
mod checker;
mod concurrency;
mod consistency;
mod console_assets;
mod corrections;
mod crash;
mod exports;
mod faults;
mod finance_consistency;
mod immutability;
mod ingest;
mod input_hardening;
mod nats;
mod operations;
mod org_binding;
mod period_scale;
mod periods;
mod plans;
mod projection;
mod reconciliation;
mod reconciliation_focus;
mod relay;
mod reports;
mod server_limits;
mod stream_integrity;
mod tokens;
mod verify;
