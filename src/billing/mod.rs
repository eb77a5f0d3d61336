//! Plans and admission (contract §4), pure: plan definitions with decimal money, and the
//! admission decision over the facts the projections hold.

pub mod admission;
pub mod overage;
pub mod plan;
pub mod reconcile;
pub mod report;

pub use admission::{decide, Action, Decision, Facts, Reason};
pub use plan::{Overage, Plan};
