//! Plans: definitions are ledger events with decimal-string money; an org can
//! only move to a plan that exists.

use reqwest::Method;
use serde_json::{json, Value};

use crate::helpers::{ago, TestApp};

pub fn pro_plan() -> Value {
    json!({
        "sandbox_runtime": true, "included_runtime_seconds": 3600, "overage": "deny",
        "overage_price_per_hour": "0.125", "currency": "USD",
        "max_running_containers": 1, "max_published_ports": 2,
    })
}

async fn plans(app: &TestApp) -> Value {
    app.get_plans().await.1
}

#[tokio::test]
async fn a_plan_is_defined_versioned_and_listed_with_its_price_as_a_decimal_string() {
    let app = TestApp::spawn().await;
    let listed = plans(&app).await;
    assert_eq!(listed["plans"].as_array().unwrap().len(), 1);
    assert_eq!(listed["plans"][0]["id"], "free");
    assert_eq!(listed["plans"][0]["sandbox_runtime"], false);
    assert_eq!(listed["plans"][0]["version"], 0);

    let (status, created) = app.put_plan("pro", &pro_plan()).await;
    assert_eq!(status, 201, "{created}");
    assert_eq!(created["version"], 1);
    assert_eq!(created["overage_price_per_hour"], "0.125");
    let (status, same) = app.put_plan("pro", &pro_plan()).await;
    assert_eq!(status, 200, "the same definition is not a new version");
    assert_eq!(same["version"], 1);
    let mut cheaper = pro_plan();
    cheaper["overage_price_per_hour"] = json!("0.1");
    let (status, changed) = app.put_plan("pro", &cheaper).await;
    assert_eq!(status, 201);
    assert_eq!(changed["version"], 2);

    let listed = plans(&app).await;
    let ids: Vec<&str> = listed["plans"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["free", "pro"]);
    assert_eq!(listed["plans"][1]["overage_price_per_hour"], "0.1");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM ledger WHERE type = 'plan.defined'")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(stored, 2, "every version is a ledger event");
    app.stop().await;
}

#[tokio::test]
async fn bad_plans_and_references_to_unknown_plans_are_refused_and_store_nothing() {
    let app = TestApp::spawn().await;
    let with = |field: &str, value: Value| {
        let mut body = pro_plan();
        body[field] = value;
        body
    };
    let cases = [
        (
            "pro",
            with("overage_price_per_hour", json!(0.125)),
            "price_not_a_string",
        ),
        (
            "pro",
            with("overage_price_per_hour", json!("-1")),
            "invalid_price",
        ),
        (
            "pro",
            with("overage_price_per_hour", json!("0.1234567")),
            "invalid_price",
        ),
        (
            "pro",
            with("included_runtime_seconds", json!(-1)),
            "invalid_allowance",
        ),
        (
            "pro",
            with("currency", json!("dollars")),
            "invalid_currency",
        ),
        // Three capitals, but no currency anyone bills in.
        ("pro", with("currency", json!("ABC")), "invalid_currency"),
        ("pro", with("currency", json!("XAU")), "invalid_currency"),
        (
            "pro",
            with("overage", json!("sometimes")),
            "invalid_overage",
        ),
        (
            "pro",
            with("max_running_containers", json!(-3)),
            "invalid_limit",
        ),
        ("pro", with("discount", json!("10%")), "unknown_field"),
    ];
    for (id, body, code) in cases {
        let (status, error) = app.put_plan(id, &body).await;
        assert_eq!(status, 422, "{body}: {error}");
        assert_eq!(error["error"]["code"], "invalid_plan");
        assert_eq!(error["error"]["details"][0]["code"], code, "{body}");
    }
    let (status, error) = app.put_plan("bad.id", &pro_plan()).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (422, Some("invalid_plan_id"))
    );
    let response = app
        .request(Method::PUT, "/v1/plans/pro")
        .header("content-type", "application/json")
        .body("{\"sandbox_runtime\": tru")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);

    let (status, error) = app
        .post_events(
            &json!({"id": uuid::Uuid::new_v4(), "type": "org.plan_changed", "org_id": "acme",
                           "occurred_at": ago(60), "data": {"plan": "enterprise"}}),
        )
        .await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["code"], "unknown_plan");
    assert_eq!(error["error"]["details"][0]["index"], 0);
    let (status, error) = app
        .post_events(
            &json!({"id": uuid::Uuid::new_v4(), "type": "plan.defined", "org_id": "acme",
                           "occurred_at": ago(60), "data": pro_plan()}),
        )
        .await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["details"][0]["code"], "reserved_type");
    assert_eq!(app.ledger_count().await, 0, "nothing was stored");

    let (status, _) = app
        .post_events(
            &json!({"id": uuid::Uuid::new_v4(), "type": "org.plan_changed", "org_id": "acme",
                           "occurred_at": ago(60), "data": {"plan": "free"}}),
        )
        .await;
    assert_eq!(status, 200, "free always exists");
    app.stop().await;
}

