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
        json!({"ready": true, "postgres": "up", "nats": "up", "relay": "up", "streams": "up"})
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_copies_of_each_stream_asked_of_a_server_outside_a_cluster_make_the_instance_not_ready_saying_why(
) {
    let app = TestApp::spawn_with(|config| config.stream_replicas = 3).await;
    let anyone = app.without_token();
    // The relay and the ingest consumer each make their streams on their own time: wait
    // until both have been refused, not only the first.
    eventually(30, "the instance is not ready for both streams", || async {
        let ready = anyone.get("/readyz").await;
        let streams = ready.json()["streams"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        ready.status == 503 && streams.contains("TALLY_LEDGER") && streams.contains("TALLY_INGEST")
    })
    .await;
    let ready = anyone.get("/readyz").await;
    let answer = ready.json();
    assert_eq!(
        (ready.status, &answer["ready"], &answer["nats"]),
        (503, &json!(false), &json!("up")),
        "{answer}"
    );
    let streams = answer["streams"].as_str().unwrap();
    for said in [
        "refused",
        "TALLY_LEDGER",
        "TALLY_INGEST",
        "TALLY_STREAM_REPLICAS 3",
        "replicas > 1 not supported in non-clustered mode",
    ] {
        assert!(streams.contains(said), "{said:?} is not in {streams:?}");
    }
    // HTTP appends still work; nothing reaches a stream that was never made.
    assert_eq!(
        app.post_events(&json!({"events": valid_events(3)})).await.0,
        200
    );
    let js = app.nats.jetstream().await;
    assert!(js.get_stream("TALLY_LEDGER").await.is_err());
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
async fn every_operation_of_the_openapi_document_refuses_a_query_parameter_it_does_not_take_and_does_nothing(
) {
    let app = TestApp::spawn().await;
    let (status, document) = app.get_json("/openapi.json").await;
    assert_eq!(status, 200);
    let tokens = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM api_token")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let tokens_before = tokens().await;
    let mut accepted = Vec::new();
    for (method, path, concrete) in documented(&document) {
        if !path.starts_with("/v1/") {
            continue;
        }
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let target = format!("{concrete}?dry_run=true");
        let (status, body) = app.send(method.clone(), &target, None).await.status_json();
        if status != 422 || body["error"]["code"] != "unknown_parameter" {
            accepted.push(format!("{method} {path}: {status} {body}"));
        }
    }
    assert_eq!(accepted, Vec::<String>::new());
    // The token is checked first; HEAD is its GET.
    let (status, body) = app
        .without_token()
        .send(Method::POST, "/v1/events?dry_run=true", None)
        .await
        .status_json();
    assert_eq!(status, 401, "{body}");
    let reply = app.send(Method::HEAD, "/v1/plans?dry_run=true", None).await;
    assert_eq!(reply.status, 422);
    // With a body that would be stored: still refused, and nothing is.
    let event = valid_event("org_dry", "ctr_1", 0);
    let (status, body) = app
        .send(Method::POST, "/v1/events?dry_run=true", Some(&event))
        .await
        .status_json();
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("unknown_parameter")),
        "{body}"
    );
    let plan = json!({"name": "Pro", "included_runtime_ms": 3_600_000, "max_running": 2,
        "overage": "deny", "currency": "usd", "sandbox_allowed": true});
    let (status, body) = app
        .send(Method::PUT, "/v1/plans/pro?dry_run=1", Some(&plan))
        .await
        .status_json();
    assert_eq!(status, 422, "{body}");
    let (status, body) = app
        .send(
            Method::POST,
            "/v1/tokens?dry_run=1",
            Some(&json!({"scopes": ["usage:read"]})),
        )
        .await
        .status_json();
    assert_eq!(status, 422, "{body}");
    assert_eq!(app.ledger_count().await, 0, "nothing was stored");
    assert_eq!(tokens().await, tokens_before, "no token was made");
    let (status, body) = app.post_events(&event).await;
    assert_eq!(
        status, 200,
        "the same event without the parameter is stored: {body}"
    );
    let (status, _) = app.post_token(&json!({"scopes": ["usage:read"]})).await;
    assert_eq!(status, 201);
    assert_eq!(tokens().await, tokens_before + 1);
    app.stop().await;
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

/// Every operation of the document: `(METHOD path, its parameters)`, those of the path item
/// included (they apply to each of its operations).
fn operation_parameters(document: &serde_json::Value) -> Vec<(String, Vec<serde_json::Value>)> {
    let mut operations = Vec::new();
    for (path, item) in document["paths"].as_object().expect("paths") {
        let shared = item["parameters"].as_array().cloned().unwrap_or_default();
        for (method, operation) in item.as_object().expect("operations") {
            if method == "parameters" {
                continue;
            }
            let mut parameters = shared.clone();
            parameters.extend(
                operation["parameters"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default(),
            );
            operations.push((format!("{} {path}", method.to_uppercase()), parameters));
        }
    }
    operations
}

/// What is wrong with the parameters of the operation `name` on `path`: a name declared
/// twice (in any two places: the routes never read one name from two), a place other than
/// path, query or header, a path parameter that is not a segment of the path (a query
/// parameter marked `in: path`) or not required, a segment without its parameter.
fn parameter_faults(name: &str, path: &str, parameters: &[serde_json::Value]) -> Vec<String> {
    let mut faults = Vec::new();
    let segments: Vec<&str> = path
        .split('/')
        .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
        .collect();
    let mut seen = std::collections::BTreeSet::new();
    let mut in_path = Vec::new();
    for parameter in parameters {
        let (Some(parameter_name), Some(place)) =
            (parameter["name"].as_str(), parameter["in"].as_str())
        else {
            faults.push(format!(
                "{name}: a parameter without name or place: {parameter}"
            ));
            continue;
        };
        // Header names are case-insensitive; the others are compared as written.
        let key = if place == "header" {
            parameter_name.to_ascii_lowercase()
        } else {
            parameter_name.to_owned()
        };
        if !seen.insert(key) {
            faults.push(format!("{name}: {parameter_name} is declared twice"));
        }
        match place {
            "path" => {
                in_path.push(parameter_name);
                if !segments.contains(&parameter_name) {
                    faults.push(format!(
                        "{name}: {parameter_name} is in: path but not a segment of the path"
                    ));
                }
                if parameter["required"] != true {
                    faults.push(format!(
                        "{name}: path parameter {parameter_name} is not required"
                    ));
                }
            }
            "query" | "header" => {}
            other => faults.push(format!("{name}: {parameter_name} is in: {other}")),
        }
    }
    for segment in segments {
        if !in_path.contains(&segment) {
            faults.push(format!(
                "{name}: the segment {{{segment}}} has no path parameter"
            ));
        }
    }
    faults
}

#[tokio::test]
async fn every_parameter_of_the_openapi_document_is_declared_once_and_in_the_place_the_route_reads_it(
) {
    let app = TestApp::spawn().await;
    let (status, document) = app.without_token().get_json("/openapi.json").await;
    assert_eq!(status, 200);
    let operations = operation_parameters(&document);
    assert!(operations.len() > 20, "{operations:?}");
    let mut faults = Vec::new();
    for (name, parameters) in &operations {
        let path = name.split_once(' ').expect("METHOD path").1;
        faults.extend(parameter_faults(name, path, parameters));
    }
    assert_eq!(faults, Vec::<String>::new());

    // The audit pages' filters are query parameters; on the container's page the container
    // is the path's alone.
    let events = &operations
        .iter()
        .find(|(name, _)| name == "GET /v1/events")
        .expect("GET /v1/events")
        .1;
    let container_id = events
        .iter()
        .find(|parameter| parameter["name"] == "container_id")
        .expect("a container_id filter");
    assert_eq!(
        (&container_id["in"], &container_id["required"]),
        (&json!("query"), &json!(false))
    );
    app.stop().await;
}

#[test]
fn the_parameter_check_finds_a_query_parameter_marked_in_path_and_a_name_declared_twice() {
    let parameters = [
        json!({"name": "container_id", "in": "path", "required": true}),
        json!({"name": "container_id", "in": "path", "required": true}),
        json!({"name": "limit", "in": "path", "required": true}),
        json!({"name": "Tally-Min-Position", "in": "header"}),
        json!({"name": "tally-min-position", "in": "header"}),
    ];
    let path = "/v1/containers/{container_id}/events";
    assert_eq!(
        parameter_faults("GET path", path, &parameters),
        [
            "GET path: container_id is declared twice",
            "GET path: limit is in: path but not a segment of the path",
            "GET path: tally-min-position is declared twice",
        ]
    );
    assert_eq!(
        parameter_faults("GET path", path, &[json!({"name": "after", "in": "query"})]),
        ["GET path: the segment {container_id} has no path parameter"]
    );
}

/// Where `value` does not fit `schema` (resolved in `document`): a type it does not have, a
/// property the schema does not name or a required one it lacks, at `at`.
fn misfits(
    document: &serde_json::Value,
    schema: &serde_json::Value,
    value: &serde_json::Value,
    at: &str,
) -> Vec<String> {
    let schema = resolved(document, schema);
    if let Some(parts) = schema["allOf"].as_array() {
        return parts
            .iter()
            .flat_map(|part| misfits(document, part, value, at))
            .collect();
    }
    let kind = match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "boolean",
        serde_json::Value::Number(number) if number.is_i64() || number.is_u64() => "integer",
        serde_json::Value::Number(_) => "number",
        serde_json::Value::String(_) => "string",
        serde_json::Value::Array(_) => "array",
        serde_json::Value::Object(_) => "object",
    };
    let allowed: Vec<&str> = match &schema["type"] {
        serde_json::Value::String(one) => vec![one.as_str()],
        serde_json::Value::Array(many) => many.iter().filter_map(|kind| kind.as_str()).collect(),
        _ => return vec![format!("{at}: the schema names no type: {schema}")],
    };
    let fits = allowed.contains(&kind) || (kind == "integer" && allowed.contains(&"number"));
    if !fits {
        return vec![format!("{at}: {kind} where the schema says {allowed:?}")];
    }
    let mut faults = Vec::new();
    match value {
        serde_json::Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                faults.extend(misfits(
                    document,
                    &schema["items"],
                    item,
                    &format!("{at}[{index}]"),
                ));
            }
        }
        serde_json::Value::Object(members) => {
            let properties = schema["properties"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            for (name, member) in members {
                match properties.get(name) {
                    Some(property) => {
                        faults.extend(misfits(document, property, member, &format!("{at}.{name}")))
                    }
                    None => faults.push(format!("{at}.{name}: not a documented property")),
                }
            }
            for required in schema["required"].as_array().into_iter().flatten() {
                let required = required.as_str().expect("a property name");
                if !members.contains_key(required) {
                    faults.push(format!("{at}.{required}: required, and missing"));
                }
            }
        }
        _ => {}
    }
    faults
}

