//! The `TALLY_LEDGER` copy against forgery and tampering: the shipped NATS permissions let
//! only tally publish to `tally.ledger.>`; without them the relay finds a message it did
//! not write, halts and says so in `/readyz`; and `verify --stream` finds a ledger rewrite
//! that recomputed the hash chain.

use std::path::PathBuf;
use std::process::Command;

use async_nats::HeaderMap;
use serde_json::{json, Value};
use tally::config::Config;
use tally::event::canonical;
use tally::ledger::read;
use tally::startup::Service;

use crate::helpers::*;

const TALLY_PASSWORD: &str = "tally-secret";
const PRODUCER_PASSWORD: &str = "producer-secret";

/// The configuration file operators are told to run.
fn shipped_config() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/nats/tally.conf")
}

fn start_permissioned_nats() -> TestNats {
    TestNats::start_with_config(
        &shipped_config(),
        &[
            ("TALLY_NATS_PASSWORD", TALLY_PASSWORD),
            ("TALLY_PRODUCER_PASSWORD", PRODUCER_PASSWORD),
        ],
    )
}

/// `tally verify` with extra arguments, against the app's database and NATS.
fn run_tally_verify(app: &TestApp, nats_url: &str, args: &[&str]) -> (i32, Value, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_tally"))
        .arg("verify")
        .args(args)
        .env("DATABASE_URL", &app.db.url)
        .env("NATS_URL", nats_url)
        .env("RUST_LOG", "error")
        .output()
        .expect("running tally verify");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    let report = serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("verify prints a JSON report ({e}); stderr: {stderr}"));
    (output.status.code().unwrap_or(-1), report, stderr)
}

async fn wait_for_stream(js: &async_nats::jetstream::Context, count: u64) {
    eventually(
        20,
        &format!("TALLY_LEDGER holds {count} messages"),
        || async { stream_messages(js, "TALLY_LEDGER").await == count },
    )
    .await;
}

