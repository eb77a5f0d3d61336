//! The service's clock: what "now" is for every rule that depends on it (the current period,
//! the bounds on an event's time, `as_of`, a reservation's expiry, whether a period has
//! ended). In production it is the system clock; a test sets it to an instant of its choice,
//! from which it keeps moving at the system clock's pace, because the service also waits,
//! times out and lets reservations expire. See docs/decisions/0020-clock.md.

use chrono::{DateTime, Duration, Utc};

/// A clock that runs at the system clock's pace, at a fixed offset from it (none for the
/// system clock itself). Cheap to copy; every copy reads the same time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Clock {
    offset: Duration,
}

impl Clock {
    /// The system clock.
    pub fn system() -> Clock {
        Clock::default()
    }

    /// A clock that reads `instant` now and moves on from there.
    pub fn starting_at(instant: DateTime<Utc>) -> Clock {
        Clock {
            offset: instant - Utc::now(),
        }
    }

    pub fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    #[test]
    fn the_system_clock_reads_the_system_time() {
        let before = Utc::now();
        let now = Clock::system().now();
        assert!(before <= now && now <= Utc::now());
    }

    #[test]
    fn a_clock_started_at_an_instant_reads_it_and_moves_on() {
        let instant = Utc.with_ymd_and_hms(2026, 10, 15, 12, 0, 0).unwrap();
        let started = Utc::now();
        let clock = Clock::starting_at(instant);
        let first = clock.now();
        assert!(first >= instant && first - instant <= Utc::now() - started);
        std::thread::sleep(std::time::Duration::from_millis(5));
        assert!(clock.now() - first >= Duration::milliseconds(5));
    }
}
