//! Append isolation: one request whose content Postgres refuses fails
//! alone. Every other request of its group commit is stored and answered, positions stay
//! gap-free and the chain intact; over HTTP the refused caller gets a 422, over NATS the
//! message is dead-lettered instead of redelivered for ever.
//!
//! Validation refuses NUL before the appender ever sees it, so these tests do not send NUL
//! through HTTP or NATS: they build the `Event` in code and hand it to the `Appender`, or
//! make Postgres refuse otherwise valid content with a check constraint added to the test's
//! own ledger (SQLSTATE 23514), which is what anything validation misses looks like.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::json;
use sqlx::PgPool;
use tally::event::{CloudEventOrigin, ContainerCreated, Event, EventData};
use tally::ledger::append::LEDGER_LOCK_KEY;
use tally::ledger::{verify, AppendError, AppendLimits, AppendedEvent, Appender};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::helpers::*;

/// The content the check constraint of [`refuse_marked_names`] refuses.
const REFUSED_NAME: &str = "refused-by-check";

/// Makes this test's ledger refuse a `container.created` named [`REFUSED_NAME`], a name
/// every validation accepts.
async fn refuse_marked_names(pool: &PgPool) {
    sqlx::query(&format!(
        "ALTER TABLE ledger ADD CONSTRAINT refuses_marked_names \
         CHECK (data->>'name' IS DISTINCT FROM '{REFUSED_NAME}')"
    ))
    .execute(pool)
    .await
    .unwrap();
}

