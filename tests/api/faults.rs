//! Faults: with Postgres gone, requests fail fast with 503 — never a 500 — and
//! nothing is half-written; when it returns, the service recovers by itself. The test runs
//! a private Postgres cluster of its own, so that stopping it disturbs nobody.

use std::net::TcpListener;
use std::os::unix::fs::chown;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::json;
use uuid::Uuid;

use crate::helpers::{ago, eventually, Api, TestNats, TOKEN};

const BIN: &str = "/usr/lib/postgresql/15/bin";

/// A Postgres cluster in a temporary directory, on a free port, run as `postgres` (initdb
/// refuses root). Stopped and removed on drop.
struct PrivatePostgres {
    dir: PathBuf,
    port: u16,
}

impl PrivatePostgres {
    fn start() -> PrivatePostgres {
        let dir = std::env::temp_dir().join(format!("tally-pg-{}", Uuid::new_v4().simple()));
        std::fs::create_dir(&dir).unwrap();
        let postgres = uid_of("postgres");
        chown(&dir, Some(postgres.0), Some(postgres.1)).unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cluster = PrivatePostgres { dir, port };
        cluster.as_postgres(&[
            &format!("{BIN}/initdb"),
            "-D",
            cluster.data(),
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
        ]);
        cluster.up();
        cluster
    }

    fn data(&self) -> &str {
        self.dir.to_str().unwrap()
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/tally", self.port)
    }

    fn up(&self) {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.data()
        );
        let log = format!("{}/log", self.data());
        self.as_postgres(&[
            &format!("{BIN}/pg_ctl"),
            "-D",
            self.data(),
            "-o",
            &options,
            "-l",
            &log,
            "-w",
            "start",
        ]);
    }

    fn down(&self) {
        self.as_postgres(&[
            &format!("{BIN}/pg_ctl"),
            "-D",
            self.data(),
            "-m",
            "immediate",
            "-w",
            "stop",
        ]);
    }

    fn as_postgres(&self, command: &[&str]) {
        let output = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .args(command)
            .output()
            .expect("runuser runs");
        assert!(
            output.status.success(),
            "{command:?}: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let _ = Command::new("runuser")
            .args([
                "-u",
                "postgres",
                "--",
                &format!("{BIN}/pg_ctl"),
                "-D",
                self.data(),
                "-m",
                "immediate",
                "stop",
            ])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn uid_of(user: &str) -> (u32, u32) {
    let id = |flag: &str| -> u32 {
        let output = Command::new("id").args([flag, user]).output().unwrap();
        String::from_utf8(output.stdout)
            .unwrap()
            .trim()
            .parse()
            .unwrap()
    };
    (id("-u"), id("-g"))
}

fn event() -> serde_json::Value {
    json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
           "container_id": format!("c{}", Uuid::new_v4().simple()), "occurred_at": ago(60)})
}

#[tokio::test]
async fn with_postgres_stopped_requests_fail_fast_with_503_and_the_service_recovers_by_itself() {
    let postgres = PrivatePostgres::start();
    let nats = TestNats::start();
    let mut config = tally::config::Config::new(postgres.url(), &nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.db_acquire_timeout_ms = 500;
    let service = tally::startup::Service::start(config).await.unwrap();
    let api = Api::new(reqwest::Client::new(), service.local_addr);
    let post = |body: serde_json::Value| {
        let api = api.clone();
        async move {
            let reply = api.send(Method::POST, "/v1/events", Some(&body)).await;
            let retry_after = reply.header("retry-after").is_some();
            (reply.status, retry_after, reply.json())
        }
    };
    let get = |path: &'static str| {
        let api = api.clone();
        async move { api.get(path).await.status }
    };
    let (status, _, _) = post(event()).await;
    assert_eq!(status, 200);

    postgres.down();
    let mut refused = Vec::new();
    for _ in 0..5 {
        let body = event();
        let started = Instant::now();
        let (status, retry_after, error) = post(body.clone()).await;
        assert_eq!(status, 503, "{error}");
        assert!(retry_after, "a 503 says when to retry");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "fails fast: {:?}",
            started.elapsed()
        );
        refused.push(body["id"].as_str().unwrap().to_owned());
    }
    for path in [
        "/v1/orgs/acme/usage?period=2026-11",
        "/v1/events",
        "/readyz",
    ] {
        let started = Instant::now();
        assert_eq!(get(path).await, 503, "{path}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{path} fails fast"
        );
    }
    assert_eq!(get("/healthz").await, 200, "the process is up");

    postgres.up();
    eventually(30, "the service accepts events again", || async {
        post(event()).await.0 == 200
    })
    .await;
    assert_eq!(get("/readyz").await, 200);
    let pool = sqlx::PgPool::connect(&postgres.url()).await.unwrap();
    let stored: Vec<String> = sqlx::query_scalar("SELECT id::text FROM ledger")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert!(
        refused.iter().all(|id| !stored.contains(id)),
        "nothing refused was stored"
    );
    let verified = tally::ledger::verify::verify(&pool).await.unwrap();
    assert!(verified.ok, "{verified:?}");
    pool.close().await;
    service.stop().await;
}
