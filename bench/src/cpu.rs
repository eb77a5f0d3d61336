//! Who used the machine's CPU during a phase, from `/proc`: the `tally serve` children, every
//! Postgres process, every nats-server, the bench itself, and the machine as a whole. It
//! tells what bounds a phase: the service, the database, the broker or the load generator.
//!
//! Postgres forks a backend per connection; a backend's time is read from its own
//! `/proc/<pid>/stat` while it lives and from the postmaster's reaped-children time
//! (`cutime` + `cstime`) after it exits, so summing both over every `postgres` process
//! counts each backend once, whenever it started or ended, except between its exit and
//! the postmaster reaping it: a phase takes its last reading before it closes the
//! connections it opened. The sums are of every such process on the machine: another
//! client of the same server is counted too.

use std::time::{Duration, Instant};

use crate::child::Served;

/// Linux reports CPU time in clock ticks of `USER_HZ`, which is 100 on every architecture
/// the service runs on.
const CLOCK_TICKS_PER_SECOND: f64 = 100.0;

/// CPU time so far, in seconds.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CpuSplit {
    at: Instant,
    tally: f64,
    postgres: f64,
    nats: f64,
    bench: f64,
    /// Every core's non-idle time.
    busy: f64,
}

impl CpuSplit {
    /// `None` where `/proc` does not tell.
    pub(crate) fn now(services: &[Served]) -> Option<CpuSplit> {
        let mut tally = 0.0;
        for service in services {
            tally += service.usage().ok()?.cpu.as_secs_f64();
        }
        let (postgres, nats) = named_processes_seconds(&["postgres", "nats-server"]);
        let bench = own_seconds(&std::fs::read_to_string("/proc/self/stat").ok()?)?;
        Some(CpuSplit {
            at: Instant::now(),
            tally,
            postgres,
            nats,
            bench,
            busy: machine_busy_seconds(&std::fs::read_to_string("/proc/stat").ok()?)?,
        })
    }

    /// The machine's busy core-seconds between two readings: every process on it, the
    /// load generator and the service alike. Divided by what a phase did, it is what the
    /// phase cost the machine per event, which is what two figures on the same cores can
    /// be compared by.
    pub(crate) fn machine_seconds(
        before: Option<CpuSplit>,
        after: Option<CpuSplit>,
    ) -> Option<f64> {
        Some((after?.busy - before?.busy).max(0.0))
    }

    /// `seconds` of the machine's CPU (from [`CpuSplit::machine_seconds`]) over `count`
    /// things done, in microseconds each; `None` when either is unknown or nothing, as a
    /// part too short for `/proc`'s ticks reads.
    pub(crate) fn per_event_us(seconds: Option<f64>, count: u64) -> Option<f64> {
        let seconds = seconds?;
        (count > 0 && seconds > 0.0).then(|| seconds / count as f64 * 1e6)
    }

    /// "CPU cores: tally serve A, Postgres B, nats-server C, the bench D, machine E busy of
    /// F" between two readings.
    pub(crate) fn describe(before: Option<CpuSplit>, after: Option<CpuSplit>) -> String {
        let (Some(before), Some(after)) = (before, after) else {
            return "CPU use unknown".to_owned();
        };
        let elapsed = after
            .at
            .duration_since(before.at)
            .max(Duration::from_millis(1));
        let cores = |after: f64, before: f64| (after - before).max(0.0) / elapsed.as_secs_f64();
        let machine = std::thread::available_parallelism().map_or(0, |n| n.get());
        format!(
            "CPU cores: tally serve {:.2}, Postgres {:.2}, nats-server {:.2}, the bench {:.2}; \
             machine {:.2} busy of {machine}",
            cores(after.tally, before.tally),
            cores(after.postgres, before.postgres),
            cores(after.nats, before.nats),
            cores(after.bench, before.bench),
            cores(after.busy, before.busy),
        )
    }
}

/// CPU seconds of every process named `names[0]` and of every one named `names[1]`, each
/// with the time of its reaped children.
fn named_processes_seconds(names: &[&str; 2]) -> (f64, f64) {
    let mut sums = (0.0, 0.0);
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return sums;
    };
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let Some(pid) = file_name.to_str() else {
            continue;
        };
        if !pid.bytes().all(|byte| byte.is_ascii_digit()) {
            continue;
        }
        // A process may exit between the listing and the read: it is simply not counted
        // here, and its parent's reaped-children time counts it at the next reading.
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((name, seconds)) = name_and_seconds_with_children(&stat) else {
            continue;
        };
        if name == names[0] {
            sums.0 += seconds;
        } else if name == names[1] {
            sums.1 += seconds;
        }
    }
    sums
}

/// The fields of `/proc/<pid>/stat` after the command name (which may itself hold spaces
/// and parentheses), with the name.
fn split_stat(stat: &str) -> Option<(&str, Vec<&str>)> {
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let name = stat.get(open + 1..close)?;
    Some((name, stat.get(close + 1..)?.split_whitespace().collect()))
}

/// The command name and utime + stime + cutime + cstime (fields 14 to 17), in seconds.
fn name_and_seconds_with_children(stat: &str) -> Option<(&str, f64)> {
    let (name, fields) = split_stat(stat)?;
    // Field 3 of the whole line is index 0 after the name.
    let mut ticks = 0_u64;
    for index in 11..=14 {
        ticks += fields.get(index)?.parse::<u64>().ok()?;
    }
    Some((name, ticks as f64 / CLOCK_TICKS_PER_SECOND))
}

/// utime + stime of a process's own threads, in seconds.
pub(crate) fn own_seconds(stat: &str) -> Option<f64> {
    let (_, fields) = split_stat(stat)?;
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / CLOCK_TICKS_PER_SECOND)
}

/// Every core's non-idle time from `/proc/stat`'s first line, in seconds.
pub(crate) fn machine_busy_seconds(stat: &str) -> Option<f64> {
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|value| value.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …: idle and iowait are not busy.
    let total: u64 = ticks.iter().take(8).sum();
    let idle = ticks.get(3)? + ticks.get(4)?;
    Some((total - idle) as f64 / CLOCK_TICKS_PER_SECOND)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_counts_its_own_and_its_reaped_childrens_time_after_a_name_with_spaces() {
        let stat = "42 (postgres: x (y)) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 30 20 20 0 9 0";
        let (name, seconds) = name_and_seconds_with_children(stat).unwrap();
        assert_eq!(name, "postgres: x (y)");
        assert_eq!(seconds, 3.5);
        assert_eq!(own_seconds(stat), Some(3.0));
    }

    #[test]
    fn cpu_per_event_is_unknown_for_nothing_done_or_no_tick_counted() {
        assert_eq!(CpuSplit::per_event_us(Some(1.5), 1_000), Some(1_500.0));
        assert_eq!(CpuSplit::per_event_us(Some(1.5), 0), None);
        assert_eq!(CpuSplit::per_event_us(Some(0.0), 1_000), None);
        assert_eq!(CpuSplit::per_event_us(None, 1_000), None);
    }

    #[test]
    fn the_machine_is_busy_for_everything_but_idle_and_iowait() {
        let stat = "cpu  100 5 50 1000 40 3 2 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(machine_busy_seconds(stat), Some(1.6));
    }
}
