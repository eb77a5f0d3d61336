//! The servers the bench tests run against: the Postgres server of the service's tests
//! (`TALLY_TEST_DATABASE_URL`) and a private nats-server with JetStream
//! (`TALLY_TEST_NATS_SERVER`), as in the service's `tests/api/helpers.rs`.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long nats-server may take to listen before the test fails.
const NATS_START_TIMEOUT: Duration = Duration::from_secs(15);

/// The Postgres server the bench creates its scratch databases on.
pub fn server_url() -> String {
    std::env::var("TALLY_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432".to_string())
}

/// A private nats-server with JetStream on a free port, killed when the test ends.
pub struct TestNats {
    child: Child,
    pub url: String,
    _store: tempfile::TempDir,
}

impl TestNats {
    pub fn start() -> TestNats {
        let store = tempfile::tempdir().expect("a temporary directory");
        let port = free_port();
        let child = Command::new(nats_server_binary())
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("starting nats-server (set TALLY_TEST_NATS_SERVER to its path)");
        wait_until_listening(port);
        TestNats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _store: store,
        }
    }
}

impl Drop for TestNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_until_listening(port: u16) {
    let deadline = Instant::now() + NATS_START_TIMEOUT;
    let address: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    while TcpStream::connect_timeout(&address, Duration::from_millis(100)).is_err() {
        assert!(
            Instant::now() < deadline,
            "nats-server did not start on {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

fn nats_server_binary() -> PathBuf {
    if let Ok(path) = std::env::var("TALLY_TEST_NATS_SERVER") {
        return PathBuf::from(path);
    }
    for candidate in [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ] {
        if std::path::Path::new(candidate).exists() {
            return PathBuf::from(candidate);
        }
    }
    PathBuf::from("nats-server")
}

/// The `tally` binary of this workspace, built if needed, for the parts that start `tally
/// serve` as a child process. Built as `cargo test --workspace --all-targets` builds it
/// (scripts/test does that first), so that here it is already fresh: a narrower build
/// (`-p tally`, or without the test targets) unifies dependency features differently and
/// would compile every dependency a second time.
///
/// The build runs without the variables cargo sets for this test process (its package's
/// `CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, …): build scripts that track one of them (ring's
/// tracks `CARGO_MANIFEST_DIR`) would see it changed, rebuild, and relink
/// `target/debug/tally` under the tests of the other lanes that are running it.
pub fn tally_binary() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut build = Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_by_cargo_for_crates) {
            build.env_remove(&name);
        }
    }
    let output = build
        .args(["build", "--quiet", "--workspace", "--all-targets"])
        .args(["--message-format", "json"])
        .stderr(Stdio::inherit())
        .output()
        .expect("running cargo build");
    assert!(output.status.success(), "cargo build --workspace failed");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        // The program, not the test harness `--all-targets` also builds from its main.rs.
        .filter(|message| message["target"]["name"] == "tally")
        .filter(|message| message["profile"]["test"] == false)
        .filter(|message| {
            message["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|kind| kind == "bin"))
        })
        .find_map(|message| Some(PathBuf::from(message["executable"].as_str()?)))
        .expect("cargo build names the tally executable")
}

/// Whether cargo sets `name` for the crate it compiles or the test it runs ("Environment
/// variables Cargo sets for crates"), rather than the user for cargo itself.
fn set_by_cargo_for_crates(name: &str) -> bool {
    name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
        || matches!(
            name,
            "CARGO_MANIFEST_DIR"
                | "CARGO_MANIFEST_PATH"
                | "CARGO_MANIFEST_LINKS"
                | "CARGO_CRATE_NAME"
                | "CARGO_BIN_NAME"
                | "CARGO_PRIMARY_PACKAGE"
                | "CARGO_TARGET_TMPDIR"
                | "CARGO_RUSTC_CURRENT_DIR"
                | "OUT_DIR"
        )
}
