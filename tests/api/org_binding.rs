//! Tokens against each other: a token bound to one org is held to it on every
//! route, driven from the route table itself (item 3); one verify pass at a time (item 6);
//! one token cannot take every request slot (item 5); the bearer scheme in any case
//! (item 9).

use std::collections::BTreeSet;

use chrono::Utc;
use reqwest::Method;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tally::http::auth::{OrgRule, RouteRule, ROUTES};
use tally::runtime::Period;
use uuid::Uuid;

use crate::admission::ready_org;
use crate::helpers::{answered, eventually, projected_to_head, slow_request, TestApp, TOKEN};

const ORG_A: &str = "org_a";
const ORG_B: &str = "org_b";

/// A token made through the API.
async fn create_token(app: &TestApp, body: Value) -> String {
    answered(201, app.post_token(&body).await)["token"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// A token bound to `org` with every scope, admin included, stored directly: the API
/// refuses to bind an admin token, so this is the token that reaches every route's org
/// rule rather than stopping at its scope (and a row written some other way is held to the
/// rules all the same).
async fn bound_token_with_every_scope(app: &TestApp, org: &str) -> String {
    let secret = format!("tly_test_{}", Uuid::new_v4().simple());
    sqlx::query(
        "INSERT INTO api_token (id, secret_sha256, scopes, org_id, created_at, created_by) \
         VALUES ($1, $2, $3, $4, now(), 'test')",
    )
    .bind(Uuid::new_v4())
    .bind(&Sha256::digest(secret.as_bytes())[..])
    .bind(vec![
        "events:write",
        "usage:read",
        "admission",
        "finance",
        "audit",
        "admin",
    ])
    .bind(org)
    .execute(&app.pool)
    .await
    .unwrap();
    secret
}

fn json_body(value: Value) -> Option<(&'static str, Vec<u8>)> {
    Some(("application/json", value.to_string().into_bytes()))
}

/// What org_a's token must get from a request aimed at org_b or at every org.
enum Expect {
    /// 403 with this code.
    Refused(&'static str),
    /// 200 with at least one row, every row org_a's; the function lists the rows' orgs.
    OrgARowsOnly(fn(&str) -> Vec<String>),
    /// 200: the route serves no org's data.
    Served,
}

struct Probe {
    method: Method,
    path: String,
    body: Option<(&'static str, Vec<u8>)>,
    expect: Expect,
}

/// What the fixture made for org_b (and org_a), for the probes to aim at.
struct Fixture {
    period: Period,
    /// A minute before the service's now.
    minute_ago: String,
    reservation_b: Uuid,
    reconciliation: String,
    report_csv: String,
    some_token_id: String,
}

fn csv_orgs(body: &str) -> Vec<String> {
    body.lines()
        .skip(1)
        .filter(|line| !line.is_empty())
        .map(|line| line.split(',').next().unwrap().to_owned())
        .collect()
}

fn event_orgs(body: &str) -> Vec<String> {
    let page: Value = serde_json::from_str(body).unwrap();
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["org_id"].as_str().unwrap().to_owned())
        .collect()
}

fn container_org(body: &str) -> Vec<String> {
    let container: Value = serde_json::from_str(body).unwrap();
    vec![container["org_id"].as_str().unwrap().to_owned()]
}

/// The probes of one route. A route of the table with no case here fails the test: give
/// it an org rule in `ROUTES` and a case here.
fn probes(rule: &RouteRule, fixture: &Fixture) -> Vec<Probe> {
    let probe = |method: Method, path: String, body, expect| Probe {
        method,
        path,
        body,
        expect,
    };
    let method: Method = rule.method.parse().unwrap();
    let period = fixture.period;
    let previous = Period::containing(period.start() - chrono::Duration::milliseconds(1));
    let one = |path: String, body, expect| vec![probe(method.clone(), path, body, expect)];
    match (rule.method, rule.path) {
        ("POST", "/v1/events") => {
            let own = |event_type: &str, data: Value| {
                json!({"id": Uuid::new_v4(), "type": event_type, "org_id": ORG_A,
                       "occurred_at": fixture.minute_ago, "data": data})
            };
            // Its own org's account events, alone or after one of its container events:
            // a bound token may not set its own plan, verification or billing.
            let mut created = own("container.created", Value::Null);
            created["container_id"] = json!("ca_new");
            created.as_object_mut().unwrap().remove("data");
            let account = [
                own("org.plan_changed", json!({"plan": "pro"})),
                own("org.verification_changed", json!({"verified": false})),
                own(
                    "org.billing_eligibility_changed",
                    json!({"eligible": false}),
                ),
            ];
            let mut probes = vec![probe(
                method.clone(),
                "/v1/events".into(),
                json_body(
                    json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": ORG_B,
                           "container_id": "cb_new", "occurred_at": fixture.minute_ago}),
                ),
                Expect::Refused("org_not_allowed"),
            )];
            probes.extend(account.into_iter().map(|event| {
                let body = json!({"events": [created.clone(), event]});
                probe(
                    method.clone(),
                    "/v1/events".into(),
                    json_body(body),
                    Expect::Refused("org_bound_token"),
                )
            }));
            probes
        }
        ("GET", "/v1/orgs/{org_id}/usage") => one(
            format!("/v1/orgs/{ORG_B}/usage?period={period}"),
            None,
            Expect::Refused("org_not_allowed"),
        ),
        ("GET", "/v1/containers/{container_id}") => vec![
            probe(
                Method::GET,
                "/v1/containers/shared".into(),
                None,
                Expect::OrgARowsOnly(container_org),
            ),
            probe(
                Method::GET,
                format!("/v1/containers/shared?org_id={ORG_B}"),
                None,
                Expect::Refused("org_not_allowed"),
            ),
        ],
        ("GET", "/v1/plans") => one("/v1/plans".into(), None, Expect::Served),
        ("PUT", "/v1/plans/{plan_id}") => one(
            "/v1/plans/pro".into(),
            json_body(crate::plans::pro_plan()),
            Expect::Refused("org_bound_token"),
        ),
        ("POST", "/v1/admission/check") => one(
            "/v1/admission/check".into(),
            json_body(json!({"org_id": ORG_B, "action": "create"})),
            Expect::Refused("org_not_allowed"),
        ),
        ("POST", "/v1/admission/reservations") => one(
            "/v1/admission/reservations".into(),
            json_body(json!({"org_id": ORG_B, "action": "create"})),
            Expect::Refused("org_not_allowed"),
        ),
        ("DELETE", "/v1/admission/reservations/{reservation_id}") => one(
            format!("/v1/admission/reservations/{}", fixture.reservation_b),
            None,
            Expect::Refused("org_not_allowed"),
        ),
        ("GET", "/v1/events") => vec![
            probe(
                Method::GET,
                "/v1/events".into(),
                None,
                Expect::OrgARowsOnly(event_orgs),
            ),
            probe(
                Method::GET,
                format!("/v1/events?org_id={ORG_B}"),
                None,
                Expect::Refused("org_not_allowed"),
            ),
        ],
        ("GET", "/v1/containers/{container_id}/events") => vec![
            probe(
                Method::GET,
                "/v1/containers/shared/events".into(),
                None,
                Expect::OrgARowsOnly(event_orgs),
            ),
            probe(
                Method::GET,
                format!("/v1/containers/shared/events?org_id={ORG_B}"),
                None,
                Expect::Refused("org_not_allowed"),
            ),
        ],
        ("GET", "/v1/ledger/verify") => vec![
            probe(
                Method::GET,
                "/v1/ledger/verify".into(),
                None,
                Expect::Refused("org_bound_token"),
            ),
            probe(
                Method::GET,
                "/v1/ledger/verify?full=true".into(),
                None,
                Expect::Refused("org_bound_token"),
            ),
        ],
        ("POST", "/v1/tokens") => one(
            "/v1/tokens".into(),
            json_body(json!({"scopes": ["finance"], "org_id": ORG_B})),
            Expect::Refused("org_bound_token"),
        ),
        ("DELETE", "/v1/tokens/{token_id}") => one(
            format!("/v1/tokens/{}", fixture.some_token_id),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("POST", "/v1/provider-reports") => one(
            "/v1/provider-reports".into(),
            Some((
                "text/csv",
                format!("{}\n", fixture.report_csv.trim_end()).into_bytes(),
            )),
            Expect::Refused("org_bound_token"),
        ),
        ("POST", "/v1/reconciliations") => one(
            "/v1/reconciliations".into(),
            json_body(json!({"report_id": Uuid::new_v4()})),
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/exports/usage.csv") => vec![
            probe(
                Method::GET,
                format!("/v1/exports/usage.csv?period={period}"),
                None,
                Expect::OrgARowsOnly(csv_orgs),
            ),
            probe(
                Method::GET,
                format!("/v1/exports/usage.csv?period={period}&format=json"),
                None,
                Expect::OrgARowsOnly(|body| {
                    let export: Value = serde_json::from_str(body).unwrap();
                    export["rows"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|row| row["org_id"].as_str().unwrap().to_owned())
                        .collect()
                }),
            ),
        ],
        ("POST", "/v1/periods/{period}/close") => one(
            format!("/v1/periods/{previous}/close"),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/periods/{period}/close") => one(
            format!("/v1/periods/{previous}/close"),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/periods/{period}") => one(
            format!("/v1/periods/{previous}"),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/reconciliations/{reconciliation_id}/lines.csv") => vec![
            probe(
                Method::GET,
                format!("/v1/reconciliations/{}/lines.csv", fixture.reconciliation),
                None,
                Expect::OrgARowsOnly(csv_orgs),
            ),
            probe(
                Method::GET,
                format!(
                    "/v1/reconciliations/{}/lines.csv?format=json",
                    fixture.reconciliation
                ),
                None,
                Expect::OrgARowsOnly(|body| {
                    let export: Value = serde_json::from_str(body).unwrap();
                    export["lines"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|line| line["org_id"].as_str().unwrap_or("").to_owned())
                        .collect()
                }),
            ),
        ],
        ("GET", "/v1/reconciliations/{reconciliation_id}/lines") => vec![
            probe(
                Method::GET,
                format!(
                    "/v1/reconciliations/{}/lines?sort=abs_cost_delta",
                    fixture.reconciliation
                ),
                None,
                Expect::OrgARowsOnly(|body| {
                    let page: Value = serde_json::from_str(body).unwrap();
                    let lines = page["lines"].as_array().unwrap();
                    assert_eq!(page["total"], lines.len(), "the total counts its org only");
                    lines
                        .iter()
                        .map(|line| line["org_id"].as_str().unwrap_or("").to_owned())
                        .collect()
                }),
            ),
            probe(
                Method::GET,
                format!(
                    "/v1/reconciliations/{}/lines?org_id={ORG_B}",
                    fixture.reconciliation
                ),
                None,
                Expect::Refused("org_not_allowed"),
            ),
        ],
        ("GET", "/v1/reconciliations/{reconciliation_id}") => one(
            format!("/v1/reconciliations/{}", fixture.reconciliation),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/reconciliations") => one(
            "/v1/reconciliations".into(),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/provider-reports") => one(
            "/v1/provider-reports".into(),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/periods") => one(
            "/v1/periods".into(),
            None,
            Expect::Refused("org_bound_token"),
        ),
        ("POST", "/v1/corrections/voids") => one(
            "/v1/corrections/voids".into(),
            json_body(json!({"event_id": Uuid::new_v4(), "reason": "test"})),
            Expect::Refused("org_bound_token"),
        ),
        ("POST", "/v1/corrections/events") => one(
            "/v1/corrections/events".into(),
            json_body(json!({"events": [], "reason": "test"})),
            Expect::Refused("org_bound_token"),
        ),
        ("GET", "/v1/whoami") => one("/v1/whoami".into(), None, Expect::Served),
        ("GET", "/v1/orgs/{org_id}") => one(
            format!("/v1/orgs/{ORG_B}"),
            None,
            Expect::Refused("org_not_allowed"),
        ),
        ("GET", "/v1/orgs/{org_id}/containers") => one(
            format!("/v1/orgs/{ORG_B}/containers?state=running"),
            None,
            Expect::Refused("org_not_allowed"),
        ),
        ("GET", "/v1/status") => one(
            "/v1/status".into(),
            None,
            Expect::Refused("org_bound_token"),
        ),
        (method, path) => panic!(
            "{method} {path} has no org-binding case: give it an org rule in ROUTES and a case here"
        ),
    }
}

/// org_a and org_b each with containers running this period (one container id used by
/// both), a reservation of org_b, a provider report with lines of both, reconciled.
async fn fixture(app: &TestApp) -> Fixture {
    let period = Period::containing(app.now());
    ready_org(app, ORG_B).await;
    let (status, reservation) = app
        .reserve(&json!({"org_id": ORG_B, "action": "create", "container_id": "cb_later"}))
        .await;
    assert_eq!(status, 201, "{reservation}");
    let reservation_b = reservation["reservation_id"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();

    let created = |org: &str, container: &str| {
        json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org,
               "container_id": container, "occurred_at": app.ago(1800)})
    };
    let events = vec![
        created(ORG_A, "ca1"),
        created(ORG_A, "shared"),
        created(ORG_B, "cb1"),
        created(ORG_B, "shared"),
    ];
    let (status, response) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200, "{response}");
    projected_to_head(&app.pool, "the fixture is projected").await;

    let (start, end) = (app.ago(1800), app.ago(600));
    let line = |container: &str, org: &str| {
        format!(
            r#"{start},{end},{container},1200,Seconds,0.10,USD,"{{""org_id"":""{org}""}}",Usage"#
        )
    };
    let report_csv = [
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory".to_owned(),
        line("ca1", ORG_A),
        line("cb1", ORG_B),
        line("shared", ORG_B),
    ]
    .join("\n");
    let (status, report) = app.post_report(report_csv.clone()).await;
    assert_eq!(status, 201, "{report}");
    let (status, reconciliation) = app
        .post_reconciliation(&json!({"report_id": report["report_id"]}))
        .await;
    assert_eq!(status, 201, "{reconciliation}");

    let (status, token) = app.post_token(&json!({"scopes": ["audit"]})).await;
    assert_eq!(status, 201, "{token}");
    Fixture {
        period,
        minute_ago: app.ago(60),
        reservation_b,
        reconciliation: reconciliation["reconciliation_id"]
            .as_str()
            .unwrap()
            .to_owned(),
        report_csv,
        some_token_id: token["id"].as_str().unwrap().to_owned(),
    }
}

