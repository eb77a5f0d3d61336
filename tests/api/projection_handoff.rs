//! The projector's events handed over in memory by the appender: the same events as the
//! ledger gives back, and the same projection, row for row, as the ledger path builds.

use chrono::{DateTime, Duration, DurationRound, Utc};
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use tally::clock::Clock;
use tally::event::{
    ContainerCommandRan, ContainerCreated, ContainerId, ContainerPortPublished, ContainerResumed,
    ContainerStopped, Event, EventData, EventId, EventType, OrgBillingEligibilityChanged, OrgId,
    OrgPlanChanged, OrgVerificationChanged, StopReason, COMMAND_DURATION_MAX_MS,
};
use tally::ledger::{AppendLimits, Appender, Committed, Rows};
use tally::projection::model::ProjectedEvent;
use tally::projection::store::{self, EventRow, EVENT_COLUMNS};
use tally::projection::{project_once, projector, Freshness, ProjectorSettings, Round};
use tokio_util::sync::CancellationToken;

use crate::helpers::{eventually, TestDb};

pub(crate) const LIMITS: AppendLimits = AppendLimits {
    queue_max: 64,
    group_events_max: 1000,
};

/// Events per round: smaller than most steps, so that rounds also end inside what was
/// handed over.
const ROUND_EVENTS_MAX: usize = 4;

/// Builds the events of the script, each with an id of its own.
pub(crate) struct Script {
    pub(crate) start: DateTime<Utc>,
}

impl Script {
    pub(crate) fn new() -> Script {
        let start = Utc::now().duration_trunc(Duration::seconds(1)).unwrap() - Duration::hours(3);
        Script { start }
    }

    fn event(
        &self,
        event_type: EventType,
        org: &str,
        container: Option<&str>,
        minutes: i64,
        data: EventData,
    ) -> Event {
        Event {
            id: EventId::from_uuid(Uuid::now_v7()).unwrap(),
            event_type,
            org_id: OrgId::parse(org).unwrap(),
            container_id: container.map(|id| ContainerId::parse(id).unwrap()),
            occurred_at: self.start + Duration::minutes(minutes),
            data,
            origin: None,
        }
    }

    pub(crate) fn created(&self, org: &str, container: &str, minutes: i64) -> Event {
        let data = EventData::ContainerCreated(ContainerCreated {
            name: Some("job".to_owned()),
            image: None,
        });
        self.event(
            EventType::ContainerCreated,
            org,
            Some(container),
            minutes,
            data,
        )
    }

    pub(crate) fn resumed(&self, org: &str, container: &str, minutes: i64) -> Event {
        let data = EventData::ContainerResumed(ContainerResumed {});
        self.event(
            EventType::ContainerResumed,
            org,
            Some(container),
            minutes,
            data,
        )
    }

    pub(crate) fn stopped(&self, org: &str, container: &str, minutes: i64) -> Event {
        let data = EventData::ContainerStopped(ContainerStopped {
            reason: Some(StopReason::User),
        });
        self.event(
            EventType::ContainerStopped,
            org,
            Some(container),
            minutes,
            data,
        )
    }

    pub(crate) fn command(
        &self,
        org: &str,
        container: &str,
        minutes: i64,
        duration_ms: u64,
    ) -> Event {
        let data = EventData::ContainerCommandRan(ContainerCommandRan {
            command_id: format!("cmd{minutes}"),
            exit_code: -1,
            duration_ms,
            timed_out: Some(false),
        });
        self.event(
            EventType::ContainerCommandRan,
            org,
            Some(container),
            minutes,
            data,
        )
    }

    fn port(&self, org: &str, container: &str, minutes: i64, port: u16) -> Event {
        let data = EventData::ContainerPortPublished(ContainerPortPublished {
            port,
            url: Some(format!("https://{container}.example/{port}")),
        });
        self.event(
            EventType::ContainerPortPublished,
            org,
            Some(container),
            minutes,
            data,
        )
    }

    fn account(&self, org: &str, minutes: i64, change: &str) -> Event {
        let (event_type, data) = match change {
            "verified" => (
                EventType::OrgVerificationChanged,
                EventData::OrgVerificationChanged(OrgVerificationChanged { verified: true }),
            ),
            "ineligible" => (
                EventType::OrgBillingEligibilityChanged,
                EventData::OrgBillingEligibilityChanged(OrgBillingEligibilityChanged {
                    eligible: false,
                }),
            ),
            plan => (
                EventType::OrgPlanChanged,
                EventData::OrgPlanChanged(OrgPlanChanged {
                    plan: plan.to_owned(),
                }),
            ),
        };
        self.event(event_type, org, None, minutes, data)
    }

