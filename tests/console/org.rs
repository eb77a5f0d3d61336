//! The org page and the container page show exactly the API's figures for a known month.

use serde_json::Value;

use crate::browser::{Browser, PHONE};
use crate::helpers::TOKEN;
use crate::month::{self, ALPHA, ORG};

/// A figure's `data-value` as the console writes it: the API's raw value, a string as is.
pub fn raw(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        other => other.to_string(),
    }
}

/// Signs in with the admin token from the home page.
pub async fn signed_in(browser: &Browser, token: &str) {
    browser.goto("/console/").await;
    browser.sign_in(token).await;
}

fn org_path() -> String {
    format!("/console/orgs/{ORG}?period={}", month::period_text())
}

/// The org figures on the page equal the API's usage for the month.
async fn assert_org_figures(browser: &Browser, usage: &Value) {
    for name in [
        "runtime_ms",
        "included_ms",
        "overage_ms",
        "overage_amount",
        "currency",
    ] {
        assert_eq!(
            browser.figure("#page", name).await,
            raw(&usage[name]),
            "{name} on the org page is the API's"
        );
    }
}

#[tokio::test]
async fn the_org_page_shows_the_months_runtime_overage_and_every_day_as_the_api_gives_them() {
    let app = month::service().await;
    month::load(&app).await;
    let usage = month::usage(&app).await;
    // 12 h of alpha, 32 h of beta, gamma's last 72.5 h: 116.5 h against 10 h included.
    assert_eq!(usage["runtime_ms"], 419_400_000, "{usage}");
    assert_eq!(usage["included_ms"], 36_000_000, "{usage}");
    assert_eq!(usage["overage_ms"], 383_400_000, "{usage}");
    assert_eq!(usage["overage_amount"], "13.31", "{usage}");

    let browser = Browser::open(app.address).await;
    signed_in(&browser, TOKEN).await;
    browser.wait_ready("home").await;
    browser.screenshot("home").await;
    browser.goto(&org_path()).await;
    let notices = browser.wait_ready("org").await;
    assert!(
        notices.is_empty(),
        "the admin sees every section: {notices:?}"
    );
    assert_org_figures(&browser, &usage).await;
    let positions = browser
        .attrs("#page [data-figure=position]", "data-value")
        .await;
    assert!(
        positions.contains(&usage["position"].to_string().into()),
        "the usage's position {} is on the page: {positions:?}",
        usage["position"]
    );
    assert!(
        browser
            .count("meter#allowance, #allowance[role=img][aria-label]")
            .await
            == 1,
        "the allowance gauge"
    );
    assert_eq!(browser.count("figure#days-chart").await, 1, "the chart");

    let days = usage["days"].as_array().expect("the API's days");
    assert_eq!(
        days.len(),
        month::period().window().length_ms() as usize / 86_400_000
    );
    assert_eq!(
        browser.count("#days-table tr[data-day]").await,
        days.len(),
        "one row per API day"
    );
    for day in days {
        let row = format!(
            "#days-table tr[data-day=\"{}\"]",
            day["date"].as_str().unwrap()
        );
        for name in ["runtime_ms", "commands"] {
            assert_eq!(
                browser.figure(&row, name).await,
                raw(&day[name]),
                "{name} of {}",
                day["date"]
            );
        }
    }
    // Gamma still runs; alpha and beta stopped.
    assert_eq!(
        browser
            .attrs(
                "#running-containers tr[data-container-id]",
                "data-container-id"
            )
            .await,
        vec![Value::from(month::GAMMA)]
    );
    assert_eq!(browser.figure("#page", "plan").await, month::PLAN);
    assert_eq!(browser.figure("#page", "verified").await, "true");
    assert_eq!(browser.figure("#page", "billing_eligible").await, "true");
    assert!(
        browser
            .count("#admission tr[data-action][data-allowed]")
            .await
            >= 2
    );
    assert!(browser.count("#plan-history tr").await >= 1);
    browser.screenshot("org").await;
    browser.close().await;
}