/// The media types the document lists for a GET's 200 answer on `path`.
fn answer_types<'a>(document: &'a serde_json::Value, path: &str) -> Vec<&'a str> {
    document["paths"][path]["get"]["responses"]["200"]["content"]
        .as_object()
        .unwrap_or_else(|| panic!("GET {path} documents no 200 content"))
        .keys()
        .map(String::as_str)
        .collect()
}

/// Figures for both finance exports: a closed period with a late event (an adjustment in
/// the current period's export), runtime in the current period, and a reconciliation of a
/// provider report. The reconciliation's id.
async fn finance_exports(app: &TestApp) -> String {
    let current = tally::runtime::Period::containing(app.now());
    let closed = tally::runtime::Period::containing(current.start() - chrono::Duration::days(1));
    let run = |org: &str, container: &str, from: chrono::DateTime<chrono::Utc>, hours: i64| {
        json!({"events": [
            {"id": uuid::Uuid::new_v4(), "type": "container.created", "org_id": org, "container_id": container,
             "occurred_at": tally::event::canonical::timestamp(from)},
            {"id": uuid::Uuid::new_v4(), "type": "container.stopped", "org_id": org, "container_id": container,
             "occurred_at": tally::event::canonical::timestamp(from + chrono::Duration::hours(hours))},
        ]})
    };
    let in_closed = closed.end() - chrono::Duration::hours(5);
    ok(app.post_events(&run("acme", "c1", in_closed, 2)).await);
    projected_to_head(&app.pool, "the closed period's events are projected").await;
    let (status, _, job) = app.close_period(&closed.to_string()).await;
    assert_eq!(status, 202, "{job}");
    eventually(30, "the period is closed", || async {
        app.get_close(&closed.to_string()).await.1["status"] == "done"
    })
    .await;
    ok(app.post_events(&run("acme", "c2", in_closed, 1)).await);
    let started = app.now() - chrono::Duration::hours(3);
    ok(app.post_events(&run("acme", "c3", started, 2)).await);
    projected_to_head(&app.pool, "the late and current events are projected").await;

    let window = |at: chrono::DateTime<chrono::Utc>| tally::event::canonical::timestamp(at);
    let csv = format!(
        "ChargeCategory,ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags\n\
         Usage,{},{},c3,7200,Seconds,1.44,USD,\"{{\"\"org_id\"\":\"\"acme\"\"}}\"",
        window(started - chrono::Duration::hours(1)),
        window(started + chrono::Duration::hours(3)),
    );
    let report = answered(201, app.post_report(csv).await);
    let reconciliation = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    reconciliation["reconciliation_id"]
        .as_str()
        .expect("a reconciliation id")
        .to_owned()
}

