//! The Postgres ledger: the source of truth. Set-up (`db`), the single ordered writer
//! (`append`), reads by position (`read`) and hash-chain verification (`verify`).

pub mod append;
pub mod db;
pub mod read;
pub mod verify;

pub use append::{AppendError, AppendLimits, AppendedEvent, Appender};
pub use read::LedgerRow;
pub use verify::VerifyReport;
