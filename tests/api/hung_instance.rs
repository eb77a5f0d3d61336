//! An instance that hangs without dying — stopped with SIGSTOP, as a frozen VM would leave
//! it — inside a transaction (its projector's round holding the checkpoint, or an append
//! holding the ledger's lock) and holding the relay's lock. Its TCP connections stay open,
//! so Postgres would not notice it on its own; the sessions end after their idle bounds
//! (`LOCK_IDLE_TIMEOUT_MS` inside a transaction, `LOCK_SESSION_IDLE_TIMEOUT_MS` for the
//! relay's lock), and the other instance appends, projects and relays meanwhile. When it wakes, nothing it did or had been asked is lost or doubled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use tokio::process::Child;

use crate::helpers::*;
use crate::scale_out::{
    assert_ledger_holds_every_acknowledged_event_once, assert_stream_is_the_ledger, checkpoint,
    free_listen, head, instance_name, lock_holder, relayed, spawn_tally, wait_ready, Record,
};

/// Clients posting back to back to the instance that will hang, and events per request:
/// enough that its appender is inside a transaction much of the time.
const CLIENTS: usize = 4;
const EVENTS_PER_REQUEST: usize = 200;
/// Times the instance is stopped and, when no session of it is inside a transaction at
/// that moment, woken again, before the test gives up on catching it in one.
const STOP_TRIES: usize = 200;
/// How long after the stop its session is looked at: long enough for Postgres to have
/// done whatever the process had sent.
const SETTLE_MS: u64 = 200;
/// How long the other instance may take to append and relay once the hung one is stopped:
/// far past the bounds it should take (5 s each), so that only a lock that is never
/// released fails the test, not a slow machine.
const RELEASE_BOUND_S: u64 = 60;

fn signal(child: &Child, signal: libc::c_int) {
    let pid = libc::pid_t::try_from(child.id().expect("running")).unwrap();
    // SAFETY: kill(2) with the pid of a child this test spawned and has not reaped.
    let sent = unsafe { libc::kill(pid, signal) };
    assert_eq!(sent, 0, "kill({pid}, {signal})");
}