    fn plan(&self, id: &str, minutes: i64) -> Event {
        let data = EventData::PlanDefined(json!({
            "id": id, "sandbox_runtime": false, "included_runtime_seconds": 3600,
            "overage": "bill", "overage_price_per_hour": "0.12", "currency": "USD",
            "max_running_containers": 5, "max_published_ports": 3
        }));
        self.event(EventType::PlanDefined, "_plans", None, minutes, data)
    }

    pub(crate) fn void(&self, voided: &Event, minutes: i64) -> Event {
        let data = EventData::Correction(json!({
            "event_id": voided.id.to_string(), "reason": "entered twice", "by": "admin"
        }));
        let org = voided.org_id.as_str();
        self.event(EventType::LedgerEventVoided, org, None, minutes, data)
    }

    fn added(&self, added: &[&Event], minutes: i64) -> Event {
        let ids: Vec<String> = added.iter().map(|event| event.id.to_string()).collect();
        let data = EventData::Correction(json!({
            "event_ids": ids, "reason": "lost by a producer", "by": "admin"
        }));
        self.event(
            EventType::LedgerEventsAdded,
            "_corrections",
            None,
            minutes,
            data,
        )
    }
}

/// Commits appended in one go between two projections: each inner list is one append (one
/// group commit); `appended_by_other` when another instance appends them,
/// `projected_by_other` when another instance's projector projects them.
struct Step {
    appends: Vec<Vec<Event>>,
    appended_by_other: bool,
    projected_by_other: bool,
}

fn step(appends: Vec<Vec<Event>>) -> Step {
    Step {
        appends,
        appended_by_other: false,
        projected_by_other: false,
    }
}

impl Step {
    fn appended_by_other(self) -> Step {
        Step {
            appended_by_other: true,
            ..self
        }
    }

    fn projected_by_other(self) -> Step {
        Step {
            projected_by_other: true,
            ..self
        }
    }
}

/// Every event type, several orgs, late lifecycle events that refold a container, a late
/// command, voids (of an earlier round's events and of one in the same round), a plan
/// definition and plan changes, a step appended by another instance and one that another
/// instance projects.
fn script() -> Vec<Step> {
    let s = Script::new();
    let command_a = s.command("org_a", "c1", 1, 1_500);
    let stop_a = s.stopped("org_a", "c1", 30);
    let command_c = s.command("org_c", "c3", 7, COMMAND_DURATION_MAX_MS);
    let added_b = s.created("org_b", "c4", -60);
    vec![
        step(vec![
            vec![s.plan("pro", 0), s.created("org_a", "c1", 0)],
            vec![command_a.clone(), s.port("org_a", "c1", 2, 8080)],
            vec![s.created("org_b", "c2", 0), s.account("org_a", 0, "pro")],
            vec![s.account("org_a", 1, "verified")],
            vec![s.account("org_b", 1, "ineligible")],
        ]),
        step(vec![
            vec![stop_a.clone(), s.command("org_b", "c2", 3, 0)],
            vec![
                s.created("org_c", "c3", 5),
                s.port("org_b", "c2", 4, 65_535),
            ],
        ]),
        step(vec![
            // Late: before c1's stop at 30, so its history is folded again.
            vec![s.stopped("org_a", "c1", 20)],
            vec![
                s.resumed("org_a", "c1", 25),
                s.command("org_b", "c2", -5, 10),
            ],
            vec![s.port("org_a", "c1", 21, 1)],
        ]),
        step(vec![
            vec![s.void(&command_a, 40), s.void(&stop_a, 41)],
            vec![command_c.clone(), s.stopped("org_a", "c1", 45)],
            vec![s.void(&command_c, 46)],
            vec![added_b.clone(), s.added(&[&added_b], 47)],
        ]),
        step(vec![
            vec![s.command("org_c", "c3", 50, 2_000)],
            vec![s.account("org_b", 50, "pro"), s.stopped("org_b", "c2", 51)],
        ])
        .appended_by_other(),
        step(vec![
            vec![s.created("org_a", "c5", 55), s.stopped("org_c", "c3", 56)],
            vec![s.resumed("org_a", "c1", 57), s.plan("basic", 58)],
        ]),
        // Handed to this instance, projected by another: dropped here, never applied again.
        step(vec![
            vec![s.command("org_a", "c5", 60, 5)],
            vec![
                s.account("org_c", 60, "verified"),
                s.stopped("org_a", "c5", 61),
            ],
        ])
        .projected_by_other(),
        step(vec![
            vec![s.resumed("org_a", "c5", 62), s.port("org_a", "c5", 63, 443)],
            vec![s.void(&added_b, 64)],
        ]),
    ]
}