/// Lets the requests spawned so far reach the appender's queue while the lock is held.
/// Only makes a shared group likely; no assertion depends on it.
async fn let_requests_queue() {
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// A valid `container.created` event, as the appender takes it.
fn good_event(org: &str, container: &str) -> Event {
    parse_events(&[valid_event(org, container, 0)]).remove(0)
}

/// An event Postgres cannot store: a NUL in a `data` string (`jsonb`, 22P05) or, with
/// `in_source`, in a CloudEvent's source (`text`, 22021). Built in code, past validation.
fn poisoned_event(org: &str, container: &str, in_source: bool) -> Event {
    let mut event = good_event(org, container);
    if in_source {
        event.origin = Some(CloudEventOrigin {
            source: "/producer\u{0}x".to_owned(),
            id: "1".to_owned(),
            attributes: Default::default(),
        });
    } else {
        event.data = EventData::ContainerCreated(ContainerCreated {
            name: Some("a\u{0}b".to_owned()),
            image: None,
        });
    }
    event
}

/// Every id in the ledger with its position.
async fn stored(pool: &PgPool) -> HashMap<Uuid, i64> {
    sqlx::query_as::<_, (Uuid, i64)>("SELECT id, position FROM ledger")
        .fetch_all(pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
}

fn assert_unstorable(result: &Result<Vec<AppendedEvent>, AppendError>, sqlstates: &[&str]) {
    match result {
        Err(AppendError::Unstorable { sqlstate, .. }) => assert!(
            sqlstates.contains(&sqlstate.as_str()),
            "refused with sqlstate {sqlstate}, expected one of {sqlstates:?}"
        ),
        other => panic!("expected the request to be refused as unstorable, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_postgres_refuses_for_its_content_fails_alone_and_the_rest_of_its_group_commits()
{
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _, _task) = Appender::start(
        pool.clone(),
        AppendLimits {
            queue_max: 64,
            group_events_max: 1_000,
        },
    );
    const REQUESTS: usize = 9;
    const POISONED: usize = 4;
    let requests: Vec<Vec<Event>> = (0..REQUESTS)
        .map(|n| {
            if n == POISONED {
                vec![poisoned_event("org_a", "ctr_a", false)]
            } else {
                vec![good_event("org_b", &format!("ctr_{n}"))]
            }
        })
        .collect();
    // The ledger lock held, as another instance in the middle of a commit holds it: the
    // appends queue up behind it and go into one group commit once it is released.
    let lock = hold_advisory_lock(&db.url, LEDGER_LOCK_KEY).await;
    let appending = {
        let appender = appender.clone();
        tokio::spawn(async move {
            // Polled together, every request is queued before any is answered.
            futures::future::join_all(requests.into_iter().map(|events| appender.append(events)))
                .await
        })
    };
    let_requests_queue().await;
    release_advisory_lock(lock, LEDGER_LOCK_KEY).await;
    let results = appending.await.unwrap();

    assert_unstorable(&results[POISONED], &["22P05"]);
    let mut positions = Vec::new();
    for (n, result) in results.iter().enumerate() {
        if n != POISONED {
            let appended = result
                .as_ref()
                .unwrap_or_else(|e| panic!("request {n} of another org failed: {e}"));
            positions.push(appended[0].position);
        }
    }
    assert_eq!(
        positions,
        (1..REQUESTS as i64).collect::<Vec<_>>(),
        "the others are stored in queue order without gaps"
    );
    assert_eq!(
        super::helpers::positions(&pool).await,
        (1..REQUESTS as i64).collect::<Vec<_>>()
    );
    let report = verify::verify(&pool).await.unwrap();
    assert!(report.ok, "{report:?}");

    // The appender goes on: its head is the one actually committed.
    let after = appender
        .append(vec![good_event("org_b", "ctr_after")])
        .await
        .unwrap();
    assert_eq!(after[0].position, REQUESTS as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_the_database_refuses_is_a_422_for_its_caller_while_another_orgs_concurrent_requests_are_stored(
) {
    let app = TestApp::spawn().await;
    refuse_marked_names(&app.pool).await;
    const GOOD: usize = 40;
    let mut refused = valid_event("org_a", "ctr_a", 0);
    refused["data"] = json!({"name": REFUSED_NAME});
    let mut bodies: Vec<serde_json::Value> = (0..GOOD)
        .map(|n| valid_event("org_b", &format!("ctr_{n}"), n))
        .collect();
    bodies.insert(GOOD / 2, refused.clone());

    let lock = hold_advisory_lock(&app.db.url, LEDGER_LOCK_KEY).await;
    let requests: Vec<_> = bodies
        .iter()
        .map(|body| {
            let (api, body) = (app.api.clone(), body.to_string().into_bytes());
            tokio::spawn(async move { api.post_raw("application/json", body).await })
        })
        .collect();
    let_requests_queue().await;
    release_advisory_lock(lock, LEDGER_LOCK_KEY).await;

    let mut answers = Vec::new();
    for request in requests {
        answers.push(request.await.unwrap());
    }
    let (status, body) = &answers[GOOD / 2];
    assert_eq!(*status, 422, "{body}");
    assert_eq!(body["error"]["code"], "unstorable_event", "{body}");
    assert_eq!(body["error"]["details"][0]["code"], "unstorable_event");
    for (n, (status, body)) in answers.iter().enumerate() {
        if n != GOOD / 2 {
            assert_eq!(*status, 200, "request {n} of another org: {body}");
        }
    }
    assert_eq!(app.ledger_count().await, GOOD as i64);
    let refused_id: Uuid = refused["id"].as_str().unwrap().parse().unwrap();
    assert!(!stored(&app.pool).await.contains_key(&refused_id));
    assert_eq!(
        positions(&app.pool).await,
        (1..=GOOD as i64).collect::<Vec<_>>()
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_message_refused_for_its_content_is_dead_lettered_once_while_the_rest_of_its_fetch_is_stored(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    refuse_marked_names(&pool).await;
    let nats = TestNats::start();
    let js = nats.jetstream().await;
    let names = tally::bus::Names::new("").unwrap();
    tally::bus::apply_streams(&js, &names, &["TALLY_INGEST", "TALLY_DLQ"])
        .await
        .unwrap();

    // Published before the consumer starts, so that one fetch takes them all and their
    // appends share group commits.
    const GOOD: usize = 20;
    let mut refused = valid_event("org_a", "ctr_a", 0);
    refused["data"] = json!({"name": REFUSED_NAME});
    let good: Vec<serde_json::Value> = (0..GOOD)
        .map(|n| valid_event("org_b", &format!("ctr_{n}"), n))
        .collect();
    for (n, event) in good.iter().enumerate() {
        if n == GOOD / 2 {
            let mut headers = HeaderMap::new();
            headers.insert("Producer", "a");
            js.publish_with_headers("tally.ingest.a", headers, refused.to_string().into())
                .await
                .unwrap()
                .await
                .unwrap();
        }
        js.publish("tally.ingest.b", event.to_string().into())
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let (appender, _, _task) = Appender::start(
        pool.clone(),
        AppendLimits {
            queue_max: 1_024,
            group_events_max: 1_000,
        },
    );
    let shutdown = CancellationToken::new();
    let ingest = tokio::spawn(tally::bus::ingest::run(
        js.clone(),
        names,
        pool.clone(),
        appender,
        tally::bus::ingest::IngestSettings {
            nats_url: nats.url.clone(),
            fetch_max: 1_000,
            batch_events_max: 1_000,
            backdate_max: chrono::Duration::days(35),
            clock: tally::clock::Clock::system(),
        },
        tally::bus::StreamHealth::default(),
        shutdown.clone(),
    ));

    wait_for_ledger_count(&pool, GOOD as i64).await;
    eventually(
        10,
        "the refused message is on the dead-letter stream",
        || async { stream_messages(&js, "TALLY_DLQ").await == 1 },
    )
    .await;
    let dead = js
        .get_stream("TALLY_DLQ")
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(dead.subject.as_str(), "tally.dlq.a");
    assert_eq!(
        dead.headers.get("Tally-Error-Code").unwrap().as_str(),
        "unstorable_event"
    );
    assert!(
        dead.headers
            .get("Tally-Error")
            .unwrap()
            .as_str()
            .contains("23514"),
        "the header names what Postgres said"
    );
    assert_eq!(dead.headers.get("Producer").unwrap().as_str(), "a");
    let payload: serde_json::Value = serde_json::from_slice(&dead.payload).unwrap();
    assert_eq!(payload, refused);

    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    // Time for a redelivery (1 s after a nak) to show if there were one.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info = ingest_consumer_info(&js).await;
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_redelivered, 0, "nothing was nak'ed");
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 1);
    let stored = stored(&pool).await;
    assert_eq!(stored.len(), GOOD);
    assert_eq!(
        stored.keys().copied().collect::<HashSet<_>>(),
        ids_of(&good).into_iter().collect::<HashSet<_>>()
    );
    shutdown.cancel();
    ingest.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_racing_requests_of_five_orgs_on_two_instances_with_poisoned_ones_mixed_in_commit_every_good_one_once_in_a_gap_free_verified_chain(
) {
    const TASKS: usize = 200;
    const ORGS: usize = 5;
    /// Every this many tasks one is poisoned: 8 of 200.
    const POISON_EVERY: usize = 25;
    const INSTANCES: usize = 2;
    let db = TestDb::new().await;
    let pool = db.pool().await;
    // Two instances (appenders with pools of their own) interleave their commits, so that
    // a part of an isolated group may find the head moved. Small groups, so that several
    // group commits each have a poisoned request to isolate.
    let mut appenders = Vec::new();
    for _ in 0..INSTANCES {
        let (appender, _, _task) = Appender::start(
            db.pool().await,
            AppendLimits {
                queue_max: 1_024,
                group_events_max: 64,
            },
        );
        appenders.push(appender);
    }

    let lock = hold_advisory_lock(&db.url, LEDGER_LOCK_KEY).await;
    let tasks: Vec<_> = (0..TASKS)
        .map(|task| {
            let appender = appenders[task % INSTANCES].clone();
            let org = format!("org_{}", task % ORGS);
            let container = format!("ctr_{task}");
            let poisoned = task % POISON_EVERY == 7;
            // 1 to 3 events; a poisoned request has good events around its bad one, and
            // none of them may be stored.
            let mut events: Vec<Event> = (0..1 + task % 3)
                .map(|_| good_event(&org, &container))
                .collect();
            if poisoned {
                let at = events.len() / 2;
                let in_source = task % 2 == 0;
                events.insert(at, poisoned_event(&org, &container, in_source));
            }
            tokio::spawn(async move {
                let ids: Vec<Uuid> = events.iter().map(|e| e.id.as_uuid()).collect();
                (poisoned, ids, appender.append(events).await)
            })
        })
        .collect();
    let_requests_queue().await;
    release_advisory_lock(lock, LEDGER_LOCK_KEY).await;

    let mut acknowledged: HashMap<Uuid, i64> = HashMap::new();
    let mut refused_ids = HashSet::new();
    let mut refused = 0;
    for task in tasks {
        let (poisoned, ids, result) = task.await.unwrap();
        if poisoned {
            assert_unstorable(&result, &["22P05", "22021"]);
            refused += 1;
            refused_ids.extend(ids);
            continue;
        }
        let appended = result.unwrap_or_else(|e| panic!("a good request failed: {e}"));
        assert_eq!(
            appended.iter().map(|a| a.id.as_uuid()).collect::<Vec<_>>(),
            ids
        );
        for event in appended {
            assert!(!event.duplicate);
            let earlier = acknowledged.insert(event.id.as_uuid(), event.position);
            assert!(earlier.is_none(), "acknowledged once");
        }
    }
    assert_eq!(refused, TASKS / POISON_EVERY);

    let stored = stored(&pool).await;
    assert_eq!(
        stored, acknowledged,
        "the ledger holds exactly what was acknowledged"
    );
    assert!(refused_ids.iter().all(|id| !stored.contains_key(id)));
    assert_eq!(
        positions(&pool).await,
        (1..=acknowledged.len() as i64).collect::<Vec<_>>(),
        "positions are gap-free"
    );
    let (code, report, stderr) = run_verify(&db.url);
    assert_eq!(code, 0, "tally verify: {report} {stderr}");
    assert_eq!(report["ok"], true);
    assert_eq!(report["events_checked"], acknowledged.len());
}