/// The ledger, the stored tokens, reports, reconciliations, periods and reservations, as
/// counts: a refused request must change none of them.
async fn stored(app: &TestApp) -> Vec<i64> {
    let mut counts = Vec::new();
    for query in [
        "SELECT count(*) FROM ledger",
        "SELECT count(*) FROM api_token WHERE revoked_at IS NULL",
        "SELECT count(*) FROM provider_report",
        "SELECT count(*) FROM reconciliation",
        "SELECT count(*) FROM period_close",
        "SELECT count(*) FROM admission_reservation WHERE released_at IS NULL",
    ] {
        counts.push(
            sqlx::query_scalar(query)
                .fetch_one(&app.pool)
                .await
                .unwrap(),
        );
    }
    counts
}

#[tokio::test]
async fn a_token_bound_to_one_org_gets_403_or_only_its_orgs_rows_on_every_route() {
    // Mid-period, so that the fixture's last half hour is all this period's.
    let app = TestApp::spawn_mid_period().await;
    let fixture = fixture(&app).await;

    // Every /v1 path the OpenAPI document shows is in the table, and the other way round:
    // a new route without an org rule fails here.
    let (status, document) = app.get_json("/openapi.json").await;
    assert_eq!(status, 200);
    let documented: BTreeSet<(String, String)> = document["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(path, _)| path.starts_with("/v1/"))
        .flat_map(|(path, operations)| {
            operations
                .as_object()
                .unwrap()
                .keys()
                .map(|method| (method.to_uppercase(), path.clone()))
                .collect::<Vec<_>>()
        })
        .collect();
    let listed: BTreeSet<(String, String)> = ROUTES
        .iter()
        .map(|rule| (rule.method.to_owned(), rule.path.to_owned()))
        .collect();
    assert_eq!(
        documented, listed,
        "the OpenAPI document's /v1 routes and the route table differ"
    );

    let every_scope = bound_token_with_every_scope(&app, ORG_A).await;
    let mut failures = Vec::new();
    for rule in ROUTES {
        // The token as an operator would make it: only the route's scope (an admin token
        // cannot be bound), and the one that has every scope.
        let mut tokens = vec![("every scope", every_scope.clone())];
        // A route any token may use (`scope` None) is probed with the first alone.
        if let Some(scope) = rule
            .scope
            .filter(|scope| *scope != tally::http::auth::Scope::Admin)
        {
            let scope = scope.as_str();
            tokens.push((
                scope,
                create_token(&app, json!({"scopes": [scope], "org_id": ORG_A})).await,
            ));
        }
        for probe in probes(rule, &fixture) {
            for (which, token) in &tokens {
                let what = format!(
                    "{} {} ({:?}) with org_a's {which} token",
                    probe.method, probe.path, rule.org
                );
                let before = stored(&app).await;
                let api = app.with_token(token);
                let reply = match probe.body.clone() {
                    Some((content_type, bytes)) => {
                        let method = probe.method.clone();
                        api.send_bytes(method, &probe.path, content_type, bytes)
                            .await
                    }
                    None => api.send(probe.method.clone(), &probe.path, None).await,
                };
                let (status, body) = (reply.status, reply.text);
                let failure = match &probe.expect {
                    Expect::Refused(code) => {
                        let error: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                        let after = stored(&app).await;
                        if status != 403 || error["error"]["code"] != *code {
                            Some(format!("expected 403 {code}, got {status}: {body}"))
                        } else if after != before {
                            Some(format!("a refused request changed {before:?} to {after:?}"))
                        } else {
                            None
                        }
                    }
                    Expect::OrgARowsOnly(orgs_of) => {
                        let orgs = if status == 200 {
                            orgs_of(&body)
                        } else {
                            Vec::new()
                        };
                        if status != 200 || orgs.is_empty() {
                            Some(format!(
                                "expected 200 with org_a's rows, got {status}: {body}"
                            ))
                        } else if orgs.iter().any(|org| org != ORG_A) {
                            Some(format!("rows of other orgs are served: {orgs:?}"))
                        } else {
                            None
                        }
                    }
                    Expect::Served => {
                        (rule.org != OrgRule::NoOrgData || status != 200 || body.contains(ORG_B))
                            .then(|| format!("expected 200 without org_b, got {status}: {body}"))
                    }
                };
                failures.extend(failure.map(|failure| format!("{what}: {failure}")));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} requests broke the org binding:\n{}",
        failures.len(),
        failures.join("\n")
    );
    // The same requests with an unbound token see org_b: the fixture is not empty of it.
    let (status, lines) = app.get_lines(&fixture.reconciliation.to_string()).await;
    assert_eq!(status, 200);
    assert!(csv_orgs(&lines).contains(&ORG_B.to_owned()), "{lines}");
    let (status, usage) = app
        .get_usage_export(&format!("period={}", fixture.period))
        .await;
    assert_eq!(status, 200);
    assert!(csv_orgs(&usage).contains(&ORG_B.to_owned()), "{usage}");
    app.stop().await;
}

#[tokio::test]
async fn a_bound_token_cannot_take_another_orgs_cloudevent_id_with_a_native_event() {
    let app = TestApp::spawn().await;
    let bound = app.with_token(
        &create_token(&app, json!({"scopes": ["events:write"], "org_id": ORG_A})).await,
    );
    // The id org_b's provider will give its CloudEvent: anyone can compute it.
    let (source, id) = ("/providers/acme", "ctr_b-stopped");
    let taken = tally::event::cloudevent::cloudevent_ledger_id(ORG_B, source, id);
    let created = |id: String| {
        json!({"id": id, "type": "container.created", "org_id": ORG_A, "container_id": "ca_1",
               "occurred_at": Utc::now().to_rfc3339()})
    };
    let (status, body) = bound.post_events(&created(taken.to_string())).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("org_bound_token")),
        "{body}"
    );
    // Any name-based id, not only one a CloudEvent has: the token cannot tell them apart.
    let own_v5 = Uuid::new_v5(&Uuid::NAMESPACE_URL, b"https://example.com/a");
    let (status, body) = bound.post_events(&created(own_v5.to_string())).await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(app.ledger_count().await, 0);

    // Random ids and the bound org's own CloudEvents are stored as before.
    let (status, body) = bound
        .post_events(&created(Uuid::new_v4().to_string()))
        .await;
    assert_eq!(status, 200, "{body}");
    let cloudevent = |org: &str| {
        json!({"specversion": "1.0", "id": id, "source": source, "type": "container.stopped",
               "time": Utc::now().to_rfc3339(), "subject": format!("{org}-c"), "orgid": org})
    };
    let (status, body) = bound
        .post_raw(
            "application/cloudevents+json",
            cloudevent(ORG_A).to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    // org_b's CloudEvent takes its id, and an unbound producer may still use name-based
    // ids for native events.
    let (status, body) = app
        .post_raw(
            "application/cloudevents+json",
            cloudevent(ORG_B).to_string().into_bytes(),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["results"][0]["id"], json!(taken.to_string()));
    let (status, body) = app.post_events(&created(own_v5.to_string())).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(app.ledger_count().await, 4);
    app.stop().await;
}

#[tokio::test]
async fn the_bearer_scheme_is_accepted_in_any_case() {
    let app = TestApp::spawn().await;
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"] {
        let response = app
            .client
            .get(app.url("/v1/plans"))
            .header("authorization", format!("{scheme} {TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), 200, "{scheme}");
    }
    let response = app
        .client
        .get(app.url("/v1/plans"))
        .header("authorization", format!("Basic {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 401, "another scheme");
    app.stop().await;
}

#[tokio::test]
async fn one_token_past_its_limit_gets_429_while_another_tokens_requests_succeed() {
    const LIMIT: usize = 8;
    let app = TestApp::spawn_with(|config| config.token_concurrency_max = LIMIT).await;
    let greedy = create_token(&app, json!({"scopes": ["events:write", "usage:read"]})).await;
    let other = create_token(&app, json!({"scopes": ["events:write", "usage:read"]})).await;

    // Twice the limit of slow requests from one token, all at once.
    let mut slow = Vec::new();
    for _ in 0..2 * LIMIT {
        slow.push(slow_request(&app, &greedy, "/v1/events", "application/json", "{\"id\":").await);
    }
    eventually(10, "the requests past the limit are answered", || async {
        slow.iter().filter(|task| task.is_finished()).count() >= LIMIT
    })
    .await;

    // Meanwhile the other token's requests, as many as its limit, all succeed.
    let theirs = futures::future::join_all((0..LIMIT).map(|n| {
        let event = crate::helpers::valid_event(ORG_A, &format!("c{n}"), n);
        let api = app.with_token(&other);
        async move { api.post_events(&event).await }
    }))
    .await;
    for (status, body) in &theirs {
        assert_eq!(*status, 200, "the other token is served: {body}");
    }

    let mut refused = 0;
    let mut held = Vec::new();
    for task in slow {
        if task.is_finished() {
            let (status, text) = task.await.unwrap().expect("an answer");
            assert_eq!(status, 429, "{text}");
            assert!(text.contains("\"too_many_requests\""), "{text}");
            assert!(text.to_lowercase().contains("retry-after:"), "{text}");
            refused += 1;
        } else {
            held.push(task);
        }
    }
    assert_eq!(
        refused, LIMIT,
        "exactly the requests past the limit are refused"
    );

    // When the slow requests end, the token is served again.
    for task in held {
        task.abort();
    }
    eventually(10, "the greedy token is served again", || async {
        app.with_token(&greedy).get_plans().await.0 == 200
    })
    .await;
    app.stop().await;
}

/// Verify passes waiting on the checkpoint row's lock.
async fn verifies_waiting(app: &TestApp) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
           AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO verify_checkpoint%'",
    )
    .fetch_one(&app.pool)
    .await
    .unwrap()
}

/// A ledger with a few events and a verified checkpoint, and a transaction that holds the
/// checkpoint's row: a verify pass walks the ledger, then waits on it to save its
/// checkpoint, holding its place until the transaction ends.
async fn verify_held(app: &TestApp) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let events: Vec<Value> = crate::helpers::valid_events(5);
    let (status, response) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200, "{response}");
    let (status, report) = app.verify("").await;
    assert_eq!(status, 200, "{report}");
    let mut holder = app.pool.begin().await.unwrap();
    sqlx::query("SELECT position FROM verify_checkpoint FOR UPDATE")
        .fetch_one(&mut *holder)
        .await
        .unwrap();
    holder
}