pub(crate) async fn append_all(appender: &Appender, appends: &[Vec<Event>]) {
    for events in appends {
        appender.append(events.clone()).await.unwrap();
    }
}

/// Every row of every table of the projection, as text, table by table; the checkpoint
/// without the instant it was written.
pub(crate) async fn projection_rows(pool: &PgPool) -> Vec<(String, Vec<String>)> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::TEXT FROM information_schema.tables \
         WHERE table_schema = 'proj' ORDER BY 1",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    let mut rows = Vec::new();
    for table in tables {
        let text: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT (to_jsonb(t) - 'projected_at')::TEXT FROM proj.{table} t ORDER BY 1"
        ))
        .fetch_all(pool)
        .await
        .unwrap();
        rows.push((table, text));
    }
    rows
}

/// Projects `memory` (with `handoff`, or as another instance without it) until it is
/// caught up, each round mirrored on `ledger` (from the ledger) with the same events, so
/// that both have the same rounds; returns whether each round was handed over.
async fn project_both(
    memory: &PgPool,
    mut handoff: Option<&mut Committed<ProjectedEvent>>,
    ledger: &PgPool,
) -> Vec<bool> {
    let mut handed_rounds = Vec::new();
    loop {
        let handoff = handoff.as_deref_mut();
        let round = project_once(
            memory,
            (ROUND_EVENTS_MAX, Clock::system()),
            handoff,
            None,
            None,
        )
        .await
        .unwrap();
        let Round::Projected {
            events,
            position,
            handed,
            reread,
        } = round
        else {
            assert!(matches!(round, Round::CaughtUp { .. }), "{round:?}");
            return handed_rounds;
        };
        let mirrored = project_once(ledger, (events, Clock::system()), None, None, None)
            .await
            .unwrap();
        assert_eq!(
            mirrored,
            Round::Projected {
                events,
                position,
                handed: false,
                reread,
            }
        );
        handed_rounds.push(handed);
    }
}

#[tokio::test]
async fn the_projection_made_from_handed_events_is_the_one_made_from_the_ledger_row_for_row() {
    let (memory_db, ledger_db) = (TestDb::new().await, TestDb::new().await);
    let (memory, ledger) = (memory_db.pool().await, ledger_db.pool().await);
    let (appender, _relay, _task) = Appender::start(memory.clone(), LIMITS);
    let (other, _other_relay, _other_task) = Appender::start(memory.clone(), LIMITS);
    let (ledger_appender, _, _ledger_task) = Appender::start(ledger.clone(), LIMITS);
    let mut handoff = appender.handoff::<ProjectedEvent>();
    for step in script() {
        let on_memory = if step.appended_by_other {
            &other
        } else {
            &appender
        };
        append_all(on_memory, &step.appends).await;
        append_all(&ledger_appender, &step.appends).await;
        let projector = (!step.projected_by_other).then_some(&mut handoff);
        let handed = project_both(&memory, projector, &ledger).await;
        assert!(!handed.is_empty());
        // Another instance's commits are not in this one's memory.
        let from_memory = !step.appended_by_other && !step.projected_by_other;
        assert!(
            handed.iter().all(|handed| *handed == from_memory),
            "{handed:?}"
        );
        assert_eq!(
            projection_rows(&memory).await,
            projection_rows(&ledger).await
        );
    }
    let rows = projection_rows(&memory).await;
    for (table, at_least) in [("container", 4), ("voided", 4), ("account_change", 5)] {
        let count = rows.iter().find(|(name, _)| name == table).unwrap().1.len();
        assert!(count >= at_least, "{table}: {count} rows");
    }
}

#[tokio::test]
async fn the_events_made_from_handed_rows_are_those_read_from_the_ledger() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _relay, _task) = Appender::start(pool.clone(), LIMITS);
    let mut handoff = appender.handoff::<ProjectedEvent>();
    let mut appended = 0;
    for step in script() {
        append_all(&appender, &step.appends).await;
        appended += step.appends.iter().map(Vec::len).sum::<usize>();
    }
    let handed = handoff.take_after(0, usize::MAX).unwrap();
    assert_eq!(handed.len(), appended, "every row was handed over");
    let mut connection = pool.acquire().await.unwrap();
    let read = store::read_events(&mut connection, 0, appended)
        .await
        .unwrap();
    assert_eq!(handed, read);
    assert!(handed.iter().any(|event| event.voids.is_some()));
    assert!(handoff.take_after(appended as i64, 10).is_none());
}

