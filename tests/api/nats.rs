//! NATS: ingest through `TALLY_INGEST`, dead letters on `TALLY_DLQ`, and the relay's copy
//! of the ledger on `TALLY_LEDGER`.

use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::{json, Value};

use crate::helpers::*;

async fn wait_for_ingest_stream(js: &async_nats::jetstream::Context) {
    eventually(10, "the ingest stream exists", || async {
        js.get_stream("TALLY_INGEST").await.is_ok()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_published_to_ingest_reaches_the_ledger_and_the_ledger_stream() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    let event = valid_event("org_nats", "ctr_n1", 0);
    let id = event["id"].as_str().unwrap().to_owned();
    wait_for_ingest_stream(&js).await;
    publish(&js, "tally.ingest.x", event.to_string()).await;
    // Redelivery or a producer retry of the same event must not count it twice.
    publish(&js, "tally.ingest.x", event.to_string()).await;

    wait_for_ledger_count(&app.pool, 1).await;
    let stored: uuid::Uuid = sqlx::query_scalar("SELECT id FROM ledger")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored.to_string(), id);

    eventually(10, "the relay published it", || async {
        stream_messages(&js, "TALLY_LEDGER").await == 1
    })
    .await;
    let stream = js.get_stream("TALLY_LEDGER").await.unwrap();
    let message = stream.get_raw_message(1).await.unwrap();
    assert_eq!(
        message.subject.as_str(),
        "tally.ledger.org_nats.container.created"
    );
    assert_eq!(message.headers.get("Nats-Msg-Id").unwrap().as_str(), id);
    assert_eq!(message.headers.get("Tally-Position").unwrap().as_str(), "1");
    let body: serde_json::Value = serde_json::from_slice(&message.payload).unwrap();
    assert_eq!(body["id"], json!(id));
    assert_eq!(body["position"], 1);

    // The durable consumer holds nothing back: both messages were acknowledged.
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudevent_over_nats_is_read_by_its_content_type_header() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    let cloudevent = json!({"specversion": "1.0", "id": "n-1", "source": "/nats", "type": "container.resumed",
        "time": ago(5), "subject": "ctr_9", "orgid": "org_ce"});
    let mut headers = HeaderMap::new();
    headers.insert("Content-Type", "application/cloudevents+json");
    js.publish_with_headers("tally.ingest.ce", headers, cloudevent.to_string().into())
        .await
        .unwrap()
        .await
        .unwrap();
    wait_for_ledger_count(&app.pool, 1).await;
    let source: String = sqlx::query_scalar("SELECT source FROM ledger")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(source, "/nats");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_message_is_dead_lettered_with_its_error_and_never_redelivered() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    publish(&js, "tally.ingest.bad", "{\"id\": ").await;
    let mut invalid = valid_event("org_1", "ctr_1", 1);
    invalid["type"] = json!("container.vanished");
    publish(&js, "tally.ingest.bad", invalid.to_string()).await;

    let [first, second] = <[_; 2]>::try_from(dead_letters(&js, 2).await).unwrap();
    assert_eq!(first.subject.as_str(), "tally.dlq.bad");
    assert_eq!(
        first.headers.get("Tally-Error-Code").unwrap().as_str(),
        "malformed_json"
    );
    assert!(!first
        .headers
        .get("Tally-Error")
        .unwrap()
        .as_str()
        .is_empty());
    assert_eq!(
        first
            .headers
            .get("Tally-Original-Subject")
            .unwrap()
            .as_str(),
        "tally.ingest.bad"
    );
    assert_eq!(&first.payload[..], b"{\"id\": ");
    assert_eq!(
        second.headers.get("Tally-Error-Code").unwrap().as_str(),
        "invalid_events"
    );
    assert!(second
        .headers
        .get("Tally-Error")
        .unwrap()
        .as_str()
        .contains("unknown_type"));

    // Acknowledged: gone from the work queue, nothing pending or redelivered, no new dead letters.
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let info = ingest_consumer_info(&js).await;
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_redelivered, 0);
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 2);
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

/// Waits until the dead-letter stream holds `count` messages and returns them in order.
async fn dead_letters(
    js: &async_nats::jetstream::Context,
    count: u64,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    dead_letters_within(js, count, 10).await
}