fn spawn_full_verify(
    app: &TestApp,
    token: &str,
) -> tokio::task::JoinHandle<(u16, Option<String>, String)> {
    let api = app.with_token(token);
    tokio::spawn(async move {
        let reply = api.get("/v1/ledger/verify?full=true").await;
        let retry_after = reply.header("retry-after");
        (reply.status, retry_after, reply.text)
    })
}

fn assert_one_answered_the_rest_refused(answers: &[(u16, Option<String>, String)]) {
    let passed = answers.iter().filter(|(status, _, _)| *status == 200);
    assert_eq!(passed.count(), 1, "one pass runs: {answers:?}");
    for (status, retry_after, body) in answers.iter().filter(|(status, _, _)| *status != 200) {
        assert_eq!(*status, 503, "{body}");
        let error: Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["code"], "verify_in_progress", "{body}");
        assert!(retry_after.is_some(), "with Retry-After: {body}");
    }
}

#[tokio::test]
async fn of_two_full_verifies_at_once_one_is_answered_and_the_other_refused_with_retry_after() {
    let app = TestApp::spawn().await;
    let audit = create_token(&app, json!({"scopes": ["audit"]})).await;
    let holder = verify_held(&app).await;
    let first = spawn_full_verify(&app, &audit);
    eventually(10, "the first pass waits on the checkpoint", || async {
        verifies_waiting(&app).await == 1
    })
    .await;
    let second = spawn_full_verify(&app, &audit);
    eventually(10, "the second is answered or waits too", || async {
        second.is_finished() || verifies_waiting(&app).await == 2
    })
    .await;
    holder.rollback().await.unwrap();
    let answers = [first.await.unwrap(), second.await.unwrap()];
    assert_one_answered_the_rest_refused(&answers);
    app.stop().await;
}