#[tokio::test]
async fn the_container_page_draws_each_planted_interval_anomaly_command_and_port() {
    let app = month::service().await;
    month::load(&app).await;
    let browser = Browser::open(app.address).await;
    signed_in(&browser, TOKEN).await;
    browser.wait_ready("home").await;
    browser
        .goto(&format!("/console/containers/{ALPHA}?org_id={ORG}"))
        .await;
    let notices = browser.wait_ready("container").await;
    assert!(notices.is_empty(), "{notices:?}");

    assert_eq!(browser.count("svg#timeline[role=img][aria-label]").await, 1);
    assert_eq!(
        browser
            .count("#timeline rect.interval[data-start][data-end]")
            .await,
        month::ALPHA_INTERVALS,
        "interval bars"
    );
    let kinds = browser.attrs("#timeline .anomaly", "data-kind").await;
    let mut kinds: Vec<&str> = kinds.iter().map(|kind| kind.as_str().unwrap()).collect();
    kinds.sort_unstable();
    assert_eq!(
        kinds,
        [
            "command_while_not_running",
            "resume_while_running",
            "stop_while_not_running"
        ],
        "one mark per planted anomaly"
    );
    assert_eq!(kinds.len(), month::ALPHA_ANOMALIES);
    let exits = browser.attrs("#timeline .command", "data-exit-code").await;
    assert_eq!(exits.len(), month::ALPHA_COMMANDS, "command ticks");
    let mut exits: Vec<&str> = exits.iter().map(|code| code.as_str().unwrap()).collect();
    exits.sort_unstable();
    assert_eq!(exits, ["0", "0", "1"]);
    let durations = browser
        .attrs("#timeline .command", "data-duration-ms")
        .await;
    let mut durations: Vec<&str> = durations.iter().map(|ms| ms.as_str().unwrap()).collect();
    durations.sort_unstable();
    assert_eq!(durations, ["1200", "300", "50"]);
    assert_eq!(
        browser.attrs("#timeline .port", "data-port").await,
        vec![Value::from("8080")],
        "the published port"
    );
    assert_eq!(browser.count("#timeline .port").await, month::ALPHA_PORTS);
    for (kind, count) in [
        ("container.created", 1),
        ("container.stopped", 3),
        ("container.resumed", 2),
    ] {
        assert_eq!(
            browser
                .count(&format!("#timeline .lifecycle[data-type=\"{kind}\"]"))
                .await,
            count,
            "{kind} marks"
        );
    }
    assert_eq!(
        browser.count("#intervals-table tbody tr").await,
        month::ALPHA_INTERVALS
    );
    assert_eq!(
        browser.count("#anomalies-table tbody tr").await,
        month::ALPHA_ANOMALIES
    );
    // Its events in position order, each with its position and hash, as the API has them.
    let (status, events) = app
        .get_container_events(ALPHA, &format!("org_id={ORG}"))
        .await;
    assert_eq!(status, 200, "{events}");
    let api_positions: Vec<String> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| raw(&event["position"]))
        .collect();
    let page_positions: Vec<String> = browser
        .attrs("#container-events tr[data-position]", "data-position")
        .await
        .iter()
        .map(raw)
        .collect();
    assert_eq!(page_positions, api_positions);
    assert_eq!(
        browser
            .count("#container-events tr[data-position][data-hash]")
            .await,
        api_positions.len()
    );
    browser.screenshot("container").await;
    browser.close().await;
}

#[tokio::test]
async fn the_org_page_still_shows_the_org_figures_on_a_phone() {
    let app = month::service().await;
    month::load(&app).await;
    let usage = month::usage(&app).await;
    let browser = Browser::open(app.address).await;
    browser.resize(PHONE).await;
    signed_in(&browser, TOKEN).await;
    browser.wait_ready("home").await;
    browser.goto(&org_path()).await;
    browser.wait_ready("org").await;
    assert_org_figures(&browser, &usage).await;
    // Each figure is drawn, and inside the phone's width.
    for name in ["runtime_ms", "included_ms", "overage_ms", "overage_amount"] {
        let rect = browser
            .js(
                "const e = document.querySelector('#page [data-figure=\"' + arguments[0] + '\"]');
                 const r = e.getBoundingClientRect();
                 return [r.left, r.right, r.width, r.height, window.innerWidth];",
                vec![Value::from(name)],
            )
            .await;
        let [left, right, width, height, viewport] =
            [0usize, 1, 2, 3, 4].map(|index| rect[index].as_f64().unwrap());
        assert_eq!(viewport, f64::from(PHONE.0), "the viewport is a phone's");
        assert!(width > 0.0 && height > 0.0, "{name} is drawn: {rect}");
        assert!(
            left >= 0.0 && right <= viewport,
            "{name} fits the width: {rect}"
        );
    }
    browser.screenshot("org-phone").await;
    browser.close().await;
}
