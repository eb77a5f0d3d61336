//! HTTP ingest: once each, duplicates reported, conflicts refused, batches atomic, and
//! every kind of bad input refused with the JSON error shape and nothing stored.

use std::collections::{HashMap, HashSet};

use rand::seq::SliceRandom;
use reqwest::Method;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shuffled_batch_is_stored_once_each_with_unique_gap_free_positions() {
    let app = TestApp::spawn().await;
    let mut events = valid_events(600);
    events.shuffle(&mut rand::rng());
    // Six concurrent batches, so that group commit merges requests.
    let bodies: Vec<_> = events
        .chunks(100)
        .map(|chunk| json!({ "events": chunk }))
        .collect();
    let responses =
        futures::future::join_all(bodies.iter().map(|body| app.post_events(body))).await;

    let mut position_of: HashMap<Uuid, i64> = HashMap::new();
    for ((status, body), chunk) in responses.iter().zip(events.chunks(100)) {
        assert_eq!(*status, 200, "{body}");
        let results = body["results"].as_array().unwrap();
        assert_eq!(results.len(), chunk.len());
        for (result, event) in results.iter().zip(chunk) {
            assert_eq!(result["id"], event["id"], "results come in input order");
            assert_eq!(result["duplicate"], false);
            position_of.insert(
                result["id"].as_str().unwrap().parse().unwrap(),
                result["position"].as_i64().unwrap(),
            );
        }
    }
    assert_eq!(position_of.len(), 600);
    assert_eq!(positions(&app.pool).await, (1..=600).collect::<Vec<i64>>());
    let stored: Vec<(Uuid, i64)> = sqlx::query_as("SELECT id, position FROM ledger")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    let stored: HashMap<Uuid, i64> = stored.into_iter().collect();
    assert_eq!(
        stored, position_of,
        "each event sits at the position it was told"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resending_returns_duplicates_at_their_original_positions_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let events = valid_events(50);
    let (status, first) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200);
    let original: HashMap<String, i64> = first["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["id"].as_str().unwrap().to_owned(),
                r["position"].as_i64().unwrap(),
            )
        })
        .collect();

    let mut subset: Vec<Value> = events.iter().step_by(3).cloned().collect();
    subset.shuffle(&mut rand::rng());
    let (status, again) = app.post_events(&json!({ "events": subset })).await;
    assert_eq!(status, 200, "{again}");
    for result in again["results"].as_array().unwrap() {
        assert_eq!(result["duplicate"], true);
        assert_eq!(
            result["position"].as_i64().unwrap(),
            original[result["id"].as_str().unwrap()]
        );
    }
    // A single event resent alone, and a batch mixing old and new events.
    let (status, single) = app.post_events(&events[4]).await;
    assert_eq!(
        (status, single["results"][0]["duplicate"].clone()),
        (200, json!(true))
    );
    let fresh = valid_events(2);
    let (status, mixed) = app
        .post_events(&json!({"events": [events[0].clone(), fresh[0].clone(), fresh[0].clone(), fresh[1].clone()]}))
        .await;
    assert_eq!(status, 200);
    let flags: Vec<_> = mixed["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["duplicate"].clone())
        .collect();
    assert_eq!(
        flags,
        vec![json!(true), json!(false), json!(true), json!(false)]
    );
    assert_eq!(
        mixed["results"][1]["position"],
        mixed["results"][2]["position"]
    );
    assert_eq!(app.ledger_count().await, 52);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_id_with_other_content_is_a_conflict_and_nothing_of_its_batch_is_stored() {
    let app = TestApp::spawn().await;
    let events = valid_events(5);
    assert_eq!(app.post_events(&json!({ "events": events })).await.0, 200);

    let mut changed = events[2].clone();
    changed["occurred_at"] = json!(ago(10));
    let fresh = valid_events(3);
    let batch = json!({"events": [fresh[0], changed, fresh[1]]});
    let (status, body) = app.post_events(&batch).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "idempotency_conflict");
    assert_eq!(body["error"]["details"][0]["index"], 1);
    assert_eq!(
        app.ledger_count().await,
        5,
        "the new events of the refused batch were not stored"
    );

    // Two events with one id and different content inside one batch conflict too.
    let mut twin = fresh[2].clone();
    twin["org_id"] = json!("org_other");
    let (status, body) = app.post_events(&json!({"events": [fresh[2], twin]})).await;
    assert_eq!(
        (status, body["error"]["details"][0]["index"].clone()),
        (409, json!(1))
    );
    assert_eq!(app.ledger_count().await, 5);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_with_one_invalid_event_is_refused_whole_naming_its_index() {
    let app = TestApp::spawn().await;
    let mut events = valid_events(20);
    events[7]["type"] = json!("container.exploded");
    events[13]["org_id"] = json!("org.with.dots");
    let (status, body) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 422, "{body}");
    let details: Vec<(i64, String)> = body["error"]["details"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["index"].as_i64().unwrap(),
                d["code"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        details,
        vec![(7, "unknown_type".into()), (13, "invalid_org_id".into())]
    );
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cloudevents_are_accepted_and_a_retried_cloudevent_is_a_duplicate() {
    let app = TestApp::spawn().await;
    let cloudevent = json!({
        "specversion": "1.0", "id": "evt-42", "source": "/provider/acme",
        "type": "container.created", "time": ago(60), "subject": "ctr_9", "orgid": "org_ce",
        "data": {"name": "from-acme"}
    });
    let (status, body) = app
        .post_raw(
            "application/cloudevents+json",
            cloudevent.to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let expected_id =
        tally::event::parse::cloudevent_ledger_id("org_ce", "/provider/acme", "evt-42");
    assert_eq!(body["results"][0]["id"], json!(expected_id.to_string()));

    let mut second = cloudevent.clone();
    second["id"] = json!("evt-43");
    second["type"] = json!("container.stopped");
    second["data"] = json!({"reason": "user"});
    let (status, body) = app
        .post_raw(
            "application/cloudevents-batch+json",
            json!([cloudevent, second]).to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"][0]["duplicate"], true);
    assert_eq!(body["results"][1]["duplicate"], false);

    let (source, source_event_id): (String, String) =
        sqlx::query_as("SELECT source, source_event_id FROM ledger WHERE position = 2")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(
        (source.as_str(), source_event_id.as_str()),
        ("/provider/acme", "evt-43")
    );
    app.stop().await;
}

/// A content type and the bytes sent with it.
type Body = (&'static str, Vec<u8>);

fn event_with(overrides: Value) -> Value {
    let mut event = valid_event("org_1", "ctr_1", 1);
    for (key, value) in overrides.as_object().unwrap() {
        if value.is_null() {
            event.as_object_mut().unwrap().remove(key);
        } else {
            event[key] = value.clone();
        }
    }
    event
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_bad_input_gets_a_json_4xx_and_leaves_the_ledger_unchanged() {
    let app = TestApp::spawn().await;
    let seed = valid_events(3);
    assert_eq!(app.post_events(&json!({ "events": seed })).await.0, 200);
    let before: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT position, hash FROM ledger ORDER BY position")
            .fetch_all(&app.pool)
            .await
            .unwrap();

    let json_body = |value: Value| ("application/json", value.to_string().into_bytes());
    let too_many: Vec<Value> = valid_events(1001);
    let huge_name = "x".repeat(5 * 1024 * 1024);
    let cloudevent_without_orgid = json!({"specversion": "1.0", "id": "e1", "source": "/s",
        "type": "container.created", "time": ago(1), "subject": "ctr_1"});
    let cases: Vec<(&str, Body, u16, &str)> = vec![
        (
            "truncated JSON",
            ("application/json", br#"{"events": [{"id": "#.to_vec()),
            400,
            "malformed_json",
        ),
        (
            "invalid UTF-8",
            ("application/json", b"{\"id\": \"\xc3\x28\"}".to_vec()),
            400,
            "malformed_json",
        ),
        (
            "not JSON at all",
            ("application/json", b"hello".to_vec()),
            400,
            "malformed_json",
        ),
        (
            "empty body",
            ("application/json", Vec::new()),
            400,
            "malformed_json",
        ),
        (
            "a JSON array body",
            json_body(json!([1, 2])),
            422,
            "invalid_body",
        ),
        (
            "unknown type",
            json_body(event_with(json!({"type": "container.deleted"}))),
            422,
            "invalid_events",
        ),
        (
            "id not a UUID",
            json_body(event_with(json!({"id": "12345"}))),
            422,
            "invalid_events",
        ),
        (
            "org id with a dot",
            json_body(event_with(json!({"org_id": "org.1"}))),
            422,
            "invalid_events",
        ),
        (
            "org id with a space",
            json_body(event_with(json!({"org_id": "org 1"}))),
            422,
            "invalid_events",
        ),
        (
            "container id too long",
            json_body(event_with(json!({"container_id": "c".repeat(65)}))),
            422,
            "invalid_events",
        ),
        (
            "future timestamp",
            json_body(event_with(json!({"occurred_at": ago(-600)}))),
            422,
            "invalid_events",
        ),
        (
            "ancient timestamp",
            json_body(event_with(json!({"occurred_at": "2020-01-01T00:00:00Z"}))),
            422,
            "invalid_events",
        ),
        (
            "timestamp without offset",
            json_body(event_with(json!({"occurred_at": "2026-11-29T10:00:00"}))),
            422,
            "invalid_events",
        ),
        (
            "unknown top-level field",
            json_body(event_with(json!({"color": "red"}))),
            422,
            "invalid_events",
        ),
        (
            "unknown data field",
            json_body(event_with(
                json!({"type": "container.resumed", "data": {"why": 1}}),
            )),
            422,
            "invalid_events",
        ),
        (
            "data of the wrong shape",
            json_body(event_with(
                json!({"type": "container.command_ran", "data": {"command_id": "c", "exit_code": "zero", "duration_ms": 1}}),
            )),
            422,
            "invalid_events",
        ),
        (
            "data as an array",
            json_body(event_with(json!({"data": [1]}))),
            422,
            "invalid_events",
        ),
        (
            "port out of range",
            json_body(event_with(
                json!({"type": "container.port_published", "data": {"port": 70000}}),
            )),
            422,
            "invalid_events",
        ),
        (
            "container id on an org event",
            json_body(event_with(
                json!({"type": "org.verification_changed", "data": {"verified": true}}),
            )),
            422,
            "invalid_events",
        ),
        (
            "missing id",
            json_body(event_with(json!({"id": null}))),
            422,
            "invalid_events",
        ),
        (
            "empty batch",
            json_body(json!({"events": []})),
            422,
            "empty_batch",
        ),
        (
            "batch with another key",
            json_body(json!({"events": [seed[0]], "dry_run": true})),
            422,
            "invalid_body",
        ),
        (
            "oversized batch",
            json_body(json!({ "events": too_many })),
            413,
            "batch_too_large",
        ),
        (
            "oversized body",
            json_body(event_with(json!({"data": {"name": huge_name}}))),
            413,
            "body_too_large",
        ),
        (
            "wrong content type",
            ("text/plain", seed[0].to_string().into_bytes()),
            415,
            "unsupported_media_type",
        ),
        (
            "CloudEvent without orgid",
            (
                "application/cloudevents+json",
                cloudevent_without_orgid.to_string().into_bytes(),
            ),
            422,
            "invalid_events",
        ),
        (
            "CloudEvents batch that is not an array",
            ("application/cloudevents-batch+json", b"{}".to_vec()),
            422,
            "invalid_body",
        ),
    ];
    assert!(cases.len() >= 20);
    let mut seen_codes = HashSet::new();
    for (name, (content_type, body), status, code) in cases {
        let (got_status, got) = app.post_raw(content_type, body).await;
        assert_eq!(got_status, status, "{name}: {got}");
        assert_eq!(got["error"]["code"], code, "{name}: {got}");
        assert!(
            got["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}"
        );
        assert!(got["error"]["details"].is_array(), "{name}");
        seen_codes.insert(code);
    }

    // No token, a wrong token, and a missing content type.
    let (status, no_token) = app.without_token().post_events(&seed[0]).await;
    assert_eq!(status, 401);
    assert_eq!(no_token["error"]["code"], "unauthorized");
    let (status, _) = app.with_token("nope").post_events(&seed[0]).await;
    assert_eq!(status, 401);
    let untyped = app
        .request(Method::POST, "/v1/events")
        .body(seed[0].to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(untyped.status(), 415);

    let after: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT position, hash FROM ledger ORDER BY position")
            .fetch_all(&app.pool)
            .await
            .unwrap();
    assert_eq!(before, after, "no bad request changed the ledger");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_append_queue_limit_a_request_gets_503_with_retry_after_and_nothing_is_lost() {
    let app = TestApp::spawn_with(|config| config.append_queue_max = 1).await;
    // Another "instance" holds the ledger lock, so the appender stalls in its first commit.
    let mut other = app.pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(tally::ledger::append::LEDGER_LOCK_KEY)
        .execute(&mut *other)
        .await
        .unwrap();

    let first = json!({ "events": valid_events(3) });
    let second = json!({ "events": valid_events(2) });
    let stalled = app.post_events(&first);
    let queued = async {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        app.post_events(&second).await
    };
    let refused = async {
        tokio::time::sleep(std::time::Duration::from_millis(600)).await;
        let reply = app
            .send(
                Method::POST,
                "/v1/events",
                Some(&json!({ "events": valid_events(1) })),
            )
            .await;
        let (status, retry_after, body) = reply.with_retry_after();
        other.commit().await.unwrap();
        (status, retry_after, body)
    };
    let ((first_status, _), (second_status, _), (status, retry_after, body)) =
        tokio::join!(stalled, queued, refused);

    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "overloaded");
    assert_eq!(retry_after.unwrap(), "1");
    assert_eq!((first_status, second_status), (200, 200));
    assert_eq!(app.ledger_count().await, 5);
    app.stop().await;
}

/// A CloudEvent whose `data` is JSON, as the official SDKs send it.
fn stopped_cloudevent(id: &str) -> Value {
    json!({
        "specversion": "1.0", "id": id, "source": "/providers/acme eu", "type": "container.stopped",
        "time": ago(30), "subject": "ctr_ce", "orgid": "org_ce",
        "datacontenttype": "application/json", "data": {"reason": "user"}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_cloudevent_sent_structured_batch_and_binary_is_one_ledger_row() {
    let app = TestApp::spawn().await;
    let expected = tally::event::parse::cloudevent_ledger_id("org_ce", "/providers/acme eu", "e-1");
    let cloudevent = stopped_cloudevent("e-1");
    let mut without_type = cloudevent.clone();
    without_type
        .as_object_mut()
        .unwrap()
        .remove("datacontenttype");
    let (headers, body) = binary_mode(&without_type, "Ce-");
    let (status, first) = app
        .post_raw(
            "application/cloudevents+json",
            cloudevent.to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{first}");
    let (status, batch) = app
        .post_raw(
            "application/cloudevents-batch+json",
            json!([cloudevent]).to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{batch}");
    let (status, binary) = app
        .post_binary(&headers, Some("application/json"), body.clone())
        .await;
    assert_eq!(status, 200, "{binary}");
    for answer in [&first, &batch, &binary] {
        assert_eq!(answer["results"][0]["id"], json!(expected.to_string()));
        assert_eq!(answer["results"][0]["position"], 1);
    }
    assert_eq!(first["results"][0]["duplicate"], false);
    assert_eq!(batch["results"][0]["duplicate"], true);
    assert_eq!(binary["results"][0]["duplicate"], true);

    // Binary first this time, then structured: the same single row.
    let second = stopped_cloudevent("e-2");
    let mut without_type = second.clone();
    without_type
        .as_object_mut()
        .unwrap()
        .remove("datacontenttype");
    let (headers, body) = binary_mode(&without_type, "ce-");
    let (status, binary) = app
        .post_binary(&headers, Some("application/json"), body)
        .await;
    assert_eq!(status, 200, "{binary}");
    assert_eq!(binary["results"][0]["duplicate"], false);
    let (status, structured) = app
        .post_raw(
            "application/cloudevents+json",
            second.to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{structured}");
    assert_eq!(structured["results"][0]["duplicate"], true);
    assert_eq!(structured["results"][0]["id"], binary["results"][0]["id"]);
    assert_eq!(app.ledger_count().await, 2);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_cloudevent_with_tracing_extensions_is_stored_and_they_are_read_back() {
    let app = TestApp::spawn().await;
    let mut cloudevent = stopped_cloudevent("e-traced");
    cloudevent
        .as_object_mut()
        .unwrap()
        .remove("datacontenttype");
    cloudevent["dataschema"] = json!("https://schemas.example/container-stopped.json");
    cloudevent["traceparent"] = json!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    cloudevent["tracestate"] = json!("congo=t61rcWkgMzE,rojo=00f067aa0ba902b7");
    let (headers, body) = binary_mode(&cloudevent, "ce-");
    let (status, answer) = app
        .post_binary(&headers, Some("application/json; charset=utf-8"), body)
        .await;
    assert_eq!(status, 200, "{answer}");

    let (status, page) = app.get_json("/v1/events?org_id=org_ce").await;
    assert_eq!(status, 200, "{page}");
    let stored = &page["events"][0];
    assert_eq!(stored["source"], "/providers/acme eu");
    assert_eq!(stored["source_event_id"], "e-traced");
    assert_eq!(
        stored["attributes"],
        json!({
            "datacontenttype": "application/json; charset=utf-8",
            "dataschema": "https://schemas.example/container-stopped.json",
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "tracestate": "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7",
        })
    );
    assert_eq!(stored["data"], json!({"reason": "user"}));

    // Another hop's trace context is no new content: a duplicate, the first one's kept.
    cloudevent["traceparent"] = json!("00-11111111111111111111111111111111-2222222222222222-01");
    let (headers, body) = binary_mode(&cloudevent, "ce-");
    let (status, again) = app
        .post_binary(&headers, Some("application/json"), body)
        .await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["results"][0]["duplicate"], true);
    let (_, page) = app.get_json("/v1/events?org_id=org_ce").await;
    assert_eq!(page["events"].as_array().unwrap().len(), 1);
    assert_eq!(
        page["events"][0]["attributes"]["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );

    // The attributes are chained: the chain recomputed from the rows holds.
    let (code, report, stderr) = run_verify(&app.db.url);
    assert_eq!(code, 0, "{report} {stderr}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extension_attributes_past_their_limits_are_refused_and_nothing_is_stored() {
    let app = TestApp::spawn().await;
    let mut too_many = stopped_cloudevent("e-many");
    for i in 0..16 {
        too_many[format!("ext{i}")] = json!("v");
    }
    let mut too_long = stopped_cloudevent("e-long");
    too_long["tracestate"] = json!("x".repeat(4096));
    let mut badly_named = stopped_cloudevent("e-name");
    badly_named["Trace_Parent"] = json!("x");
    let cases = [
        (too_many.clone(), "extensions_too_large"),
        (too_long, "extensions_too_large"),
        (badly_named, "invalid_extension"),
    ];
    for (cloudevent, code) in cases {
        let (status, body) = app
            .post_raw(
                "application/cloudevents+json",
                cloudevent.to_string().into_bytes(),
            )
            .await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["error"]["code"], "invalid_events", "{body}");
        assert_eq!(body["error"]["details"][0]["code"], code, "{body}");
    }
    // The same limit in binary mode.
    too_many.as_object_mut().unwrap().remove("datacontenttype");
    let (headers, body) = binary_mode(&too_many, "ce-");
    let (status, answer) = app
        .post_binary(&headers, Some("application/json"), body)
        .await;
    assert_eq!(status, 422, "{answer}");
    assert_eq!(
        answer["error"]["details"][0]["code"],
        "extensions_too_large"
    );
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binary_cloudevent_missing_an_attribute_or_giving_data_as_one_is_refused_naming_its_header(
) {
    let app = TestApp::spawn().await;
    for missing in ["source", "specversion", "orgid"] {
        let mut cloudevent = stopped_cloudevent("e-missing");
        cloudevent
            .as_object_mut()
            .unwrap()
            .remove("datacontenttype");
        cloudevent.as_object_mut().unwrap().remove(missing);
        let (headers, body) = binary_mode(&cloudevent, "ce-");
        let (status, answer) = app
            .post_binary(&headers, Some("application/json"), body)
            .await;
        assert_eq!(status, 422, "{answer}");
        let detail = &answer["error"]["details"][0];
        assert_eq!(detail["code"], "missing_field", "{answer}");
        assert!(
            detail["message"]
                .as_str()
                .unwrap()
                .starts_with(&format!("ce-{missing}:")),
            "{answer}"
        );
    }
    // Nor is data given twice, as the body and as a `ce-data` header.
    let mut cloudevent = stopped_cloudevent("e-data-twice");
    cloudevent
        .as_object_mut()
        .unwrap()
        .remove("datacontenttype");
    let (mut headers, body) = binary_mode(&cloudevent, "ce-");
    headers.push(("ce-data".into(), "%7B%22reason%22%3A%22admin%22%7D".into()));
    let (status, answer) = app
        .post_binary(&headers, Some("application/json"), body)
        .await;
    assert_eq!(status, 422, "{answer}");
    let detail = &answer["error"]["details"][0];
    assert_eq!(detail["code"], "invalid_cloudevent", "{answer}");
    assert!(detail["message"].as_str().unwrap().starts_with("ce-data:"));
    // Data that is not JSON is not taken for an event at all.
    let mut cloudevent = stopped_cloudevent("e-text");
    cloudevent
        .as_object_mut()
        .unwrap()
        .remove("datacontenttype");
    let (headers, _) = binary_mode(&cloudevent, "ce-");
    let (status, answer) = app
        .post_binary(&headers, Some("text/plain"), b"user".to_vec())
        .await;
    assert_eq!(status, 415, "{answer}");
    assert_eq!(answer["error"]["code"], "unsupported_media_type");
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}
