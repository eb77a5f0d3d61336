//! The Postgres ledger: the source of truth. Set-up (`db`), the single ordered writer
//! (`append`) and the rows it writes (`rows`), the monthly tables it is made of
//! (`partitions`), reads by position (`read`) and hash-chain verification (`verify`); the
//! lookup that lets CloudEvents stored under their unscoped id keep it (`legacy_ids`).

pub mod append;
pub mod db;
pub mod legacy_ids;
pub mod partitions;
pub mod plans;
pub mod read;
pub mod rows;
pub mod verify;

pub use append::{
    committed_after, Acknowledged, AppendError, AppendLimits, AppendedEvent, Appender, Committed,
    Handed, ACKNOWLEDGED_ORGS_MAX,
};
pub use read::{Head, LedgerRow};
pub use rows::Rows;
pub use verify::VerifyReport;

/// A ledger read or set-up that failed: the database, or a stored row that does not
/// decode (a bug or a hand-edited ledger, never the caller's).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Database(#[from] sqlx::Error),
    #[error(transparent)]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("{0}")]
    Corrupt(String),
}

impl Error {
    /// The database error this comes from, if any: the HTTP layer answers 503 for one that
    /// is an outage.
    pub fn database(&self) -> Option<&sqlx::Error> {
        match self {
            Error::Database(error) => Some(error),
            Error::Migrate(_) | Error::Corrupt(_) => None,
        }
    }
}
