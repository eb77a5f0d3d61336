//! CloudEvents stored under their unscoped (legacy) id keep it (see
//! `docs/decisions/0003-cloudevents-ids-scoped-by-org.md`).
//!
//! The parser gives every CloudEvent its org-scoped id. Before such events go to the
//! appender, one query asks whether the ledger already holds any of them under its legacy
//! id — the same org, the same `source` and `id` — and those take the legacy id back, so
//! that a producer retrying an event stored under its legacy id gets a duplicate (or a 409
//! for other content), as for any event. No new row is ever written with a legacy id, so
//! the answer for an event never changes from "no" to "yes": the lookup is stable.

use std::collections::HashMap;

use sqlx::PgExecutor;
use uuid::Uuid;

use crate::event::parse::legacy_cloudevent_ledger_id;
use crate::event::Event;

/// Gives each CloudEvent of `events` that the ledger holds under its legacy id that id.
/// One query, and none when no event is a CloudEvent.
#[tracing::instrument(skip_all)]
pub async fn adopt(executor: impl PgExecutor<'_>, events: &mut [Event]) -> sqlx::Result<()> {
    let legacy: Vec<(usize, Uuid)> = events
        .iter()
        .enumerate()
        .filter_map(|(index, event)| {
            let origin = event.origin.as_ref()?;
            let id = legacy_cloudevent_ledger_id(&origin.source, &origin.id);
            Some((index, id.as_uuid()))
        })
        .collect();
    if legacy.is_empty() {
        return Ok(());
    }
    let ids: Vec<Uuid> = legacy.iter().map(|(_, id)| *id).collect();
    // Matched on org, source and original id too: a legacy id that another org took, or
    // that a native event happens to carry, is not this event's.
    // Through `ledger_ids`, so that each id is looked for in its own month only.
    let stored: Vec<(Uuid, String, Option<String>, Option<String>)> = sqlx::query_as(
        "SELECT l.id, l.org_id, l.source, l.source_event_id \
         FROM ledger_ids i JOIN ledger l USING (position, recorded_at) WHERE i.id = ANY($1)",
    )
    .bind(&ids)
    .fetch_all(executor)
    .await?;
    if stored.is_empty() {
        return Ok(());
    }
    let stored: HashMap<Uuid, (String, Option<String>, Option<String>)> = stored
        .into_iter()
        .map(|(id, org, source, source_id)| (id, (org, source, source_id)))
        .collect();
    for (index, legacy_id) in legacy {
        let event = &mut events[index];
        let origin = event.origin.as_ref().expect("only CloudEvents were listed");
        let same = stored
            .get(&legacy_id)
            .is_some_and(|(org, source, source_id)| {
                org == event.org_id.as_str()
                    && source.as_deref() == Some(origin.source.as_str())
                    && source_id.as_deref() == Some(origin.id.as_str())
            });
        if same {
            event.id = crate::event::EventId::from_uuid(legacy_id).expect("a v5 UUID is never nil");
        }
    }
    Ok(())
}
