//! kill -9 of the real binary during sustained ingest loses nothing it acknowledged and
//! counts nothing twice; after a restart the relay completes `TALLY_LEDGER` exactly.

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;
use uuid::Uuid;

use crate::helpers::*;

const CLIENTS: usize = 8;
const EVENTS_PER_REQUEST: usize = 20;

fn spawn_tally(database_url: &str, nats_url: &str, listen: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("serve")
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", nats_url)
        .env("TALLY_LISTEN", listen)
        .env("TALLY_BOOTSTRAP_TOKEN", TOKEN)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("starting tally serve")
}

async fn wait_ready(client: &reqwest::Client, base: &str) {
    let url = format!("{base}/readyz");
    eventually(60, "tally serve is ready", || {
        let request = client.get(&url).send();
        async move { request.await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_service_keeps_every_acknowledged_event_exactly_once_and_the_relay_completes_the_stream(
) {
    let db = TestDb::new().await;
    let nats = TestNats::start();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let base = format!("http://{listen}");
    let client = reqwest::Client::new();

    let mut tally = spawn_tally(&db.url, &nats.url, &listen);
    wait_ready(&client, &base).await;

    let acked = Arc::new(Mutex::new(Vec::<Uuid>::new()));
    let running = Arc::new(AtomicBool::new(true));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, base, acked, running) =
                (client.clone(), base.clone(), acked.clone(), running.clone());
            tokio::spawn(async move {
                while running.load(Ordering::SeqCst) {
                    let events = valid_events(EVENTS_PER_REQUEST);
                    let response = client
                        .post(format!("{base}/v1/events"))
                        .bearer_auth(TOKEN)
                        .json(&json!({ "events": events }))
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await;
                    match response {
                        Ok(r) if r.status() == 200 => acked.lock().await.extend(ids_of(&events)),
                        Ok(r) => panic!("unexpected status {}", r.status()),
                        // The service is dead: the request may or may not have committed.
                        Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            })
        })
        .collect();

    // Let ingest run, then kill -9 in the middle of it.
    let pool = db.pool().await;
    eventually(30, "some events are acknowledged", || {
        let acked = acked.clone();
        async move { acked.lock().await.len() >= 2_000 }
    })
    .await;
    tally.start_kill().expect("SIGKILL");
    tally.wait().await.unwrap();
    running.store(false, Ordering::SeqCst);
    for client in clients {
        client.await.unwrap();
    }
    let acked: Vec<Uuid> = acked.lock().await.clone();

    let mut tally = spawn_tally(&db.url, &nats.url, &listen);
    wait_ready(&client, &base).await;

    let found: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE id = ANY($1)")
        .bind(&acked)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        found as usize,
        acked.len(),
        "every acknowledged event is in the ledger"
    );
    let total = ledger_count(&pool).await;
    assert_eq!(
        positions(&pool).await,
        (1..=total).collect::<Vec<_>>(),
        "gap-free"
    );

    let verify = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("verify")
        .env("DATABASE_URL", &db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert_eq!(
        verify.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&verify.stdout)
    );

    let js = nats.jetstream().await;
    eventually(60, "the relay caught up", || {
        let js = js.clone();
        async move {
            match js.get_stream("TALLY_LEDGER").await {
                Ok(mut stream) => stream
                    .info()
                    .await
                    .is_ok_and(|i| i.state.messages == total as u64),
                Err(_) => false,
            }
        }
    })
    .await;
    let stream = js.get_stream("TALLY_LEDGER").await.unwrap();
    let mut relayed = Vec::new();
    for sequence in 1..=total as u64 {
        let message = stream.get_raw_message(sequence).await.unwrap();
        relayed.push(
            message
                .headers
                .get("Nats-Msg-Id")
                .unwrap()
                .as_str()
                .parse::<Uuid>()
                .unwrap(),
        );
        assert_eq!(
            message.headers.get("Tally-Position").unwrap().as_str(),
            sequence.to_string(),
            "the stream is in ledger order"
        );
    }
    let ledger_ids: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM ledger ORDER BY position")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(
        relayed, ledger_ids,
        "the stream holds exactly the ledger's events"
    );
    assert_eq!(relayed.iter().collect::<HashSet<_>>().len(), relayed.len());

    tally.start_kill().unwrap();
    tally.wait().await.unwrap();
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_during_ingest_drains_in_flight_batches_and_exits_cleanly() {
    let db = TestDb::new().await;
    let nats = TestNats::start();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let base = format!("http://{listen}");
    let client = reqwest::Client::new();
    let mut tally = spawn_tally(&db.url, &nats.url, &listen);
    wait_ready(&client, &base).await;

    let acked = Arc::new(Mutex::new(Vec::<Uuid>::new()));
    let running = Arc::new(AtomicBool::new(true));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let (client, base, acked, running) =
                (client.clone(), base.clone(), acked.clone(), running.clone());
            tokio::spawn(async move {
                while running.load(Ordering::SeqCst) {
                    let events = valid_events(EVENTS_PER_REQUEST);
                    let response = client
                        .post(format!("{base}/v1/events"))
                        .bearer_auth(TOKEN)
                        .json(&json!({ "events": events }))
                        .send()
                        .await;
                    match response {
                        Ok(r) if r.status() == 200 => acked.lock().await.extend(ids_of(&events)),
                        // Stopping: 503 while draining, or the listener is gone.
                        _ => tokio::time::sleep(Duration::from_millis(20)).await,
                    }
                }
            })
        })
        .collect();
    eventually(30, "some events are acknowledged", || {
        let acked = acked.clone();
        async move { acked.lock().await.len() >= 1_000 }
    })
    .await;

    let pid = tally.id().expect("tally is running").to_string();
    let signalled = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(signalled.success());
    let status = tokio::time::timeout(Duration::from_secs(20), tally.wait())
        .await
        .expect("tally stops within 20 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "tally exited with {status}");
    running.store(false, Ordering::SeqCst);
    for client in clients {
        client.await.unwrap();
    }

    let acked: Vec<Uuid> = acked.lock().await.clone();
    let pool = db.pool().await;
    let found: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE id = ANY($1)")
        .bind(&acked)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        found as usize,
        acked.len(),
        "every acknowledged event is in the ledger"
    );
    pool.close().await;
}
