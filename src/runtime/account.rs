//! An org's account state over time: plan, verification and billing eligibility.
//!
//! Admission asks what the state is now, and pricing asks which plan was in effect at each
//! instant of a period; both read an [`AccountTimeline`] folded from the org's account
//! events. The state at an instant is the last value set at or before it, by `occurred_at`
//! and then ledger position (contract §3), whatever order the events arrived in.

use chrono::{DateTime, Utc};

use super::ledger_order;
use crate::event::{Event, EventData, EventId, PlanId};

/// The plan of an org that never had a plan event (contract §3, §4).
pub const FREE_PLAN: &str = "free";

/// An org event, reduced to the value it sets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountEntry {
    pub occurred_at: DateTime<Utc>,
    pub position: i64,
    pub event_id: EventId,
    pub change: AccountChange,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountChange {
    Plan(PlanId),
    Verified(bool),
    BillingEligible(bool),
}

impl AccountEntry {
    /// The entry for an org event stored at `position`; `None` for container events.
    pub fn from_event(event: &Event, position: i64) -> Option<AccountEntry> {
        let change = match &event.data {
            EventData::OrgPlanChanged(changed) => AccountChange::Plan(
                PlanId::parse(&changed.plan).expect("validation accepts only valid plan ids"),
            ),
            EventData::OrgVerificationChanged(changed) => AccountChange::Verified(changed.verified),
            EventData::OrgBillingEligibilityChanged(changed) => {
                AccountChange::BillingEligible(changed.eligible)
            }
            EventData::ContainerCreated(_)
            | EventData::ContainerCommandRan(_)
            | EventData::ContainerStopped(_)
            | EventData::ContainerResumed(_)
            | EventData::ContainerPortPublished(_)
            | EventData::PlanDefined(_)
            | EventData::Correction(_) => return None,
        };
        Some(AccountEntry {
            occurred_at: event.occurred_at,
            position,
            event_id: event.id,
            change,
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountState {
    pub plan: PlanId,
    pub verified: bool,
    pub billing_eligible: bool,
}

impl Default for AccountState {
    /// An org with no account events: on `free`, unverified, not eligible.
    fn default() -> AccountState {
        AccountState {
            plan: PlanId::parse(FREE_PLAN).expect("\"free\" is a valid plan id"),
            verified: false,
            billing_eligible: false,
        }
    }
}

/// The state in effect from `from` until the next change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountStateChange {
    pub from: DateTime<Utc>,
    pub state: AccountState,
}

/// An org's account state at every instant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountTimeline {
    /// Strictly increasing `from`, each state different from the one before, the first
    /// different from the default: only real changes, so that consumers (pricing) can
    /// split time at exactly these points.
    changes: Vec<AccountStateChange>,
}

impl AccountTimeline {
    /// Folds one org's account entries, in any order; a repeated event id is ignored.
    pub fn fold(entries: &[AccountEntry]) -> AccountTimeline {
        let ordered = ledger_order(entries, |entry| {
            (entry.occurred_at, entry.position, entry.event_id)
        });
        let initial = AccountState::default();
        let mut changes: Vec<AccountStateChange> = Vec::new();
        let mut state = initial.clone();
        for (index, entry) in ordered.iter().enumerate() {
            match &entry.change {
                AccountChange::Plan(plan) => state.plan = plan.clone(),
                AccountChange::Verified(verified) => state.verified = *verified,
                AccountChange::BillingEligible(eligible) => state.billing_eligible = *eligible,
            }
            // Several events in one millisecond make one change: the state at that instant
            // is the one after the last of them.
            let last_at_this_instant = ordered
                .get(index + 1)
                .is_none_or(|next| next.occurred_at > entry.occurred_at);
            let unchanged = changes.last().map_or(&initial, |change| &change.state) == &state;
            if last_at_this_instant && !unchanged {
                changes.push(AccountStateChange {
                    from: entry.occurred_at,
                    state: state.clone(),
                });
            }
        }
        AccountTimeline { changes }
    }

    /// The state at `instant`: an event at exactly that instant is already in effect.
    pub fn state_at(&self, instant: DateTime<Utc>) -> AccountState {
        let after = self
            .changes
            .partition_point(|change| change.from <= instant);
        match after {
            0 => AccountState::default(),
            _ => self.changes[after - 1].state.clone(),
        }
    }

    /// The instants at which the state changed, in order, with the state from then on;
    /// before the first, the state is the default.
    pub fn changes(&self) -> &[AccountStateChange] {
        &self.changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::container::tests::{event_id, minute};

    fn plan(name: &str) -> AccountChange {
        AccountChange::Plan(PlanId::parse(name).unwrap())
    }

    /// Entries at the given minutes, with positions 1, 2, … in the order given.
    fn history(changes: &[(i64, AccountChange)]) -> Vec<AccountEntry> {
        changes
            .iter()
            .zip(1..)
            .map(|((at, change), position)| AccountEntry {
                occurred_at: minute(*at),
                position,
                event_id: event_id(position),
                change: change.clone(),
            })
            .collect()
    }

    fn state(plan: &str, verified: bool, billing_eligible: bool) -> AccountState {
        AccountState {
            plan: PlanId::parse(plan).unwrap(),
            verified,
            billing_eligible,
        }
    }

    #[test]
    fn an_org_without_account_events_is_free_unverified_and_not_eligible() {
        let timeline = AccountTimeline::fold(&[]);
        assert_eq!(timeline.state_at(minute(0)), state("free", false, false));
        assert_eq!(timeline.changes(), []);
    }

    #[test]
    fn the_state_at_an_instant_is_the_last_value_set_at_or_before_it() {
        use AccountChange::{BillingEligible, Verified};
        // Arrival order is deliberately not time order.
        let timeline = AccountTimeline::fold(&history(&[
            (20, plan("team")),
            (10, plan("pro")),
            (10, Verified(true)),
            (15, BillingEligible(true)),
            (30, Verified(false)),
        ]));
        let rows = [
            (9, state("free", false, false)),
            (10, state("pro", true, false)),
            (14, state("pro", true, false)),
            (15, state("pro", true, true)),
            (20, state("team", true, true)),
            (30, state("team", false, true)),
            (999, state("team", false, true)),
        ];
        for (at, expected) in rows {
            assert_eq!(timeline.state_at(minute(at)), expected, "minute {at}");
        }
        let froms: Vec<DateTime<Utc>> = timeline.changes().iter().map(|c| c.from).collect();
        assert_eq!(froms, [minute(10), minute(15), minute(20), minute(30)]);
    }

    #[test]
    fn values_set_in_the_same_millisecond_are_applied_by_ledger_position() {
        let timeline = AccountTimeline::fold(&history(&[(10, plan("team")), (10, plan("pro"))]));
        assert_eq!(timeline.state_at(minute(10)).plan.as_str(), "pro");
        assert_eq!(timeline.changes().len(), 1);
    }

    #[test]
    fn setting_a_value_it_already_has_is_not_a_change() {
        let timeline = AccountTimeline::fold(&history(&[
            (5, plan("free")),
            (10, plan("pro")),
            (20, plan("pro")),
            (30, AccountChange::Verified(false)),
        ]));
        let froms: Vec<DateTime<Utc>> = timeline.changes().iter().map(|c| c.from).collect();
        assert_eq!(froms, [minute(10)]);
    }
}
