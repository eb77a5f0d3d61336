//! `tally audit`: the ledger as a readable timeline, one line per event, in position order.
//!
//! It reads the ledger itself, not a projection, so it sees every acknowledged event. It
//! takes the head at its start, says it (`# ledger head N`, on the notes stream: standard
//! error from the command line) and prints the events up to it, no further: the timeline is
//! the ledger as it stood at that position, however many pages it takes and whatever is
//! appended meanwhile.

use std::io::Write;
use std::process::ExitCode;

use anyhow::{anyhow, bail};
use sqlx::PgPool;

use crate::config::Config;
use crate::event::canonical;
use crate::event::{ContainerId, EventType, OrgId};
use crate::http::audit::PAGE_MAX;
use crate::ledger::db;
use crate::ledger::read::{self, Filter};

/// The filters and page of `tally audit`.
#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    #[arg(long)]
    pub org: Option<String>,
    #[arg(long)]
    pub container: Option<String>,
    /// An event type, e.g. `container.stopped`.
    #[arg(long = "type")]
    pub event_type: Option<String>,
    /// Start after this position.
    #[arg(long, default_value_t = 0)]
    pub after: i64,
    /// Events to print at most.
    #[arg(long, default_value_t = 100)]
    pub limit: usize,
}

/// `tally audit`: the timeline to standard output, the head to standard error.
pub async fn run(config: &Config, args: &AuditArgs) -> anyhow::Result<ExitCode> {
    let pool = db::prepare(config).await?;
    let (mut out, mut notes) = (std::io::stdout(), std::io::stderr());
    let printed = print_timeline(&pool, args, &mut out, &mut notes).await;
    pool.close().await;
    printed?;
    Ok(ExitCode::SUCCESS)
}

/// Prints the timeline to `out` and the head it was read at to `notes`.
pub async fn print_timeline(
    pool: &PgPool,
    args: &AuditArgs,
    out: &mut impl Write,
    notes: &mut impl Write,
) -> anyhow::Result<()> {
    if let Some(org) = &args.org {
        OrgId::parse(org).map_err(|error| anyhow!("--org: {error}"))?;
    }
    if let Some(container) = &args.container {
        ContainerId::parse(container).map_err(|error| anyhow!("--container: {error}"))?;
    }
    if let Some(event_type) = &args.event_type {
        if EventType::parse(event_type).is_none() {
            bail!("--type: {event_type:?} is not an event type");
        }
    }
    let filter = Filter {
        org_id: args.org.as_deref(),
        container_id: args.container.as_deref(),
        event_type: args.event_type.as_deref(),
    };
    let head = read::head(pool).await?.position;
    writeln!(notes, "# ledger head {head}")?;
    writeln!(
        out,
        "{:>10}  {:<24}  {:<24}  {:<32}  {:<24}  data",
        "position", "occurred_at", "recorded_at", "type", "org/container"
    )?;
    let mut after = args.after;
    let mut left = args.limit;
    while left > 0 && after < head {
        let mut rows = read::read_filtered(pool, &filter, after, left.min(PAGE_MAX)).await?;
        // Appended after the head was taken: not in this timeline.
        rows.retain(|row| row.position <= head);
        let Some(last) = rows.last() else { break };
        after = last.position;
        left -= rows.len();
        for row in &rows {
            let owner = match &row.container_id {
                Some(container) => format!("{}/{}", row.org_id, container),
                None => row.org_id.clone(),
            };
            writeln!(
                out,
                "{:>10}  {:<24}  {:<24}  {:<32}  {:<24}  {}",
                row.position,
                canonical::timestamp(row.occurred_at),
                canonical::timestamp(row.recorded_at),
                row.event_type,
                owner,
                row.data
            )?;
        }
    }
    Ok(())
}
