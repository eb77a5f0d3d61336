//! The notice every projector round (and a replay's swap, and a reservation granted or
//! released) sends on a Postgres channel when its transaction commits: the new checkpoint
//! and the orgs whose figures changed. Instances hear it to drop the admission facts they
//! keep (`admission::cache`) and to wake reads waiting for another instance's projector.
//! A round's notice also carries a tag, under which the instance that projected it keeps
//! what the round changed ([`Rounds`]): its own listener, hearing the tag, advances the
//! facts it keeps by those changes instead of dropping them.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::model::Changes;

/// The channel of the notices.
pub const CHANNEL: &str = "tally_admission";
/// Postgres refuses a notice of 8 000 bytes or more; past this many a round says "all".
pub const NOTICE_BYTES_MAX: usize = 7_000;
/// What a notice says has changed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// The projection's checkpoint after the change, when it comes from a projector round.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<i64>,
    /// The orgs whose facts may have changed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub orgs: Vec<String>,
    /// Everything may have changed.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub all: bool,
    /// The tag of the projector round that sent it, under which the projecting instance
    /// keeps the round's changes in its [`Rounds`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<u64>,
}

impl Notice {
    /// Everything may have changed.
    pub fn all(position: Option<i64>) -> Notice {
        Notice {
            position,
            orgs: Vec::new(),
            all: true,
            round: None,
        }
    }

    /// The notice of a change to `org`'s reservations.
    pub fn of_org(org: &str) -> String {
        Notice {
            position: None,
            orgs: vec![org.to_owned()],
            all: false,
            round: None,
        }
        .to_string()
    }

    /// The notice of a projector round up to `position` over events of `orgs`, tagged
    /// `round`; "all" when `all` or when the orgs do not fit in one notice.
    pub fn of_round<'a>(
        position: i64,
        orgs: impl IntoIterator<Item = &'a str>,
        all: bool,
        round: Option<u64>,
    ) -> String {
        let mut notice = Notice {
            position: Some(position),
            orgs: Vec::new(),
            all,
            round,
        };
        if !all {
            let mut orgs: Vec<String> = orgs.into_iter().map(str::to_owned).collect();
            orgs.sort_unstable();
            orgs.dedup();
            notice.orgs = orgs;
        }
        let payload = notice.to_string();
        if payload.len() <= NOTICE_BYTES_MAX {
            return payload;
        }
        Notice::all(Some(position)).to_string()
    }
}

/// Rounds kept for the listener at most; a round's notice arrives within milliseconds of
/// its commit, so older ones are those whose commit failed, and are dropped first.
pub const ROUNDS_KEPT_MAX: usize = 16;

/// What one projector round changed, for the admission facts of the instance that
/// projected it.
#[derive(Debug)]
pub struct RoundChanges {
    /// As written, port counts included.
    pub changes: Changes,
    /// Orgs whose facts the changes do not advance and which are read again: those with an
    /// account event or a void in the round, or with a reservation the round consumed.
    pub reread: HashSet<String>,
}

/// This instance's projector rounds whose notices its listener has not heard yet, by tag.
/// A round is put here before its transaction commits, so that its notice, sent at the
/// commit, always finds it.
#[derive(Debug, Clone, Default)]
pub struct Rounds(Arc<Mutex<VecDeque<Tagged>>>);

/// A round's changes under its tag.
type Tagged = (u64, RoundChanges);

impl Rounds {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Tagged>> {
        self.0
            .lock()
            .expect("the rounds are never held across a panic")
    }

    /// Keeps `changes` under the round's tag `round`, dropping the oldest past the limit.
    pub fn record(&self, round: u64, changes: RoundChanges) {
        let mut rounds = self.lock();
        if rounds.len() >= ROUNDS_KEPT_MAX {
            rounds.pop_front();
        }
        rounds.push_back((round, changes));
    }

    /// The changes of the round tagged `round`, taken out; `None` when this instance did
    /// not project it (or dropped it).
    pub fn take(&self, round: u64) -> Option<RoundChanges> {
        let mut rounds = self.lock();
        let index = rounds.iter().position(|(tag, _)| *tag == round)?;
        rounds.remove(index).map(|(_, changes)| changes)
    }

    /// Rounds kept now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let json = serde_json::to_string(self).map_err(|_| std::fmt::Error)?;
        f.write_str(&json)
    }
}

/// Sends `payload` on [`CHANNEL`] when the transaction of `executor` commits (at once
/// outside a transaction).
pub async fn notify(executor: impl sqlx::PgExecutor<'_>, payload: &str) -> sqlx::Result<()> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(CHANNEL)
        .bind(payload)
        .execute(executor)
        .await?;
    Ok(())
}
