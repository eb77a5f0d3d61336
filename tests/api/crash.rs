//! The real binary under sustained ingest: kill -9 loses nothing it acknowledged and counts
//! nothing twice, and after a restart the relay completes `TALLY_LEDGER` exactly; SIGTERM
//! drains what is in flight and exits cleanly.

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;
use tokio::process::{Child, Command};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::helpers::*;

const CLIENTS: usize = 8;
const EVENTS_PER_REQUEST: usize = 20;

/// `tally serve` as a child process on its own database, NATS and port.
struct Served {
    db: TestDb,
    nats: TestNats,
    listen: String,
    api: Api,
    child: Child,
}

impl Served {
    async fn start() -> Served {
        let db = TestDb::new().await;
        let nats = TestNats::start();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let listen = format!("127.0.0.1:{port}");
        let child = spawn_tally(&db.url, &nats.url, &listen);
        let served = Served {
            api: Api::new(reqwest::Client::new(), listen.parse().unwrap()),
            db,
            nats,
            listen,
            child,
        };
        served.wait_ready().await;
        served
    }

    async fn restart(&mut self) {
        self.child = spawn_tally(&self.db.url, &self.nats.url, &self.listen);
        self.wait_ready().await;
    }

    async fn wait_ready(&self) {
        eventually(60, "tally serve is ready", || {
            let request = self
                .api
                .without_token()
                .request(Method::GET, "/readyz")
                .send();
            async move { request.await.is_ok_and(|r| r.status() == 200) }
        })
        .await;
    }
}

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

/// Producers posting batches until stopped, recording the ids of every batch answered 200.
struct Load {
    acked: Arc<Mutex<Vec<Uuid>>>,
    running: Arc<AtomicBool>,
    clients: Vec<JoinHandle<()>>,
}

impl Load {
    fn start(served: &Served) -> Load {
        let acked = Arc::new(Mutex::new(Vec::new()));
        let running = Arc::new(AtomicBool::new(true));
        let clients = (0..CLIENTS)
            .map(|_| {
                let api = served.api.clone();
                let (acked, running) = (acked.clone(), running.clone());
                tokio::spawn(async move {
                    while running.load(Ordering::SeqCst) {
                        let events = valid_events(EVENTS_PER_REQUEST);
                        let response = api
                            .request(Method::POST, "/v1/events")
                            .json(&json!({ "events": events }))
                            .timeout(Duration::from_secs(5))
                            .send()
                            .await;
                        match response {
                            Ok(r) if r.status() == 200 => {
                                acked.lock().await.extend(ids_of(&events))
                            }
                            // Stopping: the service drains (503) or is gone; the request
                            // may or may not have committed.
                            Ok(r) if r.status() == 503 => {
                                tokio::time::sleep(Duration::from_millis(20)).await
                            }
                            Ok(r) => panic!("unexpected status {}", r.status()),
                            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                        }
                    }
                })
            })
            .collect();
        Load {
            acked,
            running,
            clients,
        }
    }

    async fn wait_for_acks(&self, count: usize) {
        eventually(30, "some events are acknowledged", || async {
            self.acked.lock().await.len() >= count
        })
        .await;
    }

    /// Stops the producers; returns every acknowledged id.
    async fn stop(self) -> Vec<Uuid> {
        self.running.store(false, Ordering::SeqCst);
        for client in self.clients {
            client.await.unwrap();
        }
        let acked = self.acked.lock().await;
        acked.clone()
    }
}

async fn assert_all_in_ledger(pool: &PgPool, acked: &[Uuid]) {
    let found: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE id = ANY($1)")
        .bind(acked)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(
        found as usize,
        acked.len(),
        "every acknowledged event is in the ledger"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_service_keeps_every_acknowledged_event_exactly_once_and_the_relay_completes_the_stream(
) {
    let mut served = Served::start().await;
    let load = Load::start(&served);
    // Let ingest run, then kill -9 in the middle of it.
    load.wait_for_acks(2_000).await;
    served.child.start_kill().expect("SIGKILL");
    served.child.wait().await.unwrap();
    let acked = load.stop().await;

    served.restart().await;
    let pool = served.db.pool().await;
    assert_all_in_ledger(&pool, &acked).await;
    let total = ledger_count(&pool).await;
    assert_eq!(
        positions(&pool).await,
        (1..=total).collect::<Vec<_>>(),
        "gap-free"
    );
    let (code, report, _) = run_verify(&served.db.url);
    assert_eq!(code, 0, "{report}");

    let js = served.nats.jetstream().await;
    eventually(60, "the relay caught up", || async {
        stream_messages(&js, "TALLY_LEDGER").await == total as u64
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
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_during_ingest_drains_in_flight_batches_and_exits_cleanly() {
    let mut served = Served::start().await;
    let load = Load::start(&served);
    load.wait_for_acks(1_000).await;

    let pid = served.child.id().expect("tally is running").to_string();
    let signalled = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(signalled.success());
    let status = tokio::time::timeout(Duration::from_secs(20), served.child.wait())
        .await
        .expect("tally stops within 20 s of SIGTERM")
        .unwrap();
    assert!(status.success(), "tally exited with {status}");
    let acked = load.stop().await;

    let pool = served.db.pool().await;
    assert_all_in_ledger(&pool, &acked).await;
    pool.close().await;
}
