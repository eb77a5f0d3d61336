//! Audit queries: pages of the ledger in position order with a cursor.

use std::collections::BTreeSet;

use serde_json::{json, Value};

use crate::helpers::{valid_event, TestApp};

/// Follows `next_after` from the start; returns every page's events in order.
async fn page_through(app: &TestApp, query: &str, limit: usize) -> Vec<Value> {
    let mut after = 0;
    let mut events = Vec::new();
    loop {
        let (status, page) = app
            .get_events(&format!("{query}&after={after}&limit={limit}"))
            .await;
        assert_eq!(status, 200, "{page}");
        let batch = page["events"].as_array().unwrap().clone();
        assert!(batch.len() <= limit);
        if batch.is_empty() {
            assert_eq!(page["next_after"], after, "an empty page keeps the cursor");
            return events;
        }
        after = page["next_after"].as_i64().unwrap();
        assert_eq!(batch.last().unwrap()["position"], after);
        events.extend(batch);
    }
}

#[tokio::test]
async fn paging_through_an_orgs_history_returns_every_event_exactly_once_in_order() {
    let app = TestApp::spawn().await;
    let events: Vec<Value> = (0..450)
        .map(|n| {
            valid_event(
                if n % 3 == 0 { "org_a" } else { "org_b" },
                &format!("c{}", n % 7),
                n,
            )
        })
        .collect();
    for chunk in events.chunks(100) {
        let (status, response) = app.post_events(&json!({"events": chunk})).await;
        assert_eq!(status, 200, "{response}");
    }
    let sent: BTreeSet<String> = events
        .iter()
        .filter(|event| event["org_id"] == "org_a")
        .map(|event| event["id"].as_str().unwrap().to_owned())
        .collect();
    let paged = page_through(&app, "org_id=org_a", 7).await;
    let positions: Vec<i64> = paged
        .iter()
        .map(|event| event["position"].as_i64().unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|pair| pair[0] < pair[1]),
        "strictly in position order"
    );
    let ids: Vec<String> = paged
        .iter()
        .map(|event| event["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids.len(), sent.len(), "no event twice");
    assert_eq!(
        ids.into_iter().collect::<BTreeSet<_>>(),
        sent,
        "every event of the org, no other"
    );
    let first = &paged[0];
    for field in [
        "position",
        "id",
        "type",
        "org_id",
        "container_id",
        "occurred_at",
        "recorded_at",
        "data",
        "hash",
    ] {
        assert!(first.get(field).is_some(), "{field} in {first}");
    }

    let stops = page_through(&app, "org_id=org_b&type=container.stopped", 1000).await;
    let expected = events
        .iter()
        .filter(|event| event["org_id"] == "org_b" && event["type"] == "container.stopped")
        .count();
    assert_eq!(stops.len(), expected);
    let (status, page) = app.get_container_events("c3", "limit=1000").await;
    assert_eq!(status, 200);
    let in_container = events
        .iter()
        .filter(|event| event["container_id"] == "c3")
        .count();
    assert_eq!(page["events"].as_array().unwrap().len(), in_container);
    assert!(page["events"]
        .as_array()
        .unwrap()
        .iter()
        .all(|event| event["container_id"] == "c3"));

    // The CLI prints the same history as a timeline.
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["audit", "--org", "org_a", "--limit", "1000"])
        .env("DATABASE_URL", &app.db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(output.status.success());
    let printed = String::from_utf8(output.stdout).unwrap();
    assert_eq!(
        printed.lines().count(),
        1 + sent.len(),
        "a header and one line per event"
    );
    app.stop().await;
}

#[tokio::test]
async fn bad_audit_parameters_are_refused_with_422() {
    let app = TestApp::spawn().await;
    for (query, code) in [
        ("/v1/events?limit=0", "invalid_limit"),
        ("/v1/events?limit=1001", "invalid_limit"),
        ("/v1/events?limit=ten", "invalid_limit"),
        ("/v1/events?after=-1", "invalid_after"),
        ("/v1/events?after=%2B1", "invalid_after"),
        ("/v1/events?limit=%2B5", "invalid_limit"),
        ("/v1/events?limit=%205", "invalid_limit"),
        ("/v1/events?type=container.deleted", "invalid_type"),
        ("/v1/events?org_id=a.b", "invalid_org_id"),
        ("/v1/events?color=red", "unknown_parameter"),
        (
            "/v1/containers/c1/events?container_id=c2",
            "unknown_parameter",
        ),
        ("/v1/containers/c1/events?color=red", "unknown_parameter"),
        ("/v1/ledger/verify?color=red", "unknown_parameter"),
        ("/v1/ledger/verify?full=yes", "invalid_full"),
        (
            "/v1/reconciliations/00000000-0000-4000-8000-000000000000/lines.csv?color=red",
            "unknown_parameter",
        ),
        (
            "/v1/reconciliations/00000000-0000-4000-8000-000000000000/lines.csv?format=xml",
            "invalid_format",
        ),
    ] {
        let (status, error) = app.get_json(query).await;
        assert_eq!(status, 422, "{query}: {error}");
        assert_eq!(error["error"]["code"], code, "{query}");
    }
    app.stop().await;
}

#[tokio::test]
async fn a_lowered_page_limit_caps_both_the_default_and_the_largest_page() {
    let app = TestApp::spawn_with(|config| config.page_events_max = 5).await;
    let events: Vec<Value> = (0..12).map(|n| valid_event("org_a", "c1", n)).collect();
    assert_eq!(app.post_events(&json!({"events": events})).await.0, 200);
    let (status, page) = app.get_events("").await;
    assert_eq!(status, 200);
    assert_eq!(page["events"].as_array().unwrap().len(), 5);
    let (status, error) = app.get_events("limit=6").await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (422, Some("invalid_limit"))
    );
    app.stop().await;
}