/// Polls `/readyz` at `base` (up to 20 s) until it is 503 with the relay halted; returns
/// its body.
async fn wait_for_halt(api: &Api) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let (status, body) = api.without_token().get_json("/readyz").await;
        if status == 503 && body["relay"].as_str().unwrap_or("").starts_with("halted") {
            return body;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "readyz never reported the relay halted: {status} {body}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_shipped_nats_permissions_tally_relays_and_ingests_and_a_producer_cannot_forge_the_ledger(
) {
    let nats = start_permissioned_nats();
    let tally_url = format!("nats://tally:{TALLY_PASSWORD}@127.0.0.1:{}", nats.port);
    let producer_url = format!("nats://127.0.0.1:{}", nats.port);
    let app = TestApp::spawn_on(nats, &tally_url).await;
    let (status, body) = app.post_events(&json!({"events": valid_events(3)})).await;
    assert_eq!(status, 200, "{body}");
    // Read the stream as tally does (its user, its inbox prefix).
    let tally_js = tally::bus::jetstream(tally::bus::connect(&tally_url).await.unwrap());
    wait_for_stream(&tally_js, 3).await;

    let (events, mut errors) = tokio::sync::mpsc::unbounded_channel();
    let producer = async_nats::ConnectOptions::with_user_and_password(
        "producer".into(),
        PRODUCER_PASSWORD.into(),
    )
    .event_callback(move |event| {
        let events = events.clone();
        async move {
            let _ = events.send(event.to_string());
        }
    })
    .connect(&producer_url)
    .await
    .expect("the producer user connects");
    // Events, with the stream's acknowledgement: allowed.
    let producer_js = async_nats::jetstream::new(producer.clone());
    let event = valid_event("org_producer", "ctr_p", 0);
    producer_js
        .publish("tally.ingest.org_producer", event.to_string().into())
        .await
        .unwrap()
        .await
        .expect("the stream acknowledges a producer's event");
    wait_for_ledger_count(&app.pool, 4).await;
    wait_for_stream(&tally_js, 4).await;

    // A message on the ledger's subjects: refused by the server.
    producer
        .publish("tally.ledger.evil.container.created", "{}".into())
        .await
        .unwrap();
    producer.flush().await.unwrap();
    let refusal = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        loop {
            let event = errors.recv().await.expect("the producer's events");
            if event.to_lowercase().contains("permissions violation") {
                return event;
            }
        }
    })
    .await
    .expect("the server reports a permissions violation");
    assert!(
        refusal.contains("tally.ledger.evil.container.created"),
        "{refusal}"
    );

    // The copy is untouched and the relay carries on.
    let (status, body) = app
        .post_events(&json!({"events": [valid_event("org_a", "ctr_a", 1)]}))
        .await;
    assert_eq!(status, 200, "{body}");
    wait_for_stream(&tally_js, 5).await;
    let (status, ready) = app.get_json("/readyz").await;
    assert_eq!(
        (status, ready["relay"].clone()),
        (200, json!("up")),
        "{ready}"
    );
    let (status, report) = app.verify("full=true&stream=true").await;
    assert_eq!(status, 200, "{report}");
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["stream"]["messages_checked"], 5, "{report}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_permissions_off_a_forged_ledger_message_halts_the_relay_and_readyz_names_it() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(5)})).await.0,
        200
    );
    let js = app.nats.jetstream().await;
    wait_for_stream(&js, 5).await;

    let forged = js
        .publish("tally.ledger.evil.container.created", "{}".into())
        .await
        .unwrap()
        .await
        .expect("a server without permissions stores anything");
    assert_eq!(forged.sequence, 6);
    // The relay finds it when it publishes position 6 and the stream refuses the sequence.
    let (status, body) = app
        .post_events(&json!({"events": [valid_event("org_a", "ctr_a", 1)]}))
        .await;
    assert_eq!(status, 200, "{body}");

    let ready = wait_for_halt(&app).await;
    assert_eq!(ready["ready"], false);
    assert_eq!(
        ready["relay"],
        "halted: stream message 6 does not match ledger position 6: it has no Tally-Position header"
    );
    let metrics = app.without_token().get("/metrics").await.text;
    assert!(metrics.contains("tally_relay_halted 1"), "{metrics}");
    assert!(
        metrics.contains("tally_relay_halted_position 6"),
        "{metrics}"
    );
    assert_eq!(
        stream_messages(&js, "TALLY_LEDGER").await,
        6,
        "nothing relayed past the forged message"
    );
    let (_, report) = app.verify("stream=true").await;
    assert_eq!(
        (report["ok"].clone(), report["first_bad_position"].clone()),
        (json!(false), json!(6)),
        "{report}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_position_header_does_not_move_the_relay_which_halts_when_it_starts() {
    let mut app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(3)})).await.0,
        200
    );
    let js = app.nats.jetstream().await;
    wait_for_stream(&js, 3).await;
    app.service.take().unwrap().stop().await;

    let mut headers = HeaderMap::new();
    headers.insert("Tally-Position", "1000000");
    headers.insert("Nats-Msg-Id", uuid::Uuid::new_v4().to_string().as_str());
    js.publish_with_headers("tally.ledger.org_0.container.created", headers, "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let mut config = Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    let service = Service::start(config).await.unwrap();
    let other = app.at(service.local_addr);
    let ready = wait_for_halt(&other).await;
    assert_eq!(
        ready["relay"],
        "halted: stream message 4 does not match ledger position 4: the ledger has no position 4"
    );
    let (status, _) = other.post_events(&json!({"events": valid_events(2)})).await;
    assert_eq!(status, 200);
    assert_eq!(stream_messages(&js, "TALLY_LEDGER").await, 4);
    service.stop().await;
    app.stop().await;
}

