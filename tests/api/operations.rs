//! The operating interface: health, readiness, metrics and the OpenAPI document need no
//! token; errors on unknown routes keep the JSON shape.

use std::collections::HashMap;

use reqwest::Method;
use serde_json::json;
use tally::telemetry::FAMILIES;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_metrics_and_openapi_answer_without_a_token() {
    let app = TestApp::spawn().await;
    let anyone = app.without_token();
    assert_eq!(anyone.get("/healthz").await.status, 200);
    let ready = anyone.get("/readyz").await;
    assert_eq!(ready.status, 200);
    assert_eq!(
        ready.json(),
        json!({"ready": true, "postgres": "up", "nats": "up", "relay": "up"})
    );

    assert_eq!(
        app.post_events(&json!({"events": valid_events(3)})).await.0,
        200
    );
    let metrics = anyone.get("/metrics").await.text;
    for name in [
        "tally_ingest_events_total",
        "tally_append_batch_events",
        "tally_append_batch_seconds",
    ] {
        assert!(metrics.contains(name), "/metrics lacks {name}");
    }
    let openapi = anyone.get("/openapi.json").await.json();
    for path in [
        "/v1/events",
        "/v1/ledger/verify",
        "/healthz",
        "/readyz",
        "/metrics",
    ] {
        assert!(openapi["paths"][path].is_object(), "openapi lacks {path}");
    }
    app.stop().await;
}

/// The families of a scrape: each `# HELP` text and `# TYPE` by name, and the name of
/// every sample line.
struct Scrape {
    help: HashMap<String, String>,
    kind: HashMap<String, String>,
    samples: Vec<String>,
}

