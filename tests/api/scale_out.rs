//! Scale-out under failure: three `tally serve` processes on one database and a 3-node
//! JetStream cluster that keeps every stream three times (`TALLY_STREAM_REPLICAS=3`).
//! Events are posted to every instance and published to the ingest subject, and the one
//! running slot of an org is reserved through every instance, while the instance holding
//! the relay is killed (-9), then the node leading `TALLY_LEDGER`; the instance returns, the
//! node returns and catches up, then a follower node is killed and returns. Afterwards the ledger holds every acknowledged event once at gap-free
//! positions, the stream is the ledger, the projection is what a replay folds from the
//! ledger, no slot was granted twice, ingest and the dead-letter stream carried on, and a
//! read on one instance saw what another had just acknowledged, the returned one included.
//! Also: the streams follow `TALLY_STREAM_REPLICAS` when it changes, and bad `NATS_URL`
//! lists and replica counts stop start-up with a message naming them.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::join_all;
use futures::StreamExt as _;
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;
use tally::bus::Names;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::helpers::*;
use crate::plans::pro_plan;

const INSTANCES: usize = 3;
/// The org whose one running slot (plan `pro`) the reservation rounds race for.
const SLOT_ORG: &str = "slots";
/// The org of the read-after-acknowledge checks' containers.
const READER_ORG: &str = "readers";
/// HTTP producers, events per request and the pause between a producer's requests, with
/// the NATS publisher's messages per round: some 500 events a second in all, enough to keep
/// every component busy through the kills, few enough that the final comparisons stay
/// quick on two cores.
const HTTP_PRODUCERS: usize = 3;
const EVENTS_PER_REQUEST: usize = 10;
const PAUSE_MS: u64 = 50;
const MESSAGES_PER_ROUND: usize = 5;
/// Reservation requests per round, spread over the living instances.
const RACERS: usize = 6;
/// How long a surviving instance may take to take over the relay or the projection: far
/// past the second it takes (the relay asks for its lock every 4 × `TALLY_RELAY_POLL_MS`,
/// projector rounds come every `TALLY_PROJECTOR_POLL_MS`), so that only a takeover that
/// does not happen fails the test, not a slow machine.
const TAKEOVER_BOUND_S: u64 = 20;
/// The same for the cluster electing a new stream leader and tally going on through it
/// (JetStream's election timeout alone is 4 to 9 seconds).
const FAILOVER_BOUND_S: u64 = 40;

/// One `tally serve` process.
struct Instance {
    api: Api,
    listen: String,
    child: Option<Child>,
}

/// Three instances on one database and the cluster, their logs in a directory of their own
/// (printed when the test fails). Dropped in field order: the instances are killed before
/// the cluster and the database go.
struct Fleet {
    instances: Vec<Instance>,
    cluster: TestNatsCluster,
    db: TestDb,
    logs: tempfile::TempDir,
}

/// `tally-<n>`: the instance's Postgres `application_name`, which names the session that
/// holds the relay's lock.
pub(crate) fn instance_name(index: usize) -> String {
    format!("tally-{index}")
}

/// `tally serve` keeping `replicas` copies of each stream, its log in `log`.
pub(crate) fn spawn_tally(
    database_url: &str,
    nats_url: &str,
    replicas: usize,
    listen: &str,
    log: &Path,
) -> Child {
    let log = std::fs::File::create(log).expect("a log file");
    Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("serve")
        .env("DATABASE_URL", database_url)
        .env("NATS_URL", nats_url)
        .env("TALLY_STREAM_REPLICAS", replicas.to_string())
        .env("TALLY_LISTEN", listen)
        .env("TALLY_BOOTSTRAP_TOKEN", TOKEN)
        // The guarantee of a read on another instance is the wait, not its budget.
        .env("TALLY_READ_WAIT_MS", "60000")
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("starting tally serve")
}

pub(crate) fn free_listen() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