/// Rewrites the data of the row at `position` and recomputes every hash from there on, and
/// the verify checkpoint, as a superuser with the guards switched off could.
async fn rewrite_with_recomputed_chain(pool: &sqlx::PgPool, position: i64) {
    let mut rows = read::read_after(pool, 0, 10_000).await.unwrap();
    let mut prev_hash = canonical::GENESIS_HASH;
    let mut transaction = pool.begin().await.unwrap();
    sqlx::query("ALTER TABLE ledger DISABLE TRIGGER ALL")
        .execute(&mut *transaction)
        .await
        .unwrap();
    for row in &mut rows {
        if row.position == position {
            row.data = json!({"rewritten": true});
        }
        if row.position >= position {
            let bytes = canonical::record_bytes(&row.fields(), row.position, row.recorded_at);
            row.hash = canonical::chain_hash(&prev_hash, &bytes).to_vec();
            sqlx::query("UPDATE ledger SET data = $1, hash = $2 WHERE position = $3")
                .bind(&row.data)
                .bind(&row.hash)
                .bind(row.position)
                .execute(&mut *transaction)
                .await
                .unwrap();
        }
        prev_hash = row.hash.as_slice().try_into().unwrap();
    }
    sqlx::raw_sql(
        "ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_update_or_delete;
         ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_truncate;
         ALTER TABLE ledger ENABLE TRIGGER ledger_record_ids;",
    )
    .execute(&mut *transaction)
    .await
    .unwrap();
    let head = rows.last().unwrap();
    sqlx::query("UPDATE verify_checkpoint SET hash = $1 WHERE position = $2")
        .bind(&head.hash)
        .bind(head.position)
        .execute(&mut *transaction)
        .await
        .unwrap();
    transaction.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rewrite_with_a_recomputed_chain_passes_verify_but_verify_stream_names_its_position() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(10)}))
            .await
            .0,
        200
    );
    let js = app.nats.jetstream().await;
    wait_for_stream(&js, 10).await;
    let nats_url = app.nats.url.clone();

    let (code, report, stderr) = run_tally_verify(&app, &nats_url, &["--stream"]);
    assert_eq!(code, 0, "{report} {stderr}");
    assert_eq!(
        report["stream"],
        json!({"ok": true, "messages_checked": 10, "last_sequence": 10, "first_position": 1,
               "rows_not_in_stream": 0, "first_bad_position": null})
    );

    rewrite_with_recomputed_chain(&app.pool, 4).await;
    for args in [&[][..], &["--incremental"][..]] {
        let (code, report, _) = run_tally_verify(&app, &nats_url, args);
        assert_eq!((code, report["ok"].clone()), (0, json!(true)), "{report}");
    }
    let (status, report) = app.verify("full=true").await;
    assert_eq!((status, report["ok"].clone()), (200, json!(true)));

    let (code, report, stderr) = run_tally_verify(&app, &nats_url, &["--stream"]);
    assert_eq!(code, 1, "{report}");
    assert_eq!(report["ok"], false);
    assert_eq!(report["first_bad_position"], 4, "{report}");
    assert_eq!(report["stream"]["first_bad_position"], 4, "{report}");
    assert_eq!(report["stream"]["messages_checked"], 3, "{report}");
    assert!(stderr.contains("position 4"), "{stderr}");
    let problem = report["stream"]["problem"].as_str().unwrap();
    assert!(
        problem.starts_with("stream message 4 does not match ledger position 4: its Tally-Hash"),
        "{problem}"
    );

    let (status, report) = app.verify("full=true&stream=true").await;
    assert_eq!(status, 200);
    assert_eq!(
        (
            report["ok"].clone(),
            report["first_bad_position"].clone(),
            report["stream"]["first_bad_position"].clone()
        ),
        (json!(false), json!(4), json!(4)),
        "{report}"
    );
    let (status, refused) = app.verify("stream=yes").await;
    assert_eq!(
        (status, refused["error"]["code"].clone()),
        (422, json!("invalid_stream"))
    );
    app.stop().await;
}