/// One ledger row of type `event_type` with `data`, as the appender hands it over.
fn one_row(event_type: &'static str, data: Value) -> Rows {
    let at = Utc::now()
        .duration_trunc(Duration::milliseconds(1))
        .unwrap();
    Rows {
        position: vec![7],
        id: vec![Uuid::now_v7()],
        event_type: vec![event_type],
        org_id: vec!["org_a".to_owned()],
        container_id: vec![Some("c1".to_owned())],
        occurred_at: vec![at],
        recorded_at: vec![at],
        data: vec![data],
        source: vec![None],
        source_event_id: vec![None],
        attributes: vec![None],
        content_digest: vec![vec![0; 32]],
        hash: vec![vec![0; 32]],
    }
}

/// What `EVENT_COLUMNS` gives for the row, or `None` where Postgres refuses it.
async fn read_back(pool: &PgPool, rows: &Rows) -> Option<EventRow> {
    sqlx::query_as(&format!(
        "SELECT {EVENT_COLUMNS} FROM (SELECT $1::BIGINT AS position, $2::UUID AS id, \
           $3::TEXT AS type, $4::TEXT AS org_id, $5::TEXT AS container_id, \
           $6::TIMESTAMPTZ AS occurred_at, $7::TIMESTAMPTZ AS recorded_at, \
           $8::JSONB AS data) ledger"
    ))
    .bind(rows.position[0])
    .bind(rows.id[0])
    .bind(rows.event_type[0])
    .bind(&rows.org_id[0])
    .bind(&rows.container_id[0])
    .bind(rows.occurred_at[0])
    .bind(rows.recorded_at[0])
    .bind(&rows.data[0])
    .fetch_one(pool)
    .await
    .ok()
}

#[tokio::test]
async fn a_handed_row_is_read_as_postgres_reads_it_or_left_to_the_ledger() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let id = Uuid::now_v7();
    let certain = [
        (
            "container.command_ran",
            json!({"command_id": "c", "exit_code": 0, "duration_ms": 0}),
        ),
        (
            "container.command_ran",
            json!({"duration_ms": COMMAND_DURATION_MAX_MS}),
        ),
        ("container.command_ran", json!({"duration_ms": i64::MAX})),
        ("container.command_ran", json!({"duration_ms": -3})),
        ("container.port_published", json!({"port": 1})),
        (
            "container.port_published",
            json!({"port": 65_535, "url": "https://x.example"}),
        ),
        ("container.port_published", json!({"port": 70_000})),
        ("container.created", json!({})),
        (
            "container.stopped",
            json!({"reason": null, "duration_ms": null}),
        ),
        ("org.plan_changed", json!({"plan": "pro"})),
        ("org.plan_changed", json!({"plan": "Pro_1-x"})),
        ("org.verification_changed", json!({"verified": true})),
        ("org.verification_changed", json!({"verified": false})),
        (
            "org.billing_eligibility_changed",
            json!({"eligible": false}),
        ),
        (
            "ledger.event_voided",
            json!({"event_id": id.to_string(), "reason": "r"}),
        ),
        (
            "ledger.event_voided",
            json!({"event_id": id.to_string().to_uppercase()}),
        ),
        ("ledger.event_voided", json!({"reason": "no id"})),
        (
            "ledger.events_added",
            json!({"event_ids": [id.to_string()], "event_id": 5}),
        ),
        (
            "plan.defined",
            json!({"id": "pro", "max_running_containers": 5}),
        ),
        ("container.created", json!([1, 2])),
        ("container.created", json!("text")),
    ];
    for (event_type, data) in certain {
        let rows = one_row(event_type, data.clone());
        let handed = EventRow::of_committed(&rows, 0);
        assert!(handed.is_some(), "{event_type} {data}: not certain");
        assert_eq!(handed, read_back(&pool, &rows).await, "{event_type} {data}");
    }
    // Postgres casts or refuses these; the projector reads them from the ledger.
    let uncertain = [
        ("container.command_ran", json!({"duration_ms": "12"})),
        ("container.command_ran", json!({"duration_ms": 1.5})),
        ("container.command_ran", json!({"duration_ms": 1e3})),
        ("container.command_ran", json!({"duration_ms": u64::MAX})),
        (
            "container.port_published",
            json!({"port": 3_000_000_000_i64}),
        ),
        ("org.plan_changed", json!({"plan": 5})),
        ("org.plan_changed", json!({"plan": {"id": "pro"}})),
        ("org.verification_changed", json!({"verified": "yes"})),
        ("org.billing_eligibility_changed", json!({"eligible": 1})),
        (
            "ledger.event_voided",
            json!({"event_id": id.simple().to_string()}),
        ),
        (
            "ledger.event_voided",
            json!({"event_id": id.braced().to_string()}),
        ),
        (
            "ledger.event_voided",
            json!({"event_id": id.urn().to_string()}),
        ),
    ];
    for (event_type, data) in uncertain {
        let rows = one_row(event_type, data.clone());
        assert_eq!(
            EventRow::of_committed(&rows, 0),
            None,
            "{event_type} {data}"
        );
    }
    let mut finer = one_row("container.created", json!({}));
    finer.occurred_at[0] += Duration::nanoseconds(1);
    assert_eq!(EventRow::of_committed(&finer, 0), None, "nanoseconds");
}