/// [`dead_letters`], waiting up to `seconds`.
async fn dead_letters_within(
    js: &async_nats::jetstream::Context,
    count: u64,
    seconds: u64,
) -> Vec<async_nats::jetstream::message::StreamMessage> {
    eventually(seconds, "the dead letters are stored", || async {
        stream_messages(js, "TALLY_DLQ").await == count
    })
    .await;
    let dlq = js.get_stream("TALLY_DLQ").await.unwrap();
    let mut messages = Vec::new();
    for sequence in 1..=count {
        messages.push(dlq.get_raw_message(sequence).await.unwrap());
    }
    messages
}

/// Waits until every message published to ingest has been dealt with, and checks that none
/// is still pending or was ever redelivered: a consumer that fails a batch leaves its
/// messages pending and gets them again after the ack wait.
async fn ingest_settled(js: &async_nats::jetstream::Context) {
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(js, "TALLY_INGEST").await == 0
    })
    .await;
    let info = ingest_consumer_info(js).await;
    assert_eq!(
        (info.num_ack_pending, info.num_redelivered),
        (0, 0),
        "{info:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_with_jetstream_headers_or_of_the_largest_size_is_dead_lettered_and_ingest_goes_on(
) {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    // A producer's expectation of the ingest stream would make the dead-letter stream refuse
    // a copy that kept it.
    publish_with(
        &js,
        "tally.ingest.hdr",
        &[
            header("Nats-Expected-Stream", "TALLY_INGEST"),
            header("Tally-Error-Code", "made_up"),
        ],
        b"not json".to_vec(),
    )
    .await;
    // As large as the ingest stream takes: with the reasons added it would not fit whole.
    let largest = vec![b'x'; 1 << 20];
    publish(&js, "tally.ingest.big", largest.clone()).await;
    let event = valid_event("org_dlq", "ctr_1", 0);
    publish(&js, "tally.ingest.ok", event.to_string()).await;

    wait_for_ledger_count(&app.pool, 1).await;
    let [renamed, cut] = <[_; 2]>::try_from(dead_letters(&js, 2).await).unwrap();
    assert_eq!(renamed.subject.as_str(), "tally.dlq.hdr");
    assert_eq!(
        renamed
            .headers
            .get("Tally-Original-Nats-Expected-Stream")
            .map(|value| value.as_str()),
        Some("TALLY_INGEST")
    );
    assert!(renamed.headers.get("Nats-Expected-Stream").is_none());
    // A header named like tally's is the producer's, kept apart from tally's own.
    assert_eq!(
        (
            renamed
                .headers
                .get("Tally-Original-Tally-Error-Code")
                .map(|value| value.as_str()),
            renamed
                .headers
                .get("Tally-Error-Code")
                .map(|value| value.as_str()),
        ),
        (Some("made_up"), Some("malformed_json"))
    );
    assert_eq!(&renamed.payload[..], b"not json");
    assert_eq!(cut.subject.as_str(), "tally.dlq.big");
    assert_eq!(
        cut.headers.get("Tally-Error-Code").unwrap().as_str(),
        "malformed_json"
    );
    assert_eq!(
        cut.headers.get("Tally-Payload-Truncated").unwrap().as_str(),
        largest.len().to_string()
    );
    assert!(
        cut.payload.len() < largest.len() && cut.payload.len() > largest.len() - 4096,
        "{} bytes kept",
        cut.payload.len()
    );
    assert!(largest.starts_with(&cut.payload));
    ingest_settled(&js).await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_the_dead_letter_stream_refuses_is_published_without_the_message_and_ingest_goes_on(
) {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    // Once an event is stored the consumer is running, with the dead-letter stream's limit
    // read; an operator then lowers the limit under it.
    publish(
        &js,
        "tally.ingest.ok",
        valid_event("org_dlq", "ctr_1", 0).to_string(),
    )
    .await;
    wait_for_ledger_count(&app.pool, 1).await;
    let mut config = js
        .get_stream("TALLY_DLQ")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .config
        .clone();
    config.max_message_size = 4096;
    js.update_stream(config).await.unwrap();

    publish(&js, "tally.ingest.big", vec![b'x'; 10_000]).await;
    publish(
        &js,
        "tally.ingest.ok",
        valid_event("org_dlq", "ctr_1", 1).to_string(),
    )
    .await;
    wait_for_ledger_count(&app.pool, 2).await;
    let [bare] = <[_; 1]>::try_from(dead_letters(&js, 1).await).unwrap();
    assert_eq!(
        bare.headers.get("Tally-Error-Code").unwrap().as_str(),
        "malformed_json"
    );
    assert_eq!(
        bare.headers
            .get("Tally-Payload-Truncated")
            .unwrap()
            .as_str(),
        "10000"
    );
    assert!(bare.payload.is_empty());
    ingest_settled(&js).await;
    app.stop().await;
}

/// Publishes `payload` to `subject` and waits for the ack.
async fn publish(js: &async_nats::jetstream::Context, subject: &str, payload: impl Into<Vec<u8>>) {
    publish_with(js, subject, &[], payload.into()).await;
}

/// Publishes `payload` to `subject` with `headers` (names as given) and waits for the ack.
async fn publish_with(
    js: &async_nats::jetstream::Context,
    subject: &str,
    headers: &[(String, String)],
    payload: Vec<u8>,
) {
    let mut map = HeaderMap::new();
    for (name, value) in headers {
        map.append(name.as_str(), value.as_str());
    }
    js.publish_with_headers(subject.to_owned(), map, payload.into())
        .await
        .unwrap()
        .await
        .unwrap();
}

fn header(name: &str, value: &str) -> (String, String) {
    (name.to_owned(), value.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_cloudevent_sent_in_every_mode_over_http_and_nats_is_one_ledger_row() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    let cloudevent = json!({
        "specversion": "1.0", "id": "every-mode", "source": "/nats/modes", "type": "container.created",
        "time": ago(20), "subject": "ctr_modes", "orgid": "org_modes", "data": {"name": "n"}
    });
    let text = cloudevent.to_string().into_bytes();
    let batch = json!([cloudevent]).to_string().into_bytes();
    let (binary_headers, data) = binary_mode(&cloudevent, "Ce-");

    // Over NATS, with the header names in every case producers use.
    let structured = [header("content-type", "application/cloudevents+json")];
    publish_with(&js, "tally.ingest.modes", &structured, text.clone()).await;
    let batched = [header("CONTENT-TYPE", "application/cloudevents-batch+json")];
    publish_with(&js, "tally.ingest.modes", &batched, batch.clone()).await;
    let mut binary = binary_headers.clone();
    binary.push(header("Content-Type", "application/json"));
    publish_with(&js, "tally.ingest.modes", &binary, data.clone()).await;
    let lower: Vec<_> = binary_headers
        .iter()
        .map(|(name, value)| (name.to_lowercase(), value.clone()))
        .chain([header("content-type", "application/json")])
        .collect();
    publish_with(&js, "tally.ingest.modes", &lower, data.clone()).await;
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;

    // Over HTTP, each answered with the row NATS stored.
    let expected =
        tally::event::parse::cloudevent_ledger_id("org_modes", "/nats/modes", "every-mode");
    for (status, answer) in [
        app.post_raw("application/cloudevents+json", text).await,
        app.post_raw("application/cloudevents-batch+json", batch)
            .await,
        app.post_binary(&binary_headers, Some("application/json"), data)
            .await,
    ] {
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["results"][0]["id"], json!(expected.to_string()));
        assert_eq!(answer["results"][0]["duplicate"], true, "{answer}");
    }
    assert_eq!(app.ledger_count().await, 1);
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_case_content_type_header_over_nats_is_recognised() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    let cloudevent = json!({"specversion": "1.0", "id": "lower", "source": "/nats", "type": "container.resumed",
        "time": ago(5), "subject": "ctr_9", "orgid": "org_ce", "traceparent": "00-ab-cd-01"});
    let headers = [header("content-type", "application/cloudevents+json")];
    publish_with(
        &js,
        "tally.ingest.ce",
        &headers,
        cloudevent.to_string().into_bytes(),
    )
    .await;
    wait_for_ledger_count(&app.pool, 1).await;
    let attributes: Value = sqlx::query_scalar("SELECT attributes FROM ledger")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(attributes, json!({"traceparent": "00-ab-cd-01"}));
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_message_missing_an_attribute_is_dead_lettered_naming_its_header() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    let cloudevent = json!({"specversion": "1.0", "id": "no-source", "type": "container.resumed",
        "time": ago(5), "subject": "ctr_9", "orgid": "org_ce"});
    let (headers, _) = binary_mode(&cloudevent, "ce-");
    publish_with(&js, "tally.ingest.bin", &headers, Vec::new()).await;
    let [dead] = <[_; 1]>::try_from(dead_letters(&js, 1).await).unwrap();
    assert_eq!(
        dead.headers.get("Tally-Error-Code").unwrap().as_str(),
        "invalid_events"
    );
    let error = dead.headers.get("Tally-Error").unwrap().as_str().to_owned();
    assert!(error.contains("missing_field: ce-source"), "{error}");
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

/// The service as the race below starts it: small fetches, so that many batches are in the
/// ingest pipeline at once.
async fn start_with_small_fetches(app: &TestApp) -> tally::startup::Service {
    let mut config = tally::config::Config::new(&app.db.url, &app.nats.url);
    config.bootstrap_token = Some(TOKEN.to_string());
    config.ingest_fetch_max = RACE_FETCH_MAX;
    tally::startup::Service::start(config)
        .await
        .expect("starting the service")
}

const RACE_FETCH_MAX: usize = 25;
const RACE_VALID: usize = 3_000;

/// The race's messages: every valid event, every tenth one again, and every eighth an
/// invalid one; returns them with the valid events and the invalid payloads.
fn race_messages() -> (Vec<Vec<u8>>, Vec<Value>, Vec<Vec<u8>>) {
    let valid: Vec<Value> = (0..RACE_VALID)
        .map(|n| valid_event(&format!("org_{}", n % 5), &format!("ctr_{}", n % 40), n))
        .collect();
    let (mut messages, mut invalid) = (Vec::new(), Vec::new());
    for (n, event) in valid.iter().enumerate() {
        messages.push(event.to_string().into_bytes());
        if n % 10 == 9 {
            messages.push(valid[n - 5].to_string().into_bytes());
        }
        if n % 8 == 7 {
            let mut vanished = valid_event("org_bad", &format!("ctr_bad_{n}"), n);
            vanished["type"] = json!("container.vanished");
            invalid.push(vanished.to_string().into_bytes());
            messages.push(invalid.last().unwrap().clone());
        }
    }
    (messages, valid, invalid)
}

/// Waits until the ledger holds more than `count` events.
async fn wait_for_ledger_past(pool: &sqlx::PgPool, count: usize) {
    eventually(
        60,
        &format!("the ledger holds over {count} events"),
        || async { ledger_count(pool).await > count as i64 },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousands_of_messages_consumed_in_small_batches_by_two_instances_stopped_and_started_meanwhile_are_each_stored_or_dead_lettered_once_and_all_acknowledged(
) {
    let mut app = TestApp::spawn_with(|config| config.ingest_fetch_max = RACE_FETCH_MAX).await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    let mut second = Some(start_with_small_fetches(&app).await);
    let (messages, valid, invalid) = race_messages();
    let publisher = {
        let js = js.clone();
        tokio::spawn(async move {
            for chunk in messages.chunks(100) {
                let mut confirmations = Vec::new();
                for message in chunk {
                    let sent = js.publish("tally.ingest.race", message.clone().into());
                    confirmations.push(sent.await.unwrap());
                }
                for confirmation in confirmations {
                    confirmation.await.unwrap();
                }
            }
        })
    };

    // Each instance is stopped with batches fetched, being appended and being settled.
    wait_for_ledger_past(&app.pool, RACE_VALID / 4).await;
    second.take().unwrap().stop().await;
    wait_for_ledger_past(&app.pool, RACE_VALID / 2).await;
    second = Some(start_with_small_fetches(&app).await);
    wait_for_ledger_past(&app.pool, RACE_VALID * 3 / 4).await;
    app.service.take().unwrap().stop().await;
    app.service = Some(start_with_small_fetches(&app).await);
    publisher.await.unwrap();

    eventually(60, "every message is settled", || async {
        let info = ingest_consumer_info(&js).await;
        info.num_pending == 0 && info.num_ack_pending == 0
    })
    .await;
    assert_eq!(stream_messages(&js, "TALLY_INGEST").await, 0);
    let stored: std::collections::HashSet<uuid::Uuid> = sqlx::query_scalar("SELECT id FROM ledger")
        .fetch_all(&app.pool)
        .await
        .unwrap()
        .into_iter()
        .collect();
    assert_eq!(
        app.ledger_count().await,
        RACE_VALID as i64,
        "each event once"
    );
    assert_eq!(stored, ids_of(&valid).into_iter().collect());
    let dead_letters = stream_messages(&js, "TALLY_DLQ").await;
    assert_eq!(
        dead_letters,
        invalid.len() as u64,
        "each invalid message once"
    );
    let dlq = js.get_stream("TALLY_DLQ").await.unwrap();
    let mut dead = std::collections::HashSet::new();
    for sequence in 1..=dead_letters {
        dead.insert(
            dlq.get_raw_message(sequence)
                .await
                .unwrap()
                .payload
                .to_vec(),
        );
    }
    assert_eq!(dead, invalid.into_iter().collect());
    second.take().unwrap().stop().await;
    app.stop().await;
}

/// Publishes a message with the raw header block `headers` (from `NATS/1.0` to the blank
/// line) straight on the wire, as a producer that uses no NATS client could: clients refuse
/// to send headers they could not read back.
fn publish_raw(nats: &TestNats, subject: &str, headers: &str, payload: &str) {
    publish_raw_bytes(
        nats,
        subject.as_bytes(),
        headers.as_bytes(),
        payload.as_bytes(),
    );
}

/// [`publish_raw`] of bytes, with no header block at all when `headers` is empty.
fn publish_raw_bytes(nats: &TestNats, subject: &[u8], headers: &[u8], payload: &[u8]) {
    use std::io::{BufRead, BufReader, Write};
    let stream = std::net::TcpStream::connect(("127.0.0.1", nats.port)).unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("INFO"), "{line}");
    let mut writer = stream;
    let mut wire = b"CONNECT {\"verbose\":false,\"headers\":true}\r\n".to_vec();
    let total = headers.len() + payload.len();
    if headers.is_empty() {
        wire.extend_from_slice(b"PUB ");
        wire.extend_from_slice(subject);
        wire.extend_from_slice(format!(" {total}\r\n").as_bytes());
    } else {
        wire.extend_from_slice(b"HPUB ");
        wire.extend_from_slice(subject);
        wire.extend_from_slice(format!(" {} {total}\r\n", headers.len()).as_bytes());
        wire.extend_from_slice(headers);
    }
    wire.extend_from_slice(payload);
    wire.extend_from_slice(b"\r\nPING\r\n");
    writer.write_all(&wire).unwrap();
    line.clear();
    reader.read_line(&mut line).unwrap();
    assert_eq!(line, "PONG\r\n", "the server refused the message");
}

/// The header block a dead letter of a message no client could take keeps, decoded.
fn kept_header_block(letter: &async_nats::jetstream::message::StreamMessage) -> Vec<u8> {
    use base64::Engine as _;
    let kept = letter.headers.get("Tally-Original-Headers").unwrap();
    base64::engine::general_purpose::STANDARD
        .decode(kept.as_str())
        .unwrap()
}

/// Waits until the ledger holds `count` events (those fetched beside a message that broke
/// the consumer's connection come back after the ack wait) and the ingest work queue is
/// empty; the orgs of the events stored, sorted.
async fn orgs_stored_once_ingest_settles(
    app: &TestApp,
    js: &async_nats::jetstream::Context,
    count: i64,
) -> Vec<String> {
    eventually(90, "the messages that can be are stored", || async {
        app.ledger_count().await == count
    })
    .await;
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(js, "TALLY_INGEST").await == 0
    })
    .await;
    let mut orgs: Vec<String> = sqlx::query_scalar("SELECT org_id FROM ledger")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    orgs.sort();
    orgs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_on_subjects_no_client_can_take_are_dead_lettered_under_a_plain_subject() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    // nats-server splits a subject on spaces and tabs only; the client reads the line that
    // delivers a message as UTF-8, and splits that of a message with headers on any white
    // space.
    let event = |org: &str| valid_event(org, "ctr_1", 0).to_string();
    let headers = b"NATS/1.0\r\nContent-Type: application/json\r\n\r\n";
    publish_raw_bytes(
        &app.nats,
        "tally.ingest.a\u{a0}b".as_bytes(),
        headers,
        event("org_nbsp").as_bytes(),
    );
    publish_raw_bytes(
        &app.nats,
        b"tally.ingest.\xff",
        b"",
        event("org_bytes").as_bytes(),
    );
    // Without headers, white space other than a space is no trouble to the client.
    publish_raw_bytes(
        &app.nats,
        "tally.ingest.c\u{a0}d".as_bytes(),
        b"",
        event("org_plain").as_bytes(),
    );
    publish(&js, "tally.ingest.after", event("org_after")).await;

    let letters = dead_letters_within(&js, 2, 90).await;
    let mut originals = Vec::new();
    for letter in &letters {
        assert_eq!(letter.subject.as_str(), "tally.dlq.unknown");
        assert_eq!(
            letter.headers.get("Tally-Error-Code").unwrap().as_str(),
            "unreadable_subject"
        );
        let payload: Value = serde_json::from_slice(&letter.payload).unwrap();
        originals.push(payload["org_id"].as_str().unwrap().to_owned());
    }
    originals.sort();
    assert_eq!(originals, ["org_bytes", "org_nbsp"]);
    let orgs = orgs_stored_once_ingest_settles(&app, &js, 2).await;
    assert_eq!(orgs, ["org_after", "org_plain"]);
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 2);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_whose_headers_no_client_can_take_are_dead_lettered_whole_and_nats_goes_on() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    // nats-server stores these blocks as sent. The client drops its connection on the first,
    // panics in its connection task on the second, takes the third for the server's failure
    // of the fetch and the fourth for its end.
    let blocks = [
        "NATS/1.0\r\nBad Name: x\r\nContent-Type: application/json\r\n\r\n",
        "NATS/1.0\r\nContent-Type: application/json\r\nX-Note: a\rb\r\n\r\n",
        "NATS/1.0 503\r\n\r\n",
        "NATS/1.0 408 Request Timeout\r\n\r\n",
    ];
    // A status of 200 is a message like any other.
    let ok = valid_event("org_ok", "ctr_1", 0).to_string();
    publish_raw(
        &app.nats,
        "tally.ingest.ok",
        "NATS/1.0 200 OK\r\nA: b\r\n\r\n",
        &ok,
    );
    for (n, block) in blocks.iter().enumerate() {
        let unreadable = valid_event(&format!("org_unreadable_{n}"), "ctr_1", 0).to_string();
        publish_raw(
            &app.nats,
            &format!("tally.ingest.bad{n}"),
            block,
            &unreadable,
        );
        let after = valid_event(&format!("org_after_{n}"), "ctr_1", 0).to_string();
        publish(&js, "tally.ingest.after", after).await;
    }

    let letters = dead_letters_within(&js, blocks.len() as u64, 90).await;
    for letter in &letters {
        assert_eq!(
            letter.headers.get("Tally-Error-Code").unwrap().as_str(),
            "unreadable_headers"
        );
        let subject = letter.headers.get("Tally-Original-Subject").unwrap();
        let n: usize = subject
            .as_str()
            .strip_prefix("tally.ingest.bad")
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(letter.subject.as_str(), format!("tally.dlq.bad{n}"));
        assert_eq!(kept_header_block(letter), blocks[n].as_bytes());
        let payload: Value = serde_json::from_slice(&letter.payload).unwrap();
        assert_eq!(payload["org_id"], json!(format!("org_unreadable_{n}")));
    }

    // The messages after them are stored (those fetched beside one after the ack wait), the
    // work queue empties, and none of the unreadable messages is stored.
    let orgs = orgs_stored_once_ingest_settles(&app, &js, blocks.len() as i64 + 1).await;
    assert_eq!(
        orgs,
        [
            "org_after_0",
            "org_after_1",
            "org_after_2",
            "org_after_3",
            "org_ok"
        ]
    );
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, blocks.len() as u64);
    // The instance's own connection never saw them: the relay publishes on.
    eventually(10, "the relay published what was stored", || async {
        stream_messages(&js, "TALLY_LEDGER").await == blocks.len() as u64 + 1
    })
    .await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn looks_racing_over_the_same_unreadable_messages_dead_letter_each_once() {
    let app = TestApp::spawn().await;
    let second = start_with_small_fetches(&app).await;
    let js = app.nats.jetstream().await;
    wait_for_ingest_stream(&js).await;
    let unreadable = 30;
    for n in 0..unreadable {
        let headers = format!("NATS/1.0\r\nBad Name {n}: x\r\n\r\n");
        publish_raw(&app.nats, "tally.ingest.poison", &headers, "{}");
    }
    // Both instances look on their own, and four more looks run at once from here.
    let names = tally::bus::Names::new("").unwrap();
    let looks = (0..4).map(|_| {
        let (js, names) = (js.clone(), names.clone());
        tokio::spawn(async move {
            let shutdown = tokio_util::sync::CancellationToken::new();
            tally::bus::unreadable::dead_letter_unreadable(&js, &names, true, &shutdown).await
        })
    });
    for look in futures::future::join_all(looks).await {
        look.unwrap().unwrap();
    }
    let letters = dead_letters_within(&js, unreadable, 60).await;
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    // Past both instances' next looks: no copy arrives late.
    tokio::time::sleep(tally::bus::unreadable::WATCH_INTERVAL * 2).await;
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, unreadable);
    let mut blocks: Vec<Vec<u8>> = letters.iter().map(kept_header_block).collect();
    blocks.sort();
    blocks.dedup();
    assert_eq!(blocks.len() as u64, unreadable);
    second.stop().await;
    app.stop().await;
}
