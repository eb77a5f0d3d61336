//! `tally-bench --outside`: single events driven from outside the bench's process, by
//! `wrk`, against the yardstick driven by `pgbench`, so that the in-process figure can be
//! checked with tools nobody here wrote.
//!
//! It runs in the ingest part after the in-process phases and their checks, against the
//! same running `tally serve` child: `wrk` posts single events from [`WRK_CONNECTIONS`]
//! connections for `--outside-seconds` (a Lua script the bench writes, each request one of
//! the ingest workload's commands of running containers under a fresh UUID, counting the
//! answers that are 200 and new and keeping their positions); then, with the service idle,
//! `pgbench -c 16` runs the yardstick's one-row INSERT a transaction into a table shaped
//! like the ledger. Last, every event `wrk` got a 200 for is looked up in the ledger.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use rand::Rng;
use sqlx::PgConnection;

use crate::cpu::CpuSplit;
use crate::targets::{per_second, Bound, Figure, Row};
use crate::{create_baseline_table, Check, SINGLE_BASELINE_CONNECTIONS, SINGLE_BASELINE_TABLE};

/// `--outside-seconds` when not given: long enough for a stable rate at either end.
pub(crate) const OUTSIDE_SECONDS: u64 = 10;
/// The longest `--outside-seconds`: five minutes of single events is hundreds of thousands
/// of events and positions to check, far past what a stable rate needs.
pub(crate) const OUTSIDE_SECONDS_MAX: u64 = 300;
/// `wrk`'s connections: issue 23's figure ("wrk, 64 connections").
const WRK_CONNECTIONS: usize = 64;
/// `wrk`'s and `pgbench`'s threads: one per core of the machines the bench runs on.
const LOAD_THREADS: usize = 2;
/// `wrk`'s per-request timeout: the bench's own HTTP deadline, so that a slow answer is
/// counted as an answer, not dropped as a timeout.
const WRK_TIMEOUT_SECONDS: u64 = crate::HTTP_TIMEOUT_MS / 1_000;
/// Workload bodies the Lua script cycles through, each under fresh ids: enough variety of
/// orgs and containers, and a script of a few hundred kilobytes at most.
const TEMPLATES_MAX: usize = 1_000;
/// The one event type the Lua script posts: issue 23 measures single events as commands of
/// running containers, and a body repeated under fresh ids must stay such an event. The
/// workload's commands are all of running containers. A repeated lifecycle body would not
/// be: each repetition of a `container.stopped` or `container.created` is a late lifecycle
/// event, which refolds its container's whole history, and every repetition makes that
/// history longer (docs/benchmarks.md, "The outside measurement").
const TEMPLATE_TYPE: &str = "container.command_ran";
/// The table `pgbench` inserts into, shaped like the ledger as the yardstick's is.
const OUTSIDE_TABLE: &str = "outside_single";
/// How long `wrk` or `pgbench` may run beyond the seconds asked before the run fails.
const TOOL_GRACE_SECONDS: u64 = 60;

/// What the outside measurement gave.
pub(crate) struct Outside {
    pub(crate) figures: Figures,
    pub(crate) checks: Vec<Check>,
}

/// The outside measurement's rates.
pub(crate) struct Figures {
    seconds: u64,
    /// Single events answered 200 (and new) a second, by `wrk`.
    events_per_second: f64,
    /// `wrk`'s p99, in milliseconds.
    wrk_p99_ms: f64,
    /// One-row transactions a second, by `pgbench`.
    rows_per_second: f64,
    /// What the machine spent per event answered to `wrk` and per row `pgbench` committed,
    /// in microseconds, each over its tool's run.
    cpu_per_event_us: (Option<f64>, Option<f64>),
}

impl Figures {
    /// Two lines under the ingest part's table.
    pub(crate) fn print(&self) {
        let cpu = |microseconds: Option<f64>| {
            microseconds.map_or_else(String::new, |us| format!(", machine CPU {us:.0} µs each"))
        };
        println!(
            "- outside, {} s each: wrk, {WRK_CONNECTIONS} connections, {:.0} single events/s \
             (p99 {:.2} ms{}); pgbench -c {SINGLE_BASELINE_CONNECTIONS}, {:.0} one-row \
             INSERTs/s{}; {:.3} x",
            self.seconds,
            self.events_per_second,
            self.wrk_p99_ms,
            cpu(self.cpu_per_event_us.0),
            self.rows_per_second,
            cpu(self.cpu_per_event_us.1),
            self.events_per_second / self.rows_per_second
        );
        println!();
    }

