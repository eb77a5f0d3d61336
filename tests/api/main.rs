//! Integration tests against real Postgres and real nats-server, in one binary.

mod helpers;

mod admission;
mod admission_cache;
mod audit;
mod bench;
mod checker;
mod concurrency;
mod corrections;
mod crash;
mod exports;
mod faults;
mod immutability;
mod ingest;
mod nats;
mod operations;
mod period_scale;
mod periods;
mod plans;
mod projection;
mod reconciliation;
mod relay;
mod reports;
mod tokens;
mod verify;
