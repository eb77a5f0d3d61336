//! `tally` as a child process: every part measures the binary that is deployed, in a
//! process of its own (its own runtime, allocator and metrics recorder). A running `tally
//! serve`'s CPU time and peak memory come from `/proc/<pid>`; those of a subcommand run to
//! its end (`tally replay`, `tally verify`, …) from `wait4` (CPU) and `/proc` while it runs
//! (peak memory).

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use sqlx::PgPool;
use tally::config::Config;

use crate::{HttpConnection, POLL_MS, STARTUP_TIMEOUT_MS};

/// How long the child may take to stop after SIGTERM (it drains its append queue first).
const STOP_TIMEOUT_MS: u64 = 120_000;
/// Connections the bench's own pool opens on the child's database, for its checks.
const CHECK_POOL_MAX: u32 = 4;
/// The child's log level when `RUST_LOG` is not set: its info lines would bury the table.
const CHILD_LOG_LEVEL: &str = "warn";

/// The `tally` binary to run: the one given, or the one built next to this binary (both
/// land in `target/<profile>/` after `cargo build --workspace`).
pub(crate) fn serve_binary(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    let binary = match given {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe()?
            .parent()
            .context("this binary has no directory")?
            .join("tally"),
    };
    anyhow::ensure!(
        binary.is_file(),
        "no tally binary at {} (build it with `cargo build --release --workspace`, or \
         give --serve-binary)",
        binary.display()
    );
    Ok(binary)
}

/// A running `tally serve`, killed if dropped before [`Served::stop`].
pub(crate) struct Served {
    child: tokio::process::Child,
    pid: u32,
    pub(crate) address: SocketAddr,
    token: String,
    /// The bench's own connections to the child's database.
    pub(crate) pool: PgPool,
}

/// CPU time and memory of a process, from `/proc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessUsage {
    /// User and system time since the process started.
    pub(crate) cpu: Duration,
    /// The peak resident set (`VmHWM`), in MiB.
    pub(crate) peak_mb: f64,
}

impl Served {
    /// Starts `binary serve` with `config`'s database, NATS, namespace and token (the rest
    /// of its settings from this process's environment, as `tally` reads them) and waits
    /// until `/readyz` answers 200.
    pub(crate) async fn start(binary: &Path, config: &Config) -> anyhow::Result<Served> {
        let address = free_address()?;
        let token = config
            .bootstrap_token
            .as_deref()
            .context("the bench gives the service a token")?;
        let child = tokio::process::Command::new(binary)
            .arg("serve")
            .envs(child_env(config))
            .env("TALLY_LISTEN", address.to_string())
            .env("TALLY_BOOTSTRAP_TOKEN", token)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", binary.display()))?;
        let pid = child.id().context("the child has no pid")?;
        let mut served = Served {
            child,
            pid,
            address,
            token: token.to_owned(),
            pool: sqlx::postgres::PgPoolOptions::new()
                .max_connections(CHECK_POOL_MAX)
                .connect_lazy(&config.database_url)?,
        };
        served.wait_until_ready().await?;
        Ok(served)
    }

    async fn wait_until_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_millis(STARTUP_TIMEOUT_MS);
        let readyz: hyper::Uri = "/readyz".parse()?;
        loop {
            if let Some(status) = self.child.try_wait()? {
                anyhow::bail!("tally serve exited during start-up ({status})");
            }
            if let Ok(mut connection) = HttpConnection::open(self.address, "/", &self.token).await {
                if connection.get(&readyz).await.is_ok() {
                    return Ok(());
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "tally serve was not ready within {STARTUP_TIMEOUT_MS} ms"
            );
            tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
        }
    }

    /// The child's process id, for `/proc/<pid>`.
    pub(crate) fn pid(&self) -> u32 {
        self.pid
    }

    /// The child's `/metrics` text.
    pub(crate) async fn metrics(&self) -> anyhow::Result<String> {
        let mut connection = HttpConnection::open(self.address, "/", &self.token).await?;
        let text = connection.get(&"/metrics".parse()?).await?;
        Ok(String::from_utf8(text.to_vec())?)
    }

    /// The child's CPU time so far and its peak memory.
    pub(crate) fn usage(&self) -> anyhow::Result<ProcessUsage> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        Ok(ProcessUsage {
            cpu: cpu_time(&stat)?,
            peak_mb: peak_mb(&status)?,
        })
    }

    /// SIGTERM, then waits for the graceful stop; returns the usage read just before.
    pub(crate) async fn stop(mut self) -> anyhow::Result<ProcessUsage> {
        let usage = self.usage()?;
        let pid = libc::pid_t::try_from(self.pid)?;
        // SAFETY: kill takes no pointers; the pid is our own child, not yet waited for.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            anyhow::bail!(
                "cannot signal tally serve: {}",
                std::io::Error::last_os_error()
            );
        }
        let stopping = Instant::now();
        let stopped =
            tokio::time::timeout(Duration::from_millis(STOP_TIMEOUT_MS), self.child.wait()).await;
        eprintln!(
            "bench: tally serve stopped in {:.1} s",
            stopping.elapsed().as_secs_f64()
        );
        self.pool.close().await;
        match stopped {
            Ok(status) => anyhow::ensure!(status?.success(), "tally serve stopped with an error"),
            Err(_) => anyhow::bail!("tally serve did not stop within {STOP_TIMEOUT_MS} ms"),
        }
        Ok(usage)
    }
}