    /// The targets table's row.
    pub(crate) fn target(&self) -> Row {
        Row::new(
            Figure::Outside,
            format!(
                "wrk {} vs pgbench {}",
                per_second(self.events_per_second),
                per_second(self.rows_per_second)
            ),
            self.events_per_second,
            self.rows_per_second,
            Bound::AtLeast(1.5),
            "≥ 1.5 ×",
        )
        .with_cpu_per_event(self.cpu_per_event_us.0, self.cpu_per_event_us.1)
    }
}

/// The two tools, found on the `PATH`; fails before anything is created when one is not.
pub(crate) fn tools() -> anyhow::Result<(PathBuf, PathBuf)> {
    let find = |name: &str, package: &str| {
        on_path(name).with_context(|| {
            format!(
                "--outside runs {name}, which is not on the PATH: scripts/load-tools installs it \
                 (Debian package {package}), or install it by hand"
            )
        })
    };
    Ok((find("wrk", "wrk")?, find("pgbench", "postgresql")?))
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|directory| directory.join(name))
        .find(|candidate| candidate.is_file())
}

/// Runs `wrk` against the service at `address`, then `pgbench` on `database_url`, and
/// checks the ledger for every event `wrk` was acknowledged.
pub(crate) async fn measure(
    address: std::net::SocketAddr,
    token: &str,
    database_url: &str,
    pool: &sqlx::PgPool,
    single_bodies: &[Bytes],
    seconds: u64,
) -> anyhow::Result<Outside> {
    let (wrk, pgbench) = tools()?;
    let prefix = format!("{:08x}", rand::rng().random::<u32>());
    let script = Scratch::write(
        &format!("tally-bench-{prefix}.lua"),
        &lua_script(single_bodies, token, &prefix)?,
    )?;
    eprintln!("bench: outside: wrk, {WRK_CONNECTIONS} connections, {seconds} s of single events");
    // The machine's CPU alone: the service's share is in the ingest part's figures.
    let wrk_before = CpuSplit::now(&[]);
    let output = run_tool(
        tokio::process::Command::new(&wrk)
            .arg(format!("-t{LOAD_THREADS}"))
            .arg(format!("-c{WRK_CONNECTIONS}"))
            .arg(format!("-d{seconds}s"))
            .arg(format!("--timeout={WRK_TIMEOUT_SECONDS}s"))
            .arg("-s")
            .arg(&script.0)
            .arg(format!("http://{address}/v1/events")),
        seconds,
    )
    .await?;
    let wrk_cpu = CpuSplit::machine_seconds(wrk_before, CpuSplit::now(&[]));
    let answered = WrkAnswers::parse(&output)?;
    let mut checks = vec![answered.all_ok_check()];
    checks.push(acknowledged_in_ledger(pool, &answered, &prefix).await?);

    eprintln!(
        "bench: outside: pgbench -c {SINGLE_BASELINE_CONNECTIONS}, {seconds} s of one-row INSERTs"
    );
    let mut connection = sqlx::Connection::connect(database_url).await?;
    let pgbench_script = Scratch::write(
        &format!("tally-bench-{prefix}.sql"),
        &pgbench_script(&mut connection).await?,
    )?;
    let pgbench_before = CpuSplit::now(&[]);
    let output = run_tool(
        tokio::process::Command::new(&pgbench)
            .args(["-n", "-M", "prepared"])
            .arg(format!("-c{SINGLE_BASELINE_CONNECTIONS}"))
            .arg(format!("-j{LOAD_THREADS}"))
            .arg(format!("-T{seconds}"))
            .arg("-f")
            .arg(&pgbench_script.0)
            .arg(database_url),
        seconds,
    )
    .await?;
    let pgbench_cpu = CpuSplit::machine_seconds(pgbench_before, CpuSplit::now(&[]));
    let (transactions, rows_per_second) = parse_pgbench(&output)?;
    let inserted: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {OUTSIDE_TABLE}"))
        .fetch_one(&mut connection)
        .await?;
    sqlx::Connection::close(connection).await?;
    checks.push(Check {
        description: format!(
            "pgbench processed {transactions} transactions and {OUTSIDE_TABLE} holds {inserted} rows"
        ),
        passed: i64::try_from(transactions)? == inserted,
    });
    Ok(Outside {
        figures: Figures {
            seconds,
            events_per_second: answered.ok as f64 / answered.seconds,
            wrk_p99_ms: answered.p99_ms,
            rows_per_second,
            cpu_per_event_us: (
                CpuSplit::per_event_us(wrk_cpu, answered.ok),
                CpuSplit::per_event_us(pgbench_cpu, transactions),
            ),
        },
        checks,
    })
}

