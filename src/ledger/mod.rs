//! The Postgres ledger: the source of truth. Set-up (`db`), the single ordered writer
//! (`append`) and the rows it writes (`rows`), reads by position (`read`) and hash-chain
//! verification (`verify`); the ids CloudEvents kept from before they were scoped by org
//! (`legacy_ids`).

pub mod append;
pub mod db;
pub mod legacy_ids;
pub mod plans;
pub mod read;
pub mod rows;
pub mod verify;

pub use append::{
    Acknowledged, AppendError, AppendLimits, AppendedEvent, Appender, Committed,
    ACKNOWLEDGED_ORGS_MAX,
};
pub use read::{Head, LedgerRow};
pub use rows::Rows;
pub use verify::VerifyReport;
