//! Test harness: a fresh database per test, a private nats-server per test, and the
//! service started in-process (or as the real binary) against them. Everything a test
//! starts is stopped and dropped when it ends, so tests run in parallel and leave nothing.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::ops::Deref;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use reqwest::header::HeaderMap;
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};
use tally::clock::Clock;
use tally::config::Config;
use tally::ledger::db;
use tally::startup::Service;
use uuid::Uuid;

pub const TOKEN: &str = "test-admin-token";

/// The Postgres server tests create their databases on.
pub fn server_url() -> String {
    std::env::var("TALLY_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_string())
}

/// A database of its own, dropped when the test ends.
pub struct TestDb {
    pub url: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        let name = format!("tally_test_{}", Uuid::new_v4().simple());
        let url = format!("{}/{name}", server_url().trim_end_matches('/'));
        db::ensure_database(&url)
            .await
            .expect("creating a test database");
        TestDb { url }
    }

    pub async fn pool(&self) -> PgPool {
        let config = Config::new(&self.url, "nats://unused");
        db::prepare(&config)
            .await
            .expect("preparing the test database")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let url = self.url.clone();
        // Drop runs inside the test's runtime; drop the database from a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            runtime.block_on(async {
                if let Err(error) = db::drop_database(&url).await {
                    eprintln!("could not drop {url}: {error}");
                }
            });
        })
        .join();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

