//! The browser console's files (decision 0028): served beside the API without a token, with
//! their types and security headers; every app address answers with the page.

use reqwest::Method;

use crate::helpers::*;

const CSP: &str = "default-src 'self'; img-src 'self' data:; style-src 'self'; \
                   script-src 'self'; connect-src 'self'; frame-ancestors 'none'";

/// The console's security headers are on the answer.
fn assert_console_headers(reply: &Reply, what: &str) {
    assert_eq!(
        reply.header("content-security-policy").as_deref(),
        Some(CSP),
        "{what}"
    );
    assert_eq!(
        reply.header("x-content-type-options").as_deref(),
        Some("nosniff"),
        "{what}"
    );
    assert_eq!(
        reply.header("referrer-policy").as_deref(),
        Some("no-referrer"),
        "{what}"
    );
}

/// A client that does not follow redirects, to see them.
fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("a client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bare_console_address_redirects_and_every_app_address_is_the_page_without_a_token() {
    let app = TestApp::spawn().await;
    let anyone = app.without_token();

    let redirect = Api::reply(no_redirects().get(app.url("/console"))).await;
    assert_eq!(redirect.status, 308);
    assert_eq!(redirect.header("location").as_deref(), Some("/console/"));
    assert_console_headers(&redirect, "the redirect");

    let index = anyone.get("/console/").await;
    assert_eq!(index.status, 200);
    assert_eq!(
        index.header("content-type").as_deref(),
        Some("text/html; charset=utf-8")
    );
    assert!(index.text.contains(r#"<main id="page""#), "{}", index.text);
    assert!(
        !index.text.contains("<script>") && !index.text.contains("style="),
        "no inline script or style: the CSP would refuse it"
    );
    assert_console_headers(&index, "the page");
    for deep in [
        "/console/orgs/org_1?period=2026-12",
        "/console/containers/c-1?org_id=org_1&from=2026-12-01T00:00:00.000Z",
        "/console/reconciliations/0196a4b8-0000-7000-8000-000000000000",
        "/console/periods/2026-11",
        "/console/audit?org_id=org_1&after=10",
        "/console/operator",
        "/console/no/such/page",
    ] {
        let page = anyone.get(deep).await;
        assert_eq!(page.status, 200, "{deep}");
        assert_eq!(page.text, index.text, "{deep} is the page");
        assert_console_headers(&page, deep);
    }
    // A token the service does not know changes nothing: the files are public, the data is not.
    let stranger = app.with_token("not-a-token");
    assert_eq!(stranger.get("/console/orgs/org_1").await.status, 200);
    assert_eq!(stranger.get("/console/assets/app.js").await.status, 200);
    assert_eq!(stranger.get("/v1/plans").await.status, 401);
    assert_eq!(anyone.get("/v1/plans").await.status, 401);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_assets_are_served_with_their_types_and_an_unknown_one_is_not_found() {
    let app = TestApp::spawn().await;
    let anyone = app.without_token();
    for (path, content_type) in [
        ("/console/assets/app.js", "text/javascript; charset=utf-8"),
        (
            "/console/assets/pages/org.js",
            "text/javascript; charset=utf-8",
        ),
        ("/console/assets/console.css", "text/css; charset=utf-8"),
        ("/console/assets/icon.svg", "image/svg+xml"),
        (
            "/console/assets/vendor/uplot/uPlot.iife.min.js",
            "text/javascript; charset=utf-8",
        ),
        (
            "/console/assets/vendor/uplot/uPlot.min.css",
            "text/css; charset=utf-8",
        ),
        (
            "/console/assets/vendor/uplot/LICENSE",
            "text/plain; charset=utf-8",
        ),
    ] {
        let reply = anyone.get(path).await;
        assert_eq!(reply.status, 200, "{path}");
        assert_eq!(
            reply.header("content-type").as_deref(),
            Some(content_type),
            "{path}"
        );
        assert_eq!(
            reply.header("cache-control").as_deref(),
            Some("no-cache"),
            "{path}"
        );
        assert_console_headers(&reply, path);
        assert!(!reply.text.is_empty(), "{path}");
        // The ETag names this version: asked again with it, the answer is a bodiless 304.
        let etag = reply.header("etag").expect("an ETag");
        let again = Api::reply(
            anyone
                .request(Method::GET, path)
                .header("if-none-match", &etag),
        )
        .await;
        assert_eq!(again.status, 304, "{path}");
        assert!(again.text.is_empty(), "{path}");
        let changed = Api::reply(
            anyone
                .request(Method::GET, path)
                .header("if-none-match", "\"another\""),
        )
        .await;
        assert_eq!(changed.status, 200, "{path}");
    }
    let head = anyone
        .send(Method::HEAD, "/console/assets/app.js", None)
        .await;
    assert_eq!(head.status, 200);
    for missing in [
        "/console/assets/nope.js",
        "/console/assets/vendor/uplot/uPlot.js",
        "/console/assets/",
    ] {
        let reply = anyone.get(missing).await;
        assert_eq!(reply.status, 404, "{missing}");
        assert_eq!(reply.json()["error"]["code"], "not_found", "{missing}");
        assert_console_headers(&reply, missing);
    }
    let posted = anyone.send(Method::POST, "/console/", None).await;
    assert_eq!(posted.status, 405);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_file_the_page_names_is_served_and_the_console_is_not_in_the_openapi_document() {
    let app = TestApp::spawn().await;
    let anyone = app.without_token();
    let index = anyone.get("/console/").await.text;
    let named: Vec<&str> = index
        .split('"')
        .filter(|part| part.starts_with("/console/assets/"))
        .collect();
    assert!(named.len() >= 4, "{named:?}");
    for path in named {
        assert_eq!(anyone.get(path).await.status, 200, "{path}");
    }
    // Each module the app imports, by the relative paths it names.
    let app_js = anyone.get("/console/assets/app.js").await.text;
    for line in app_js.lines().filter(|line| line.starts_with("import ")) {
        let relative = line.rsplit_once("from '").expect("an import").1;
        let relative = relative.trim_end_matches("';").trim_start_matches("./");
        let path = format!("/console/assets/{relative}");
        assert_eq!(anyone.get(&path).await.status, 200, "{path}");
    }
    let (status, document) = anyone.get_json("/openapi.json").await;
    assert_eq!(status, 200);
    let paths = document["paths"].as_object().expect("paths");
    assert!(
        paths.keys().all(|path| !path.starts_with("/console")),
        "{:?}",
        paths.keys().collect::<Vec<_>>()
    );
    app.stop().await;
}
