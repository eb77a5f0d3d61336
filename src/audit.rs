//! `tally audit`: the ledger as a readable timeline, one line per event, in position order.

use std::io::Write;

use anyhow::{anyhow, bail};
use sqlx::PgPool;

use crate::cli::AuditArgs;
use crate::event::canonical;
use crate::event::{ContainerId, EventType, OrgId};
use crate::http::audit::PAGE_MAX;
use crate::ledger::read::{self, Filter};

pub async fn print_timeline(
    pool: &PgPool,
    args: &AuditArgs,
    out: &mut impl Write,
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
    writeln!(
        out,
        "{:>10}  {:<24}  {:<24}  {:<32}  {:<24}  data",
        "position", "occurred_at", "recorded_at", "type", "org/container"
    )?;
    let mut after = args.after;
    let mut left = args.limit;
    while left > 0 {
        let rows = read::read_filtered(pool, &filter, after, left.min(PAGE_MAX)).await?;
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