fn nats_server_binary() -> PathBuf {
    if let Ok(path) = std::env::var("TALLY_TEST_NATS_SERVER") {
        return PathBuf::from(path);
    }
    for candidate in [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ] {
        if std::path::Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    PathBuf::from("nats-server")
}

/// A private nats-server with JetStream on a free port, killed when the test ends.
pub struct TestNats {
    child: Child,
    pub url: String,
    pub port: u16,
    store: tempfile::TempDir,
}

impl TestNats {
    pub fn start() -> TestNats {
        let store = tempfile::tempdir().expect("a temporary directory");
        let port = free_port();
        let child = spawn_nats(port, &store);
        let nats = TestNats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            port,
            store,
        };
        nats.wait_until_listening();
        nats
    }

    fn wait_until_listening(&self) {
        wait_until_listening(self.port);
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port with the same store.
    pub fn restart(&mut self) {
        self.stop();
        self.child = spawn_nats(self.port, &self.store);
        self.wait_until_listening();
    }

    pub async fn jetstream(&self) -> async_nats::jetstream::Context {
        let client = async_nats::connect(&self.url)
            .await
            .expect("connecting to the test NATS");
        async_nats::jetstream::new(client)
    }
}

fn spawn_nats(port: u16, store: &tempfile::TempDir) -> Child {
    Command::new(nats_server_binary())
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(store.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("starting nats-server (set TALLY_TEST_NATS_SERVER to its path)")
}

impl Drop for TestNats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The service, in-process, on its own database and NATS.
pub struct TestApp {
    pub address: SocketAddr,
    pub client: reqwest::Client,
    /// This instance's API with the admin token; `TestApp` derefs to it, so a test calls
    /// `app.get_plans()` and `app.with_token(t).get_plans()` alike.
    pub api: Api,
    pub pool: PgPool,
    pub service: Option<Service>,
    pub nats: TestNats,
    pub db: TestDb,
    /// The service's clock, for a test to place its events relative to the service's now.
    pub clock: Clock,
}

impl TestApp {
    pub async fn spawn() -> TestApp {
        Self::spawn_with(|_| {}).await
    }

    /// The service with its clock at `instant` (moving on from there).
    pub async fn spawn_at(instant: DateTime<Utc>) -> TestApp {
        Self::spawn_with(|config| config.clock = Clock::starting_at(instant)).await
    }

    /// The service on [`mid_period_clock`].
    pub async fn spawn_mid_period() -> TestApp {
        Self::spawn_with(|config| config.clock = mid_period_clock()).await
    }

    pub async fn spawn_with(adjust: impl FnOnce(&mut Config)) -> TestApp {
        let db = TestDb::new().await;
        let nats = TestNats::start();
        let mut config = Config::new(&db.url, &nats.url);
        config.bootstrap_token = Some(TOKEN.to_string());
        config.relay_poll_ms = 50;
        adjust(&mut config);
        let service = Service::start(config).await.expect("starting the service");
        let pool = db.pool().await;
        TestApp::of(service, pool, nats, db)
    }

    /// A `TestApp` around a service a test started itself.
    pub fn of(service: Service, pool: PgPool, nats: TestNats, db: TestDb) -> TestApp {
        let client = reqwest::Client::new();
        TestApp {
            clock: service.clock,
            address: service.local_addr,
            api: Api::new(client.clone(), service.local_addr),
            client,
            pool,
            service: Some(service),
            nats,
            db,
        }
    }

    pub async fn ledger_count(&self) -> i64 {
        ledger_count(&self.pool).await
    }

    /// The service's now.
    pub fn now(&self) -> DateTime<Utc> {
        self.clock.now()
    }

    /// A timestamp `seconds_ago` before the service's now, as [`ago`] writes it.
    pub fn ago(&self, seconds_ago: i64) -> String {
        tally::event::canonical::timestamp(self.now() - chrono::Duration::seconds(seconds_ago))
    }

    pub async fn stop(mut self) {
        if let Some(service) = self.service.take() {
            service.stop().await;
        }
    }
}

pub async fn ledger_count(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Positions of the whole ledger, in order.
pub async fn positions(pool: &PgPool) -> Vec<i64> {
    sqlx::query_scalar("SELECT position FROM ledger ORDER BY position")
        .fetch_all(pool)
        .await
        .unwrap()
}

/// Polls `check` until it holds or `seconds` pass.
pub async fn eventually<F, Fut>(seconds: u64, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(seconds);
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The 15th of last month at 12:00 UTC: the middle of a period, so that a test whose
/// service's clock starts there can date its history days either side of now and stay in
/// the same period whatever the day it runs; and in the past, so that the service's times
/// stay behind the real time that Postgres and the ledger's `recorded_at` keep.
pub fn mid_period() -> DateTime<Utc> {
    let this_month = tally::runtime::Period::containing(Utc::now()).start();
    let last_month = tally::runtime::Period::containing(this_month - chrono::Duration::days(1));
    last_month.start() + chrono::Duration::days(14) + chrono::Duration::hours(12)
}

/// One clock started at [`mid_period`] for every test of this process that wants one, so
/// that a test's helpers can place events on it before or without a service.
pub fn mid_period_clock() -> Clock {
    static CLOCK: std::sync::OnceLock<Clock> = std::sync::OnceLock::new();
    *CLOCK.get_or_init(|| Clock::starting_at(mid_period()))
}

/// A timestamp `seconds_ago` before now, in RFC 3339 with milliseconds.
pub fn ago(seconds_ago: i64) -> String {
    tally::event::canonical::timestamp(chrono::Utc::now() - chrono::Duration::seconds(seconds_ago))
}

/// A valid event of a random kind for the given org and container.
pub fn valid_event(org: &str, container: &str, n: usize) -> Value {
    let id = Uuid::new_v4().to_string();
    let occurred_at = ago(3600 - (n as i64 % 3000));
    match n % 5 {
        0 => {
            json!({"id": id, "type": "container.created", "org_id": org, "container_id": container,
                    "occurred_at": occurred_at, "data": {"name": format!("task-{n}"), "image": "python:3.12"}})
        }
        1 => {
            json!({"id": id, "type": "container.command_ran", "org_id": org, "container_id": container,
                    "occurred_at": occurred_at, "data": {"command_id": format!("cmd-{n}"), "exit_code": 0, "duration_ms": n}})
        }
        2 => {
            json!({"id": id, "type": "container.stopped", "org_id": org, "container_id": container,
                    "occurred_at": occurred_at, "data": {"reason": "idle"}})
        }
        3 => {
            json!({"id": id, "type": "container.resumed", "org_id": org, "container_id": container,
                    "occurred_at": occurred_at})
        }
        _ => {
            json!({"id": id, "type": "container.port_published", "org_id": org, "container_id": container,
                    "occurred_at": occurred_at, "data": {"port": 8000 + (n % 1000), "url": "https://p.example.com/x"}})
        }
    }
}

pub fn valid_events(count: usize) -> Vec<Value> {
    (0..count)
        .map(|n| valid_event(&format!("org_{}", n % 7), &format!("ctr_{}", n % 31), n))
        .collect()
}

/// Native events as the appender takes them, checked as the HTTP ingest checks them.
pub fn parse_events(values: &[Value]) -> Vec<tally::event::Event> {
    let body = json!({ "events": values }).to_string();
    let bounds = tally::event::TimeBounds {
        now: chrono::Utc::now(),
        backdate_max: chrono::Duration::days(35),
    };
    tally::event::parse::parse_body(
        tally::event::parse::BodyKind::Native,
        body.as_bytes(),
        bounds,
        1000,
    )
    .unwrap()
}

pub fn ids_of(events: &[Value]) -> Vec<Uuid> {
    events
        .iter()
        .map(|e| e["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// Waits (up to 30 s: a loaded CI machine) until the projection's checkpoint is at the
/// ledger's head; returns the head.
pub async fn projected_to_head(pool: &PgPool, what: &str) -> i64 {
    projected_to_head_within(pool, 30, what).await
}

/// [`projected_to_head`], waiting up to `seconds`.
pub async fn projected_to_head_within(pool: &PgPool, seconds: u64, what: &str) -> i64 {
    let head: i64 = sqlx::query_scalar("SELECT max(position) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    eventually(seconds, what, || async {
        let projected: i64 = sqlx::query_scalar("SELECT position FROM proj.checkpoint")
            .fetch_one(pool)
            .await
            .unwrap();
        projected == head
    })
    .await;
    head
}

/// Polls until the ledger holds `count` events.
pub async fn wait_for_ledger_count(pool: &PgPool, count: i64) {
    eventually(10, &format!("the ledger holds {count} events"), || async {
        ledger_count(pool).await == count
    })
    .await;
}

/// What the server says of tally's durable ingest consumer (pending and redelivered counts).
pub async fn ingest_consumer_info(
    js: &async_nats::jetstream::Context,
) -> async_nats::jetstream::consumer::Info {
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream("TALLY_INGEST")
        .await
        .unwrap()
        .get_consumer(tally::bus::INGEST_CONSUMER)
        .await
        .unwrap();
    consumer.info().await.unwrap().clone()
}

/// Messages in a stream; 0 while it does not exist or the server does not answer.
pub async fn stream_messages(js: &async_nats::jetstream::Context, stream: &str) -> u64 {
    match js.get_stream(stream).await {
        Ok(mut stream) => stream.info().await.map(|i| i.state.messages).unwrap_or(0),
        Err(_) => 0,
    }
}

/// Runs the real binary with `args` on `database_url`: whether it succeeded, its standard
/// output and its standard error.
pub fn run_tally(database_url: &str, args: &[&str]) -> (bool, String, String) {
    let (code, stdout, stderr) = run_tally_exit(database_url, args);
    (code == Some(0), stdout, stderr)
}

/// [`run_tally`], with the exit code (`None` when a signal ended it).
pub fn run_tally_exit(database_url: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(args)
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("running tally");
    (
        output.status.code(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// Holds the advisory lock `key` on a connection of its own, as another instance holding
/// it would (the ledger's, the corrections'); [`release_advisory_lock`] lets it go.
pub async fn hold_advisory_lock(url: &str, key: i64) -> PgConnection {
    let mut connection = PgConnection::connect(url).await.unwrap();
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(key)
        .execute(&mut connection)
        .await
        .unwrap();
    connection
}

pub async fn release_advisory_lock(mut connection: PgConnection, key: i64) {
    sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(key)
        .execute(&mut connection)
        .await
        .unwrap();
}

/// Runs `tally verify` on a database: exit code, JSON report, stderr.
pub fn run_verify(database_url: &str) -> (i32, Value, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("verify")
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("running tally verify");
    let report = serde_json::from_slice(&output.stdout).expect("verify prints a JSON report");
    (
        output.status.code().unwrap_or(-1),
        report,
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

impl TestNats {
    /// A private nats-server run with a configuration file (as `nats-server -c`), on a free
    /// port, with `env` set for the file's `$VARIABLES` and `TALLY_NATS_STORE_DIR` pointing
    /// at the server's own store. `restart` starts it again without the file.
    pub fn start_with_config(config: &std::path::Path, env: &[(&str, &str)]) -> TestNats {
        let store = tempfile::tempdir().expect("a temporary directory");
        let port = free_port();
        let child = Command::new(nats_server_binary())
            .arg("-c")
            .arg(config)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js"])
            .env("TALLY_NATS_STORE_DIR", store.path())
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server (set TALLY_TEST_NATS_SERVER to its path)");
        let nats = TestNats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            port,
            store,
        };
        nats.wait_until_listening();
        nats
    }
}

impl TestApp {
    /// The service on a fresh database and the given NATS server, connecting with
    /// `nats_url` (which may carry a user and password).
    pub async fn spawn_on(nats: TestNats, nats_url: &str) -> TestApp {
        let db = TestDb::new().await;
        let mut config = Config::new(&db.url, nats_url);
        config.bootstrap_token = Some(TOKEN.to_string());
        config.relay_poll_ms = 50;
        let service = Service::start(config).await.expect("starting the service");
        let pool = db.pool().await;
        TestApp::of(service, pool, nats, db)
    }
}

impl Deref for TestApp {
    type Target = Api;

    fn deref(&self) -> &Api {
        &self.api
    }
}

/// One instance's HTTP API as one caller sees it: its address, the bearer token sent (the
/// admin token unless `with_token`/`without_token` says otherwise) and any extra headers.
/// Each endpoint has a method; the generic ones (`send`, `get_json`, `post_json`,
/// `request`) are for requests no endpoint method sends, such as deliberately bad ones.
#[derive(Clone)]
pub struct Api {
    client: reqwest::Client,
    base: String,
    token: Option<String>,
    headers: Vec<(String, String)>,
}

/// An answer: its status, headers and body as text.
pub struct Reply {
    pub status: u16,
    pub headers: HeaderMap,
    pub text: String,
}

impl Reply {
    /// The body as JSON, `null` when empty; a body that is not JSON fails the test.
    pub fn json(&self) -> Value {
        if self.text.is_empty() {
            return Value::Null;
        }
        let status = self.status;
        let text = &self.text;
        serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("status {status}: body is not JSON ({e}): {text:?}"))
    }

    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .map(|value| value.to_str().unwrap().to_owned())
    }

    pub fn status_json(&self) -> (u16, Value) {
        (self.status, self.json())
    }

    /// Status, `Retry-After` and JSON body: what a read that may wait is judged by.
    pub fn with_retry_after(&self) -> (u16, Option<String>, Value) {
        (self.status, self.header("retry-after"), self.json())
    }
}

impl Api {
    pub fn new(client: reqwest::Client, address: SocketAddr) -> Api {
        Api {
            client,
            base: format!("http://{address}"),
            token: Some(TOKEN.to_string()),
            headers: Vec::new(),
        }
    }

    /// The same caller talking to another instance (on the same database).
    pub fn at(&self, address: SocketAddr) -> Api {
        Api {
            base: format!("http://{address}"),
            ..self.clone()
        }
    }

    pub fn with_token(&self, token: &str) -> Api {
        Api {
            token: Some(token.to_string()),
            ..self.clone()
        }
    }

    pub fn without_token(&self) -> Api {
        Api {
            token: None,
            ..self.clone()
        }
    }

    /// Sends `name: value` with every request, e.g. `Tally-Min-Position`.
    pub fn with_header(&self, name: &str, value: &str) -> Api {
        let mut api = self.clone();
        api.headers.push((name.to_string(), value.to_string()));
        api
    }

    /// Sends `Tally-Min-Position: position` when given.
    pub fn with_min_position(&self, position: Option<&str>) -> Api {
        match position {
            Some(position) => self.with_header("Tally-Min-Position", position),
            None => self.clone(),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request with this caller's token and headers, to finish and send by hand.
    pub fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        let mut request = self.client.request(method, self.url(path));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        for (name, value) in &self.headers {
            request = request.header(name, value);
        }
        request
    }

    pub async fn reply(request: reqwest::RequestBuilder) -> Reply {
        let response = request
            .send()
            .await
            .expect("the request reaches the service");
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let text = response.text().await.unwrap();
        Reply {
            status,
            headers,
            text,
        }
    }

    /// `method path`, with `body` as JSON when given.
    pub async fn send(&self, method: Method, path: &str, body: Option<&Value>) -> Reply {
        let mut request = self.request(method, path);
        if let Some(body) = body {
            request = request.json(body);
        }
        Self::reply(request).await
    }

    /// `method path` with `body` as bytes of `content_type`.
    pub async fn send_bytes(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: impl Into<reqwest::Body>,
    ) -> Reply {
        let request = self
            .request(method, path)
            .header("content-type", content_type)
            .body(body);
        Self::reply(request).await
    }

    /// GET `path`: the whole answer, headers included.
    pub async fn get(&self, path: &str) -> Reply {
        self.send(Method::GET, path, None).await
    }

    /// GET `path`: the status and the JSON body (`null` when empty).
    pub async fn get_json(&self, path: &str) -> (u16, Value) {
        self.send(Method::GET, path, None).await.status_json()
    }

    /// GET `path`: the status and the body as text.
    pub async fn get_text(&self, path: &str) -> (u16, String) {
        let reply = self.send(Method::GET, path, None).await;
        (reply.status, reply.text)
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> (u16, Value) {
        self.send(Method::POST, path, Some(body))
            .await
            .status_json()
    }

    /// POST /v1/events with a body of any type and bytes.
    pub async fn post_raw(&self, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        self.send_bytes(Method::POST, "/v1/events", content_type, body)
            .await
            .status_json()
    }

    pub async fn post_events(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/events", body).await
    }

    /// GET /v1/orgs/{org}/usage, with `query` (without `?`) when not empty.
    pub async fn get_usage(&self, org: &str, query: &str) -> (u16, Value) {
        self.get_json(&with_query(&format!("/v1/orgs/{org}/usage"), query))
            .await
    }

    pub async fn get_container(&self, container: &str, query: &str) -> (u16, Value) {
        self.get_json(&with_query(&format!("/v1/containers/{container}"), query))
            .await
    }

    pub async fn get_container_events(&self, container: &str, query: &str) -> (u16, Value) {
        let path = format!("/v1/containers/{container}/events");
        self.get_json(&with_query(&path, query)).await
    }

    pub async fn get_plans(&self) -> (u16, Value) {
        self.get_json("/v1/plans").await
    }

    pub async fn put_plan(&self, id: &str, plan: &Value) -> (u16, Value) {
        self.send(Method::PUT, &format!("/v1/plans/{id}"), Some(plan))
            .await
            .status_json()
    }

    pub async fn check_admission(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/admission/check", body).await
    }

    pub async fn reserve(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/admission/reservations", body).await
    }

    pub async fn release(&self, reservation: &str) -> (u16, Value) {
        let path = format!("/v1/admission/reservations/{reservation}");
        self.send(Method::DELETE, &path, None).await.status_json()
    }

    /// GET /v1/events (the audit read), with `query` (without `?`) when not empty.
    pub async fn get_events(&self, query: &str) -> (u16, Value) {
        self.get_json(&with_query("/v1/events", query)).await
    }

    /// GET /v1/ledger/verify, with `query` (without `?`) when not empty.
    pub async fn verify(&self, query: &str) -> (u16, Value) {
        self.get_json(&with_query("/v1/ledger/verify", query)).await
    }

    pub async fn post_token(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/tokens", body).await
    }

    pub async fn delete_token(&self, id: &str) -> (u16, Value) {
        let path = format!("/v1/tokens/{id}");
        self.send(Method::DELETE, &path, None).await.status_json()
    }

    /// POST /v1/provider-reports with a CSV body.
    pub async fn post_report(&self, csv: String) -> (u16, Value) {
        self.send_bytes(
            Method::POST,
            "/v1/provider-reports",
            "text/csv",
            csv.into_bytes(),
        )
        .await
        .status_json()
    }

    pub async fn post_reconciliation(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/reconciliations", body).await
    }

    /// GET a reconciliation's lines.csv: status and text.
    pub async fn get_lines(&self, reconciliation: &str) -> (u16, String) {
        let path = format!("/v1/reconciliations/{reconciliation}/lines.csv");
        self.get_text(&path).await
    }

    /// GET /v1/exports/usage.csv, with `query` (without `?`) when not empty: status and text.
    pub async fn get_usage_export(&self, query: &str) -> (u16, String) {
        self.get_text(&with_query("/v1/exports/usage.csv", query))
            .await
    }

    /// POST /v1/periods/{period}/close: status, `Location` (the job's status route), job.
    pub async fn close_period(&self, period: &str) -> (u16, Option<String>, Value) {
        let path = format!("/v1/periods/{period}/close");
        let reply = self.send(Method::POST, &path, None).await;
        (reply.status, reply.header("location"), reply.json())
    }

    pub async fn get_close(&self, period: &str) -> (u16, Value) {
        self.get_json(&format!("/v1/periods/{period}/close")).await
    }

    pub async fn get_period(&self, period: &str) -> (u16, Value) {
        self.get_json(&format!("/v1/periods/{period}")).await
    }

    pub async fn post_void(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/corrections/voids", body).await
    }

    pub async fn post_corrections(&self, body: &Value) -> (u16, Value) {
        self.post_json("/v1/corrections/events", body).await
    }
}

/// The body of an answer that must have the `expected` status.
#[track_caller]
pub fn answered(expected: u16, (status, body): (u16, Value)) -> Value {
    assert_eq!(status, expected, "{body}");
    body
}

/// The body of an answer that must be 200.
#[track_caller]
pub fn ok(answer: (u16, Value)) -> Value {
    answered(200, answer)
}

fn with_query(path: &str, query: &str) -> String {
    if query.is_empty() {
        return path.to_string();
    }
    format!("{path}?{query}")
}

/// A CloudEvent in binary mode: one `ce-` header per attribute (values percent-encoded as
/// the HTTP binding says: space, `"`, `%` and everything outside printable ASCII), and its
/// `data` as the body. Header names keep the case given in `cloudevent`'s keys' prefix.
pub fn binary_mode(cloudevent: &Value, prefix: &str) -> (Vec<(String, String)>, Vec<u8>) {
    let mut headers = Vec::new();
    let mut body = Vec::new();
    for (name, value) in cloudevent.as_object().unwrap() {
        if name == "data" {
            body = value.to_string().into_bytes();
            continue;
        }
        let text = match value {
            Value::String(text) => text.clone(),
            other => other.to_string(),
        };
        headers.push((format!("{prefix}{name}"), percent_encode(&text)));
    }
    (headers, body)
}

fn percent_encode(text: &str) -> String {
    let mut out = String::new();
    for byte in text.bytes() {
        if (0x21..=0x7e).contains(&byte) && byte != b'"' && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl Api {
    /// POST /v1/events in binary mode: `headers` as given, `body` as `content_type`.
    pub async fn post_binary(
        &self,
        headers: &[(String, String)],
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> (u16, Value) {
        let mut request = self.request(Method::POST, "/v1/events").body(body);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        Self::reply(request).await.status_json()
    }
}

/// A 3-node NATS cluster with JetStream on free loopback ports, each node run from
/// `deploy/nats/cluster-node.conf` (the configuration operators are given) with a store of
/// its own; every node still running is killed and every store removed when the test ends.
pub struct TestNatsCluster {
    pub nodes: Vec<ClusterNode>,
    /// Every node's client URL, comma-separated, as `NATS_URL` takes them.
    pub url: String,
}

/// One node of a [`TestNatsCluster`].
pub struct ClusterNode {
    /// Its `server_name`, as stream info names a stream's leader.
    pub name: String,
    pub port: u16,
    cluster_port: u16,
    child: Option<Child>,
    store: tempfile::TempDir,
}

impl TestNatsCluster {
    /// The nodes `cluster-node.conf` names routes for.
    pub const NODES: usize = 3;

    pub fn start() -> TestNatsCluster {
        let client_ports: Vec<u16> = (0..Self::NODES).map(|_| free_port()).collect();
        let cluster_ports: Vec<u16> = (0..Self::NODES).map(|_| free_port()).collect();
        let mut cluster = TestNatsCluster {
            nodes: (0..Self::NODES)
                .map(|index| ClusterNode {
                    name: format!("nats-{}", index + 1),
                    port: client_ports[index],
                    cluster_port: cluster_ports[index],
                    child: None,
                    store: tempfile::tempdir().expect("a temporary directory"),
                })
                .collect(),
            url: client_ports
                .iter()
                .map(|port| format!("nats://127.0.0.1:{port}"))
                .collect::<Vec<_>>()
                .join(","),
        };
        for index in 0..Self::NODES {
            cluster.spawn(index);
        }
        for node in &cluster.nodes {
            wait_until_listening(node.port);
        }
        cluster
    }

    /// Runs node `index` from `cluster-node.conf` with its ports and store.
    fn spawn(&mut self, index: usize) {
        let config =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/nats/cluster-node.conf");
        let routes: Vec<String> = self
            .nodes
            .iter()
            .map(|node| format!("nats://127.0.0.1:{}", node.cluster_port))
            .collect();
        let node = &mut self.nodes[index];
        assert!(node.child.is_none(), "node {} is running", node.name);
        let child = Command::new(nats_server_binary())
            .arg("-c")
            .arg(&config)
            .args(["-a", "127.0.0.1", "-p", &node.port.to_string()])
            .env("TALLY_NATS_NODE", &node.name)
            .env("TALLY_NATS_STORE_DIR", node.store.path())
            .env(
                "TALLY_NATS_CLUSTER_LISTEN",
                format!("127.0.0.1:{}", node.cluster_port),
            )
            .env("TALLY_NATS_ROUTE_1", &routes[0])
            .env("TALLY_NATS_ROUTE_2", &routes[1])
            .env("TALLY_NATS_ROUTE_3", &routes[2])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server (set TALLY_TEST_NATS_SERVER to its path)");
        node.child = Some(child);
    }

    /// Starts a killed node again, on its ports with its store, as an operator restarts a
    /// failed server; returns once it accepts connections.
    pub fn restart(&mut self, index: usize) {
        self.spawn(index);
        wait_until_listening(self.nodes[index].port);
    }

    /// The index of the node named `name`.
    pub fn node(&self, name: &str) -> usize {
        self.nodes
            .iter()
            .position(|node| node.name == name)
            .unwrap_or_else(|| panic!("no node named {name}"))
    }

    /// kill -9 of one node; its store stays until the test ends.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.nodes[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// A JetStream context on a client that knows every node, as tally's does; its requests
    /// wait `timeout` for an answer.
    pub async fn jetstream(&self, timeout: Duration) -> async_nats::jetstream::Context {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(self.url.split(',').collect::<Vec<_>>().as_slice())
            .await
            .expect("connecting to the test cluster");
        let mut context = async_nats::jetstream::new(client);
        context.set_timeout(timeout);
        context
    }
}

impl Drop for TestNatsCluster {
    fn drop(&mut self) {
        for index in 0..self.nodes.len() {
            self.kill(index);
        }
    }
}

/// Waits until something accepts connections on the loopback `port`.
fn wait_until_listening(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    while TcpStream::connect_timeout(&address, Duration::from_millis(100)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not start on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until `count` appends of this database wait for the ledger lock.
pub async fn waiting_for_the_ledger_lock(pool: &sqlx::PgPool, count: i64) {
    eventually(5, "appends wait for the ledger lock", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        waiting == count
    })
    .await;
}

/// Opens a POST to `path` of `token` that holds its slot: headers announcing 100 000 bytes
/// and then only `start` of the body, the rest never coming. Returns a task that reads the
/// status of the answer, if one comes before the connection is dropped (when the task is
/// aborted or ends).
pub async fn slow_request(
    app: &TestApp,
    token: &str,
    path: &str,
    content_type: &str,
    start: &str,
) -> tokio::task::JoinHandle<Option<(u16, String)>> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(app.address).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: {content_type}\r\nContent-Length: 100000\r\n\r\n{start}"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    tokio::spawn(async move {
        let mut answer = Vec::new();
        let mut buffer = [0u8; 4096];
        loop {
            let read = stream.read(&mut buffer).await.ok()?;
            if read == 0 {
                break;
            }
            answer.extend_from_slice(&buffer[..read]);
            if answer.windows(4).any(|window| window == b"\r\n\r\n") && answer.ends_with(b"}") {
                break;
            }
        }
        let text = String::from_utf8_lossy(&answer).into_owned();
        let status = text.split(' ').nth(1)?.parse().ok()?;
        Some((status, text))
    })
}