impl Scrape {
    fn parse(text: &str) -> Scrape {
        let mut scrape = Scrape {
            help: HashMap::new(),
            kind: HashMap::new(),
            samples: Vec::new(),
        };
        for line in text.lines().filter(|line| !line.is_empty()) {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect("# HELP name text");
                let before = scrape.help.insert(name.to_owned(), help.to_owned());
                assert!(before.is_none(), "two # HELP lines for {name}");
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("# TYPE name kind");
                let before = scrape.kind.insert(name.to_owned(), kind.to_owned());
                assert!(before.is_none(), "two # TYPE lines for {name}");
            } else {
                assert!(!line.starts_with('#'), "unexpected comment {line:?}");
                let name = line.split(['{', ' ']).next().expect("a sample's name");
                scrape.samples.push(name.to_owned());
            }
        }
        scrape
    }

    /// The family a sample belongs to: its name, or its name less a histogram's suffix.
    fn family_of<'a>(&self, sample: &'a str) -> Option<&'a str> {
        if self.kind.contains_key(sample) {
            return Some(sample);
        }
        ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|suffix| sample.strip_suffix(suffix))
            .find(|name| self.kind.get(*name).is_some_and(|kind| kind == "histogram"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_scrape_before_any_request_has_every_family_with_help_and_type_in_base_units() {
    let app = TestApp::spawn().await;
    let text = app.without_token().get("/metrics").await.text;
    let scrape = Scrape::parse(&text);
    for family in FAMILIES {
        assert_eq!(
            scrape.help.get(family.name).map(String::as_str),
            Some(family.help),
            "# HELP of {}",
            family.name
        );
        assert_eq!(
            scrape.kind.get(family.name).map(String::as_str),
            Some(family.kind.as_str()),
            "# TYPE of {}",
            family.name
        );
        assert!(
            scrape
                .samples
                .iter()
                .any(|sample| scrape.family_of(sample) == Some(family.name)),
            "{} has no series",
            family.name
        );
    }
    for (name, kind) in &scrape.kind {
        assert!(
            FAMILIES.iter().any(|family| family.name == name),
            "{name} is not in the table of families"
        );
        assert!(!name.ends_with("_ms"), "{name} is not in seconds");
        assert_ne!(kind, "summary", "{name} is a summary");
        // A duration that is not a gauge's reading is a latency: a histogram.
        if name.ends_with("_seconds") && kind != "gauge" {
            assert_eq!(kind, "histogram", "{name}");
        }
    }
    for sample in &scrape.samples {
        assert!(scrape.family_of(sample).is_some(), "{sample} has no # TYPE");
    }
    app.stop().await;
}

/// The schema a property points at: itself, or the component its `$ref` (bare or as the
/// one member of `allOf`/`oneOf`) names.
fn resolved<'a>(
    document: &'a serde_json::Value,
    schema: &'a serde_json::Value,
) -> &'a serde_json::Value {
    let reference = schema["$ref"]
        .as_str()
        .or_else(|| schema["allOf"][0]["$ref"].as_str())
        .or_else(|| schema["oneOf"][0]["$ref"].as_str());
    match reference {
        Some(reference) => {
            let name = reference
                .strip_prefix("#/components/schemas/")
                .expect("a component reference");
            &document["components"]["schemas"][name]
        }
        None => schema,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_enumerates_exactly_the_error_codes_of_the_enum() {
    let app = TestApp::spawn().await;
    let openapi = app.without_token().get("/openapi.json").await.json();
    let code = resolved(
        &openapi,
        &openapi["components"]["schemas"]["ErrorContent"]["properties"]["code"],
    );
    let mut listed: Vec<&str> = code["enum"]
        .as_array()
        .unwrap_or_else(|| panic!("ErrorContent.code is not an enumeration: {code}"))
        .iter()
        .map(|value| value.as_str().expect("a code is a string"))
        .collect();
    listed.sort_unstable();
    let mut codes: Vec<&str> = tally::error_code::ErrorCode::ALL
        .iter()
        .map(|code| code.as_str())
        .collect();
    codes.sort_unstable();
    assert_eq!(listed, codes);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_when_nats_is_down_while_ingest_keeps_working_and_the_relay_catches_up_after(
) {
    let mut app = TestApp::spawn().await;
    app.nats.stop();
    let anyone = app.without_token();
    eventually(10, "readyz reports NATS down", || async {
        let (status, ready) = anyone.get_json("/readyz").await;
        status == 503 && ready["nats"] == "down"
    })
    .await;
    let (status, body) = app.post_events(&json!({"events": valid_events(2)})).await;
    assert_eq!(status, 200, "{body}");

    // When NATS returns (same store), the relay catches up without being told.
    app.nats.restart();
    let js = app.nats.jetstream().await;
    eventually(30, "the relay caught up after NATS returned", || async {
        stream_messages(&js, "TALLY_LEDGER").await == 2
    })
    .await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_routes_and_methods_get_json_errors() {
    let app = TestApp::spawn().await;
    let (status, error) = app.without_token().get_json("/v1/nothing").await;
    assert_eq!(status, 404);
    assert_eq!(error["error"]["code"], "not_found");
    let (status, error) = app
        .send(Method::DELETE, "/v1/events", None)
        .await
        .status_json();
    assert_eq!(status, 405);
    assert_eq!(error["error"]["code"], "method_not_allowed");
    app.stop().await;
}

/// The document's operations, `(METHOD, path)`, and its paths with each path parameter
/// given a value (any segment matches a parameter).
fn documented(document: &serde_json::Value) -> Vec<(String, String, String)> {
    let mut operations = Vec::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        let concrete: Vec<String> = path
            .split('/')
            .map(|segment| {
                if segment.starts_with('{') {
                    "x1".to_owned()
                } else {
                    segment.to_owned()
                }
            })
            .collect();
        for method in item.as_object().expect("operations").keys() {
            operations.push((method.to_uppercase(), path.clone(), concrete.join("/")));
        }
    }
    operations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_answers_every_operation_of_the_openapi_document_and_refuses_every_other_method_on_its_paths(
) {
    let app = TestApp::spawn().await;
    let anyone = app.without_token();
    let (status, document) = anyone.get_json("/openapi.json").await;
    assert_eq!(status, 200);
    let operations = documented(&document);
    assert!(operations.len() > 20, "{operations:?}");

    // A documented operation reaches its route: the token check of /v1 (which runs only
    // on a matched route) or an operations endpoint's answer; not the 404 or 405 of no route.
    let mut unanswered = Vec::new();
    for (method, path, concrete) in &operations {
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let reply = anyone.send(method.clone(), concrete, None).await;
        let answered = if path.starts_with("/v1/") {
            reply.status == 401 && reply.json()["error"]["code"] == "unauthorized"
        } else {
            reply.status == 200
        };
        if !answered {
            unanswered.push(format!("{method} {path}: {} {}", reply.status, reply.text));
        }
    }
    assert_eq!(unanswered, Vec::<String>::new());

    // The other way round: on a documented path, a method the document does not list is
    // 405 even for the admin, so the router serves no operation the document leaves out.
    let mut undocumented = Vec::new();
    for (_, path, concrete) in &operations {
        for method in [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
        ] {
            let listed = operations
                .iter()
                .any(|(m, p, _)| p == path && m.as_str() == method.as_str());
            if listed {
                continue;
            }
            let (status, body) = app.send(method.clone(), concrete, None).await.status_json();
            if status != 405 || body["error"]["code"] != "method_not_allowed" {
                undocumented.push(format!("{method} {path}: {status} {body}"));
            }
        }
    }
    assert_eq!(undocumented, Vec::<String>::new());
    app.stop().await;
}

#[tokio::test]
async fn past_the_concurrency_limit_requests_are_shed_with_503_and_retry_after_not_queued() {
    use std::io::Write as _;

    let app = TestApp::spawn_with(|config| config.http_concurrency_max = 2).await;
    // Two requests that hold their slot: each sends headers and half of its body, then
    // waits.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = std::net::TcpStream::connect(app.address).unwrap();
        write!(
            stream,
            "POST /v1/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n\
             Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"id\":"
        )
        .unwrap();
        held.push(stream);
    }
    let anyone = app.without_token();
    eventually(5, "a third request is shed", || async {
        let health = anyone.get("/healthz").await;
        health.status == 503 && health.header("retry-after").is_some()
    })
    .await;
    let body = anyone.get("/healthz").await.json();
    assert_eq!(body["error"]["code"], "overloaded");

    drop(held);
    eventually(
        5,
        "slots are free again once the held requests end",
        || async { anyone.get("/healthz").await.status == 200 },
    )
    .await;
    app.stop().await;
}
