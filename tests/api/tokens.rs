//! Tokens and scopes: every route checks its scope in one place, org-bound
//! tokens act on their org only, revocation is immediate, and secrets are never stored.

use reqwest::Method;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::helpers::{ago, answered, Api, TestApp, TOKEN};
use crate::plans::pro_plan;

async fn create_token(app: &TestApp, body: Value) -> (String, String) {
    let created = answered(201, app.post_token(&body).await);
    (
        created["id"].as_str().unwrap().to_owned(),
        created["token"].as_str().unwrap().to_owned(),
    )
}

struct Route {
    method: Method,
    path: String,
    body: Option<Value>,
    scope: &'static str,
    /// Acts on org `acme`: an org-bound token of another org is refused.
    org_scoped: bool,
}

impl Route {
    /// This route's request by `api`'s caller: the status and the body as JSON, `null`
    /// when it is not JSON (a CSV export's answer, for one).
    async fn send(&self, api: &Api) -> (u16, Value) {
        let reply = api
            .send(self.method.clone(), &self.path, self.body.as_ref())
            .await;
        let body = serde_json::from_str(&reply.text).unwrap_or(Value::Null);
        (reply.status, body)
    }
}

fn routes() -> Vec<Route> {
    let route = |method: Method, path: &str, body: Option<Value>, scope, org_scoped| Route {
        method,
        path: path.to_owned(),
        body,
        scope,
        org_scoped,
    };
    let event = json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme",
                       "container_id": "c1", "occurred_at": ago(60)});
    let missing = Uuid::new_v4();
    vec![
        route(
            Method::POST,
            "/v1/events",
            Some(event),
            "events:write",
            true,
        ),
        route(
            Method::GET,
            "/v1/orgs/acme/usage?period=2026-11",
            None,
            "usage:read",
            true,
        ),
        route(
            Method::GET,
            "/v1/containers/c1?org_id=acme",
            None,
            "usage:read",
            true,
        ),
        route(Method::GET, "/v1/plans", None, "usage:read", false),
        route(
            Method::PUT,
            "/v1/plans/pro",
            Some(pro_plan()),
            "admin",
            false,
        ),
        route(
            Method::POST,
            "/v1/admission/check",
            Some(json!({"org_id": "acme", "action": "create"})),
            "admission",
            true,
        ),
        route(
            Method::POST,
            "/v1/admission/reservations",
            Some(json!({"org_id": "acme", "action": "create"})),
            "admission",
            true,
        ),
        route(
            Method::DELETE,
            &format!("/v1/admission/reservations/{missing}"),
            None,
            "admission",
            false,
        ),
        route(Method::GET, "/v1/events?org_id=acme", None, "audit", true),
        route(
            Method::GET,
            "/v1/containers/c1/events?org_id=acme",
            None,
            "audit",
            true,
        ),
        route(Method::GET, "/v1/ledger/verify", None, "audit", false),
        route(
            Method::POST,
            "/v1/tokens",
            Some(json!({"scopes": ["audit"]})),
            "admin",
            false,
        ),
        route(
            Method::DELETE,
            &format!("/v1/tokens/{missing}"),
            None,
            "admin",
            false,
        ),
    ]
}

