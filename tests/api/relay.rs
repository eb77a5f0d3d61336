//! The relay takes this instance's commits from memory and everything else from the ledger;
//! either way `TALLY_LEDGER` ends up holding exactly the ledger.

use chrono::SubsecRound;
use futures::StreamExt;
use serde_json::{json, Value};
use tally::config::Config;
use tally::event::parse::{parse_body, BodyKind};
use tally::event::{Event, EventData, EventId, EventType, OrgId, TimeBounds};
use tally::ledger::append::HANDOFF_GROUP_EVENTS_MAX;
use tally::ledger::{read, AppendLimits, Appender, Committed};
use tally::startup::Service;

use crate::helpers::*;

fn start_appender(pool: sqlx::PgPool) -> (Appender, Committed) {
    let (appender, committed, _task) = Appender::start(
        pool,
        AppendLimits {
            queue_max: 64,
            group_events_max: 10_000,
        },
    );
    (appender, committed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rows_handed_to_the_relay_are_the_rows_the_ledger_gives_back() {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, mut committed) = start_appender(pool.clone());

    let cloud_event = json!({
        "specversion": "1.0", "id": "evt-1", "source": "//provider/eu", "type": "container.created",
        "orgid": "org_cloud", "subject": "ctr_cloud", "time": ago(60),
        "data": {"name": "n", "image": "i"}
    });
    let cloud = parse_body(
        BodyKind::CloudEvent,
        cloud_event.to_string().as_bytes(),
        TimeBounds {
            now: chrono::Utc::now(),
            backdate_max: chrono::Duration::days(35),
        },
        1000,
    )
    .unwrap();
    appender.append(cloud).await.unwrap();
    let batch = valid_events(40);
    appender.append(parse_events(&batch)).await.unwrap();
    // Duplicates store nothing and hand over nothing.
    appender.append(parse_events(&batch[..5])).await.unwrap();
    for n in 0..10 {
        appender
            .append(parse_events(&[valid_event("org_h", "ctr_h", n)]))
            .await
            .unwrap();
    }
    let account = [
        ("org.plan_changed", json!({"plan": "pro"})),
        ("org.verification_changed", json!({"verified": true})),
        (
            "org.billing_eligibility_changed",
            json!({"eligible": false}),
        ),
    ]
    .map(|(event_type, data)| {
        json!({"id": uuid::Uuid::new_v4(), "type": event_type, "org_id": "org_h",
               "occurred_at": ago(30), "data": data})
    });
    appender.append(parse_events(&account)).await.unwrap();
    // The payloads tally writes itself: a plan definition and both corrections.
    let internal = |event_type, org: &str, data| Event {
        id: EventId::from_uuid(uuid::Uuid::new_v4()).unwrap(),
        event_type,
        org_id: OrgId::parse(org).unwrap(),
        container_id: None,
        occurred_at: chrono::Utc::now().trunc_subsecs(3),
        data,
        origin: None,
    };
    let plan = json!({
        "id": "pro", "sandbox_runtime": true, "included_runtime_seconds": 3600,
        "overage": "deny", "overage_price_per_hour": "0.125", "currency": "USD",
        "max_running_containers": 1, "max_published_ports": 2,
    });
    let void = json!({"event_id": uuid::Uuid::new_v4().to_string(), "reason": "typo ✓ \"quoted\"", "by": "admin"});
    let added =
        json!({"event_ids": [uuid::Uuid::new_v4().to_string()], "reason": "late", "by": "admin"});
    appender
        .append(vec![
            internal(
                EventType::PlanDefined,
                "_plans",
                EventData::PlanDefined(plan),
            ),
            internal(
                EventType::LedgerEventVoided,
                "org_h",
                EventData::Correction(void),
            ),
            internal(
                EventType::LedgerEventsAdded,
                "org_h",
                EventData::Correction(added),
            ),
        ])
        .await
        .unwrap();

    let handed = committed
        .take_after(0, 1_000)
        .expect("all of it was handed over");
    let stored = read::read_after(&pool, 0, 1_000).await.unwrap();
    assert_eq!(stored.len(), 57);
    assert_eq!(handed, stored);
    for (handed, stored) in handed.iter().zip(&stored) {
        assert_eq!(
            serde_json::to_vec(&handed.to_message()).unwrap(),
            serde_json::to_vec(&stored.to_message()).unwrap(),
            "position {} would be relayed differently",
            stored.position
        );
    }
    assert!(committed.take_after(57, 1_000).is_none(), "nothing more");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_too_large_to_hand_over_sends_the_relay_to_the_ledger_and_later_groups_continue_from_memory(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, mut committed) = start_appender(pool.clone());

    // Parsed a thousand at a time, as the HTTP ingest takes them, and appended as one.
    let events = valid_events(HANDOFF_GROUP_EVENTS_MAX + 1);
    let large: Vec<_> = events.chunks(1_000).flat_map(parse_events).collect();
    appender.append(large).await.unwrap();
    let head = HANDOFF_GROUP_EVENTS_MAX as i64 + 1;
    assert!(
        committed.take_after(0, head as usize).is_none(),
        "a group of {head} events is read from the ledger"
    );
    assert_eq!(
        read::read_after(&pool, 0, head as usize)
            .await
            .unwrap()
            .len(),
        head as usize
    );

    appender
        .append(parse_events(&valid_events(3)))
        .await
        .unwrap();
    let handed = committed
        .take_after(head, 10)
        .expect("the next group is in memory");
    assert_eq!(handed, read::read_after(&pool, head, 10).await.unwrap());
    assert_eq!(handed.first().map(|row| row.position), Some(head + 1));
}

/// Two instances on one database and one NATS: one relays (its own commits may come from
/// memory, the other's can only come from the ledger), and the stream holds the ledger
/// exactly, in order, each message as the ledger's row would be relayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_two_instances_appending_the_stream_holds_exactly_the_ledger_in_order() {
    let first = TestApp::spawn().await;
    let mut config = Config::new(&first.db.url, &first.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    let second = Service::start(config).await.unwrap();
    let addresses = [first.address, second.local_addr];

    let writers: Vec<_> = (0..16)
        .map(|writer| {
            let api = first.at(addresses[writer % 2]);
            tokio::spawn(async move {
                for request in 0..15 {
                    let size = 1 + (writer + request) % 3;
                    let events: Vec<Value> = (0..size)
                        .map(|n| valid_event(&format!("org_{writer}"), "ctr_r", request * 3 + n))
                        .collect();
                    let (status, _) = api.post_events(&json!({ "events": events })).await;
                    assert_eq!(status, 200);
                }
            })
        })
        .collect();
    for writer in writers {
        writer.await.unwrap();
    }

    let stored = read::read_after(&first.pool, 0, 10_000).await.unwrap();
    let js = first.nats.jetstream().await;
    eventually(20, "the relay published the whole ledger", || async {
        stream_messages(&js, "TALLY_LEDGER").await == stored.len() as u64
    })
    .await;
    let stream = js.get_stream("TALLY_LEDGER").await.unwrap();
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config::default())
        .await
        .unwrap();
    let mut messages = consumer
        .fetch()
        .max_messages(stored.len())
        .messages()
        .await
        .unwrap();
    for row in &stored {
        let message = messages.next().await.expect("a message per row").unwrap();
        let header = |name: &str| {
            message
                .headers
                .as_ref()
                .unwrap()
                .get(name)
                .unwrap()
                .as_str()
                .to_owned()
        };
        assert_eq!(header("Tally-Position"), row.position.to_string());
        assert_eq!(header("Nats-Msg-Id"), row.id.to_string());
        assert_eq!(
            message.payload.as_ref(),
            serde_json::to_vec(&row.to_message()).unwrap().as_slice(),
            "position {}",
            row.position
        );
    }
    assert_eq!(
        stream_messages(&js, "TALLY_LEDGER").await,
        stored.len() as u64
    );

    second.stop().await;
    first.stop().await;
}

/// The relay looks for a stop between its batches, not only once it has caught up: a
/// service whose relay is thousands of events behind stops without publishing them, and
/// the next start publishes the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_whose_relay_is_far_behind_stops_before_publishing_the_backlog_and_the_next_start_publishes_it(
) {
    const EVENTS: usize = 5_000;
    // One event per publish, each awaiting its acknowledgement: the relay falls behind.
    let mut app = TestApp::spawn_with(|config| config.relay_batch_max = 1).await;
    for chunk in valid_events(EVENTS).chunks(1_000) {
        let (status, body) = app.post_events(&json!({ "events": chunk })).await;
        assert_eq!(status, 200, "{body}");
    }
    app.service.take().unwrap().stop().await;
    let js = app.nats.jetstream().await;
    let relayed = stream_messages(&js, "TALLY_LEDGER").await;
    assert!(
        relayed < EVENTS as u64,
        "the stop waited for the relay to publish all {EVENTS} events"
    );

    let mut config = Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    let restarted = Service::start(config)
        .await
        .expect("restarting the service");
    eventually(60, "the restarted relay publishes the rest", || async {
        stream_messages(&js, "TALLY_LEDGER").await == EVENTS as u64
    })
    .await;
    restarted.stop().await;
}
