//! Admission (contract §4): may an org create, resume, run a command in, or publish a port of
//! a container now? A pure function of the facts the projections hold.

use serde::Serialize;

use super::plan::{Overage, Plan};
use crate::error_code::ErrorCode;
use crate::runtime::{AccountState, Period};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Create,
    Resume,
    Run,
    PublishPort,
}

impl Action {
    pub fn parse(value: &str) -> Option<Action> {
        match value {
            "create" => Some(Action::Create),
            "resume" => Some(Action::Resume),
            "run" => Some(Action::Run),
            "publish_port" => Some(Action::PublishPort),
            _ => None,
        }
    }

    /// Actions that start a container and so take a running slot.
    pub fn takes_slot(self) -> bool {
        matches!(self, Action::Create | Action::Resume)
    }

    /// Actions on a container that must already be running.
    pub fn needs_running_container(self) -> bool {
        matches!(self, Action::Run | Action::PublishPort)
    }
}

/// Why admission refuses, in the order contract §4 lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    PlanExcludesSandbox,
    NotVerified,
    NotBillingEligible,
    ConcurrencyLimit,
    RuntimeAllowanceExhausted,
    /// A reservation's only (decision 0046): the container it names runs already.
    ContainerRunning,
    /// `resume` of a stopped container that has as many running intervals as a container
    /// may have: its resume would start nothing (decision 0053).
    IntervalLimit,
    /// `resume` of a stopped container with so many lifecycle events that its resume would
    /// be the last the fold walks, which stops it at once, or past it: it would start
    /// nothing (decision 0056).
    LifecycleLimit,
    ContainerNotRunning,
    PortLimit,
}

impl Reason {
    /// The error code of a refusal for this reason (contract §4: a refused reservation is a
    /// 409 whose code is its first reason).
    pub fn code(self) -> ErrorCode {
        match self {
            Reason::PlanExcludesSandbox => ErrorCode::PlanExcludesSandbox,
            Reason::NotVerified => ErrorCode::NotVerified,
            Reason::NotBillingEligible => ErrorCode::NotBillingEligible,
            Reason::ConcurrencyLimit => ErrorCode::ConcurrencyLimit,
            Reason::RuntimeAllowanceExhausted => ErrorCode::RuntimeAllowanceExhausted,
            Reason::ContainerRunning => ErrorCode::ContainerRunning,
            Reason::IntervalLimit => ErrorCode::IntervalLimit,
            Reason::LifecycleLimit => ErrorCode::LifecycleLimit,
            Reason::ContainerNotRunning => ErrorCode::ContainerNotRunning,
            Reason::PortLimit => ErrorCode::PortLimit,
        }
    }

    pub fn as_str(self) -> &'static str {
        self.code().as_str()
    }
}

/// Everything admission looks at, as of one instant.
#[derive(Debug, Clone)]
pub struct Facts<'a> {
    /// The plan in effect for the org now.
    pub plan: &'a Plan,
    pub account: &'a AccountState,
    pub period: Period,
    /// The org's runtime so far in `period`.
    pub runtime_used_ms: i64,
    /// Containers running now.
    pub running_containers: u64,
    /// Live reservations (neither expired, released nor consumed).
    pub reservations: u64,
    /// Whether the named container runs now (`run`, `publish_port`).
    pub container_running: bool,
    /// Whether the named container is stopped with [`crate::runtime::INTERVALS_MAX`]
    /// intervals (`resume`).
    pub container_at_interval_limit: bool,
    /// Whether the named container is stopped with so many lifecycle events that its
    /// resume would start nothing ([`crate::runtime::resume_past_lifecycle_limit`]).
    pub container_at_lifecycle_limit: bool,
    /// Distinct (container, port) pairs published in `period`.
    pub ports_published: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    pub reasons: Vec<Reason>,
    pub runtime_included_ms: i64,
    /// The org has used its allowance: further runtime is overage.
    pub overage: bool,
    /// Running containers plus live reservations: the slots taken.
    pub slots_taken: u64,
}

impl Decision {
    /// Refuses for `reason` too, the reasons kept in the order contract §4 lists them.
    pub fn refuse(&mut self, reason: Reason) {
        if let Err(at) = self.reasons.binary_search(&reason) {
            self.reasons.insert(at, reason);
        }
        self.allowed = false;
    }
}