#[tokio::test]
async fn the_csv_exports_answer_csv_or_json_as_their_documented_content_and_the_json_fits_its_schema(
) {
    let app = TestApp::spawn_mid_period().await;
    let reconciliation = finance_exports(&app).await;
    let (_, document) = app.without_token().get_json("/openapi.json").await;
    let current = tally::runtime::Period::containing(app.now());
    let period = format!("period={current}");
    let routes = [
        (
            "/v1/exports/usage.csv",
            "/v1/exports/usage.csv".to_owned(),
            period.as_str(),
            "rows",
        ),
        (
            "/v1/reconciliations/{reconciliation_id}/lines.csv",
            format!("/v1/reconciliations/{reconciliation}/lines.csv"),
            "",
            "lines",
        ),
    ];
    for (path, url, query, list) in routes {
        let mut types = answer_types(&document, path);
        types.sort_unstable();
        assert_eq!(types, ["application/json", "text/csv"], "{path}");

        let csv = app.get(&format!("{url}?{query}")).await;
        assert_eq!(csv.status, 200, "{url}: {}", csv.text);
        let content_type = csv.header("content-type").expect("a content type");
        assert_eq!(content_type.split(';').next(), Some("text/csv"), "{url}");

        let with_format = [query, "format=json"].join(if query.is_empty() { "" } else { "&" });
        let json = app.get(&format!("{url}?{with_format}")).await;
        assert_eq!(json.status, 200, "{url}: {}", json.text);
        assert_eq!(
            json.header("content-type").as_deref(),
            Some("application/json")
        );
        let answer = json.json();
        assert!(
            answer[list]
                .as_array()
                .is_some_and(|items| !items.is_empty()),
            "{url}: no {list} to check: {answer}"
        );
        let schema = &document["paths"][path]["get"]["responses"]["200"]["content"]
            ["application/json"]["schema"];
        assert_eq!(
            misfits(&document, schema, &answer, "answer"),
            Vec::<String>::new(),
            "{url}"
        );
    }
    let (_, export) = app
        .get_json(&format!(
            "/v1/exports/usage.csv?period={current}&format=json"
        ))
        .await;
    assert_eq!(
        export["adjustments"].as_array().map(Vec::len),
        Some(1),
        "{export}"
    );
    app.stop().await;
}

