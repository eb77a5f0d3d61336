//! Projections: the figures the read side serves, derived from the ledger alone.
//!
//! `model` decides what a run of events changes (pure), `store` reads and writes the
//! projection tables, `projector` keeps them current as the ledger grows, `replay` rebuilds
//! them from scratch, `catch_up` brings it to the head in a process that runs no projector,
//! and `query` answers the API's reads (`org`: the console's reads of one org).

pub mod catch_up;
pub mod gather;
pub mod model;
pub mod notice;
pub mod org;
pub mod projector;
pub mod query;
pub mod replay;
pub mod store;

#[cfg(test)]
mod properties;

pub use projector::{project_once, Freshness, ProjectorSettings, Round, WaitError};
pub use replay::{replay, ReplayReport};

/// A projection read or write that failed: the database, the ledger's plans, or a stored
/// row that does not decode (a bug or a hand-edited table, never the caller's).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    /// A replay statement, named because the replay runs many.
    #[error("{statement}")]
    Statement {
        statement: String,
        #[source]
        source: sqlx::Error,
    },
    #[error(transparent)]
    Ledger(#[from] crate::ledger::Error),
    #[error("another replay is running on this database")]
    ReplayRunning,
    #[error("{0}")]
    Corrupt(String),
}

impl Error {
    /// A stored value that does not decode: what it is, and why not.
    pub(crate) fn corrupt(what: impl std::fmt::Display, why: impl std::fmt::Display) -> Error {
        Error::Corrupt(format!("{what}: {why}"))
    }

    /// The database error this comes from, if any: the HTTP layer answers 503 for one that
    /// is an outage.
    pub fn database(&self) -> Option<&sqlx::Error> {
        match self {
            Error::Database(error) | Error::Statement { source: error, .. } => Some(error),
            Error::Ledger(error) => error.database(),
            Error::ReplayRunning | Error::Corrupt(_) => None,
        }
    }
}