/// `tally-bench` seeds its scratch stream with the ledger's head row instead of relaying a
/// `COPY`-built history: a first message that is its ledger row fixes where the stream
/// starts, and the relay continues from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_seeded_with_the_ledgers_head_row_is_continued_not_halted() {
    let db = TestDb::new().await;
    let nats = TestNats::start();
    let pool = db.pool().await;
    let (appender, _committed, _task) = tally::ledger::Appender::start(
        pool.clone(),
        tally::ledger::AppendLimits {
            queue_max: 64,
            group_events_max: 10_000,
        },
    );
    appender
        .append(parse_events(&valid_events(5)))
        .await
        .unwrap();
    let head = read::read_after(&pool, 4, 1).await.unwrap().pop().unwrap();
    let js = nats.jetstream().await;
    let names = tally::bus::Names::new("").unwrap();
    tally::bus::apply_streams(&js, &names, &["TALLY_LEDGER"])
        .await
        .unwrap();
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", head.id.hyphenated().to_string().as_str());
    headers.insert("Tally-Position", "5");
    js.publish_with_headers(
        names.ledger_subject(&head.org_id, &head.event_type),
        headers,
        serde_json::to_vec(&head.to_message()).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    drop(appender);

    let mut config = Config::new(&db.url, &nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    let service = Service::start(config).await.unwrap();
    let api = Api::new(reqwest::Client::new(), service.local_addr);
    let (status, _) = api.post_events(&json!({"events": valid_events(3)})).await;
    assert_eq!(status, 200);
    wait_for_stream(&js, 4).await;
    let last = js
        .get_stream("TALLY_LEDGER")
        .await
        .unwrap()
        .get_raw_message(4)
        .await
        .unwrap();
    assert_eq!(last.headers.get("Tally-Position").unwrap().as_str(), "8");
    let ready = api.without_token().get("/readyz").await;
    assert_eq!(ready.status, 200);
    let (_, report) = api.verify("stream=true").await;
    assert_eq!(
        report["stream"],
        json!({"ok": true, "messages_checked": 4, "last_sequence": 4, "first_position": 5,
               "rows_not_in_stream": 0, "first_bad_position": null}),
        "{report}"
    );
    service.stop().await;
}

/// Publishes a ledger row as the relay does (without `Tally-Hash`, as an older relay did).
async fn publish_row(js: &async_nats::jetstream::Context, row: &read::LedgerRow) -> u64 {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", row.id.hyphenated().to_string().as_str());
    headers.insert("Tally-Position", row.position.to_string().as_str());
    let subject = tally::bus::Names::new("")
        .unwrap()
        .ledger_subject(&row.org_id, &row.event_type);
    js.publish_with_headers(
        subject,
        headers,
        serde_json::to_vec(&row.to_message()).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap()
    .sequence
}

/// A message slipped in between two of the relay's publishes of one burst: the stream's
/// last message is genuine, so a check of the last message alone would resume past the
/// forged one. The relay checks the whole last burst and halts on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_forged_inside_a_burst_is_found_although_the_last_message_is_genuine() {
    let db = TestDb::new().await;
    let nats = TestNats::start();
    let pool = db.pool().await;
    let (appender, _committed, _task) = tally::ledger::Appender::start(
        pool.clone(),
        tally::ledger::AppendLimits {
            queue_max: 64,
            group_events_max: 10_000,
        },
    );
    appender
        .append(parse_events(&valid_events(8)))
        .await
        .unwrap();
    drop(appender);
    let rows = read::read_after(&pool, 0, 100).await.unwrap();
    let js = nats.jetstream().await;
    tally::bus::apply_streams(&js, &tally::bus::Names::new("").unwrap(), &["TALLY_LEDGER"])
        .await
        .unwrap();
    for row in &rows[..5] {
        publish_row(&js, row).await;
    }
    // As in the race: position 6's publish (expecting sequence 5) is refused because the
    // forged message took 6; position 7's (expecting 6) then succeeds at 7.
    js.publish("tally.ledger.evil.container.created", "{}".into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(publish_row(&js, &rows[6]).await, 7);

    let mut config = Config::new(&db.url, &nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.relay_poll_ms = 50;
    let service = Service::start(config).await.unwrap();
    let api = Api::new(reqwest::Client::new(), service.local_addr);
    let ready = wait_for_halt(&api).await;
    assert_eq!(
        ready["relay"],
        "halted: stream message 6 does not match ledger position 6: it has no Tally-Position header"
    );
    assert_eq!(stream_messages(&js, "TALLY_LEDGER").await, 7);
    service.stop().await;
}