#[tokio::test]
async fn a_running_projector_stopped_by_a_gap_in_memory_reads_the_rest_at_once_not_at_its_next_poll(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _relay, _task) = Appender::start(pool.clone(), LIMITS);
    let (other, _other_relay, _other_task) = Appender::start(pool.clone(), LIMITS);
    let handoff = appender.handoff::<ProjectedEvent>();
    let s = Script::new();
    // 1 and 2 in memory, 3 by another instance, 4 in memory again: all committed before
    // the projector starts.
    append_all(&appender, &[vec![s.created("org_a", "c1", 0)]]).await;
    append_all(&appender, &[vec![s.command("org_a", "c1", 1, 10)]]).await;
    append_all(&other, &[vec![s.created("org_b", "c2", 2)]]).await;
    append_all(&appender, &[vec![s.stopped("org_a", "c1", 3)]]).await;
    let settings = ProjectorSettings {
        batch_max: 100,
        // Never within the test: only this instance's own commits may wake the projector.
        poll: std::time::Duration::from_secs(3_600),
        linger: std::time::Duration::ZERO,
        clock: Clock::system(),
    };
    let freshness = Freshness::new(appender.head(), appender.acknowledged());
    let shutdown = CancellationToken::new();
    let projector = tokio::spawn(projector::run(
        pool.clone(),
        settings,
        freshness,
        Some(handoff),
        None,
        shutdown.clone(),
    ));
    eventually(30, "the projection reaches position 4", || async {
        let mut connection = pool.acquire().await.unwrap();
        store::checkpoint(&mut connection, store::LIVE)
            .await
            .unwrap()
            == 4
    })
    .await;
    shutdown.cancel();
    projector.await.unwrap();
}

#[tokio::test]
async fn a_round_following_this_instances_commits_leaves_another_instances_appends_to_the_poll() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _relay, _task) = Appender::start(pool.clone(), LIMITS);
    let (other, _other_relay, _other_task) = Appender::start(pool.clone(), LIMITS);
    let mut handoff = appender.handoff::<ProjectedEvent>();
    let s = Script::new();
    // One round, following this instance's commits (with its head) or woken by the poll.
    async fn round(
        pool: &PgPool,
        handoff: &mut Committed<ProjectedEvent>,
        own_head: Option<i64>,
    ) -> Round {
        let settings = (ROUND_EVENTS_MAX, Clock::system());
        project_once(pool, settings, Some(handoff), own_head, None)
            .await
            .unwrap()
    }
    let following = || Some(*appender.head().borrow());
    let one = |position, handed| Round::Projected {
        events: 1,
        position,
        handed,
        reread: 0,
    };
    append_all(&appender, &[vec![s.created("org_a", "c1", 0)]]).await;
    assert_eq!(round(&pool, &mut handoff, following()).await, one(1, true));

    // Position 2 is another instance's: nothing of this one's follows the checkpoint.
    append_all(&other, &[vec![s.created("org_b", "c2", 1)]]).await;
    assert_eq!(*appender.head().borrow(), 1);
    assert_eq!(
        round(&pool, &mut handoff, following()).await,
        Round::CaughtUp { position: 1 }
    );

    // A round the poll wakes follows no commit of this instance's, and reads the ledger.
    assert_eq!(round(&pool, &mut handoff, None).await, one(2, false));

    // This instance's next commit follows it in memory again.
    append_all(&appender, &[vec![s.command("org_a", "c1", 2, 10)]]).await;
    assert_eq!(round(&pool, &mut handoff, following()).await, one(3, true));
}

#[tokio::test]
async fn a_round_right_after_one_that_found_nothing_finds_the_checkpoint_free() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    // Each round that finds nothing must have let go of the checkpoint when it returns;
    // one still holding it, until its connection is next used, makes the next round Busy.
    for _ in 0..200 {
        let round = project_once(&pool, (ROUND_EVENTS_MAX, Clock::system()), None, None, None)
            .await
            .unwrap();
        assert!(matches!(round, Round::CaughtUp { .. }), "{round:?}");
    }
}
