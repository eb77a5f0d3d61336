//! The notice every projector round (and a replay's swap, and a reservation granted or
//! released) sends on a Postgres channel when its transaction commits: the new checkpoint
//! and the orgs whose figures changed. Instances hear it to drop the admission facts they
//! keep (`admission::cache`) and to wake reads waiting for another instance's projector.

use serde::{Deserialize, Serialize};

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
}

impl Notice {
    /// Everything may have changed.
    pub fn all(position: Option<i64>) -> Notice {
        Notice {
            position,
            orgs: Vec::new(),
            all: true,
        }
    }

    /// The notice of a change to `org`'s reservations.
    pub fn of_org(org: &str) -> String {
        Notice {
            position: None,
            orgs: vec![org.to_owned()],
            all: false,
        }
        .to_string()
    }

    /// The notice of a projector round up to `position` over events of `orgs`; "all" when
    /// `all` or when the orgs do not fit in one notice.
    pub fn of_round<'a>(
        position: i64,
        orgs: impl IntoIterator<Item = &'a str>,
        all: bool,
    ) -> String {
        let mut notice = Notice {
            position: Some(position),
            orgs: Vec::new(),
            all,
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
