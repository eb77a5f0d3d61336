//! A Postgres primary and a streaming replica of it, made for one test in a temporary
//! directory on free ports (`initdb`, `pg_basebackup -R -X stream`), and stopped and
//! removed when the test ends, failed or not. The machine's own Postgres is not touched.
//!
//! Postgres refuses to run as root: under root the server programs run as the `postgres`
//! user (`runuser`), in a directory that user owns. The programs come from
//! `TALLY_TEST_PG_BIN` (a directory), else the newest `/usr/lib/postgresql/*/bin`, else
//! `PATH`; `scripts/services` installs them when missing.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, PgConnection};

/// How long the replica may take to start streaming: seconds on this machine; far more
/// means it never will.
const STREAMING_WAIT_S: u64 = 60;

/// A primary and its streaming replica, each on a port of its own.
pub struct ReplicatedCluster {
    pub primary_port: u16,
    pub replica_port: u16,
    bin: PathBuf,
    /// Owned by the user the servers run as; holds both data directories and their logs.
    root: tempfile::TempDir,
    /// Run the server programs as `postgres` (the test runs as root).
    as_postgres: bool,
}

impl ReplicatedCluster {
    /// Makes the primary, starts it, copies it with `pg_basebackup`, starts the copy as a
    /// standby and waits until it streams.
    pub async fn start() -> ReplicatedCluster {
        let root = tempfile::Builder::new()
            .prefix("tally-replica-test")
            .tempdir()
            .expect("a temporary directory");
        let as_postgres = running_as_root();
        let mut cluster = ReplicatedCluster {
            primary_port: free_port(),
            replica_port: 0,
            bin: pg_bin(),
            root,
            as_postgres,
        };
        if as_postgres {
            cluster.run(
                "chown",
                &["postgres:", path_str(cluster.root.path())],
                false,
            );
        }
        let primary = cluster.primary_dir();
        cluster.server(
            "initdb",
            &[
                "-D",
                path_str(&primary),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "--no-instructions",
            ],
        );
        std::fs::write(primary.join("postgresql.auto.conf"), primary_settings())
            .and_then(|()| allow_replication(&primary))
            .expect("configuring the primary");
        cluster.pg_ctl_start(&primary, cluster.primary_port);
        cluster.replica_port = free_port();
        let replica = cluster.replica_dir();
        cluster.server(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &cluster.primary_port.to_string(),
                "-U",
                "postgres",
                "-D",
                path_str(&replica),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ],
        );
        cluster.pg_ctl_start(&replica, cluster.replica_port);
        cluster.wait_until_streaming().await;
        cluster
    }

    /// The URL of `database` on the primary.
    pub fn primary_url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.primary_port
        )
    }

    /// The URL of `database` on the replica.
    pub fn replica_url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.replica_port
        )
    }

    /// A connection to the replica's `postgres` database, e.g. to pause its replay.
    pub async fn replica(&self) -> PgConnection {
        connect(&self.replica_url("postgres")).await
    }

    /// Stops replaying WAL on the replica (it goes on receiving it): from now on it lags.
    /// The startup process looks for the request before it applies each record, so no WAL
    /// written after this returns is applied until [`resume_replay`](Self::resume_replay).
    pub async fn pause_replay(&self) {
        let mut replica = self.replica().await;
        sqlx::query("SELECT pg_wal_replay_pause()")
            .execute(&mut replica)
            .await
            .expect("pausing replay");
        let state: String = sqlx::query_scalar("SELECT pg_get_wal_replay_pause_state()")
            .fetch_one(&mut replica)
            .await
            .expect("asking whether replay pauses");
        assert_ne!(state, "not paused", "the replica did not take the pause");
    }

    pub async fn resume_replay(&self) {
        let mut replica = self.replica().await;
        sqlx::query("SELECT pg_wal_replay_resume()")
            .execute(&mut replica)
            .await
            .expect("resuming replay");
    }

    fn primary_dir(&self) -> PathBuf {
        self.root.path().join("primary")
    }

    fn replica_dir(&self) -> PathBuf {
        self.root.path().join("replica")
    }

    async fn wait_until_streaming(&self) {
        let deadline = Instant::now() + Duration::from_secs(STREAMING_WAIT_S);
        loop {
            let mut replica = self.replica().await;
            let (in_recovery, status): (bool, Option<String>) = sqlx::query_as(
                "SELECT pg_is_in_recovery(), (SELECT status FROM pg_stat_wal_receiver)",
            )
            .fetch_one(&mut replica)
            .await
            .expect("asking the replica how it replicates");
            if in_recovery && status.as_deref() == Some("streaming") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the replica did not stream within {STREAMING_WAIT_S} s (recovery {in_recovery}, receiver {status:?})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn pg_ctl_start(&self, data: &Path, port: u16) {
        let log = data.with_extension("log");
        let options = format!(
            "-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={}",
            path_str(self.root.path())
        );
        self.server(
            "pg_ctl",
            &[
                "start",
                "-w",
                "-t",
                "60",
                "-D",
                path_str(data),
                "-l",
                path_str(&log),
                "-o",
                &options,
            ],
        );
    }

    /// Runs one of the Postgres programs, as `postgres` under root; panics with its output
    /// when it fails.
    fn server(&self, program: &str, args: &[&str]) {
        let program = self.bin.join(program);
        self.run(path_str(&program), args, self.as_postgres);
    }

    fn run(&self, program: &str, args: &[&str], as_postgres: bool) -> Output {
        let mut command = if as_postgres {
            let mut command = Command::new("runuser");
            command.args(["-u", "postgres", "--", program]);
            command
        } else {
            Command::new(program)
        };
        let output = command
            .args(args)
            // The programs' working directory must be one the postgres user may enter.
            .current_dir(self.root.path())
            .output()
            .unwrap_or_else(|error| panic!("cannot run {program}: {error}"));
        assert!(
            output.status.success(),
            "{program} {args:?} failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        output
    }
}

impl Drop for ReplicatedCluster {
    /// Stops both servers at once (`immediate`: nothing in them is worth a checkpoint); the
    /// temporary directory then removes itself.
    fn drop(&mut self) {
        for data in [self.replica_dir(), self.primary_dir()] {
            if !data.join("postmaster.pid").exists() {
                continue;
            }
            let program = self.bin.join("pg_ctl");
            let mut command = if self.as_postgres {
                let mut command = Command::new("runuser");
                command.args(["-u", "postgres", "--"]).arg(&program);
                command
            } else {
                Command::new(&program)
            };
            let stopped = command
                .args(["stop", "-m", "immediate", "-w", "-D"])
                .arg(&data)
                .current_dir(self.root.path())
                .output();
            if !stopped.is_ok_and(|output| output.status.success()) {
                eprintln!("could not stop the test cluster in {}", data.display());
            }
        }
    }
}

/// Small and fast: a test cluster holds a few thousand rows and is thrown away.
fn primary_settings() -> &'static str {
    "fsync = off\n\
     full_page_writes = off\n\
     shared_buffers = '16MB'\n\
     max_connections = 60\n\
     wal_level = replica\n\
     max_wal_senders = 4\n\
     hot_standby = on\n\
     wal_receiver_status_interval = '1s'\n"
}

/// Lets the replica connect for replication over loopback, whatever initdb wrote.
fn allow_replication(data: &Path) -> std::io::Result<()> {
    let hba = data.join("pg_hba.conf");
    let mut text = std::fs::read_to_string(&hba)?;
    text.push_str("\nhost replication all 127.0.0.1/32 trust\n");
    std::fs::write(hba, text)
}

async fn connect(url: &str) -> PgConnection {
    let options: PgConnectOptions = url.parse().expect("a test cluster URL");
    let mut last = None;
    // A server that has just started may refuse a moment longer than `pg_ctl -w` waits.
    for _ in 0..50 {
        match options.connect().await {
            Ok(connection) => return connection,
            Err(error) => last = Some(error),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("cannot connect to {url}: {last:?}")
}

/// Where `initdb`, `pg_ctl` and `pg_basebackup` are.
fn pg_bin() -> PathBuf {
    if let Ok(bin) = std::env::var("TALLY_TEST_PG_BIN") {
        return PathBuf::from(bin);
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let bin = entry.path().join("bin");
            bin.join("initdb").exists().then_some((version, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        // Empty: the programs are looked up on PATH.
        .unwrap_or_default()
}

fn running_as_root() -> bool {
    let output = Command::new("id")
        .arg("-u")
        .output()
        .expect("running id -u");
    String::from_utf8_lossy(&output.stdout).trim() == "0"
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding an ephemeral port")
        .local_addr()
        .unwrap()
        .port()
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("a UTF-8 temporary path")
}
