//! A headless Chromium of the test's own, driven through a chromedriver of its own on a free
//! port: started per test, with a temporary profile and temporary directory, and killed
//! (chromedriver and every browser process it started, as one process group) when the test
//! ends, pass or fail; both directories go with it.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

/// How long a page may take to set `data-ready` before the test fails: generous, because
/// a loaded CI machine runs a debug build; a bound, never a fixed sleep.
pub const READY_WAIT: Duration = Duration::from_secs(60);

/// The phone the layout must still work on (CSS pixels).
pub const PHONE: (u32, u32) = (390, 844);

fn chromedriver_binary() -> PathBuf {
    if let Ok(path) = std::env::var("TALLY_TEST_CHROMEDRIVER") {
        if !path.is_empty() {
            return PathBuf::from(path);
        }
    }
    for candidate in ["/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver"] {
        if std::path::Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    PathBuf::from("chromedriver")
}

/// The browser binary chromedriver starts: TALLY_TEST_CHROMIUM, else Debian's chromium when
/// there, else whatever chromedriver finds itself.
fn chromium_binary() -> Option<String> {
    if let Ok(path) = std::env::var("TALLY_TEST_CHROMIUM") {
        if !path.is_empty() {
            return Some(path);
        }
    }
    ["/usr/bin/chromium", "/usr/lib/chromium/chromium"]
        .into_iter()
        .find(|candidate| std::path::Path::new(candidate).exists())
        .map(str::to_owned)
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

/// chromedriver in a process group of its own; the browser it starts joins the group, so
/// that killing the group on drop leaves nothing running.
struct Driver {
    child: Child,
    port: u16,
    /// Removed after the group is killed: the browser's profile (`--user-data-dir`) in
    /// `profile/`, and in `tmp/` the `TMPDIR` of chromedriver and the browser, where
    /// Chromium makes directories that a killed browser leaves behind.
    scratch: Option<tempfile::TempDir>,
}

impl Driver {
    fn start() -> Driver {
        let port = free_port();
        let binary = chromedriver_binary();
        let scratch = tempfile::tempdir().expect("a temporary directory");
        for directory in ["profile", "tmp"] {
            std::fs::create_dir(scratch.path().join(directory)).expect("a directory in it");
        }
        let child = Command::new(&binary)
            .env("TMPDIR", scratch.path().join("tmp"))
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap_or_else(|error| {
                panic!(
                    "starting {} ({error}); run scripts/browser or set TALLY_TEST_CHROMEDRIVER",
                    binary.display()
                )
            });
        let driver = Driver {
            child,
            port,
            scratch: Some(scratch),
        };
        let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect_timeout(&address, Duration::from_millis(100)).is_err() {
            assert!(
                Instant::now() < deadline,
                "chromedriver did not start on {port}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        driver
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        // The whole group: chromedriver and the chromium processes it started.
        let group = self.child.id() as libc::pid_t;
        // SAFETY: kill(2) with a negative pid signals that process group; no memory involved.
        unsafe {
            libc::kill(-group, libc::SIGKILL);
        }
        let _ = self.child.wait();
        // Chromium's last processes may still be writing the profile as they die.
        if let Some(scratch) = self.scratch.take() {
            let path = scratch.path().to_owned();
            if scratch.close().is_err() {
                std::thread::sleep(Duration::from_millis(200));
                let _ = std::fs::remove_dir_all(path);
            }
        }
    }
}

/// One headless Chromium showing the console of one service.
pub struct Browser {
    pub client: Client,
    base: String,
    // Declared after `client`, so that it is dropped (killed) after the session's handle.
    driver: Driver,
}

impl Browser {
    /// A new browser at 1280×800 for the service at `address`.
    pub async fn open(address: SocketAddr) -> Browser {
        let driver = Driver::start();
        let scratch = driver
            .scratch
            .as_ref()
            .expect("kept until the driver is dropped");
        let profile = scratch.path().join("profile").display().to_string();
        let mut options = json!({
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,800",
                "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
                format!("--user-data-dir={profile}"),
            ],
        });
        if let Some(binary) = chromium_binary() {
            options["binary"] = json!(binary);
        }
        let mut capabilities = serde_json::Map::new();
        capabilities.insert("browserName".into(), json!("chrome"));
        capabilities.insert("goog:chromeOptions".into(), options);
        let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
            .capabilities(capabilities)
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
            .expect("a chromedriver session with headless chromium");
        Browser {
            client,
            base: format!("http://{address}"),
            driver,
        }
    }

    /// Ends the WebDriver session (chromium quits); the drop kills whatever is left.
    pub async fn close(self) {
        let Browser { client, driver, .. } = self;
        let _ = client.close().await;
        drop(driver);
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// Loads `path` (of the service) in the window.
    pub async fn goto(&self, path: &str) {
        self.client
            .goto(&self.url(path))
            .await
            .unwrap_or_else(|error| panic!("opening {path}: {error}"));
    }

    /// Runs `script` (a function body; `arguments` are `args`) and returns what it returns.
    pub async fn js(&self, script: &str, args: Vec<Value>) -> Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|error| panic!("running {script:?}: {error}"))
    }

    /// `#page`'s data-page and data-ready, and the notices on the page.
    async fn page_state(&self) -> Value {
        self.js(
            "const p = document.getElementById('page');
             if (!p) return null;
             return {page: p.dataset.page || null, ready: p.dataset.ready || null,
                     notices: [...p.querySelectorAll('.notice')].map(n => [n.dataset.code || null, n.textContent])};",
            vec![],
        )
        .await
    }

    /// Polls (every 25 ms, at most [`READY_WAIT`]) until `#page` is `page` with
    /// `data-ready="true"`; returns the page's notices as `[code, text]` pairs.
    pub async fn wait_ready(&self, page: &str) -> Vec<(String, String)> {
        let deadline = Instant::now() + READY_WAIT;
        loop {
            let state = self.page_state().await;
            if state["page"] == page && state["ready"] == "true" {
                return state["notices"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|notice| {
                        (
                            notice[0].as_str().unwrap_or("").to_owned(),
                            notice[1].as_str().unwrap_or("").to_owned(),
                        )
                    })
                    .collect();
            }
            if Instant::now() > deadline {
                self.screenshot(&format!("failed-{page}")).await;
                let url = self.client.current_url().await.map(|u| u.to_string());
                panic!(
                    "#page never became {page} and ready within {READY_WAIT:?}: {state} at {url:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Opens `path`, waits for `page` to be ready and says how long that took from the
    /// navigation's start (`performance.now()` when `data-ready` turned true, seen by a
    /// MutationObserver; the current time when it was already set).
    pub async fn load_time(&self, path: &str, page: &str) -> f64 {
        self.goto(path).await;
        let measured = self
            .client
            .execute_async(
                "const done = arguments[arguments.length - 1];
                 const page = document.getElementById('page');
                 const ready = () => page && page.dataset.page === arguments[0] && page.dataset.ready === 'true';
                 if (ready()) { done(performance.now()); return; }
                 const watch = new MutationObserver(() => {
                     if (ready()) { watch.disconnect(); done(performance.now()); }
                 });
                 watch.observe(page, {attributes: true});",
                vec![json!(page)],
            )
            .await;
        self.wait_ready(page).await;
        measured
            .ok()
            .and_then(|value| value.as_f64())
            .expect("a load time")
    }

    /// Signs in on the sign-in page that is showing: pastes `token` and submits.
    pub async fn sign_in(&self, token: &str) {
        self.wait_ready("signin").await;
        let field = self
            .client
            .find(Locator::Css("form#signin input#token[type=password]"))
            .await
            .expect("the sign-in form's token field");
        field.send_keys(token).await.expect("typing the token");
        let form = self
            .client
            .form(Locator::Css("form#signin"))
            .await
            .expect("the sign-in form");
        form.submit().await.expect("submitting the sign-in form");
    }

    /// How many elements match `css`.
    pub async fn count(&self, css: &str) -> usize {
        self.js(
            "return document.querySelectorAll(arguments[0]).length;",
            vec![json!(css)],
        )
        .await
        .as_u64()
        .unwrap() as usize
    }

    /// `attribute` of each element matching `css`, in document order (null where absent).
    pub async fn attrs(&self, css: &str, attribute: &str) -> Vec<Value> {
        self.js(
            "return [...document.querySelectorAll(arguments[0])].map(e => e.getAttribute(arguments[1]));",
            vec![json!(css), json!(attribute)],
        )
        .await
        .as_array()
        .unwrap()
        .clone()
    }

    /// The `data-value` of the first `[data-figure=name]` inside `scope` (a CSS selector);
    /// fails the test when there is none.
    pub async fn figure(&self, scope: &str, name: &str) -> String {
        let value = self
            .js(
                "const e = document.querySelector(arguments[0] + ' [data-figure=\"' + arguments[1] + '\"]');
                 return e ? e.getAttribute('data-value') : null;",
                vec![json!(scope), json!(name)],
            )
            .await;
        value
            .as_str()
            .unwrap_or_else(|| panic!("no data-figure={name} with a data-value in {scope}"))
            .to_owned()
    }

    /// Clicks the element `css` selects.
    pub async fn click(&self, css: &str) {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|error| panic!("finding {css}: {error}"))
            .click()
            .await
            .unwrap_or_else(|error| panic!("clicking {css}: {error}"));
    }

    /// Resizes the window's viewport to `width`×`height` CSS pixels.
    pub async fn resize(&self, (width, height): (u32, u32)) {
        // The window's outer size includes what little frame a headless window has: set
        // it, then correct by the difference so that the viewport is exactly the size.
        self.client
            .set_window_size(width, height)
            .await
            .expect("resizing the window");
        let inner = self
            .js("return [window.innerWidth, window.innerHeight];", vec![])
            .await;
        let (inner_width, inner_height) = (
            inner[0].as_u64().unwrap() as u32,
            inner[1].as_u64().unwrap() as u32,
        );
        if (inner_width, inner_height) != (width, height) {
            self.client
                .set_window_size(width + width - inner_width, height + height - inner_height)
                .await
                .expect("resizing the window");
        }
    }

    /// Saves the window as `<screenshots>/<name>.png`.
    pub async fn screenshot(&self, name: &str) {
        let png = self.client.screenshot().await.expect("a screenshot");
        let path = screenshots_dir().join(format!("{name}.png"));
        std::fs::write(&path, png).unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    }
}

/// target/console-screenshots (under CARGO_TARGET_DIR when set), created when missing.
pub fn screenshots_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target"));
    let dir = target.join("console-screenshots");
    std::fs::create_dir_all(&dir).unwrap_or_else(|error| panic!("{}: {error}", dir.display()));
    dir
}