#[tokio::test]
async fn every_route_needs_a_token_and_its_scope_and_org_bound_tokens_stay_in_their_org() {
    let app = TestApp::spawn().await;
    let scopes = [
        "events:write",
        "usage:read",
        "admission",
        "finance",
        "audit",
        "admin",
    ];
    let mut tokens = std::collections::HashMap::new();
    for scope in scopes {
        tokens.insert(
            scope,
            create_token(&app, json!({"scopes": [scope]})).await.1,
        );
    }
    let mut bound = std::collections::HashMap::new();
    for scope in ["events:write", "usage:read", "admission", "audit"] {
        bound.insert(
            scope,
            create_token(&app, json!({"scopes": [scope], "org_id": "other"}))
                .await
                .1,
        );
    }
    for route in routes() {
        let what = format!("{} {}", route.method, route.path);
        let (status, body) = route.send(&app.without_token()).await;
        assert_eq!(status, 401, "{what} without a token: {body}");
        let (status, _) = route.send(&app.with_token("tly_not-a-token")).await;
        assert_eq!(status, 401, "{what} with a bad token");
        for scope in scopes {
            let (status, body) = route.send(&app.with_token(&tokens[scope])).await;
            if scope == route.scope || scope == "admin" {
                assert!(
                    status != 401 && status != 403,
                    "{what} with {scope}: {status} {body}"
                );
            } else {
                assert_eq!(status, 403, "{what} with {scope}: {body}");
                assert_eq!(body["error"]["code"], "forbidden_scope");
            }
        }
        if route.org_scoped {
            let (status, body) = route.send(&app.with_token(&bound[route.scope])).await;
            assert_eq!(status, 403, "{what} with a token of another org: {body}");
            assert_eq!(body["error"]["code"], "org_not_allowed");
        }
    }
    // An org-bound audit token asking for no org sees its own org only.
    let (status, page) = app.with_token(&bound["audit"]).get_events("").await;
    assert_eq!(status, 200);
    assert_eq!(
        page["events"],
        json!([]),
        "acme's events are not shown to other's token"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_revoked_token_stops_working_at_once_and_no_secret_is_stored() {
    let app = TestApp::spawn().await;
    let (id, secret) =
        create_token(&app, json!({"scopes": ["usage:read"], "org_id": "acme"})).await;
    assert!(
        secret.starts_with("tly_") && secret.len() >= 4 + 32,
        "at least 128 bits"
    );
    let holder = app.with_token(&secret);
    let (status, _) = holder.get_usage("acme", "period=2026-11").await;
    assert_eq!(status, 200);
    let (status, _) = app.delete_token(&id).await;
    assert_eq!(status, 200);
    let (status, _) = holder.get_usage("acme", "period=2026-11").await;
    assert_eq!(status, 401, "revoked at once");

    let bad = [
        json!({"scopes": []}),
        json!({"scopes": ["root"]}),
        json!({"scopes": ["admin"], "org_id": "acme"}),
        json!({"scopes": ["audit"], "org_id": "a b"}),
        json!({"scopes": ["audit"], "color": "red"}),
    ];
    for body in bad {
        let (status, error) = app.post_token(&body).await;
        assert_eq!(status, 422, "{body}: {error}");
    }

    let dump = std::process::Command::new("pg_dump")
        .arg("--data-only")
        .arg(&app.db.url)
        .output()
        .expect("pg_dump runs");
    assert!(
        dump.status.success(),
        "{}",
        String::from_utf8_lossy(&dump.stderr)
    );
    let dump = String::from_utf8_lossy(&dump.stdout);
    assert!(dump.contains(&id), "the dump holds the token's row");
    let hex_part = secret.trim_start_matches("tly_");
    assert!(!dump.contains(hex_part), "the dump holds no secret");
    assert!(!dump.contains(TOKEN), "nor the bootstrap token");
    app.stop().await;
}

/// A request sent by hand over its own connection: its head and the first `split` bytes
/// of its body at once, the rest when `rest` is awaited. Answers the status code.
struct SlowRequest {
    stream: tokio::net::TcpStream,
    rest: Vec<u8>,
}

impl SlowRequest {
    async fn start(app: &TestApp, path: &str, token: &str, body: &Value, split: usize) -> Self {
        use tokio::io::AsyncWriteExt;
        let body = body.to_string().into_bytes();
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: tally\r\nauthorization: Bearer {token}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
            body.len()
        );
        let mut stream = tokio::net::TcpStream::connect(app.address).await.unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(&body[..split]).await.unwrap();
        SlowRequest {
            stream,
            rest: body[split..].to_vec(),
        }
    }

    async fn finish(mut self) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        self.stream.write_all(&self.rest).await.unwrap();
        let mut answer = Vec::new();
        self.stream.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        answer
            .split(' ')
            .nth(1)
            .and_then(|code| code.parse().ok())
            .unwrap_or_else(|| panic!("no status in {answer:?}"))
    }
}

#[tokio::test]
async fn a_token_revoked_while_its_body_arrives_stores_nothing_and_is_answered_401() {
    let app = TestApp::spawn().await;
    let (admin_id, admin) = create_token(&app, json!({"scopes": ["admin"]})).await;
    let (writer_id, writer) =
        create_token(&app, json!({"scopes": ["events:write"], "org_id": "acme"})).await;
    let tokens = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM api_token")
            .fetch_one(&app.pool)
            .await
            .unwrap()
    };
    let (tokens_before, events_before) = (tokens().await, app.ledger_count().await);

    // Each request's head and a byte of its body, then the revocation, then the rest.
    let minting =
        SlowRequest::start(&app, "/v1/tokens", &admin, &json!({"scopes": ["admin"]}), 1).await;
    let event = crate::helpers::valid_event("acme", "c1", 0);
    let storing = SlowRequest::start(&app, "/v1/events", &writer, &event, 1).await;
    tokio::time::sleep(tally::http::recheck::RECHECK_AFTER * 3).await;
    answered(200, app.delete_token(&admin_id).await);
    answered(200, app.delete_token(&writer_id).await);
    assert_eq!(
        minting.finish().await,
        401,
        "no token minted by a revoked one"
    );
    assert_eq!(
        storing.finish().await,
        401,
        "no event stored by a revoked token"
    );
    assert_eq!(tokens().await, tokens_before);
    assert_eq!(app.ledger_count().await, events_before);
    app.stop().await;
}

#[tokio::test]
async fn a_valid_tokens_body_that_arrives_slowly_is_taken() {
    let app = TestApp::spawn().await;
    let (_, writer) =
        create_token(&app, json!({"scopes": ["events:write"], "org_id": "acme"})).await;
    let event = crate::helpers::valid_event("acme", "c1", 0);
    let storing = SlowRequest::start(&app, "/v1/events", &writer, &event, 1).await;
    tokio::time::sleep(tally::http::recheck::RECHECK_AFTER * 3).await;
    assert_eq!(storing.finish().await, 200);
    assert_eq!(app.ledger_count().await, 1);
    app.stop().await;
}

#[tokio::test]
async fn a_head_request_has_the_scope_and_org_rules_of_its_get() {
    let app = TestApp::spawn().await;
    let (_, audit) = create_token(&app, json!({"scopes": ["audit"], "org_id": "acme"})).await;
    let (_, usage) = create_token(&app, json!({"scopes": ["usage:read"], "org_id": "acme"})).await;
    for (token, path, status) in [
        (&audit, "/v1/whoami", 200),
        (&audit, "/v1/events", 200),
        (&usage, "/v1/orgs/acme/usage?period=2026-11", 200),
        (&usage, "/v1/orgs/beta/usage?period=2026-11", 403),
        (&usage, "/v1/events", 403),
    ] {
        let reply = Api::reply(app.with_token(token).request(Method::HEAD, path)).await;
        assert_eq!(reply.status, status, "HEAD {path}");
    }
    app.stop().await;
}
