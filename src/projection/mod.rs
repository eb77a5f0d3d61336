//! Projections: the figures the read side serves, derived from the ledger alone.
//!
//! `model` decides what a run of events changes (pure), `store` reads and writes the
//! projection tables, `projector` keeps them current as the ledger grows, `replay` rebuilds
//! them from scratch, `catch_up` brings it to the head in a process that runs no projector,
//! and `query` answers the API's reads.

pub mod catch_up;
pub mod model;
pub mod notice;
pub mod projector;
pub mod query;
pub mod replay;
pub mod store;

#[cfg(test)]
mod properties;

pub use projector::{project_once, Freshness, ProjectorSettings, Round, WaitError};
pub use replay::{replay, ReplayReport};