#[tokio::test]
async fn reads_and_writes_succeed_while_twenty_full_verifies_are_asked_at_once() {
    const VERIFIES: usize = 20;
    let app = TestApp::spawn().await;
    let audit = create_token(&app, json!({"scopes": ["audit"]})).await;
    let writer = create_token(&app, json!({"scopes": ["events:write", "usage:read"]})).await;
    let holder = verify_held(&app).await;
    let verifies: Vec<_> = (0..VERIFIES)
        .map(|_| spawn_full_verify(&app, &audit))
        .collect();
    // Every verify has been answered or is inside its pass (holding what a pass holds).
    eventually(30, "every verify is answered or running", || async {
        let answered = verifies.iter().filter(|task| task.is_finished()).count() as i64;
        answered + verifies_waiting(&app).await == VERIFIES as i64
    })
    .await;

    let event = crate::helpers::valid_event(ORG_A, "c1", 0);
    let (status, body) = app.with_token(&writer).post_events(&event).await;
    assert_eq!(status, 200, "a write during the verifies: {body}");
    let period = Period::containing(Utc::now());
    let (status, body) = app
        .with_token(&writer)
        .get_usage(ORG_A, &format!("period={period}"))
        .await;
    assert_eq!(status, 200, "a read during the verifies: {body}");

    holder.rollback().await.unwrap();
    let mut answers = Vec::new();
    for verify in verifies {
        answers.push(verify.await.unwrap());
    }
    assert_one_answered_the_rest_refused(&answers);
    app.stop().await;
}
