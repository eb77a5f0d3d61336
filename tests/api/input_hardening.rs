//! Input hardening: what Postgres cannot store as it was
//! hashed (leap seconds, NUL) is refused at validation wherever it enters; CloudEvents ids
//! are scoped by org while ids stored before keep theirs; duplicate JSON keys and
//! non-object `data` are refused; a report's year 0000 is a 422 naming its line.

use async_nats::HeaderMap;
use chrono::{DateTime, Utc};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestCaseError, TestRunner};
use serde_json::{json, Value};
use tally::event::canonical;
use tally::event::parse::{cloudevent_ledger_id, legacy_cloudevent_ledger_id, BodyError, BodyKind};
use tally::ledger::{read, AppendLimits, Appender};
use uuid::Uuid;

use crate::helpers::*;

fn cloudevent(org: &str, id: &str, time: &str) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "/provider/acme",
        "type": "container.created", "time": time, "subject": "ctr_1", "orgid": org,
        "data": {"name": "task"}})
}

/// The code of the first detail of a refused event body.
fn detail_code(body: &Value) -> &str {
    body["error"]["details"][0]["code"].as_str().unwrap_or("")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leap_second_is_refused_with_422_in_every_envelope_and_nothing_is_stored() {
    let app = TestApp::spawn().await;
    // A leap second a minute ago, in whichever minute that is.
    let minute_ago = Utc::now() - chrono::Duration::seconds(60);
    let leap = format!("{}:60.000Z", minute_ago.format("%Y-%m-%dT%H:%M"));
    let leap_with_offset = format!(
        "{}:60.500+01:00",
        (minute_ago + chrono::Duration::hours(1)).format("%Y-%m-%dT%H:%M")
    );
    for at in [&leap, &leap_with_offset] {
        let mut native = valid_event("org_leap", "ctr_1", 0);
        native["occurred_at"] = json!(at);
        let (status, body) = app.post_events(&native).await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(detail_code(&body), "leap_second", "{body}");
        assert!(
            body["error"]["details"][0]["message"]
                .as_str()
                .unwrap()
                .contains("leap second"),
            "{body}"
        );

        let event = cloudevent("org_leap", "evt-leap", at);
        let (status, body) = app
            .post_raw(
                "application/cloudevents+json",
                event.to_string().into_bytes(),
            )
            .await;
        assert_eq!((status, detail_code(&body)), (422, "leap_second"), "{body}");
        let (status, body) = app
            .post_raw(
                "application/cloudevents-batch+json",
                json!([event]).to_string().into_bytes(),
            )
            .await;
        assert_eq!((status, detail_code(&body)), (422, "leap_second"), "{body}");
    }
    // The correction flow takes native events too, with its own backdate bound.
    let mut added = valid_event("org_leap", "ctr_1", 3);
    added["occurred_at"] = json!(leap);
    let (status, body) = app
        .send_bytes(
            reqwest::Method::POST,
            "/v1/corrections/events",
            "application/json",
            json!({"events": [added], "reason": "provider confirmed"}).to_string(),
        )
        .await
        .status_json();
    assert_eq!((status, detail_code(&body)), (422, "leap_second"), "{body}");
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leap_second_as_of_is_refused_rather_than_echoed() {
    let app = TestApp::spawn().await;
    let period = tally::runtime::Period::containing(Utc::now()).to_string();
    let (status, body) = app
        .get_usage(
            "org_1",
            &format!("period={period}&as_of=2026-12-01T07:00:60Z"),
        )
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "leap_second", "{body}");
    let (status, body) = app
        .get_container("ctr_1", "as_of=2026-12-01T06:59:60.500%2B00:00")
        .await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(body["error"]["code"], "leap_second", "{body}");
    app.stop().await;
}

#[tokio::test]
async fn an_as_of_past_the_future_bound_is_refused_and_one_within_it_reads_as_now() {
    let app = TestApp::spawn_mid_period().await;
    let now = app.now();
    let period = tally::runtime::Period::containing(now).to_string();
    let created = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "org_1",
                         "container_id": "ctr_1", "occurred_at": app.ago(3_600)});
    assert_eq!(app.post_events(&created).await.0, 200);
    let at = |seconds: i64| {
        tally::event::canonical::timestamp(now + chrono::Duration::seconds(seconds))
            .replace('+', "%2B")
    };
    // A month ahead would count a month of runtime that has not happened.
    let ahead = at(tally::event::FUTURE_SKEW_MAX_SECONDS + 60);
    for (status, body) in [
        app.get_usage("org_1", &format!("period={period}&as_of={ahead}"))
            .await,
        app.get_container("ctr_1", &format!("as_of={ahead}")).await,
        app.get_json(&format!("/v1/orgs/org_1?as_of={ahead}")).await,
    ] {
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (422, Some("invalid_as_of")),
            "{body}"
        );
    }
    // Within a producer's clock skew: read as the server's now, and said so.
    let (status, usage) = app
        .get_usage("org_1", &format!("period={period}&as_of={}", at(60)))
        .await;
    assert_eq!(status, 200, "{usage}");
    let answered: chrono::DateTime<Utc> = usage["as_of"].as_str().unwrap().parse().unwrap();
    assert!(answered <= app.now(), "{usage}");
    let created_at: chrono::DateTime<Utc> =
        created["occurred_at"].as_str().unwrap().parse().unwrap();
    assert_eq!(
        usage["runtime_ms"].as_i64().unwrap(),
        (answered - created_at).num_milliseconds(),
        "counted up to the answer's as_of: {usage}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orgs_tally_records_its_own_events_under_are_refused_to_producers_corrections_and_tokens(
) {
    let app = TestApp::spawn().await;
    for org in [tally::event::PLANS_ORG_ID, tally::event::CORRECTIONS_ORG_ID] {
        let native = valid_event(org, "ctr_1", 0);
        let mut account = valid_event(org, "ctr_1", 1);
        account["type"] = json!("org.verification_changed");
        account["data"] = json!({"verified": true});
        account.as_object_mut().unwrap().remove("container_id");
        let refused = [
            app.post_events(&native).await,
            app.post_events(&json!({"events": [account]})).await,
            app.post_raw(
                "application/cloudevents+json",
                cloudevent(org, "evt-1", &ago(5)).to_string().into_bytes(),
            )
            .await,
            app.post_corrections(&json!({"events": [native], "reason": "r"}))
                .await,
        ];
        for (status, body) in refused {
            assert_eq!(status, 422, "{org}: {body}");
            assert_eq!(detail_code(&body), "reserved_org_id", "{org}: {body}");
        }
        let (status, body) = app
            .post_token(&json!({"scopes": ["usage:read"], "org_id": org}))
            .await;
        assert_eq!(status, 422, "{org}: {body}");
        assert_eq!(body["error"]["code"], "reserved_org_id", "{org}: {body}");
    }
    assert_eq!(app.ledger_count().await, 0, "nothing was stored");
    // A token bound to one before they were reserved answers as no token.
    let (status, token) = app
        .post_token(&json!({"scopes": ["audit"], "org_id": "org_x"}))
        .await;
    assert_eq!(status, 201, "{token}");
    let bound = app.with_token(token["token"].as_str().unwrap());
    let (status, body) = bound.get_json("/v1/whoami").await;
    assert_eq!(status, 200, "{body}");
    sqlx::query("UPDATE api_token SET org_id = '_corrections' WHERE org_id = 'org_x'")
        .execute(&app.pool)
        .await
        .unwrap();
    let (status, body) = bound.get_json("/v1/whoami").await;
    assert_eq!(status, 401, "{body}");
    // An org id that only starts the same way is any org's.
    let (status, body) = app.post_events(&valid_event("_plans2", "ctr_1", 0)).await;
    assert_eq!(status, 200, "{body}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_body_under_a_content_coding_is_415_wherever_only_provider_reports_take_one() {
    let app = TestApp::spawn().await;
    let event = valid_event("org_gz", "ctr_1", 0).to_string();
    let plan = json!({"name": "Pro", "included_runtime_ms": 3_600_000, "max_running": 2,
        "overage": "deny", "currency": "usd", "sandbox_allowed": true})
    .to_string();
    for (method, path, body) in [
        (reqwest::Method::POST, "/v1/events", event.clone()),
        (reqwest::Method::PUT, "/v1/plans/pro", plan),
    ] {
        for coding in ["gzip", "br", "identity, deflate"] {
            let reply = app
                .request(method.clone(), path)
                .header("content-type", "application/json")
                .header("content-encoding", coding)
                .body(body.clone())
                .send()
                .await
                .unwrap();
            assert_eq!(reply.status(), 415, "{path} {coding}");
            let text = reply.text().await.unwrap();
            assert!(text.contains("unsupported_content_encoding"), "{text}");
        }
    }
    assert_eq!(app.ledger_count().await, 0, "nothing was stored");
    let reply = app
        .request(reqwest::Method::POST, "/v1/events")
        .header("content-type", "application/json")
        .header("content-encoding", "identity")
        .body(event)
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200, "identity is the body as sent");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_is_refused_with_422_naming_the_field_wherever_text_enters() {
    let app = TestApp::spawn().await;
    let nul = "a\u{0}b";
    let mut name = valid_event("org_nul", "ctr_1", 0);
    name["data"]["name"] = json!(nul);
    let mut command = valid_event("org_nul", "ctr_1", 1);
    command["data"]["command_id"] = json!(nul);
    let mut ce_id = cloudevent("org_nul", "evt-1", &ago(5));
    ce_id["id"] = json!(nul);
    let mut ce_source = cloudevent("org_nul", "evt-1", &ago(5));
    ce_source["source"] = json!(format!("/p/{nul}"));
    let post = reqwest::Method::POST;
    // (method, path, content type, body, the field the error names)
    let cases: Vec<(reqwest::Method, &str, &str, String, &str)> = vec![
        (post.clone(), "/v1/events", "application/json", name.to_string(), "data.name"),
        (
            post.clone(),
            "/v1/events",
            "application/json",
            json!({"events": [command]}).to_string(),
            "data.command_id",
        ),
        (
            post.clone(),
            "/v1/events",
            "application/cloudevents+json",
            ce_id.to_string(),
            "id",
        ),
        (
            post.clone(),
            "/v1/events",
            "application/cloudevents-batch+json",
            json!([ce_source]).to_string(),
            "source",
        ),
        (
            post.clone(),
            "/v1/corrections/voids",
            "application/json",
            json!({"event_id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55", "reason": nul}).to_string(),
            "reason",
        ),
        (
            post.clone(),
            "/v1/corrections/events",
            "application/json",
            json!({"events": [name], "reason": "late"}).to_string(),
            "events[0].data.name",
        ),
        (
            reqwest::Method::PUT,
            "/v1/plans/pro",
            "application/json",
            json!({"sandbox_runtime": true, "included_runtime_seconds": 3600, "overage": "bill",
                "overage_price_per_hour": "0.10", "currency": "US\u{0}", "max_running_containers": 2,
                "max_published_ports": 2})
            .to_string(),
            "currency",
        ),
        (
            post.clone(),
            "/v1/tokens",
            "application/json",
            json!({"scopes": ["audit"], "org_id": nul}).to_string(),
            "org_id",
        ),
        (
            post.clone(),
            "/v1/admission/check",
            "application/json",
            json!({"org_id": nul, "action": "create"}).to_string(),
            "org_id",
        ),
        (
            post.clone(),
            "/v1/provider-reports",
            "text/csv",
            "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ProviderName,ChargeCategory\n\
             2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,acme,Usage\n\
             2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c2,3600,Seconds,0.5,USD,ac\u{0}me,Usage\n"
                .to_owned(),
            "ProviderName",
        ),
    ];
    let tokens_before: i64 = sqlx::query_scalar("SELECT count(*) FROM api_token")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    for (method, path, content_type, body, field) in cases {
        let (status, answer) = app
            .send_bytes(method, path, content_type, body)
            .await
            .status_json();
        assert_eq!(status, 422, "{path} {field}: {answer}");
        let error = &answer["error"];
        let (code, message) = match error["details"][0]["code"].as_str() {
            // Event bodies name the event's field in each detail.
            Some(code) if error["code"] == "invalid_events" => {
                (code, error["details"][0]["message"].as_str().unwrap())
            }
            _ => (
                error["code"].as_str().unwrap(),
                error["message"].as_str().unwrap(),
            ),
        };
        assert_eq!(code, "unstorable_text", "{path} {field}: {answer}");
        assert!(
            message.starts_with(&format!("{field}: "))
                || message.contains(&format!("column {field}")),
            "{path} {field}: {answer}"
        );
    }
    let report_lines: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_report")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let tokens_after: i64 = sqlx::query_scalar("SELECT count(*) FROM api_token")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(
        (app.ledger_count().await, report_lines, tokens_after),
        (0, 0, tokens_before)
    );
    // Nothing reached the appender, so nothing failed there: the service still appends.
    let (status, body) = app.post_events(&valid_event("org_ok", "ctr_1", 0)).await;
    assert_eq!(status, 200, "{body}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leap_second_or_a_nul_over_nats_is_dead_lettered_not_stored_or_redelivered() {
    let app = TestApp::spawn().await;
    let js = app.nats.jetstream().await;
    eventually(10, "the ingest stream exists", || async {
        js.get_stream("TALLY_INGEST").await.is_ok()
    })
    .await;
    let minute_ago = Utc::now() - chrono::Duration::seconds(60);
    let leap = format!("{}:60.500Z", minute_ago.format("%Y-%m-%dT%H:%M"));
    let mut with_nul = cloudevent("org_nats", "evt-nul", &ago(5));
    with_nul["data"]["name"] = json!("a\u{0}b");
    for (id, event) in [
        ("leap", cloudevent("org_nats", "evt-leap", &leap)),
        ("nul", with_nul),
    ] {
        let mut headers = HeaderMap::new();
        headers.insert("Content-Type", "application/cloudevents+json");
        js.publish_with_headers(
            format!("tally.ingest.{id}"),
            headers,
            event.to_string().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    eventually(15, "both are on the dead-letter stream", || async {
        stream_messages(&js, "TALLY_DLQ").await == 2
    })
    .await;
    let dlq = js.get_stream("TALLY_DLQ").await.unwrap();
    let mut found = Vec::new();
    for sequence in [1, 2] {
        let message = dlq.get_raw_message(sequence).await.unwrap();
        assert_eq!(
            message.headers.get("Tally-Error-Code").unwrap().as_str(),
            "invalid_events"
        );
        let error = message
            .headers
            .get("Tally-Error")
            .unwrap()
            .as_str()
            .to_owned();
        found.push((message.subject.to_string(), error));
    }
    found.sort();
    assert_eq!(found[0].0, "tally.dlq.leap");
    assert!(found[0].1.contains("leap_second"), "{:?}", found[0]);
    assert_eq!(found[1].0, "tally.dlq.nul");
    assert!(found[1].1.contains("unstorable_text"), "{:?}", found[1]);
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    assert_eq!(app.ledger_count().await, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_given_twice_is_refused_on_every_json_body_route() {
    let app = TestApp::spawn().await;
    let plan = r#"{"sandbox_runtime": true, "included_runtime_seconds": 3600, "overage": "bill",
        "overage_price_per_hour": "0.10", "currency": "USD", "max_running_containers": 2,
        "max_published_ports": 2, "max_running_containers": 1000}"#;
    let event = valid_event("org_dup", "ctr_1", 3).to_string();
    let cases: Vec<(reqwest::Method, &str, String, &str)> = vec![
        (reqwest::Method::PUT, "/v1/plans/pro", plan.to_owned(), "max_running_containers"),
        (
            reqwest::Method::POST,
            "/v1/tokens",
            r#"{"scopes": ["audit"], "scopes": ["finance"]}"#.to_owned(),
            "scopes",
        ),
        (
            reqwest::Method::POST,
            "/v1/admission/check",
            r#"{"org_id": "org_a", "action": "create", "org_id": "org_b"}"#.to_owned(),
            "org_id",
        ),
        (
            reqwest::Method::POST,
            "/v1/admission/reservations",
            r#"{"org_id": "org_a", "action": "create", "ttl_seconds": 5, "ttl_seconds": 300}"#
                .to_owned(),
            "ttl_seconds",
        ),
        (
            reqwest::Method::POST,
            "/v1/reconciliations",
            r#"{"report_id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55", "tolerance_ms": 1, "tolerance_ms": 2}"#
                .to_owned(),
            "tolerance_ms",
        ),
        (
            reqwest::Method::POST,
            "/v1/corrections/voids",
            r#"{"event_id": "0193a5f0-7c1e-7d2a-9b1e-2f0c6a1d4e55", "reason": "a", "reason": "b"}"#
                .to_owned(),
            "reason",
        ),
        (
            reqwest::Method::POST,
            "/v1/corrections/events",
            format!(r#"{{"events": [{event}], "reason": "a", "events": []}}"#),
            "events",
        ),
    ];
    for (method, path, body, field) in cases {
        let (status, answer) = app
            .send_bytes(method, path, "application/json", body)
            .await
            .status_json();
        assert_eq!(status, 422, "{path}: {answer}");
        assert_eq!(
            answer["error"]["code"], "duplicate_field",
            "{path}: {answer}"
        );
        assert_eq!(
            answer["error"]["details"][0]["field"], field,
            "{path}: {answer}"
        );
    }
    let tokens: i64 = sqlx::query_scalar("SELECT count(*) FROM api_token")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!((tokens, app.ledger_count().await), (0, 0));
    app.stop().await;
}

/// On the routes with a query or a path to check as well as a body, those are answered
/// first, whatever is wrong with the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_query_or_plan_id_is_answered_before_a_bad_body() {
    let app = TestApp::spawn().await;
    let bad_body = r#"{"org_id": "acme", "color": "red"}"#;
    for path in ["/v1/admission/check", "/v1/admission/reservations"] {
        let (status, answer) = app
            .send_bytes(
                reqwest::Method::POST,
                &format!("{path}?color=red"),
                "application/json",
                bad_body,
            )
            .await
            .status_json();
        assert_eq!(
            (status, answer["error"]["code"].as_str()),
            (422, Some("unknown_parameter")),
            "{path}: {answer}"
        );
    }
    let (status, answer) = app
        .send_bytes(
            reqwest::Method::PUT,
            "/v1/plans/bad.id",
            "application/json",
            bad_body,
        )
        .await
        .status_json();
    assert_eq!(
        (status, answer["error"]["code"].as_str()),
        (422, Some("invalid_plan_id")),
        "{answer}"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_that_is_not_an_object_is_refused_and_null_data_is_absent() {
    let app = TestApp::spawn().await;
    // Read by position, this array was a valid command before.
    let mut positional = valid_event("org_data", "ctr_1", 1);
    positional["data"] = json!(["cmd-1", 0, 12]);
    let (status, body) = app.post_events(&positional).await;
    assert_eq!(status, 422, "{body}");
    assert_eq!(detail_code(&body), "invalid_data", "{body}");
    let mut resumed = valid_event("org_data", "ctr_1", 3);
    resumed["data"] = json!([]);
    let (status, body) = app.post_events(&resumed).await;
    assert_eq!(
        (status, detail_code(&body)),
        (422, "invalid_data"),
        "{body}"
    );
    assert_eq!(app.ledger_count().await, 0);

    // `null` means absent (docs/decisions/0002-event-data-null-is-absent.md).
    resumed["data"] = Value::Null;
    let (status, body) = app.post_events(&resumed).await;
    assert_eq!(status, 200, "{body}");
    let stored: Value = sqlx::query_scalar("SELECT data FROM ledger")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, json!({}));
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_with_year_zero_or_a_leap_second_is_a_422_naming_its_line() {
    let app = TestApp::spawn().await;
    let header = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory";
    let good = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,Usage";
    for (bad, code) in [
        (
            "0000-11-01T00:00:00Z,2026-11-01T01:00:00Z,c2,3600,Seconds,0.5,USD,Usage",
            "invalid_timestamp",
        ),
        (
            "2026-11-01T00:00:00Z,2026-11-01T00:59:60Z,c2,3600,Seconds,0.5,USD,Usage",
            "leap_second",
        ),
    ] {
        let report = format!("{header}\n{good}\n{good}\n{bad}\n");
        let (status, body) = app
            .send_bytes(
                reqwest::Method::POST,
                "/v1/provider-reports",
                "text/csv",
                report,
            )
            .await
            .status_json();
        assert_eq!(status, 422, "{body}");
        assert_eq!(body["error"]["code"], code, "{body}");
        assert_eq!(body["error"]["details"][0]["line"], 4, "{body}");
    }
    let reports: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_report")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(reports, 0);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_orgs_cloudevent_does_not_take_another_orgs_source_and_id() {
    let app = TestApp::spawn().await;
    let at = ago(30);
    let mut ids = Vec::new();
    for org in ["org_a", "org_b"] {
        let event = cloudevent(org, "evt-7", &at);
        let (status, body) = app
            .post_raw(
                "application/cloudevents+json",
                event.to_string().into_bytes(),
            )
            .await;
        assert_eq!(status, 200, "{org}: {body}");
        assert_eq!(body["results"][0]["duplicate"], false, "{org}: {body}");
        let expected = cloudevent_ledger_id(org, "/provider/acme", "evt-7");
        assert_eq!(body["results"][0]["id"], json!(expected.to_string()));
        ids.push(expected);
    }
    assert_ne!(ids[0], ids[1]);
    // Each org's retry is its own duplicate.
    let (status, body) = app
        .post_raw(
            "application/cloudevents+json",
            cloudevent("org_b", "evt-7", &at).to_string().into_bytes(),
        )
        .await;
    assert_eq!(
        (status, body["results"][0]["duplicate"].clone()),
        (200, json!(true))
    );
    assert_eq!(app.ledger_count().await, 2);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cloudevent_stored_under_its_legacy_id_deduplicates_its_retry() {
    let app = TestApp::spawn().await;
    let at = ago(30);
    let event = cloudevent("org_old", "evt-9", &at);
    let legacy = store_under_legacy_id(&app, &event).await;

    for kind in [
        "application/cloudevents+json",
        "application/cloudevents-batch+json",
    ] {
        let body = if kind.contains("batch") {
            json!([event]).to_string()
        } else {
            event.to_string()
        };
        let (status, answer) = app.post_raw(kind, body.into_bytes()).await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(answer["results"][0]["duplicate"], true, "{answer}");
        assert_eq!(answer["results"][0]["id"], json!(legacy.to_string()));
    }
    // Other content under the same (source, id) is still the conflict it always was.
    let mut changed = event.clone();
    changed["data"]["name"] = json!("other");
    let (status, answer) = app
        .post_raw(
            "application/cloudevents+json",
            changed.to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 409, "{answer}");
    // Over NATS too.
    let js = app.nats.jetstream().await;
    eventually(10, "the ingest stream exists", || async {
        js.get_stream("TALLY_INGEST").await.is_ok()
    })
    .await;
    let mut headers = HeaderMap::new();
    headers.insert("Content-Type", "application/cloudevents+json");
    js.publish_with_headers("tally.ingest.old", headers, event.to_string().into())
        .await
        .unwrap()
        .await
        .unwrap();
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    // Another org with the same (source, id) is not the legacy row's producer.
    let (status, answer) = app
        .post_raw(
            "application/cloudevents+json",
            cloudevent("org_new", "evt-9", &at).to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["results"][0]["duplicate"], false, "{answer}");
    assert_eq!(
        answer["results"][0]["id"],
        json!(cloudevent_ledger_id("org_new", "/provider/acme", "evt-9").to_string())
    );
    assert_eq!(app.ledger_count().await, 2);
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 0);
    app.stop().await;
}

/// Stores `event` (a CloudEvent of source `/provider/acme`) under its legacy id, as an
/// earlier version did, through `app`'s appender; returns that id.
async fn store_under_legacy_id(app: &TestApp, event: &Value) -> tally::event::EventId {
    let bounds = tally::event::TimeBounds {
        now: Utc::now(),
        backdate_max: chrono::Duration::days(35),
    };
    let mut old = tally::event::parse::parse_body(
        BodyKind::CloudEvent,
        event.to_string().as_bytes(),
        bounds,
        10,
    )
    .unwrap();
    let legacy = legacy_cloudevent_ledger_id("/provider/acme", event["id"].as_str().unwrap());
    old[0].id = legacy;
    let appender = &app.service.as_ref().unwrap().appender;
    appender.append(old).await.unwrap();
    legacy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_messages_fetched_together_keep_their_own_events_and_legacy_ids() {
    let app = TestApp::spawn().await;
    let at = ago(30);
    for id in ["evt-1", "evt-2"] {
        store_under_legacy_id(&app, &cloudevent("org_old", id, &at)).await;
    }
    let js = app.nats.jetstream().await;
    eventually(10, "the ingest stream exists", || async {
        js.get_stream("TALLY_INGEST").await.is_ok()
    })
    .await;
    // Published without waiting in between, so that the consumer fetches them together:
    // retries of both legacy events (one alone, one in a batch with a new event), a message
    // that is dead-lettered between them, a new event, and another org's event with the
    // same source and id as a legacy one.
    let messages = [
        (
            "application/cloudevents+json",
            cloudevent("org_old", "evt-1", &at),
        ),
        (
            "application/cloudevents+json",
            json!({"specversion": "1.0", "id": "evt-x"}),
        ),
        (
            "application/cloudevents-batch+json",
            json!([
                cloudevent("org_old", "evt-3", &at),
                cloudevent("org_old", "evt-2", &at)
            ]),
        ),
        (
            "application/cloudevents+json",
            cloudevent("org_old", "evt-4", &at),
        ),
        (
            "application/cloudevents+json",
            cloudevent("org_new", "evt-1", &at),
        ),
    ];
    let mut acks = Vec::new();
    for (kind, body) in messages {
        let mut headers = HeaderMap::new();
        headers.insert("Content-Type", kind);
        acks.push(
            js.publish_with_headers("tally.ingest.batch", headers, body.to_string().into())
                .await
                .unwrap(),
        );
    }
    for ack in acks {
        ack.await.unwrap();
    }
    eventually(10, "the ingest work queue is empty", || async {
        stream_messages(&js, "TALLY_INGEST").await == 0
    })
    .await;
    // The two legacy events, evt-3, evt-4 and org_new's evt-1; the retries are duplicates.
    assert_eq!(app.ledger_count().await, 5);
    assert_eq!(stream_messages(&js, "TALLY_DLQ").await, 1);
    let stored: Vec<String> = sqlx::query_scalar("SELECT id::TEXT FROM ledger ORDER BY position")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    for (org, id) in [
        ("org_old", "evt-3"),
        ("org_old", "evt-4"),
        ("org_new", "evt-1"),
    ] {
        let expected = cloudevent_ledger_id(org, "/provider/acme", id).to_string();
        assert!(
            stored.contains(&expected),
            "{org} {id} is not stored: {stored:?}"
        );
    }
    app.stop().await;
}

/// One generated event: its envelope, its timestamp's parts and its texts.
#[derive(Debug, Clone)]
struct Generated {
    cloudevent: bool,
    kind: u8,
    seconds_ago: i64,
    nanos: u32,
    fraction_digits: usize,
    offset_minutes: i32,
    leap: bool,
    first: String,
    second: String,
    exit_code: i32,
    duration_ms: u64,
}

/// Text as producers send it: any character, with the awkward ones more often than chance
/// would pick them (NUL, quotes, escapes, line separators, combining marks, emoji).
fn text() -> impl Strategy<Value = String> {
    let awkward = prop_oneof![
        Just('\u{0}'),
        Just('"'),
        Just('\\'),
        Just('\n'),
        Just('\u{7f}'),
        Just('\u{2028}'),
        Just('\u{301}'),
        Just('\u{fffe}'),
        Just('😀'),
        Just('é'),
    ];
    let character = prop_oneof![4 => any::<char>(), 1 => awkward];
    proptest::collection::vec(character, 1..24).prop_map(|chars| chars.into_iter().collect())
}

fn generated() -> impl Strategy<Value = Generated> {
    (
        (
            any::<bool>(),
            0u8..5,
            60i64..30 * 86_400,
            0u32..1_000_000_000,
            0usize..10,
        ),
        (-14 * 60..=14 * 60i32, proptest::bool::weighted(0.15)),
        (text(), text(), any::<i32>(), 0u64..1_000_000_000),
    )
        .prop_map(
            |(
                (cloudevent, kind, seconds_ago, nanos, fraction_digits),
                (offset_minutes, leap),
                (first, second, exit_code, duration_ms),
            )| Generated {
                cloudevent,
                kind,
                seconds_ago,
                nanos,
                fraction_digits,
                offset_minutes,
                leap,
                first,
                second,
                exit_code,
                duration_ms,
            },
        )
}

impl Generated {
    /// The timestamp as a producer writes it: local time at the offset, a fraction of 0–9
    /// digits, `Z` for UTC, and `:60` for a leap second.
    fn timestamp(&self, now: DateTime<Utc>) -> String {
        let instant = now - chrono::Duration::seconds(self.seconds_ago);
        let offset = chrono::FixedOffset::east_opt(self.offset_minutes * 60).unwrap();
        let local = instant.with_timezone(&offset);
        let seconds = if self.leap {
            "60".to_owned()
        } else {
            local.format("%S").to_string()
        };
        let fraction = if self.fraction_digits == 0 {
            String::new()
        } else {
            let digits = format!("{:09}", self.nanos);
            format!(".{}", &digits[..self.fraction_digits])
        };
        let zone = if self.offset_minutes == 0 {
            "Z".to_owned()
        } else {
            local.format("%:z").to_string()
        };
        format!(
            "{}:{seconds}{fraction}{zone}",
            local.format("%Y-%m-%dT%H:%M")
        )
    }

    fn body(&self, now: DateTime<Utc>) -> (BodyKind, String) {
        let (event_type, data) = match self.kind {
            0 => (
                "container.created",
                json!({"name": self.first, "image": self.second}),
            ),
            1 => (
                "container.command_ran",
                json!({"command_id": self.first, "exit_code": self.exit_code,
                    "duration_ms": self.duration_ms, "timed_out": self.exit_code % 2 == 0}),
            ),
            2 => ("container.stopped", json!({"reason": "provider"})),
            3 => ("container.resumed", json!({})),
            _ => (
                "container.port_published",
                json!({"port": 1 + self.duration_ms % 65_535, "url": "https://p.example.com/x"}),
            ),
        };
        let at = self.timestamp(now);
        if self.cloudevent {
            // A source never holds control characters (those are refused on their own);
            // NUL stays, to be refused as unstorable.
            let source: String = self
                .second
                .chars()
                .map(|c| {
                    if c.is_control() && c != '\u{0}' {
                        '_'
                    } else {
                        c
                    }
                })
                .collect();
            let event = json!({"specversion": "1.0", "id": self.first,
                "source": format!("/src/{source}"), "type": event_type, "time": at,
                "subject": "ctr_p", "orgid": "org_p", "tracestate": self.second,
                "data": data});
            (BodyKind::CloudEvent, event.to_string())
        } else {
            let event = json!({"id": uuid::Uuid::new_v4().to_string(), "type": event_type,
                "org_id": "org_p", "container_id": "ctr_p", "occurred_at": at, "data": data});
            (BodyKind::Native, event.to_string())
        }
    }

    /// The texts this event carries into the ledger.
    fn texts(&self) -> Vec<&str> {
        match (self.cloudevent, self.kind) {
            // The CloudEvents id, and the source and an extension; or the name and image.
            (true, _) | (false, 0) => vec![&self.first, &self.second],
            (false, 1) => vec![&self.first],
            (false, _) => vec![],
        }
    }
}

/// contract §2: the stored, hashed and relayed forms are the same bytes. For every event the
/// parser accepts, the hash the appender computed at ingest equals the hash recomputed
/// from the row Postgres gives back (what `verify` does), and the canonical bytes from the
/// event in memory equal those from the stored row; an event Postgres could not give back
/// as it was (a leap second, a NUL) is refused.
#[test]
fn every_accepted_event_reads_back_from_postgres_as_the_bytes_hashed_at_ingest() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (db, pool, appender) = runtime.block_on(async {
        let db = TestDb::new().await;
        let pool = db.pool().await;
        let (appender, _committed, _task) = Appender::start(
            pool.clone(),
            AppendLimits {
                queue_max: 16,
                group_events_max: 100,
            },
        );
        (db, pool, appender)
    });
    let accepted = std::cell::Cell::new(0);
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let result = runner.run(&generated(), |generated| {
        let now = Utc::now();
        let (kind, body) = generated.body(now);
        let bounds = tally::event::TimeBounds {
            now,
            backdate_max: chrono::Duration::days(35),
        };
        let parsed = tally::event::parse::parse_body(kind, body.as_bytes(), bounds, 10);
        let has_nul = generated.texts().iter().any(|text| text.contains('\u{0}'));
        if generated.leap || has_nul {
            let Err(BodyError::Invalid(errors)) = &parsed else {
                return Err(TestCaseError::fail(format!(
                    "{body} was accepted: {parsed:?}"
                )));
            };
            let code = errors[0].error.code.as_str();
            prop_assert!(
                code == "leap_second" || code == "unstorable_text",
                "{body}: {code}"
            );
            return Ok(());
        }
        // Every other generated event keeps every rule.
        let events = parsed.map_err(|error| TestCaseError::fail(format!("{body}: {error:?}")))?;
        accepted.set(accepted.get() + 1);
        runtime.block_on(async {
            let appended = appender.append(events.clone()).await.unwrap();
            let position = appended[0].position;
            let rows = read::read_after(&pool, position - 2, 2).await.unwrap();
            let (prev_hash, row) = match rows.as_slice() {
                [row] => (canonical::GENESIS_HASH, row),
                [previous, row] => (<[u8; 32]>::try_from(previous.hash.as_slice()).unwrap(), row),
                other => panic!("expected the row at {position}, got {other:?}"),
            };
            prop_assert_eq!(row.position, position);
            let event = &events[0];
            let data = event.data_json();
            let attributes = event.origin.as_ref().and_then(|o| o.attributes_json());
            let fields = canonical::RecordFields {
                attributes: attributes.as_ref(),
                ..event.record_fields(&data)
            };
            let at_ingest = canonical::record_bytes(&fields, row.position, row.recorded_at);
            let from_row = canonical::record_bytes(&row.fields(), row.position, row.recorded_at);
            prop_assert_eq!(
                String::from_utf8(at_ingest).unwrap(),
                String::from_utf8(from_row.clone()).unwrap(),
                "{}",
                body
            );
            prop_assert_eq!(
                canonical::chain_hash(&prev_hash, &from_row).to_vec(),
                row.hash.clone(),
                "the stored hash is not the one recomputed from the row: {}",
                body
            );
            Ok(())
        })
    });
    if let Err(error) = result {
        panic!("{error}");
    }
    // And the whole chain verifies, as `tally verify` would run it.
    runtime.block_on(async {
        let report = tally::ledger::verify::verify(&pool).await.unwrap();
        assert!(report.ok, "{report:?}");
        drop(appender);
        pool.close().await;
    });
    drop(db);
    // Leap seconds and NULs are a minority of the cases: most reach Postgres.
    let accepted = accepted.get();
    assert!(accepted > 16, "only {accepted} of 64 cases were accepted");
}
