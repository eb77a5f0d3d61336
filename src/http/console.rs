//! The browser console (`/console/`, [0028](../../docs/decisions/0028-console.md)): static
//! files compiled into the binary and served beside the API, outside `/v1` and outside the
//! OpenAPI document (it is HTML, not API). The app in those files is a client of `/v1`
//! only, and routes on `location.pathname`: so `/console` redirects to `/console/`, a file
//! under `/console/assets/` is that file, and every other `/console/...` address is
//! `index.html`. No token is needed to load the files; the app asks for one.

use std::collections::HashMap;
use std::sync::LazyLock;

use axum::extract::Path;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{middleware, Router};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AppState;
use crate::error_code::ErrorCode;

/// Where the console lives.
pub const PREFIX: &str = "/console";

/// Only this origin's scripts, styles, images (and `data:` images, which the charts'
/// canvas may produce) and API; no inline script or style; never inside a frame.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'self'; img-src 'self' data:; \
     style-src 'self'; script-src 'self'; connect-src 'self'; frame-ancestors 'none'";

/// The files are not named by their content, so a browser asks again each time and gets a
/// 304 while the ETag holds: a new binary's console is seen at once, an unchanged one costs
/// a few bytes.
const CACHE_CONTROL: &str = "no-cache";

/// One file of the console, as compiled in.
struct Asset {
    /// Its path under `console/assets/`.
    name: &'static str,
    bytes: &'static [u8],
}

/// Compiles `console/assets/<name>` into the binary.
macro_rules! asset {
    ($name:literal) => {
        Asset {
            name: $name,
            bytes: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/console/assets/",
                $name
            )),
        }
    };
}

/// Every file under `console/assets/` (a unit test checks the list against the directory).
const ASSETS: &[Asset] = &[
    asset!("app.js"),
    asset!("api.js"),
    asset!("dom.js"),
    asset!("chart.js"),
    asset!("timeline.js"),
    asset!("pages/signin.js"),
    asset!("pages/home.js"),
    asset!("pages/org.js"),
    asset!("pages/container.js"),
    asset!("pages/reconciliations.js"),
    asset!("pages/periods.js"),
    asset!("pages/audit.js"),
    asset!("pages/operator.js"),
    asset!("console.css"),
    asset!("icon.svg"),
    asset!("vendor/uplot/uPlot.iife.min.js"),
    asset!("vendor/uplot/uPlot.min.css"),
    asset!("vendor/uplot/LICENSE"),
    asset!("vendor/uplot/README.md"),
];

/// The page every app address answers with.
const INDEX_HTML: &[u8] =
    include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/console/index.html"));

/// A file ready to send: its bytes, type and ETag (a prefix of its sha256, computed once).
struct Served {
    bytes: &'static [u8],
    content_type: &'static str,
    etag: HeaderValue,
}

impl Served {
    fn new(name: &str, bytes: &'static [u8]) -> Served {
        let digest = hex::encode(Sha256::digest(bytes));
        Served {
            bytes,
            content_type: content_type(name),
            etag: HeaderValue::from_str(&format!("\"{}\"", &digest[..32]))
                .expect("hex is a valid header value"),
        }
    }
}

static FILES: LazyLock<HashMap<&'static str, Served>> = LazyLock::new(|| {
    ASSETS
        .iter()
        .map(|asset| (asset.name, Served::new(asset.name, asset.bytes)))
        .collect()
});

static INDEX: LazyLock<Served> = LazyLock::new(|| Served::new("index.html", INDEX_HTML));

/// The type of a file by its name's ending; what is not listed is plain text.
fn content_type(name: &str) -> &'static str {
    let extension = name.rsplit_once('.').map_or("", |(_, extension)| extension);
    match extension {
        "html" => "text/html; charset=utf-8",
        "js" => "text/javascript; charset=utf-8",
        "css" => "text/css; charset=utf-8",
        "svg" => "image/svg+xml",
        "md" => "text/markdown; charset=utf-8",
        _ => "text/plain; charset=utf-8",
    }
}

/// The console's routes, with its security headers on every answer (404s included).
pub(super) fn router() -> Router<AppState> {
    Router::new()
        .route(PREFIX, get(|| async { Redirect::permanent("/console/") }))
        .route("/console/", get(index))
        .route("/console/assets/{*name}", get(asset))
        .route("/console/{*address}", get(app_address))
        .layer(middleware::map_response(security_headers))
}

async fn index(request_headers: HeaderMap) -> Response {
    send(&INDEX, &request_headers)
}

async fn asset(Path(name): Path<String>, request_headers: HeaderMap) -> Response {
    match FILES.get(name.as_str()) {
        Some(served) => send(served, &request_headers),
        None => no_such_file(),
    }
}

/// An address of the app (`/console/orgs/...`): the page, which reads the address itself.
/// `/console/assets/` with no file name is not one.
async fn app_address(Path(address): Path<String>, request_headers: HeaderMap) -> Response {
    if address == "assets" || address.starts_with("assets/") {
        return no_such_file();
    }
    send(&INDEX, &request_headers)
}

fn no_such_file() -> Response {
    ApiError::new(
        StatusCode::NOT_FOUND,
        ErrorCode::NotFound,
        "no such console file",
    )
    .into_response()
}

/// The file, or 304 when the caller already holds this version of it.
fn send(served: &Served, request_headers: &HeaderMap) -> Response {
    let cached = request_headers
        .get(header::IF_NONE_MATCH)
        .is_some_and(|held| held == served.etag);
    let headers = [
        (
            header::CONTENT_TYPE,
            HeaderValue::from_static(served.content_type),
        ),
        (
            header::CACHE_CONTROL,
            HeaderValue::from_static(CACHE_CONTROL),
        ),
        (header::ETAG, served.etag.clone()),
    ];
    if cached {
        (StatusCode::NOT_MODIFIED, headers).into_response()
    } else {
        (headers, served.bytes).into_response()
    }
}

async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The files under `console/assets/`, as paths relative to it.
    fn files_on_disk(directory: &std::path::Path, prefix: &str, found: &mut Vec<String>) {
        for entry in std::fs::read_dir(directory).expect("console/assets is readable") {
            let entry = entry.expect("a directory entry");
            let name = format!("{prefix}{}", entry.file_name().to_string_lossy());
            if entry.file_type().expect("a file type").is_dir() {
                files_on_disk(&entry.path(), &format!("{name}/"), found);
            } else {
                found.push(name);
            }
        }
    }

    #[test]
    fn every_file_under_console_assets_is_compiled_in_and_nothing_else_is_listed() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console/assets");
        let mut on_disk = Vec::new();
        files_on_disk(&root, "", &mut on_disk);
        on_disk.sort();
        let mut listed: Vec<String> = ASSETS.iter().map(|asset| asset.name.to_owned()).collect();
        listed.sort();
        assert_eq!(listed, on_disk);
    }

    #[test]
    fn file_types_follow_the_name() {
        assert_eq!(content_type("app.js"), "text/javascript; charset=utf-8");
        assert_eq!(
            content_type("vendor/uplot/uPlot.min.css"),
            "text/css; charset=utf-8"
        );
        assert_eq!(content_type("icon.svg"), "image/svg+xml");
        assert_eq!(
            content_type("vendor/uplot/LICENSE"),
            "text/plain; charset=utf-8"
        );
    }
}
