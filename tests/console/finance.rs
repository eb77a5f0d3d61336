//! Finance and operator pages: a reconciliation with one planted line of each status, the
//! periods with a closed one, the audit search's paging and the operator's figures.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use uuid::Uuid;

use crate::browser::Browser;
use crate::helpers::{answered, ok, projected_to_head, TestApp, TOKEN};
use crate::month::{self, ALPHA, BETA, GAMMA, ORG, OTHER_ORG};
use crate::org::{raw, signed_in};

/// A FOCUS report over the whole month: alpha as the ledger has it (12 h), beta 3 h over,
/// gamma 12.5 h under, a resource the ledger never saw, and a credit; the other org's
/// container is not in it at all.
fn report() -> String {
    let period = month::period();
    let (start, end) = (
        tally::event::canonical::timestamp(period.start()),
        tally::event::canonical::timestamp(period.end()),
    );
    let line = |resource: &str, quantity: &str, unit: &str, cost: &str, category: &str| {
        format!(
            r#"{start},{end},{resource},{quantity},{unit},{cost},USD,"{{""org_id"":""{ORG}""}}",{category}"#
        )
    };
    [
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory".to_owned(),
        line(ALPHA, "43200", "Seconds", "5.40", "Usage"),
        line(BETA, "126000", "Seconds", "7.00", "Usage"),
        line(GAMMA, "200000", "Seconds", "20.00", "Usage"),
        line("ctr_ghost", "100", "Seconds", "0.01", "Usage"),
        line("credit_1", "1", "Seconds", "-2.50", "Credit"),
    ]
    .join("\n")
}

/// The planted statuses: (status, container or resource).
const PLANTED: [(&str, &str); 6] = [
    ("matched", ALPHA),
    ("provider_over", BETA),
    ("provider_under", GAMMA),
    ("missing_in_ledger", "ctr_ghost"),
    ("not_runtime", "credit_1"),
    ("missing_in_provider", "ctr_other"),
];

/// Imports `csv` and reconciles it through the API; returns the reconciliation.
pub async fn reconcile(app: &TestApp, csv: String) -> Value {
    let report = answered(201, app.post_report(csv).await);
    answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    )
}

