//! Finance: provider reports and their reconciliation, usage priced per org and period,
//! the usage export, and period close. Depends on the projection and the ledger; nothing
//! below it depends on finance.

pub mod export;
pub mod periods;
pub mod pricing;
pub mod reconciliation;
pub mod reports;