fn priced(currency: &str, price: &str) -> Value {
    let mut plan = pro_plan();
    plan["currency"] = json!(currency);
    plan["overage_price_per_hour"] = json!(price);
    plan
}

async fn plan_versions_stored(app: &TestApp) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM ledger WHERE type = 'plan.defined'")
        .fetch_one(&app.pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn plans_that_price_overage_share_one_currency_and_one_in_another_is_refused() {
    let app = TestApp::spawn().await;
    assert_eq!(app.put_plan("pro", &priced("USD", "0.12")).await.0, 201);
    for (id, body) in [
        ("team", priced("EUR", "0.10")),
        // A new version of a plan is held to the same rule.
        ("pro", priced("JPY", "1")),
    ] {
        let (status, error) = app.put_plan(id, &body).await;
        assert_eq!(status, 422, "{body}: {error}");
        assert_eq!(error["error"]["code"], "invalid_plan");
        assert_eq!(error["error"]["details"][0]["code"], "currency_mismatch");
    }
    // A plan that prices nothing has no amount to mix, whatever its currency.
    assert_eq!(app.put_plan("basic", &priced("EUR", "0")).await.0, 201);
    assert_eq!(app.put_plan("team", &priced("USD", "0.10")).await.0, 201);
    assert_eq!(plan_versions_stored(&app).await, 3);
    app.stop().await;
}

#[tokio::test]
async fn of_plans_in_two_currencies_defined_at_once_only_those_in_one_are_stored() {
    let app = TestApp::spawn().await;
    let puts = (0..12).map(|n| {
        let currency = if n % 2 == 0 { "EUR" } else { "USD" };
        let app = &app;
        async move {
            // Twelve turns may outlast the read wait on a loaded machine: 503 is "retry".
            loop {
                let (status, body) = app.put_plan(&format!("p{n}"), &priced(currency, "1")).await;
                if status != 503 {
                    return (status, currency, body);
                }
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    });
    let answers = futures::future::join_all(puts).await;
    let stored: Vec<&str> = answers
        .iter()
        .filter(|(status, _, _)| *status == 201)
        .map(|(_, currency, _)| *currency)
        .collect();
    assert_eq!(stored.len(), 6, "{answers:?}");
    assert!(
        stored.iter().all(|currency| *currency == stored[0]),
        "{stored:?}"
    );
    for (status, _, body) in answers.iter().filter(|(status, _, _)| *status != 201) {
        assert_eq!(*status, 422, "{body}");
        assert_eq!(body["error"]["details"][0]["code"], "currency_mismatch");
    }
    let currencies: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT data->>'currency' FROM ledger WHERE type = 'plan.defined'",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(currencies, [stored[0]]);
    app.stop().await;
}

#[tokio::test]
async fn overage_is_labelled_with_the_currency_it_was_priced_in_when_the_org_ends_on_free() {
    let app = TestApp::spawn().await;
    let mut team = priced("EUR", "1.00");
    team["included_runtime_seconds"] = json!(0);
    team["overage"] = json!("bill");
    assert_eq!(app.put_plan("team", &team).await.0, 201);
    let event = |event_type: &str, seconds_ago: i64, data: Value| {
        let mut event = json!({"id": uuid::Uuid::new_v4(), "type": event_type, "org_id": "eu",
                               "occurred_at": app.ago(seconds_ago)});
        if data.is_null() {
            event["container_id"] = json!("c1");
        } else {
            event["data"] = data;
        }
        event
    };
    let events = [
        event("org.plan_changed", 7200, json!({"plan": "team"})),
        event("container.created", 7200, Value::Null),
        event("container.stopped", 3600, Value::Null),
        // On `free` (USD, nothing priced) at the end of the window.
        event("org.plan_changed", 1800, json!({"plan": "free"})),
    ];
    let (status, body) = app.post_events(&json!({ "events": events })).await;
    assert_eq!(status, 200, "{body}");
    let period = app.now().format("%Y-%m").to_string();
    let (status, usage) = app.get_usage("eu", &format!("period={period}")).await;
    assert_eq!(status, 200, "{usage}");
    assert_eq!(usage["plan"], "free");
    assert_eq!(
        (&usage["overage_amount"], &usage["currency"]),
        (&json!("1.00"), &json!("EUR")),
        "{usage}"
    );
    app.stop().await;
}