async fn post_until_stopped(
    api: Api,
    client: usize,
    record: Arc<Mutex<Record>>,
    running: Arc<AtomicBool>,
) {
    let mut request = 0;
    while running.load(Ordering::SeqCst) {
        request += 1;
        let events: Vec<serde_json::Value> = (0..EVENTS_PER_REQUEST)
            .map(|n| valid_event("org_hung", &format!("ctr_{client}_{}", n % 17), request + n))
            .collect();
        let sent = api
            .request(Method::POST, "/v1/events")
            .json(&json!({ "events": events }))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        // A request the hung instance never answered is not acknowledged: it may or may not
        // be stored, and nothing is asserted of it.
        if sent.is_ok_and(|response| response.status() == 200) {
            record.lock().unwrap().http_acked.extend(ids_of(&events));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_hangs_inside_a_transaction_and_holding_the_relay_lock_loses_both_and_the_other_projects_and_relays_meanwhile(
) {
    let nats = TestNats::start();
    let db = TestDb::new().await;
    let logs = tempfile::tempdir().expect("a temporary directory");
    let mut instances: Vec<(Child, Api)> = Vec::new();
    for index in 0..2 {
        let listen = free_listen();
        let url = format!("{}?application_name={}", db.url, instance_name(index));
        let log = logs.path().join(format!("{}.log", instance_name(index)));
        let child = spawn_tally(&url, &nats.url, 1, &listen, &log);
        let api = Api::new(reqwest::Client::new(), listen.parse().unwrap());
        wait_ready(&api).await;
        instances.push((child, api));
    }
    let pool = db.pool().await;
    let js = nats.jetstream().await;
    let relay_key = tally::bus::relay::RELAY_LOCK_KEY;
    eventually(10, "an instance relays", || async {
        lock_holder(&pool, relay_key).await.is_some()
    })
    .await;
    let holder_name = lock_holder(&pool, relay_key).await.unwrap();
    let hung = (0..2)
        .find(|&index| instance_name(index) == holder_name)
        .expect("the relay's holder is an instance");
    let other = 1 - hung;

    let record = Arc::new(Mutex::new(Record::default()));
    let running = Arc::new(AtomicBool::new(true));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            tokio::spawn(post_until_stopped(
                instances[hung].1.clone(),
                client,
                Arc::clone(&record),
                Arc::clone(&running),
            ))
        })
        .collect();
    eventually(20, "the instance appends", || async {
        head(&pool).await > 0
    })
    .await;

    // Stopped at random moments until one finds a session of it inside a transaction:
    // its projector's round, holding the checkpoint, or an append holding the ledger lock.
    let mut caught = None;
    for _ in 0..STOP_TRIES {
        signal(&instances[hung].0, libc::SIGSTOP);
        // Whatever it sent before it stopped (a COMMIT, say) reaches Postgres first.
        tokio::time::sleep(Duration::from_millis(SETTLE_MS)).await;
        if let Some(statement) = idle_in_transaction(&pool, &holder_name).await {
            caught = Some(statement);
            break;
        }
        signal(&instances[hung].0, libc::SIGCONT);
        tokio::time::sleep(Duration::from_millis(rand_ms())).await;
    }
    let caught = caught.expect("the instance was never stopped inside a transaction");
    let stopped_at = Instant::now();
    let head_at_stop = head(&pool).await;

    // The other instance appends: the stopped one's transaction is ended for it.
    let marker = vec![valid_event("org_marker", "ctr_marker", 0)];
    let (status, answer) = instances[other]
        .1
        .post_events(&json!({ "events": marker }))
        .await;
    assert_eq!(status, 200, "{answer}");
    record.lock().unwrap().http_acked.extend(ids_of(&marker));
    let appended = stopped_at.elapsed();
    // And projects: the stopped one's transaction is ended for it.
    eventually(
        RELEASE_BOUND_S,
        "the projection holds the marker",
        || async { checkpoint(&pool).await > head_at_stop },
    )
    .await;
    let projected = stopped_at.elapsed();
    // And relays: the stopped one's lock session is ended too.
    eventually(RELEASE_BOUND_S, "the other instance relays", || async {
        lock_holder(&pool, relay_key).await.as_deref() == Some(instance_name(other).as_str())
    })
    .await;
    eventually(RELEASE_BOUND_S, "the stream holds the marker", || async {
        relayed(&js).await > head_at_stop
    })
    .await;
    let relaying = stopped_at.elapsed();

    // It wakes, finds its sessions gone, and serves again.
    signal(&instances[hung].0, libc::SIGCONT);
    tokio::time::sleep(Duration::from_secs(2)).await;
    running.store(false, Ordering::SeqCst);
    for client in clients {
        client.await.unwrap();
    }
    let after = vec![valid_event("org_marker", "ctr_marker", 1)];
    let (status, answer) = instances[hung]
        .1
        .post_events(&json!({ "events": after }))
        .await;
    assert_eq!(status, 200, "the woken instance appends again: {answer}");
    let mut record = std::mem::take(&mut *record.lock().unwrap());
    record.http_acked.extend(ids_of(&after));
    let total = assert_ledger_holds_every_acknowledged_event_once(&pool, &record).await;
    eventually(
        RELEASE_BOUND_S,
        "the stream holds the whole ledger",
        || async { relayed(&js).await == total },
    )
    .await;
    assert_stream_is_the_ledger(&js, &pool, &instances[other].1, total).await;
    eprintln!(
        "hung_instance: stopped {holder_name} inside a transaction (its last statement {caught:?}); \
         the other appended after {appended:?}, projected after {projected:?} and relayed after \
         {relaying:?}; {total} events"
    );
    pool.close().await;
}

/// The last statement of a session of `instance` that is idle inside a transaction past
/// its first statement (and so holding what that statement locked: the projector's
/// checkpoint row, the ledger's append lock), if one is.
async fn idle_in_transaction(pool: &sqlx::PgPool, instance: &str) -> Option<String> {
    sqlx::query_scalar(
        "SELECT query FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = $1 \
           AND state = 'idle in transaction' AND query <> 'BEGIN' LIMIT 1",
    )
    .bind(instance)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// 1 to 30 ms, so that the stops fall at different points of the appender's round.
fn rand_ms() -> u64 {
    1 + u64::from(uuid::Uuid::new_v4().as_bytes()[0]) % 30
}
