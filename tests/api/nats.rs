//! NATS: ingest through `TALLY_INGEST`, dead letters on `TALLY_DLQ`, and the relay's copy
//! of the ledger on `TALLY_LEDGER`.

use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::json;

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
    js.publish("tally.ingest.x", event.to_string().into())
        .await
        .unwrap()
        .await
        .unwrap();
    // Redelivery or a producer retry of the same event must not count it twice.
    js.publish("tally.ingest.x", event.to_string().into())
        .await
        .unwrap()
        .await
        .unwrap();

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
    js.publish("tally.ingest.bad", "{\"id\": ".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let mut invalid = valid_event("org_1", "ctr_1", 1);
    invalid["type"] = json!("container.vanished");
    js.publish("tally.ingest.bad", invalid.to_string().into())
        .await
        .unwrap()
        .await
        .unwrap();

    eventually(10, "both are on the dead-letter stream", || async {
        stream_messages(&js, "TALLY_DLQ").await == 2
    })
    .await;
    let dlq = js.get_stream("TALLY_DLQ").await.unwrap();
    let first = dlq.get_raw_message(1).await.unwrap();
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
    let second = dlq.get_raw_message(2).await.unwrap();
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
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream("TALLY_INGEST")
        .await
        .unwrap()
        .get_consumer("tally-ingest")
        .await
        .unwrap();
    let info = consumer.info().await.unwrap();
    assert_eq!(info.num_ack_pending, 0);
    assert_eq!(info.num_redelivered, 0);
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 2);
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}
