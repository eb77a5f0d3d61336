//! Who sees what: an org-bound token is its org's page and nothing else; a pasted address
//! opened without a token asks for one and then shows that page.

use serde_json::Value;

use crate::browser::Browser;
use crate::helpers::TOKEN;
use crate::month::{self, ALPHA, ORG, OTHER_ORG};
use crate::org::raw;

#[tokio::test]
async fn an_org_bound_token_signs_in_to_its_org_and_cannot_open_another_org() {
    let app = month::service().await;
    month::load(&app).await;
    let token = month::token(&app, &["usage:read"], Some(ORG)).await;
    let usage = month::usage(&app).await;

    let browser = Browser::open(app.address).await;
    browser.goto("/console/").await;
    browser.screenshot("signin").await;
    browser.sign_in(&token).await;
    // An org-bound token's home is its org page.
    browser.wait_ready("org").await;
    let path = browser.js("return location.pathname;", vec![]).await;
    assert_eq!(path, format!("/console/orgs/{ORG}").as_str());

    browser
        .goto(&format!(
            "/console/orgs/{ORG}?period={}",
            month::period_text()
        ))
        .await;
    browser.wait_ready("org").await;
    assert_eq!(
        browser.figure("#page", "runtime_ms").await,
        raw(&usage["runtime_ms"])
    );

    browser
        .goto(&format!(
            "/console/orgs/{OTHER_ORG}?period={}",
            month::period_text()
        ))
        .await;
    let notices = browser.wait_ready("org").await;
    assert!(
        notices.iter().any(|(code, _)| code == "org_not_allowed"),
        "another org is refused with org_not_allowed: {notices:?}"
    );
    assert_eq!(
        browser.count("#page [data-figure=runtime_ms]").await,
        0,
        "and none of its figures shows"
    );
    browser.screenshot("org-not-allowed").await;
    browser.close().await;
}

#[tokio::test]
async fn a_deep_link_opened_without_a_token_asks_for_one_and_then_shows_that_page() {
    let app = month::service().await;
    month::load(&app).await;
    let browser = Browser::open(app.address).await;
    let path = format!("/console/containers/{ALPHA}?org_id={ORG}");
    browser.goto(&path).await;
    browser.sign_in(TOKEN).await;
    browser.wait_ready("container").await;
    let here = browser
        .js("return location.pathname + location.search;", vec![])
        .await;
    assert_eq!(here, path.as_str(), "the same address after sign-in");
    assert_eq!(
        browser.count("#timeline rect.interval").await,
        month::ALPHA_INTERVALS
    );
    // Signing out forgets the token: the same address asks again.
    browser.click("#signout").await;
    browser.goto(&path).await;
    browser.wait_ready("signin").await;
    let kept = browser
        .js(
            "return Object.values(sessionStorage).some(v => v.includes(arguments[0]))
                 || document.cookie.includes(arguments[0]);",
            vec![TOKEN.into()],
        )
        .await;
    assert_eq!(
        kept,
        Value::Bool(false),
        "no token left in sessionStorage or a cookie"
    );
    browser.close().await;
}