/// The settings every `tally` child gets from `config` (the rest of its settings from this
/// process's environment, as `tally` reads them).
fn child_env(config: &Config) -> [(&'static str, String); 4] {
    let log_level = std::env::var("RUST_LOG").unwrap_or_else(|_| CHILD_LOG_LEVEL.into());
    [
        ("DATABASE_URL", config.database_url.clone()),
        ("NATS_URL", config.nats_url.clone()),
        ("TALLY_NATS_NAMESPACE", config.nats_namespace.clone()),
        ("RUST_LOG", log_level),
    ]
}

/// A `tally` subcommand that ran to its end.
pub(crate) struct Ran {
    /// What it printed on standard output.
    pub(crate) stdout: String,
    /// From its start to its exit, process start-up and connecting included.
    pub(crate) elapsed: Duration,
    pub(crate) usage: ProcessUsage,
}

/// Runs `binary args…` with `config`'s database, NATS and namespace, to its end; fails
/// unless it exits 0. Its standard error goes to the bench's.
pub(crate) async fn run_cli(binary: &Path, config: &Config, args: &[&str]) -> anyhow::Result<Ran> {
    let mut command = std::process::Command::new(binary);
    command
        .args(args)
        .envs(child_env(config))
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let shown = format!("tally {}", args.join(" "));
    tokio::task::spawn_blocking(move || run_to_end(command, &shown))
        .await
        .context("the subcommand's waiting task failed")?
}

/// Spawns `command`, reads its standard output to the end and reaps it with `wait4` for its
/// CPU time. Its peak memory is `VmHWM`, read from `/proc/<pid>/status` while it runs:
/// `wait4`'s `ru_maxrss` would not do, since Linux carries the resident set of the process
/// that forked (the bench, hundreds of MiB after building a ledger) into the child's
/// `ru_maxrss` across `exec`.
fn run_to_end(mut command: std::process::Command, shown: &str) -> anyhow::Result<Ran> {
    use std::io::Read as _;
    let started = Instant::now();
    let mut child = command
        .spawn()
        .with_context(|| format!("cannot start {shown}"))?;
    let pid = libc::pid_t::try_from(child.id())?;
    let exited = Arc::new(AtomicBool::new(false));
    let watcher = std::thread::spawn({
        let exited = Arc::clone(&exited);
        move || {
            let mut peak = 0.0f64;
            // The last reading is taken after the child closes its output, so a child that
            // grows just before it exits is still seen unless it grows within the last poll.
            loop {
                let done = exited.load(Ordering::Acquire);
                if let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
                    if let Ok(mb) = peak_mb(&status) {
                        peak = peak.max(mb);
                    }
                }
                if done {
                    return peak;
                }
                std::thread::sleep(Duration::from_millis(PEAK_POLL_MS));
            }
        }
    });
    let mut stdout = String::new();
    let read = child
        .stdout
        .take()
        .context("the child's standard output is piped")?
        .read_to_string(&mut stdout);
    exited.store(true, Ordering::Release);
    let peak = watcher
        .join()
        .map_err(|_| anyhow::anyhow!("the peak-memory watcher panicked"))?;
    read?;
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain data, fully written by wait4 when it succeeds.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; the pid is our own child, not yet reaped
    // (std's Child is not waited for after this).
    let waited = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    anyhow::ensure!(
        waited == pid,
        "cannot wait for {shown}: {}",
        std::io::Error::last_os_error()
    );
    let elapsed = started.elapsed();
    anyhow::ensure!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "{shown} failed (wait status {status})"
    );
    let seconds = |time: libc::timeval| time.tv_sec as f64 + time.tv_usec as f64 / 1e6;
    Ok(Ran {
        stdout,
        elapsed,
        usage: ProcessUsage {
            cpu: Duration::from_secs_f64(seconds(usage.ru_utime) + seconds(usage.ru_stime)),
            peak_mb: peak,
        },
    })
}

/// How often the peak memory of a running subcommand is read.
const PEAK_POLL_MS: u64 = 5;

/// A port no one listens on right now, for the child to bind.
fn free_address() -> anyhow::Result<SocketAddr> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?)
}

/// utime + stime of `/proc/<pid>/stat` (fields 14 and 15, after the command name, which
/// may itself hold spaces and parentheses).
fn cpu_time(stat: &str) -> anyhow::Result<Duration> {
    let after_name = &stat[stat.rfind(')').context("no command name in stat")? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |index: usize| -> anyhow::Result<u64> {
        Ok(fields.get(index).context("stat is too short")?.parse()?)
    };
    // Fields 14 and 15 of the whole line; after the name, field 3 is index 0.
    let (user, system) = (ticks(11)?, ticks(12)?);
    // SAFETY: sysconf takes no pointers.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    anyhow::ensure!(per_second > 0, "no clock tick rate");
    Ok(Duration::from_secs_f64(
        (user + system) as f64 / per_second as f64,
    ))
}

/// `VmHWM` of `/proc/<pid>/status`, in MiB.
fn peak_mb(status: &str) -> anyhow::Result<f64> {
    let line = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .context("no VmHWM in status")?;
    let kilobytes: f64 = line.trim().trim_end_matches("kB").trim().parse()?;
    Ok(kilobytes / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_reads_utime_and_stime_after_a_name_with_spaces_and_parentheses() {
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
        let stat = "42 (tally (x) y) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 9 0";
        let expected = Duration::from_secs_f64(300.0 / ticks);
        assert_eq!(cpu_time(stat).unwrap(), expected);
    }

    #[test]
    fn peak_memory_is_vmhwm_in_mebibytes() {
        let status = "Name:\ttally\nVmPeak:\t 9999 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1024 kB\n";
        assert_eq!(peak_mb(status).unwrap(), 2.0);
    }
}