/// A file of the bench's in the temporary directory, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn write(name: &str, contents: &str) -> anyhow::Result<Scratch> {
        let path = std::env::temp_dir().join(name);
        std::fs::write(&path, contents)
            .with_context(|| format!("cannot write {}", path.display()))?;
        Ok(Scratch(path))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs a load tool to its end (killed if the run is dropped or it overruns); its stdout.
async fn run_tool(command: &mut tokio::process::Command, seconds: u64) -> anyhow::Result<String> {
    let program = Path::new(command.as_std().get_program())
        .display()
        .to_string();
    let output = tokio::time::timeout(
        Duration::from_secs(seconds + TOOL_GRACE_SECONDS),
        command
            .kill_on_drop(true)
            .stdin(std::process::Stdio::null())
            .output(),
    )
    .await
    .with_context(|| format!("{program} ran {TOOL_GRACE_SECONDS} s past its duration"))?
    .with_context(|| format!("cannot run {program}"))?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    anyhow::ensure!(
        output.status.success(),
        "{program} failed ({}): {}{stdout}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout)
}

/// The Lua script `wrk` runs. Each request is one of the workload's single events that is a
/// command of a running container ([`TEMPLATE_TYPE`]), under a UUID of its own
/// (`<prefix>-<thread>-4000-8000-<counter>`), so that every request is a new event and the
/// ledger can be searched for them; `response` counts the 200s that were new and keeps
/// their positions, and `done` prints what the threads counted.
fn lua_script(single_bodies: &[Bytes], token: &str, prefix: &str) -> anyhow::Result<String> {
    let mut templates = String::new();
    let mut kept = 0;
    for body in single_bodies {
        if kept == TEMPLATES_MAX {
            break;
        }
        let mut event: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(body)?;
        if event.get("type").and_then(|kind| kind.as_str()) != Some(TEMPLATE_TYPE) {
            continue;
        }
        kept += 1;
        event.remove("id").context("a single event has an id")?;
        let rest = serde_json::Value::Object(event).to_string();
        let rest = rest.strip_prefix('{').context("an object")?;
        anyhow::ensure!(
            !rest.contains("]==]"),
            "a body that closes a Lua long string"
        );
        writeln!(templates, "  {{[==[{{\"id\":\"]==], [==[\",{rest}]==]}},")?;
    }
    anyhow::ensure!(
        kept > 0,
        "no single event of the workload is a {TEMPLATE_TYPE} to post from outside"
    );
    Ok(format!(
        r#"-- Written by tally-bench --outside; removed after the run.
local templates = {{
{templates}}}
local headers = {{
  ["Authorization"] = "Bearer {token}",
  ["Content-Type"] = "application/json",
}}
local threads = {{}}

function setup(thread)
  thread:set("thread_index", #threads)
  table.insert(threads, thread)
end

function init(args)
  sent = 0
  ok = 0
  other = 0
  positions = {{}}
end

function request()
  sent = sent + 1
  local template = templates[(sent * {LOAD_THREADS} + thread_index) % #templates + 1]
  local id = string.format("{prefix}-%04x-4000-8000-%012x", thread_index, sent)
  return wrk.format("POST", nil, headers, template[1] .. id .. template[2])
end

function response(status, headers, body)
  local position = nil
  if status == 200 and string.find(body, '"duplicate":false', 1, true) then
    position = string.match(body, '"position":(%d+)')
  end
  if position then
    ok = ok + 1
    positions[#positions + 1] = position
  else
    other = other + 1
  end
end

function done(summary, latency, requests)
  local ok, other, errors = 0, 0, 0
  for _, thread in ipairs(threads) do
    ok = ok + thread:get("ok")
    other = other + thread:get("other")
    io.write("tally-wrk positions ", table.concat(thread:get("positions"), ","), "\n")
  end
  for _, count in pairs(summary.errors) do
    errors = errors + count
  end
  io.write(string.format("tally-wrk ok %d other %d errors %d duration_us %d p99_us %d\n",
    ok, other, errors, summary.duration, latency:percentile(99)))
end
"#
    ))
}

/// What `wrk`'s `done` printed.
struct WrkAnswers {
    /// Answers 200 with a new event.
    ok: u64,
    /// Any other answer.
    other: u64,
    /// Connection, read, write and timeout errors, and statuses above 399.
    errors: u64,
    seconds: f64,
    p99_ms: f64,
    /// The ledger positions of the `ok` answers.
    positions: Vec<i64>,
}

impl WrkAnswers {
    fn parse(output: &str) -> anyhow::Result<WrkAnswers> {
        let mut positions = Vec::new();
        let mut totals = None;
        for line in output.lines() {
            if let Some(list) = line.strip_prefix("tally-wrk positions ") {
                for position in list.split(',').filter(|p| !p.is_empty()) {
                    positions.push(position.parse()?);
                }
            } else if let Some(figures) = line.strip_prefix("tally-wrk ") {
                let words: Vec<&str> = figures.split_whitespace().collect();
                let value = |name: &str| -> anyhow::Result<u64> {
                    let index = words
                        .iter()
                        .position(|word| *word == name)
                        .with_context(|| format!("no {name} in wrk's line {line:?}"))?;
                    Ok(words.get(index + 1).context("a value")?.parse()?)
                };
                totals = Some((
                    value("ok")?,
                    value("other")?,
                    value("errors")?,
                    value("duration_us")?,
                    value("p99_us")?,
                ));
            }
        }
        let (ok, other, errors, duration_us, p99_us) =
            totals.with_context(|| format!("no totals in wrk's output: {output}"))?;
        anyhow::ensure!(duration_us > 0, "wrk ran for no time");
        Ok(WrkAnswers {
            ok,
            other,
            errors,
            seconds: duration_us as f64 / 1e6,
            p99_ms: p99_us as f64 / 1e3,
            positions,
        })
    }

    fn all_ok_check(&self) -> Check {
        Check {
            description: format!(
                "wrk: {} answers 200 with a new event, {} other answers, {} errors",
                self.ok, self.other, self.errors
            ),
            passed: self.ok > 0 && self.other == 0 && self.errors == 0,
        }
    }
}

/// Every event `wrk` was answered 200 for is in the ledger at the position it was told,
/// and no id of `wrk`'s is there twice. The ledger may hold a few more of them than `wrk`
/// counted: requests in flight when it stopped are committed, but not counted.
async fn acknowledged_in_ledger(
    pool: &sqlx::PgPool,
    answered: &WrkAnswers,
    prefix: &str,
) -> anyhow::Result<Check> {
    let pattern = format!("{prefix}-%");
    let (found, distinct_positions): (i64, i64) = sqlx::query_as(
        "SELECT count(*), (SELECT count(DISTINCT p) FROM unnest($1::bigint[]) AS p) \
         FROM ledger WHERE position = ANY($1) AND id::text LIKE $2",
    )
    .bind(&answered.positions)
    .bind(&pattern)
    .fetch_one(pool)
    .await?;
    let (stored, distinct_ids): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT id) FROM ledger WHERE id::text LIKE $1")
            .bind(&pattern)
            .fetch_one(pool)
            .await?;
    let acknowledged = i64::try_from(answered.positions.len())?;
    let in_flight = stored - acknowledged;
    Ok(Check {
        description: format!(
            "the {acknowledged} events wrk got a 200 for are in the ledger at their positions \
             ({found} found, {distinct_positions} distinct positions); the ledger holds \
             {stored} events of wrk's, {distinct_ids} distinct ids ({in_flight} in flight when \
             wrk stopped, at most {WRK_CONNECTIONS})"
        ),
        passed: acknowledged == i64::try_from(answered.ok)?
            && found == acknowledged
            && distinct_positions == acknowledged
            && distinct_ids == stored
            && (0..=WRK_CONNECTIONS as i64).contains(&in_flight),
    })
}

/// Creates `pgbench`'s table and returns its script: the yardstick's one-row INSERT, each
/// transaction a row of the yardstick's own table (picked at random, under a new position
/// and id), so that the rows vary as the yardstick's do.
async fn pgbench_script(connection: &mut PgConnection) -> anyhow::Result<String> {
    create_baseline_table(connection, OUTSIDE_TABLE).await?;
    sqlx::query(&format!("CREATE SEQUENCE {OUTSIDE_TABLE}_position"))
        .execute(&mut *connection)
        .await?;
    let (first, last): (Option<i64>, Option<i64>) = sqlx::query_as(&format!(
        "SELECT min(position), max(position) FROM {SINGLE_BASELINE_TABLE}"
    ))
    .fetch_one(&mut *connection)
    .await?;
    let (first, last) = first.zip(last).context("the yardstick's table is empty")?;
    let columns = crate::rows::COLUMNS;
    let copied = columns.split(", ").skip(2).collect::<Vec<_>>().join(", ");
    anyhow::ensure!(
        columns.starts_with("position, id, "),
        "the ledger's columns start with position and id"
    );
    Ok(format!(
        "\\set row random({first}, {last})\n\
         INSERT INTO {OUTSIDE_TABLE} ({columns}) \
         SELECT nextval('{OUTSIDE_TABLE}_position'), gen_random_uuid(), {copied} \
         FROM {SINGLE_BASELINE_TABLE} WHERE position = :row;\n"
    ))
}

/// `pgbench`'s transactions and rate (without connection time).
fn parse_pgbench(output: &str) -> anyhow::Result<(u64, f64)> {
    let after = |prefix: &str| {
        output
            .lines()
            .find_map(|line| line.trim().strip_prefix(prefix))
            .with_context(|| format!("no {prefix:?} in pgbench's output: {output}"))
    };
    let transactions = after("number of transactions actually processed: ")?
        .split_whitespace()
        .next()
        .context("a count")?
        .parse()?;
    let rate = after("tps = ")?
        .split_whitespace()
        .next()
        .context("a rate")?
        .parse()?;
    Ok((transactions, rate))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrk_totals_and_positions_are_read_from_the_script_output() {
        let output = "Running 2s test @ http://127.0.0.1:1/v1/events\n\
                      tally-wrk positions 4,7,9\n\
                      tally-wrk positions \n\
                      tally-wrk ok 3 other 1 errors 2 duration_us 2000000 p99_us 1500\n";
        let answers = WrkAnswers::parse(output).expect("parses");
        assert_eq!(answers.positions, vec![4, 7, 9]);
        assert_eq!((answers.ok, answers.other, answers.errors), (3, 1, 2));
        assert_eq!(answers.seconds, 2.0);
        assert_eq!(answers.p99_ms, 1.5);
        assert!(!answers.all_ok_check().passed);
    }

    #[test]
    fn the_wrk_script_posts_only_the_commands_among_the_single_events() {
        let body = |kind: &str, container: &str| {
            Bytes::from(
                serde_json::json!({
                    "id": "0193a0a0-0000-7000-8000-000000000000",
                    "type": kind,
                    "org_id": "org_1",
                    "container_id": container,
                    "occurred_at": "2026-12-01T00:00:00.000Z",
                    "data": {},
                })
                .to_string(),
            )
        };
        let bodies = [
            body("container.created", "ctr_created"),
            body(TEMPLATE_TYPE, "ctr_command"),
            body("container.stopped", "ctr_stopped"),
        ];
        let script = lua_script(&bodies, "token", "prefix").expect("a script");
        assert!(script.contains("ctr_command"));
        assert!(!script.contains("ctr_created") && !script.contains("ctr_stopped"));
        assert!(
            !script.contains("0193a0a0"),
            "every request gets an id of its own"
        );

        let error = lua_script(&bodies[..1], "token", "prefix").expect_err("no command");
        assert!(error.to_string().contains(TEMPLATE_TYPE), "{error}");
    }

    #[test]
    fn pgbench_transactions_and_rate_are_read_from_its_summary() {
        let output = "number of clients: 16\n\
                      number of transactions actually processed: 1234\n\
                      latency average = 12.9 ms\n\
                      tps = 1233.456789 (without initial connection time)\n";
        assert_eq!(parse_pgbench(output).expect("parses"), (1234, 1233.456789));
    }
}