pub fn decide(action: Action, facts: &Facts) -> Decision {
    let plan = facts.plan;
    let runtime_included_ms = plan.included_runtime_ms();
    let overage = facts.runtime_used_ms >= runtime_included_ms;
    let slots_taken = facts.running_containers + facts.reservations;
    let mut reasons = Vec::new();
    let excluded = !plan.sandbox_runtime;
    if excluded {
        reasons.push(Reason::PlanExcludesSandbox);
    }
    if !facts.account.verified {
        reasons.push(Reason::NotVerified);
    }
    if !facts.account.billing_eligible {
        reasons.push(Reason::NotBillingEligible);
    }
    // With sandboxes excluded the plan's limits are moot (contract §4).
    if !excluded && action.takes_slot() && slots_taken >= plan.max_running_containers {
        reasons.push(Reason::ConcurrencyLimit);
    }
    if !excluded && plan.overage == Overage::Deny && overage {
        reasons.push(Reason::RuntimeAllowanceExhausted);
    }
    if action == Action::Resume && facts.container_at_interval_limit {
        reasons.push(Reason::IntervalLimit);
    }
    if action == Action::Resume && facts.container_at_lifecycle_limit {
        reasons.push(Reason::LifecycleLimit);
    }
    if action.needs_running_container() && !facts.container_running {
        reasons.push(Reason::ContainerNotRunning);
    }
    if !excluded
        && action == Action::PublishPort
        && facts.ports_published >= plan.max_published_ports
    {
        reasons.push(Reason::PortLimit);
    }
    Decision {
        allowed: reasons.is_empty(),
        reasons,
        runtime_included_ms,
        overage,
        slots_taken,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::PlanId;
    use rust_decimal::Decimal;

    fn plan(overage: Overage) -> Plan {
        Plan {
            id: PlanId::parse("pro").unwrap(),
            sandbox_runtime: true,
            included_runtime_seconds: 3_600,
            overage,
            overage_price_per_hour: Decimal::new(5, 1),
            currency: "USD".into(),
            max_running_containers: 2,
            max_published_ports: 3,
        }
    }

    fn good_account() -> AccountState {
        AccountState {
            plan: PlanId::parse("pro").unwrap(),
            verified: true,
            billing_eligible: true,
        }
    }

    fn facts<'a>(plan: &'a Plan, account: &'a AccountState) -> Facts<'a> {
        Facts {
            plan,
            account,
            period: Period::parse("2026-11").unwrap(),
            runtime_used_ms: 0,
            running_containers: 0,
            reservations: 0,
            container_running: true,
            container_at_interval_limit: false,
            container_at_lifecycle_limit: false,
            ports_published: 0,
        }
    }

    fn reasons(action: Action, facts: &Facts) -> Vec<&'static str> {
        let decision = decide(action, facts);
        assert_eq!(decision.allowed, decision.reasons.is_empty());
        decision
            .reasons
            .iter()
            .map(|reason| reason.as_str())
            .collect()
    }

    #[test]
    fn an_org_never_seen_is_refused_for_three_reasons_on_the_free_plan() {
        let free = Plan::free();
        let account = AccountState::default();
        let facts = facts(&free, &account);
        for action in [Action::Create, Action::Resume] {
            assert_eq!(
                reasons(action, &facts),
                [
                    "plan_excludes_sandbox",
                    "not_verified",
                    "not_billing_eligible"
                ],
                "limits are moot when the plan excludes sandboxes"
            );
        }
    }

    #[test]
    fn each_reason_applies_alone() {
        let deny = plan(Overage::Deny);
        let account = good_account();
        let base = facts(&deny, &account);
        assert_eq!(reasons(Action::Create, &base), Vec::<&str>::new());

        let no_sandbox = Plan {
            sandbox_runtime: false,
            ..deny.clone()
        };
        assert_eq!(
            reasons(Action::Run, &facts(&no_sandbox, &account)),
            ["plan_excludes_sandbox"]
        );

        let unverified = AccountState {
            verified: false,
            ..account.clone()
        };
        assert_eq!(
            reasons(Action::Run, &facts(&deny, &unverified)),
            ["not_verified"]
        );

        let ineligible = AccountState {
            billing_eligible: false,
            ..account.clone()
        };
        assert_eq!(
            reasons(Action::Run, &facts(&deny, &ineligible)),
            ["not_billing_eligible"]
        );

        let full = Facts {
            running_containers: 1,
            reservations: 1,
            ..base.clone()
        };
        assert_eq!(reasons(Action::Create, &full), ["concurrency_limit"]);
        assert_eq!(reasons(Action::Resume, &full), ["concurrency_limit"]);
        assert_eq!(
            reasons(Action::Run, &full),
            Vec::<&str>::new(),
            "run takes no slot"
        );

        let exhausted = Facts {
            runtime_used_ms: 3_600_000,
            ..base.clone()
        };
        assert_eq!(
            reasons(Action::Create, &exhausted),
            ["runtime_allowance_exhausted"]
        );
        let almost = Facts {
            runtime_used_ms: 3_599_999,
            ..base.clone()
        };
        assert_eq!(reasons(Action::Create, &almost), Vec::<&str>::new());

        let stopped = Facts {
            container_running: false,
            ..base.clone()
        };
        assert_eq!(reasons(Action::Run, &stopped), ["container_not_running"]);
        assert_eq!(reasons(Action::Create, &stopped), Vec::<&str>::new());

        let ports = Facts {
            ports_published: 3,
            ..base.clone()
        };
        assert_eq!(reasons(Action::PublishPort, &ports), ["port_limit"]);
        assert_eq!(reasons(Action::Run, &ports), Vec::<&str>::new());

        let at_limit = Facts {
            container_running: false,
            container_at_interval_limit: true,
            ..base.clone()
        };
        assert_eq!(reasons(Action::Resume, &at_limit), ["interval_limit"]);
        assert_eq!(
            reasons(Action::Create, &at_limit),
            Vec::<&str>::new(),
            "a create names a container that has no intervals yet"
        );

        let past_lifecycle = Facts {
            container_running: false,
            container_at_lifecycle_limit: true,
            ..base.clone()
        };
        assert_eq!(
            reasons(Action::Resume, &past_lifecycle),
            ["lifecycle_limit"]
        );
        assert_eq!(reasons(Action::Create, &past_lifecycle), Vec::<&str>::new());
    }

    #[test]
    fn every_reason_together_comes_in_the_documented_order() {
        let deny = plan(Overage::Deny);
        let account = AccountState::default();
        let all = Facts {
            runtime_used_ms: 10_000_000,
            running_containers: 5,
            container_running: false,
            container_at_interval_limit: true,
            container_at_lifecycle_limit: true,
            ports_published: 9,
            ..facts(&deny, &account)
        };
        assert_eq!(
            reasons(Action::PublishPort, &all),
            [
                "not_verified",
                "not_billing_eligible",
                "runtime_allowance_exhausted",
                "container_not_running",
                "port_limit"
            ]
        );
        assert_eq!(
            reasons(Action::Create, &all),
            [
                "not_verified",
                "not_billing_eligible",
                "concurrency_limit",
                "runtime_allowance_exhausted"
            ]
        );
        assert_eq!(
            reasons(Action::Resume, &all),
            [
                "not_verified",
                "not_billing_eligible",
                "concurrency_limit",
                "runtime_allowance_exhausted",
                "interval_limit",
                "lifecycle_limit"
            ]
        );
        let no_sandbox = Plan {
            sandbox_runtime: false,
            ..deny.clone()
        };
        assert_eq!(
            reasons(
                Action::PublishPort,
                &Facts {
                    plan: &no_sandbox,
                    ..all
                }
            ),
            [
                "plan_excludes_sandbox",
                "not_verified",
                "not_billing_eligible",
                "container_not_running"
            ]
        );
    }

    #[test]
    fn a_billed_overage_is_allowed_and_reported() {
        let bill = plan(Overage::Bill);
        let account = good_account();
        let over = Facts {
            runtime_used_ms: 7_200_000,
            ..facts(&bill, &account)
        };
        let decision = decide(Action::Create, &over);
        assert!(decision.allowed);
        assert!(decision.overage);
        assert_eq!(decision.runtime_included_ms, 3_600_000);
        let deny = plan(Overage::Deny);
        let decision = decide(
            Action::Create,
            &Facts {
                plan: &deny,
                ..over
            },
        );
        assert!(!decision.allowed);
        assert!(decision.overage);
    }
}