#[test]
fn the_schema_check_finds_a_wrong_type_an_undocumented_property_and_a_missing_one() {
    let document = json!({"components": {"schemas": {"Row": {
        "type": "object", "required": ["org_id", "runtime_ms"],
        "properties": {"org_id": {"type": ["string", "null"]}, "runtime_ms": {"type": "integer"}},
    }}}});
    let schema = json!({"type": "array", "items": {"$ref": "#/components/schemas/Row"}});
    let fitting = json!([{"org_id": null, "runtime_ms": 5}, {"org_id": "acme", "runtime_ms": 0}]);
    assert_eq!(
        misfits(&document, &schema, &fitting, "a"),
        Vec::<String>::new()
    );
    let unfit = json!([{"org_id": "acme", "runtime_ms": "5", "colour": "red"}, {"org_id": "acme"}]);
    let mut faults = misfits(&document, &schema, &unfit, "a");
    faults.sort_unstable();
    assert_eq!(
        faults,
        [
            "a[0].colour: not a documented property",
            "a[0].runtime_ms: string where the schema says [\"integer\"]",
            "a[1].runtime_ms: required, and missing",
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refused_event_post_is_counted_by_its_code_whichever_check_refused_it() {
    let app = TestApp::spawn().await;
    // The recorder is the test process's: other tests count too, so each count is read
    // before and after, and must have grown.
    let codes = [
        "org_not_allowed",
        "unsupported_media_type",
        "malformed_json",
    ];
    let counts = || async {
        let text = app.without_token().get("/metrics").await.text;
        codes.map(|code| {
            let series =
                format!("tally_ingest_requests_rejected_total{{source=\"http\",code=\"{code}\"}} ");
            text.lines()
                .find_map(|line| line.strip_prefix(&series))
                .and_then(|value| value.parse::<f64>().ok())
                .unwrap_or_else(|| panic!("no {series:?}"))
        })
    };
    let before = counts().await;
    let bound = answered(
        201,
        app.post_token(&json!({"scopes": ["events:write"], "org_id": "org_a"}))
            .await,
    )["token"]
        .as_str()
        .unwrap()
        .to_owned();
    let other_org = valid_event("org_b", "c1", 0);
    let (status, _) = app.with_token(&bound).post_events(&other_org).await;
    assert_eq!(status, 403);
    let (status, _) = app.post_raw("text/plain", b"hello".to_vec()).await;
    assert_eq!(status, 415);
    let (status, _) = app.post_raw("application/json", b"{bad".to_vec()).await;
    assert_eq!(status, 400);
    let after = counts().await;
    for ((code, before), after) in codes.iter().zip(before).zip(after) {
        assert!(after > before, "{code}: {before} before, {after} after");
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_lifecycle_event_counts_the_events_its_refold_read_again() {
    let app = TestApp::spawn().await;
    // The recorder is the test process's: other tests count too, so the count is read
    // before and after, and must have grown by at least what this refold read (the exact
    // count is in tests/api/refold.rs).
    let read_again = || async {
        let text = app.without_token().get("/metrics").await.text;
        text.lines()
            .find_map(|line| line.strip_prefix("tally_projection_refold_events_total "))
            .and_then(|value| value.parse::<f64>().ok())
            .expect("the refold events are counted")
    };
    let mut history = vec![
        json!({"id": uuid::Uuid::new_v4(), "type": "container.created",
        "org_id": "acme", "container_id": "long", "occurred_at": app.ago(3_600)}),
    ];
    for n in 0..500 {
        history.push(
            json!({"id": uuid::Uuid::new_v4(), "type": "container.command_ran",
            "org_id": "acme", "container_id": "long", "occurred_at": app.ago(3_000 - n),
            "data": {"command_id": format!("c{n}"), "exit_code": 0, "duration_ms": 1}}),
        );
    }
    answered(200, app.post_events(&json!({ "events": history })).await);
    crate::helpers::projected_to_head(&app.pool, "the history is projected").await;
    let before = read_again().await;
    // Dated among the commands: a late lifecycle event, which refolds the container from
    // its two lifecycle events and the 300 or so commands after the stop (its instant is
    // taken from the clock a moment after theirs).
    let late = json!({"id": uuid::Uuid::new_v4(), "type": "container.stopped",
        "org_id": "acme", "container_id": "long", "occurred_at": app.ago(2_800)});
    answered(200, app.post_events(&late).await);
    crate::helpers::projected_to_head(&app.pool, "the late stop is projected").await;
    let after = read_again().await;
    assert!(after - before >= 252.0, "{before} then {after}");
}