pub(crate) async fn wait_ready(api: &Api) {
    eventually(60, "tally serve is ready", || {
        let request = api.without_token().request(Method::GET, "/readyz").send();
        async move { request.await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
}

impl Fleet {
    /// The cluster, then the first instance (which migrates the database), then the others;
    /// returns once every instance is ready and every stream has its three copies.
    async fn start() -> Fleet {
        let cluster = TestNatsCluster::start();
        let db = TestDb::new().await;
        let logs = tempfile::tempdir().expect("a temporary directory");
        let mut fleet = Fleet {
            instances: Vec::new(),
            cluster,
            db,
            logs,
        };
        for index in 0..INSTANCES {
            let listen = free_listen();
            let url = format!("{}?application_name={}", fleet.db.url, instance_name(index));
            let log = fleet
                .logs
                .path()
                .join(format!("{}.log", instance_name(index)));
            let child = spawn_tally(&url, &fleet.cluster.url, 3, &listen, &log);
            let api = Api::new(reqwest::Client::new(), listen.parse().unwrap());
            wait_ready(&api).await;
            fleet.instances.push(Instance {
                api,
                listen,
                child: Some(child),
            });
        }
        let js = fleet.cluster.jetstream(Duration::from_secs(2)).await;
        for stream in ["TALLY_LEDGER", "TALLY_INGEST", "TALLY_DLQ"] {
            eventually(30, &format!("{stream} has three current copies"), || {
                replicated(&js, stream, 3)
            })
            .await;
        }
        fleet
    }

    /// Starts a killed instance again, as it was (same database session name, address and
    /// settings), and waits until it is ready.
    async fn restart(&mut self, index: usize) {
        let url = format!("{}?application_name={}", self.db.url, instance_name(index));
        let log = self
            .logs
            .path()
            .join(format!("{}-returned.log", instance_name(index)));
        let instance = &mut self.instances[index];
        assert!(instance.child.is_none(), "only a killed instance returns");
        instance.child = Some(spawn_tally(
            &url,
            &self.cluster.url,
            3,
            &instance.listen,
            &log,
        ));
        wait_ready(&instance.api).await;
    }

    /// kill -9 of one instance.
    async fn kill(&mut self, index: usize) {
        let mut child = self.instances[index].child.take().expect("running");
        child.start_kill().expect("SIGKILL");
        child.wait().await.unwrap();
    }

    fn api(&self, index: usize) -> Api {
        self.instances[index].api.clone()
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for index in 0..INSTANCES {
            let path = self
                .logs
                .path()
                .join(format!("{}.log", instance_name(index)));
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!(
                "--- {} ({}), last lines:",
                instance_name(index),
                self.instances.get(index).map_or("", |i| i.listen.as_str())
            );
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// Whether `stream` exists with `replicas` copies, each current.
async fn replicated(js: &async_nats::jetstream::Context, stream: &str, replicas: usize) -> bool {
    let Ok(mut stream) = js.get_stream(stream).await else {
        return false;
    };
    let Ok(info) = stream.info().await else {
        return false;
    };
    let peers = info.cluster.as_ref().map_or(0, |cluster| {
        cluster.replicas.iter().filter(|peer| peer.current).count()
    });
    info.config.num_replicas == replicas
        && info.cluster.as_ref().is_some_and(|c| c.leader.is_some())
        && peers == replicas - 1
}

/// The server leading `stream`, when one does.
async fn stream_leader(js: &async_nats::jetstream::Context, stream: &str) -> Option<String> {
    let mut stream = js.get_stream(stream).await.ok()?;
    let info = stream.info().await.ok()?;
    info.cluster.as_ref()?.leader.clone()
}

/// The instance whose session holds the relay's advisory lock, by its `application_name`.
async fn relay_holder(pool: &PgPool) -> Option<String> {
    lock_holder(pool, tally::bus::relay::RELAY_LOCK_KEY).await
}

/// The `application_name` of the session holding the advisory lock `key` (taken by
/// session or by transaction) on the test's database.
pub(crate) async fn lock_holder(pool: &PgPool, key: i64) -> Option<String> {
    sqlx::query_scalar(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 \
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND ((l.classid::text::bigint << 32) | l.objid::text::bigint) = $1",
    )
    .bind(key)
    .fetch_optional(pool)
    .await
    .unwrap()
}

pub(crate) async fn head(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT coalesce(max(position), 0) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap()
}

pub(crate) async fn checkpoint(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT position FROM proj.checkpoint")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The ledger position of the stream's last message; 0 while it cannot be read.
pub(crate) async fn relayed(js: &async_nats::jetstream::Context) -> i64 {
    tally::bus::status::ledger_stream_last_position(js, &Names::new("").unwrap())
        .await
        .unwrap_or(0)
}

/// Sends `request`; `None` when it did not reach an instance or got no whole answer (an
/// instance killed under it).
async fn attempt(request: reqwest::RequestBuilder) -> Option<(u16, Value)> {
    let response = request.timeout(Duration::from_secs(10)).send().await.ok()?;
    let status = response.status().as_u16();
    let text = response.text().await.ok()?;
    Some((status, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// What the load saw: what was acknowledged, and what each check found.
#[derive(Default)]
pub(crate) struct Record {
    pub(crate) http_acked: Vec<Uuid>,
    /// Events whose JetStream publish was acknowledged, with when.
    nats_acked: Vec<(Uuid, Instant)>,
    /// Slots granted per reservation round.
    rounds: Vec<usize>,
    /// Read-after-acknowledge checks that passed: when, and the (writer, reader) instances.
    reads: Vec<(Instant, usize, usize)>,
    /// What went wrong, to fail the test with at the end.
    failures: Vec<String>,
}

/// Adds to the record; the lock is held for `change` alone, never across an await.
fn note(record: &Mutex<Record>, change: impl FnOnce(&mut Record)) {
    change(&mut record.lock().unwrap());
}

/// The instances the load may use (a killed one is taken out before it is killed).
#[derive(Clone)]
struct Targets {
    apis: Arc<Vec<Api>>,
    alive: Arc<Vec<AtomicBool>>,
}

impl Targets {
    fn living(&self) -> Vec<usize> {
        (0..self.apis.len())
            .filter(|&index| self.alive[index].load(Ordering::SeqCst))
            .collect()
    }

    /// The `n`-th living instance, counting round.
    fn pick(&self, n: usize) -> (usize, Api) {
        let living = self.living();
        let index = living[n % living.len()];
        (index, self.apis[index].clone())
    }
}

/// Producers over HTTP and NATS, reservation rounds and read-after-acknowledge checks,
/// until stopped.
struct Load {
    record: Arc<Mutex<Record>>,
    running: Arc<AtomicBool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    fn start(targets: &Targets, js: &async_nats::jetstream::Context) -> Load {
        let record = Arc::new(Mutex::new(Record::default()));
        let running = Arc::new(AtomicBool::new(true));
        let mut tasks = Vec::new();
        for producer in 0..HTTP_PRODUCERS {
            tasks.push(tokio::spawn(post_events(
                producer,
                targets.clone(),
                record.clone(),
                running.clone(),
            )));
        }
        tasks.push(tokio::spawn(publish_events(
            js.clone(),
            record.clone(),
            running.clone(),
        )));
        tasks.push(tokio::spawn(reserve_rounds(
            targets.clone(),
            record.clone(),
            running.clone(),
        )));
        tasks.push(tokio::spawn(read_after_acknowledge(
            targets.clone(),
            record.clone(),
            running.clone(),
        )));
        Load {
            record,
            running,
            tasks,
        }
    }

    fn acknowledged(&self) -> usize {
        let record = self.record.lock().unwrap();
        record.http_acked.len() + record.nats_acked.len()
    }

    async fn wait_for_more(&self, events: usize) {
        let target = self.acknowledged() + events;
        eventually(
            60,
            &format!("{events} more events are acknowledged"),
            || async { self.acknowledged() >= target },
        )
        .await;
    }

    async fn stop(self) -> Record {
        self.running.store(false, Ordering::SeqCst);
        for task in self.tasks {
            task.await.unwrap();
        }
        Arc::try_unwrap(self.record)
            .ok()
            .expect("the tasks are done")
            .into_inner()
            .unwrap()
    }
}

async fn post_events(
    producer: usize,
    targets: Targets,
    record: Arc<Mutex<Record>>,
    running: Arc<AtomicBool>,
) {
    let mut request = producer;
    while running.load(Ordering::SeqCst) {
        request += HTTP_PRODUCERS;
        let (_, api) = targets.pick(request);
        let events: Vec<Value> = (0..EVENTS_PER_REQUEST)
            .map(|n| {
                valid_event(
                    &format!("org_{}", n % 7),
                    &format!("ctr_{producer}_{}", n % 13),
                    request + n,
                )
            })
            .collect();
        let sent = api
            .request(Method::POST, "/v1/events")
            .json(&json!({ "events": events }));
        match attempt(sent).await {
            Some((200, _)) => record.lock().unwrap().http_acked.extend(ids_of(&events)),
            // Not acknowledged (killed under the request, or shedding): it may or may not
            // be stored, and nothing is asserted of it.
            Some((503, _)) | None => {}
            Some((status, answer)) => record
                .lock()
                .unwrap()
                .failures
                .push(format!("POST /v1/events answered {status}: {answer}")),
        }
        tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
    }
}

/// Publishes events to the ingest subject, each counted once JetStream acknowledges it.
async fn publish_events(
    js: async_nats::jetstream::Context,
    record: Arc<Mutex<Record>>,
    running: Arc<AtomicBool>,
) {
    let mut n = 0;
    while running.load(Ordering::SeqCst) {
        let mut pending = Vec::new();
        for _ in 0..MESSAGES_PER_ROUND {
            n += 1;
            let event = valid_event(
                &format!("org_{}", n % 7),
                &format!("ctr_nats_{}", n % 17),
                n,
            );
            let id: Uuid = event["id"].as_str().unwrap().parse().unwrap();
            if let Ok(ack) = js
                .publish("tally.ingest.load", event.to_string().into())
                .await
            {
                pending.push((id, ack));
            }
        }
        for (id, ack) in pending {
            if ack.await.is_ok() {
                record.lock().unwrap().nats_acked.push((id, Instant::now()));
            }
        }
        tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
    }
}

/// Rounds of reservations for the slot org's one slot, spread over the living instances:
/// at most one may be granted per round; the granted one is released before the next.
async fn reserve_rounds(targets: Targets, record: Arc<Mutex<Record>>, running: Arc<AtomicBool>) {
    let body = json!({"org_id": SLOT_ORG, "action": "create", "ttl_seconds": 2});
    let mut round = 0;
    while running.load(Ordering::SeqCst) {
        round += 1;
        let answers = join_all((0..RACERS).map(|racer| {
            let (_, api) = targets.pick(round + racer);
            let request = api
                .request(Method::POST, "/v1/admission/reservations")
                .json(&body);
            attempt(request)
        }))
        .await;
        let granted: Vec<&Value> = answers
            .iter()
            .flatten()
            .filter(|(status, _)| *status == 201)
            .map(|(_, answer)| answer)
            .collect();
        let refused_otherwise: Vec<String> = answers
            .iter()
            .flatten()
            .filter(|(status, _)| *status != 201 && *status != 409)
            .map(|(status, answer)| format!("a reservation answered {status}: {answer}"))
            .collect();
        let reservation = granted
            .first()
            .and_then(|g| g["reservation_id"].as_str())
            .map(str::to_owned);
        note(&record, |kept| {
            kept.rounds.push(granted.len());
            kept.failures.extend(refused_otherwise);
        });
        if let Some(reservation) = reservation {
            let (_, api) = targets.pick(round);
            let path = format!("/v1/admission/reservations/{reservation}");
            // Not released (the instance died under it): it expires by itself.
            let _ = attempt(api.request(Method::DELETE, &path)).await;
        }
        tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
    }
}

/// A container created through one instance, then read through another with the position
/// the first acknowledged (`Tally-Min-Position`): the read must show it running.
async fn read_after_acknowledge(
    targets: Targets,
    record: Arc<Mutex<Record>>,
    running: Arc<AtomicBool>,
) {
    let mut check = 0;
    while running.load(Ordering::SeqCst) {
        check += 1;
        let (writer, writer_api) = targets.pick(check);
        let (reader, reader_api) = targets.pick(check + 1);
        let container = format!("r{check}");
        let created = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": READER_ORG,
                             "container_id": container, "occurred_at": ago(30), "data": {"name": "reader"}});
        let post = writer_api
            .request(Method::POST, "/v1/events")
            .json(&json!({ "events": [created] }));
        let acknowledged = match attempt(post).await {
            Some((200, answer)) => answer["results"][0]["position"].as_i64(),
            _ => None,
        };
        let Some(position) = acknowledged else {
            tokio::time::sleep(Duration::from_millis(PAUSE_MS)).await;
            continue;
        };
        let path = format!("/v1/containers/{container}?org_id={READER_ORG}");
        let read = reader_api
            .with_min_position(Some(&position.to_string()))
            .request(Method::GET, &path);
        let outcome = attempt(read).await;
        note(&record, |kept| match outcome {
            Some((200, found))
                if found["state"] == "running" && found["position"].as_i64() >= Some(position) =>
            {
                kept.reads.push((Instant::now(), writer, reader))
            }
            // The reader was killed under the read.
            None => {}
            Some((status, found)) => kept.failures.push(format!(
                "{container}, acknowledged at {position} by instance {writer}, \
                 read on instance {reader}: {status} {found}"
            )),
        });
        tokio::time::sleep(Duration::from_millis(4 * PAUSE_MS)).await;
    }
}

/// The slot org on plan `pro` (one running slot), verified and billing eligible, and the
/// reader org; through `api`.
async fn prepare_orgs(api: &Api) {
    let (status, plan) = api.put_plan("pro", &pro_plan()).await;
    assert!(status == 201 || status == 200, "{plan}");
    let events: Vec<Value> = [
        ("org.plan_changed", json!({"plan": "pro"})),
        ("org.verification_changed", json!({"verified": true})),
        ("org.billing_eligibility_changed", json!({"eligible": true})),
    ]
    .into_iter()
    .map(|(event_type, data)| {
        json!({"id": Uuid::new_v4(), "type": event_type, "org_id": SLOT_ORG,
               "occurred_at": ago(600), "data": data})
    })
    .collect();
    let (status, answer) = api.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200, "{answer}");
}

/// Publishes an event no instance can append, and waits until it is dead-lettered; the
/// message published.
async fn dead_letter_one(js: &async_nats::jetstream::Context) -> String {
    let mut invalid = valid_event("org_1", "ctr_1", 1);
    invalid["type"] = json!("container.vanished");
    let text = invalid.to_string();
    js.publish("tally.ingest.bad", text.clone().into())
        .await
        .unwrap()
        .await
        .unwrap();
    eventually(30, "the invalid event is dead-lettered", || async {
        stream_messages(js, "TALLY_DLQ").await == 1
    })
    .await;
    text
}

/// How long after a kill each part was going again.
struct Takeover {
    /// A surviving instance holds the relay's lock (instance kill); the stream has a new
    /// leader (node kill).
    taken: Duration,
    /// The relay published a position appended after the kill.
    relay: Duration,
    /// The projection holds a position appended after the kill (instance kill); an event
    /// published to the ingest subject after the kill is in the ledger (node kill).
    other: Duration,
}

/// Kills (-9) the instance that holds the relay's lock; how long until a survivor relays
/// and the projection goes on.
async fn kill_the_relay_holder(
    fleet: &mut Fleet,
    targets: &Targets,
    pool: &PgPool,
    js: &async_nats::jetstream::Context,
) -> (usize, Instant, Takeover) {
    let holder = relay_holder(pool).await.expect("an instance relays");
    let index = (0..INSTANCES)
        .find(|&index| instance_name(index) == holder)
        .unwrap_or_else(|| panic!("{holder} is not an instance"));
    targets.alive[index].store(false, Ordering::SeqCst);
    let head_at_kill = head(pool).await;
    let killed_at = Instant::now();
    fleet.kill(index).await;
    eventually(
        TAKEOVER_BOUND_S,
        "a surviving instance holds the relay's lock",
        || async { relay_holder(pool).await.is_some_and(|now| now != holder) },
    )
    .await;
    let taken = killed_at.elapsed();
    eventually(
        TAKEOVER_BOUND_S,
        "the relay publishes what was appended after the kill",
        || async { relayed(js).await > head_at_kill },
    )
    .await;
    let relay = killed_at.elapsed();
    eventually(
        TAKEOVER_BOUND_S,
        "the projection holds what was appended after the kill",
        || async { checkpoint(pool).await > head_at_kill },
    )
    .await;
    let projector = killed_at.elapsed();
    (
        index,
        killed_at,
        Takeover {
            taken,
            relay,
            other: projector,
        },
    )
}

/// Which node of the cluster to kill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Node {
    /// The node leading `TALLY_LEDGER`.
    LedgerLeader,
    /// A node that keeps a copy of `TALLY_LEDGER` and does not lead it.
    Follower,
}

/// Kills (-9) `which` node; returns its index, when, and how long until `TALLY_LEDGER` has
/// a leader that is alive (a new one after the leader's kill), the relay publishes through
/// it and an event published after the kill is ingested.
async fn kill_a_node(
    fleet: &mut Fleet,
    pool: &PgPool,
    js: &async_nats::jetstream::Context,
    which: Node,
) -> (usize, Instant, Takeover) {
    let leader = stream_leader(js, "TALLY_LEDGER")
        .await
        .expect("the stream has a leader");
    let node = match which {
        Node::LedgerLeader => fleet.cluster.node(&leader),
        Node::Follower => (0..TestNatsCluster::NODES)
            .find(|&index| fleet.cluster.nodes[index].name != leader)
            .expect("a node that does not lead"),
    };
    let killed = fleet.cluster.nodes[node].name.clone();
    let head_at_kill = head(pool).await;
    let killed_at = Instant::now();
    fleet.cluster.kill(node);
    eventually(
        FAILOVER_BOUND_S,
        "TALLY_LEDGER has a leader that is alive",
        || async {
            stream_leader(js, "TALLY_LEDGER")
                .await
                .is_some_and(|now| now != killed)
        },
    )
    .await;
    let taken = killed_at.elapsed();
    eventually(
        FAILOVER_BOUND_S,
        "the relay publishes what was appended after the kill",
        || async { relayed(js).await > head_at_kill },
    )
    .await;
    let relay = killed_at.elapsed();
    let marker = valid_event("org_marker", "ctr_marker", 0);
    let id: Uuid = marker["id"].as_str().unwrap().parse().unwrap();
    eventually(
        FAILOVER_BOUND_S,
        "an event published after the kill is acknowledged",
        || async {
            match js
                .publish("tally.ingest.marker", marker.to_string().into())
                .await
            {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
    eventually(
        FAILOVER_BOUND_S,
        "an event published after the kill is ingested",
        || async {
            let found: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE id = $1")
                .bind(id)
                .fetch_one(pool)
                .await
                .unwrap();
            found == 1
        },
    )
    .await;
    let ingest = killed_at.elapsed();
    (
        node,
        killed_at,
        Takeover {
            taken,
            relay,
            other: ingest,
        },
    )
}

/// Starts killed node `node` again and waits until every stream has three current copies
/// once more; how long that took.
async fn node_returns(
    fleet: &mut Fleet,
    js: &async_nats::jetstream::Context,
    node: usize,
) -> Duration {
    let restarted_at = Instant::now();
    fleet.cluster.restart(node);
    for stream in ["TALLY_LEDGER", "TALLY_INGEST", "TALLY_DLQ"] {
        eventually(
            FAILOVER_BOUND_S,
            &format!("{stream} has three current copies after a node returned"),
            || replicated(js, stream, 3),
        )
        .await;
    }
    restarted_at.elapsed()
}

/// Every acknowledged event is in the ledger, once, at positions 1..=N; N.
pub(crate) async fn assert_ledger_holds_every_acknowledged_event_once(
    pool: &PgPool,
    record: &Record,
) -> i64 {
    let total = ledger_count(pool).await;
    assert_eq!(
        positions(pool).await,
        (1..=total).collect::<Vec<_>>(),
        "gap-free"
    );
    let distinct: i64 = sqlx::query_scalar("SELECT count(DISTINCT id) FROM ledger")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(distinct, total, "no event is stored twice");
    let acknowledged: Vec<Uuid> = record
        .http_acked
        .iter()
        .copied()
        .chain(record.nats_acked.iter().map(|(id, _)| *id))
        .collect();
    let found: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE id = ANY($1)")
        .bind(&acknowledged)
        .fetch_one(pool)
        .await
        .unwrap();
    let missing = |ids: Vec<Uuid>| {
        let pool = pool.clone();
        async move {
            let found: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM ledger WHERE id = ANY($1)")
                .bind(&ids)
                .fetch_all(&pool)
                .await
                .unwrap();
            ids.len() - found.len()
        }
    };
    assert_eq!(
        (found as usize, missing(record.http_acked.clone()).await),
        (acknowledged.len(), 0),
        "every acknowledged event is in the ledger ({} published to NATS missing)",
        missing(record.nats_acked.iter().map(|(id, _)| *id).collect()).await
    );
    total
}

/// The ids of the stream's first `count` messages, in order. Creating the consumer that
/// reads them can time out for a while after a node died (the cluster may place it on the
/// dead node); a read that failed is started again.
async fn stream_ids(stream: &async_nats::jetstream::stream::Stream, count: usize) -> Vec<Uuid> {
    let deadline = Instant::now() + Duration::from_secs(FAILOVER_BOUND_S);
    loop {
        let read = async {
            let consumer = stream
                .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
                .await?;
            let mut messages = consumer.messages().await?;
            let mut ids = Vec::with_capacity(count);
            while ids.len() < count {
                let message = messages.next().await.ok_or("the stream ended early")??;
                let id = message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Msg-Id"))
                    .expect("every ledger message has an id");
                ids.push(id.as_str().parse::<Uuid>().unwrap());
            }
            Ok::<_, async_nats::Error>(ids)
        };
        match read.await {
            Ok(ids) => return ids,
            Err(error) => {
                assert!(Instant::now() < deadline, "cannot read the stream: {error}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// The stream holds the ledger: as many messages, the same ids in position order, each
/// message equal to its row (`verify --stream`, through a surviving instance).
pub(crate) async fn assert_stream_is_the_ledger(
    js: &async_nats::jetstream::Context,
    pool: &PgPool,
    api: &Api,
    total: i64,
) {
    let deadline = Instant::now() + Duration::from_secs(FAILOVER_BOUND_S);
    let (stream, state) = loop {
        let read = async {
            let mut stream = js.get_stream("TALLY_LEDGER").await?;
            let state = stream.info().await?.state.clone();
            Ok::<_, async_nats::Error>((stream, state))
        };
        match read.await {
            Ok(found) => break found,
            Err(error) => assert!(Instant::now() < deadline, "{error}"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(
        (state.messages, state.first_sequence, state.last_sequence),
        (total as u64, 1, total as u64)
    );
    let relayed = stream_ids(&stream, total as usize).await;
    let ledger: Vec<Uuid> = sqlx::query_scalar("SELECT id FROM ledger ORDER BY position")
        .fetch_all(pool)
        .await
        .unwrap();
    assert!(
        relayed == ledger,
        "the stream holds the ledger's ids in position order"
    );
    // A pass that cannot read the stream (503: a request timed out while the cluster
    // settles) is tried again; one that read it must find it equal.
    let deadline = Instant::now() + Duration::from_secs(FAILOVER_BOUND_S);
    let report = loop {
        let (status, answer) = api.verify("full=true&stream=true").await;
        match status {
            200 => break answer,
            503 if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await
            }
            _ => panic!("verify --stream: {status} {answer}"),
        }
    };
    assert_eq!(
        (
            report["ok"].clone(),
            report["stream"]["messages_checked"].clone()
        ),
        (json!(true), json!(total)),
        "{report}"
    );
}

/// The rows of every projection table, as JSON text in order (the checkpoint by its
/// position alone: `projected_at` says when, not what).
async fn projection_rows(pool: &PgPool) -> BTreeMap<&'static str, Vec<String>> {
    let mut tables = BTreeMap::new();
    for table in [
        "container",
        "org_period",
        "org_open",
        "org",
        "account_change",
        "voided",
        "port",
    ] {
        let rows: Vec<String> = sqlx::query_scalar(&format!(
            "SELECT to_jsonb(t)::text FROM proj.{table} t ORDER BY 1"
        ))
        .fetch_all(pool)
        .await
        .unwrap();
        tables.insert(table, rows);
    }
    let position: i64 = checkpoint(pool).await;
    tables.insert("checkpoint", vec![position.to_string()]);
    tables
}

/// `tally replay`: the projection folded again from the ledger alone.
fn replay(database_url: &str) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("replay")
        .env("DATABASE_URL", database_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("running tally replay");
    assert!(
        output.status.success(),
        "tally replay failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// No two reservations of the slot org were live at once: each ends (released or expired)
/// before the next begins.
async fn overlapping_reservations(pool: &PgPool) -> i64 {
    sqlx::query_scalar(
        "WITH r AS (SELECT id, tstzrange(created_at, least(expires_at, coalesce(released_at, expires_at))) AS live \
                    FROM admission_reservation WHERE org_id = $1) \
         SELECT count(*) FROM r a JOIN r b ON a.id < b.id AND a.live && b.live",
    )
    .bind(SLOT_ORG)
    .fetch_one(pool)
    .await
    .unwrap()
}

// Long: one scenario, read top to bottom: start, load, the two kills, then every check;
// each step is a function of its own, and this is their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_on_a_three_node_cluster_lose_and_double_nothing_when_the_relay_holder_the_ledger_stream_leader_and_a_follower_are_killed_and_return(
) {
    let started = Instant::now();
    let mut fleet = Fleet::start().await;
    let pool = fleet.db.pool().await;
    let js = fleet.cluster.jetstream(Duration::from_secs(2)).await;
    prepare_orgs(&fleet.api(0)).await;
    let dead_letter = dead_letter_one(&js).await;
    let targets = Targets {
        apis: Arc::new((0..INSTANCES).map(|index| fleet.api(index)).collect()),
        alive: Arc::new((0..INSTANCES).map(|_| AtomicBool::new(true)).collect()),
    };
    let load = Load::start(&targets, &js);
    load.wait_for_more(1_500).await;

    let (killed, instance_killed_at, instance) =
        kill_the_relay_holder(&mut fleet, &targets, &pool, &js).await;
    load.wait_for_more(1_000).await;
    let (leader, node_killed_at, failover) =
        kill_a_node(&mut fleet, &pool, &js, Node::LedgerLeader).await;
    // The killed instance returns and takes its share of the load again.
    fleet.restart(killed).await;
    let returned_at = Instant::now();
    targets.alive[killed].store(true, Ordering::SeqCst);
    load.wait_for_more(1_000).await;
    // The killed node returns, catches up, and a follower dies in its turn.
    let rejoined = node_returns(&mut fleet, &js, leader).await;
    let (follower, _, follower_failover) =
        kill_a_node(&mut fleet, &pool, &js, Node::Follower).await;
    load.wait_for_more(500).await;
    let follower_rejoined = node_returns(&mut fleet, &js, follower).await;
    load.wait_for_more(500).await;
    let record = load.stop().await;
    eprintln!(
        "scale_out: killed {} (the relay holder): lock taken after {:?}, relay resumed after {:?}, \
         projection after {:?}; killed {} (the TALLY_LEDGER leader): new leader after {:?}, \
         relay resumed after {:?}, ingest after {:?}; it rejoined with current copies after \
         {rejoined:?}; killed {} (a follower): relay went on after {:?}, ingest after {:?}; \
         it rejoined after {follower_rejoined:?}",
        instance_name(killed),
        instance.taken,
        instance.relay,
        instance.other,
        fleet.cluster.nodes[leader].name,
        failover.taken,
        failover.relay,
        failover.other,
        fleet.cluster.nodes[follower].name,
        follower_failover.relay,
        follower_failover.other,
    );

    assert!(record.failures.is_empty(), "{:#?}", record.failures);
    // What a killed instance had fetched from the ingest consumer and not acknowledged is
    // redelivered after the consumer's ack wait.
    let published: Vec<Uuid> = record.nats_acked.iter().map(|(id, _)| *id).collect();
    let ingest_bound = tally::bus::ingest::ACK_WAIT_SECONDS + FAILOVER_BOUND_S;
    let stopped = Instant::now();
    eventually(
        ingest_bound,
        "every event JetStream acknowledged is ingested",
        || async {
            let found: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE id = ANY($1)")
                .bind(&published)
                .fetch_one(&pool)
                .await
                .unwrap();
            found as usize == published.len()
        },
    )
    .await;
    eprintln!(
        "scale_out: every published event ingested {:?} after the load stopped",
        stopped.elapsed()
    );
    let head = head(&pool).await;
    eventually(
        FAILOVER_BOUND_S,
        "the stream holds the whole ledger",
        || async { relayed(&js).await == head },
    )
    .await;
    projected_to_head(&pool, "the projection holds the whole ledger").await;
    let total = assert_ledger_holds_every_acknowledged_event_once(&pool, &record).await;
    assert!(
        record.nats_acked.iter().any(|(_, at)| *at > node_killed_at),
        "events published after the leader died were acknowledged (and so ingested)"
    );
    assert_stream_is_the_ledger(&js, &pool, &fleet.api(killed), total).await;
    let dlq = js.get_stream("TALLY_DLQ").await.unwrap();
    let dead = dlq
        .get_raw_message(1)
        .await
        .expect("the dead letter is kept");
    assert_eq!(
        (
            dead.headers.get("Tally-Error-Code").unwrap().as_str(),
            &dead.payload[..]
        ),
        ("invalid_events", dead_letter.as_bytes())
    );

    assert!(
        record.rounds.iter().all(|&granted| granted <= 1),
        "{:?}",
        record.rounds
    );
    assert!(
        record
            .rounds
            .iter()
            .filter(|&&granted| granted == 1)
            .count()
            >= 3,
        "{:?}",
        record.rounds
    );
    assert_eq!(
        overlapping_reservations(&pool).await,
        0,
        "no slot was granted twice"
    );
    assert!(
        record
            .reads
            .iter()
            .any(|(at, writer, reader)| *at > instance_killed_at && writer != reader),
        "reads on one instance saw what another acknowledged after the kill: {:?}",
        record.reads.len()
    );
    assert!(
        record
            .reads
            .iter()
            .any(|(at, writer, reader)| *at > returned_at
                && writer != reader
                && (*writer == killed || *reader == killed)),
        "reads through the instance that returned saw what another acknowledged, and the \
         other way round"
    );

    for index in 0..INSTANCES {
        if fleet.instances[index].child.is_some() {
            fleet.kill(index).await;
        }
    }
    let live = projection_rows(&pool).await;
    replay(&fleet.db.url);
    let folded = projection_rows(&pool).await;
    assert!(
        live == folded,
        "the projection is what a replay folds from the ledger"
    );
    eprintln!(
        "scale_out: {total} events, {} reservation rounds, {} reads across instances, {:.1} s",
        record.rounds.len(),
        record.reads.len(),
        started.elapsed().as_secs_f64()
    );
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_made_with_one_copy_get_three_when_tally_restarts_with_three_and_keep_their_messages(
) {
    let cluster = TestNatsCluster::start();
    let db = TestDb::new().await;
    let js = cluster.jetstream(Duration::from_secs(2)).await;
    let start = |replicas: usize| {
        let mut config = tally::config::Config::new(&db.url, &cluster.url);
        config.bootstrap_token = Some(TOKEN.to_string());
        config.relay_poll_ms = 50;
        config.stream_replicas = replicas;
        tally::startup::Service::start(config)
    };

    let one = start(1).await.unwrap();
    let api = Api::new(reqwest::Client::new(), one.local_addr);
    let (status, answer) = api.post_events(&json!({ "events": valid_events(5) })).await;
    assert_eq!(status, 200, "{answer}");
    for stream in ["TALLY_LEDGER", "TALLY_INGEST", "TALLY_DLQ"] {
        eventually(30, &format!("{stream} has one copy"), || {
            replicated(&js, stream, 1)
        })
        .await;
    }
    eventually(30, "the ledger is relayed", || async {
        relayed(&js).await == 5
    })
    .await;
    one.stop().await;

    let three = start(3).await.unwrap();
    for stream in ["TALLY_LEDGER", "TALLY_INGEST", "TALLY_DLQ"] {
        eventually(30, &format!("{stream} has three current copies"), || {
            replicated(&js, stream, 3)
        })
        .await;
    }
    assert_eq!(
        stream_messages(&js, "TALLY_LEDGER").await,
        5,
        "the messages are kept"
    );
    let api = Api::new(reqwest::Client::new(), three.local_addr);
    let (status, answer) = api.post_events(&json!({ "events": valid_events(1) })).await;
    assert_eq!(status, 200, "{answer}");
    eventually(30, "the relay goes on", || async {
        relayed(&js).await == 6
    })
    .await;
    three.stop().await;
}

#[test]
fn a_bad_nats_url_entry_or_replica_count_stops_tally_serve_with_a_message_naming_it() {
    let seventeen = (0..17)
        .map(|n| format!("nats://10.0.0.{n}:4222"))
        .collect::<Vec<_>>()
        .join(",");
    let cases = [
        (
            "nats://127.0.0.1:4222,http://tally:s3cret@127.0.0.1:4223",
            "1",
            "NATS_URL entry 2 (\"http://tally:***@127.0.0.1:4223\") is not a NATS URL",
        ),
        (
            "nats://127.0.0.1:4222,,nats://127.0.0.1:4223",
            "1",
            "NATS_URL entry 2 is empty",
        ),
        (
            seventeen.as_str(),
            "1",
            "NATS_URL names 17 servers; at most 16",
        ),
        (
            "nats://127.0.0.1:4222",
            "0",
            "\"0\": a whole number from 1 to 5",
        ),
        (
            "nats://127.0.0.1:4222",
            "6",
            "\"6\": a whole number from 1 to 5",
        ),
    ];
    for (nats_url, replicas, expected) in cases {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
            .arg("serve")
            // Never reached: the settings are checked first.
            .env(
                "DATABASE_URL",
                "postgres://postgres@127.0.0.1:1/unreachable",
            )
            .env("NATS_URL", nats_url)
            .env("TALLY_STREAM_REPLICAS", replicas)
            .env("TALLY_LISTEN", "127.0.0.1:0")
            .env("RUST_LOG", "off")
            .output()
            .expect("running tally serve");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(2),
            "{nats_url} {replicas}: {stderr}"
        );
        assert!(stderr.contains(expected), "{nats_url} {replicas}: {stderr}");
        assert!(!stderr.contains("s3cret"), "{stderr}");
    }
}
