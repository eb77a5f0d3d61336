//! Scale: an org of 10 000 running containers and a reconciliation of 100 000 lines are
//! shown a page at a time. The load times (navigation start to `data-ready`) are printed
//! and appended to target/console-screenshots/load-times.txt; nothing is timed-asserted.

use std::io::Write;
use std::time::Instant;

use serde_json::{json, Value};
use uuid::Uuid;

use crate::browser::{screenshots_dir, Browser};
use crate::finance::reconcile;
use crate::helpers::{ok, projected_to_head, TOKEN};
use crate::month;
use crate::org::signed_in;

const ORG: &str = "org_large";
const CONTAINERS: usize = 10_000;
const LINES: usize = 100_000;
/// The API's largest page: whatever page the console asks for, one page is at most this.
const PAGE_MAX: usize = 1_000;

fn container(n: usize) -> String {
    format!("ctr_{n:05}")
}

/// A FOCUS report of `LINES` lines over the month: one per container (each ran the same
/// hour of the 12th) and the rest resources the ledger never saw.
fn report() -> String {
    let period = month::period();
    let (start, end) = (
        tally::event::canonical::timestamp(period.start()),
        tally::event::canonical::timestamp(period.end()),
    );
    let mut csv = String::with_capacity(LINES * 160);
    csv.push_str("ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory\n");
    for n in 0..LINES {
        let resource = if n < CONTAINERS {
            container(n)
        } else {
            format!("vm_{n:06}")
        };
        // Every seventh line claims a little more than the ledger has.
        let seconds = 3600 + if n % 7 == 0 { 600 } else { 0 };
        let cost = format!("{}.{:02}", seconds / 3600, n % 100);
        csv.push_str(&format!(
            "{start},{end},{resource},{seconds},Seconds,{cost},USD,\"{{\"\"org_id\"\":\"\"{ORG}\"\"}}\",Usage\n"
        ));
    }
    csv
}

fn record(what: &str, ms: f64) {
    let line = format!("{what}: {ms:.0} ms");
    println!("load time: {line}");
    let path = screenshots_dir().join("load-times.txt");
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    writeln!(file, "{} {line}", chrono::Utc::now().to_rfc3339()).unwrap();
}

#[tokio::test]
// Long: one scenario from loading the data to the last page check, read top to bottom.
async fn an_org_of_ten_thousand_containers_and_a_reconciliation_of_a_hundred_thousand_lines_are_shown_a_page_at_a_time(
) {
    let started = Instant::now();
    let app = month::service().await;
    let created_at = month::period().start() + chrono::Duration::days(11);
    // Created on the 11th, each ran for an hour and then was resumed: all running now.
    let events: Vec<Value> = (0..CONTAINERS)
        .flat_map(|n| {
            let id = container(n);
            let at = |hours: i64| {
                tally::event::canonical::timestamp(created_at + chrono::Duration::hours(hours))
            };
            [
                json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": ORG, "container_id": id, "occurred_at": at(0)}),
                json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": ORG, "container_id": id, "occurred_at": at(1)}),
                json!({"id": Uuid::new_v4(), "type": "container.resumed", "org_id": ORG, "container_id": id, "occurred_at": at(24 * 25)}),
            ]
        })
        .collect();
    for batch in events.chunks(1000) {
        ok(app.post_events(&json!({ "events": batch })).await);
    }
    projected_to_head(&app.pool, "ten thousand containers are projected").await;
    let loaded = started.elapsed();
    let result = reconcile(&app, report()).await;
    let id = result["reconciliation_id"].as_str().unwrap().to_owned();
    let reconciled = started.elapsed() - loaded;
    println!("loading {CONTAINERS} containers: {loaded:?}; importing and reconciling {LINES} lines: {reconciled:?}");

    let browser = Browser::open(app.address).await;
    signed_in(&browser, TOKEN).await;
    browser.wait_ready("home").await;

    let org_page = format!("/console/orgs/{ORG}?period={}", month::period_text());
    let ms = browser.load_time(&org_page, "org").await;
    record(&format!("org page, {CONTAINERS} running containers"), ms);
    let running = browser.figure("#page", "running_containers").await;
    assert_eq!(running, CONTAINERS.to_string());
    let first = browser
        .count("#running-containers tr[data-container-id]")
        .await;
    assert!(
        (1..=PAGE_MAX).contains(&first) && first < CONTAINERS,
        "one page of running containers, not all: {first}"
    );
    browser.screenshot("org-large").await;
    browser.click("button#running-more").await;
    let deadline = Instant::now() + crate::browser::READY_WAIT;
    let more = loop {
        let rows = browser
            .count("#running-containers tr[data-container-id]")
            .await;
        if rows > first {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "#running-more showed no more rows"
        );
        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
    };
    let ids = browser
        .attrs(
            "#running-containers tr[data-container-id]",
            "data-container-id",
        )
        .await;
    let expected: Vec<Value> = (0..ids.len()).map(|n| Value::from(container(n))).collect();
    assert_eq!(
        ids, expected,
        "the next page follows on, in container order: {more} rows"
    );

    let ms = browser
        .load_time(&format!("/console/reconciliations/{id}"), "reconciliation")
        .await;
    record(&format!("reconciliation page, {LINES} lines"), ms);
    assert_eq!(
        browser.figure("#page", "lines_total").await,
        LINES.to_string()
    );
    let lines = browser.count("#lines tr[data-status]").await;
    assert!(
        (1..=PAGE_MAX).contains(&lines),
        "one page of lines, not all: {lines}"
    );
    assert_eq!(
        browser
            .figure(
                "#status-counts tr[data-status=\"missing_in_ledger\"]",
                "count"
            )
            .await,
        (LINES - CONTAINERS).to_string()
    );
    browser.screenshot("reconciliation-large").await;
    let before = browser.js("return location.search;", vec![]).await;
    browser.click("#lines-next").await;
    crate::finance::wait_for_new_address(&browser, &before, "reconciliation").await;
    assert!(
        browser.count("#lines tr[data-status]").await >= 1,
        "a second page"
    );
    browser.close().await;
    println!("the large case took {:?}", started.elapsed());
}