/// Polls (bounded) until the page's address has `needle` in its query and the page is
/// ready again: a sort or a page change is a navigation of the app's own.
pub async fn wait_for_query(browser: &Browser, needle: &str, page: &str) {
    let deadline = Instant::now() + crate::browser::READY_WAIT;
    loop {
        let search = browser.js("return location.search;", vec![]).await;
        if search.as_str().unwrap_or("").contains(needle) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the address never had {needle}: {search}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    browser.wait_ready(page).await;
}

/// Polls (bounded) until the page's address is no longer `before` and the page is ready.
pub async fn wait_for_new_address(browser: &Browser, before: &Value, page: &str) {
    let deadline = Instant::now() + crate::browser::READY_WAIT;
    loop {
        let search = browser.js("return location.search;", vec![]).await;
        if search != *before {
            break;
        }
        assert!(Instant::now() < deadline, "the address stayed {before}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    browser.wait_ready(page).await;
}

#[tokio::test]
async fn a_reconciliation_page_shows_each_planted_status_sorts_by_money_and_links_to_the_timeline()
{
    let app = month::service().await;
    month::load(&app).await;
    let result = reconcile(&app, report()).await;
    let id = result["reconciliation_id"].as_str().unwrap().to_owned();
    for (status, _) in PLANTED {
        assert_eq!(result["counts"][status], 1, "{status}: {result}");
    }

    let browser = Browser::open(app.address).await;
    signed_in(&browser, TOKEN).await;
    browser.wait_ready("home").await;
    browser.goto("/console/reconciliations").await;
    let notices = browser.wait_ready("reconciliations").await;
    assert!(notices.is_empty(), "{notices:?}");
    browser.screenshot("reconciliations").await;

    browser
        .goto(&format!("/console/reconciliations/{id}"))
        .await;
    let notices = browser.wait_ready("reconciliation").await;
    assert!(notices.is_empty(), "{notices:?}");
    for (status, count) in result["counts"].as_object().unwrap() {
        if count == 0 {
            continue;
        }
        let row = format!("#status-counts tr[data-status=\"{status}\"]");
        assert_eq!(browser.figure(&row, "count").await, raw(count), "{status}");
    }
    assert_eq!(browser.figure("#page", "lines_total").await, "6");
    assert_eq!(browser.count("#lines tr[data-status]").await, 6);
    for (status, container) in PLANTED {
        let row = format!("#lines tr[data-status=\"{status}\"][data-container-id=\"{container}\"]");
        assert_eq!(
            browser.count(&row).await,
            1,
            "the {status} line of {container}"
        );
    }
    browser.screenshot("reconciliation").await;

    // Largest money at stake first: gamma's 6.10 under, as the API sorts it.
    let (status, sorted) = app
        .get_json(&format!(
            "/v1/reconciliations/{id}/lines?sort=abs_cost_delta&limit=1"
        ))
        .await;
    assert_eq!(status, 200, "{sorted}");
    let first = &sorted["lines"][0];
    assert_eq!(first["container_id"], GAMMA, "{sorted}");
    browser.click("button[data-sort=\"abs_cost_delta\"]").await;
    wait_for_query(&browser, "sort=abs_cost_delta", "reconciliation").await;
    let rows = browser
        .attrs("#lines tr[data-status]", "data-container-id")
        .await;
    assert_eq!(rows.first(), Some(&Value::from(GAMMA)), "{rows:?}");
    let report_lines = browser
        .attrs("#lines tr[data-status]", "data-report-line")
        .await;
    assert_eq!(report_lines[0], Value::from(raw(&first["report_line"])));

    // From the line to the container's timeline over its charge period, the provider's
    // figure beside the ledger's.
    browser
        .click("#lines tr[data-status] a.timeline-link")
        .await;
    browser.wait_ready("container").await;
    let search = browser.js("return location.search;", vec![]).await;
    let search = search.as_str().unwrap();
    for key in ["from=", "to=", "provider_ms=", "ledger_ms=", "org_id="] {
        assert!(search.contains(key), "{key} in {search}");
    }
    assert_eq!(
        browser.figure("#page", "provider_ms").await,
        raw(&first["provider_runtime_ms"])
    );
    assert_eq!(
        browser.figure("#page", "ledger_ms").await,
        raw(&first["ledger_runtime_ms"])
    );
    assert_eq!(browser.count("#timeline rect.interval").await, 1);
    browser.screenshot("container-from-line").await;

    // A reconciliation whose run failed: its status and why, no figures.
    let failed = Uuid::now_v7();
    sqlx::query(
        "INSERT INTO reconciliation_job (id, report_id, tolerance_ms, tolerance_ratio, status, \
             requested_by, started_at, finished_at, error_code, error) \
         SELECT $1, report_id, 2000, 0.005, 'failed', 'console', now(), now(), \
             'reconciliation_failed', 'nothing of it was stored; retry' \
         FROM reconciliation LIMIT 1",
    )
    .bind(failed)
    .execute(&app.pool)
    .await
    .unwrap();
    browser
        .goto(&format!("/console/reconciliations/{failed}"))
        .await;
    browser.wait_ready("reconciliation").await;
    assert_eq!(browser.figure("#page", "status").await, "failed");
    assert_eq!(
        browser.figure("#page", "error").await,
        "reconciliation_failed: nothing of it was stored; retry"
    );
    assert_eq!(browser.count("#status-counts").await, 0, "no figures");
    browser.close().await;
}

/// Closes `period` through the API and waits for the job (bounded).
async fn close(app: &TestApp, period: &str) -> Value {
    let (status, _, job) = app.close_period(period).await;
    assert_eq!(status, 202, "{job}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (_, job) = app.get_close(period).await;
        if job["status"] != "running" {
            assert_eq!(job["status"], "done", "{job}");
            return job["closed"].clone();
        }
        assert!(Instant::now() < deadline, "the close never finished: {job}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn the_periods_audit_and_operator_pages_show_their_figures() {
    let app = month::service().await;
    month::load(&app).await;
    // A thousand more events of the org, so that its audit search has a second page
    // whatever page size the console asks for (the API's largest is 1000).
    let chatty: Vec<Value> = (0..1000)
        .map(|n| {
            json!({"id": Uuid::new_v4(), "type": "container.command_ran", "org_id": ORG,
                "container_id": "ctr_chatty",
                "occurred_at": tally::event::canonical::timestamp(
                    month::period().start() + chrono::Duration::days(20) + chrono::Duration::seconds(n)),
                "data": {"command_id": format!("c{n}"), "exit_code": 0, "duration_ms": 1}})
        })
        .collect();
    ok(app.post_events(&json!({ "events": chatty })).await);
    projected_to_head(&app.pool, "the chatty container is projected").await;
    let period = month::period_text();
    let closed = close(&app, &period).await;

    let browser = Browser::open(app.address).await;
    signed_in(&browser, TOKEN).await;
    browser.wait_ready("home").await;

    browser.goto("/console/periods").await;
    let notices = browser.wait_ready("periods").await;
    assert!(notices.is_empty(), "{notices:?}");
    let state = browser
        .attrs(
            &format!("#periods tr[data-period=\"{period}\"]"),
            "data-state",
        )
        .await;
    assert_eq!(state, vec![Value::from("closed")], "the closed month");
    assert!(
        browser
            .count("#periods tr[data-period][data-state=open]")
            .await
            >= 1
    );
    browser.screenshot("periods").await;

    browser.goto(&format!("/console/periods/{period}")).await;
    browser.wait_ready("period").await;
    assert_eq!(browser.figure("#page", "verified").await, "true");
    assert_eq!(
        browser.figure("#page", "sha256").await,
        raw(&closed["sha256"])
    );
    let export_orgs = browser
        .attrs("#export tr[data-org-id]", "data-org-id")
        .await;
    assert!(export_orgs.contains(&Value::from(ORG)), "{export_orgs:?}");
    assert!(
        export_orgs.contains(&Value::from(OTHER_ORG)),
        "{export_orgs:?}"
    );
    assert_eq!(browser.count("a#export-download").await, 1);
    browser.screenshot("period").await;

    browser.goto(&format!("/console/audit?org_id={ORG}")).await;
    browser.wait_ready("audit").await;
    let first_page = positions(&browser).await;
    assert!(
        !first_page.is_empty() && first_page.len() <= 1000,
        "one page"
    );
    assert_eq!(browser.count("form#audit-form").await, 1);
    browser.screenshot("audit").await;
    browser.click("a#audit-next").await;
    wait_for_query(&browser, "after=", "audit").await;
    let second_page = positions(&browser).await;
    assert!(!second_page.is_empty(), "a second page");
    assert!(
        second_page.iter().min() > first_page.iter().max(),
        "the next page goes on after the first: {:?} then {:?}",
        first_page.last(),
        second_page.first()
    );
    // All of the org's events, once each, on the two pages (or more).
    assert!(first_page.len() + second_page.len() <= 1018);

    let (status, status_body) = app.get_json("/v1/status").await;
    assert_eq!(status, 200, "{status_body}");
    browser.goto("/console/operator").await;
    browser.wait_ready("operator").await;
    assert_eq!(
        browser.figure("#page", "head_position").await,
        raw(&status_body["ledger"]["head_position"])
    );
    // The page's verify is the service's first: it checks the chain from the start.
    assert_eq!(browser.figure("#page", "verify_ok").await, "true");
    assert_eq!(
        browser.figure("#page", "events_checked").await,
        raw(&status_body["ledger"]["head_position"]),
        "every event, from the first"
    );
    assert_eq!(
        browser.figure("#page", "projection_lag_events").await,
        "0",
        "everything is projected"
    );
    for name in ["relay_lag_events", "dlq_messages"] {
        browser.figure("#page", name).await;
    }
    browser.screenshot("operator").await;
    browser.close().await;
}

/// The positions on the audit page, in page order.
async fn positions(browser: &Browser) -> Vec<i64> {
    browser
        .attrs("#audit-events tr[data-position]", "data-position")
        .await
        .iter()
        .map(|position| position.as_str().unwrap().parse().unwrap())
        .collect()
}
