//! Finance: provider reports and their reconciliation, usage priced per org and period,
//! the usage export, and period close. Depends on the projection and the ledger; nothing
//! below it depends on finance.

pub mod catalog;
pub mod export;
pub mod jobs;
pub mod periods;
pub mod pricing;
pub mod reconciliation;
pub mod report_input;
pub mod reports;

/// A finance read or write that failed: the database, the projection or the ledger it
/// reads, or a stored row that does not decode (a bug, never the caller's).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Projection(#[from] crate::projection::Error),
    #[error(transparent)]
    Ledger(#[from] crate::ledger::Error),
    #[error("{0}")]
    Corrupt(String),
}

impl Error {
    /// The database error this comes from, if any: the HTTP layer answers 503 for one that
    /// is an outage.
    pub fn database(&self) -> Option<&sqlx::Error> {
        match self {
            Error::Database(error) => Some(error),
            Error::Projection(error) => error.database(),
            Error::Ledger(error) => error.database(),
            Error::Corrupt(_) => None,
        }
    }
}
