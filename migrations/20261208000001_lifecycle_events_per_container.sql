-- The fold walks at most 250 000 lifecycle events (`created`, `resumed`, `stopped`) of a
-- container (LIFECYCLE_EVENTS_MAX in src/runtime/container.rs): a container still running
-- after the last of them stops at its instant, and every later one is the anomaly
-- `lifecycle_past_limit`. A late lifecycle event makes the projector read the container's
-- lifecycle events again, and one container's stray stops without end made each such read
-- longer than the last (a million of them held every org's reads for about two seconds).
-- The read now stops at the first 260 000; the projection keeps each container's number of
-- lifecycle events, so that the ones it does not read are still counted as anomalies. See
-- docs/decisions/0056-lifecycle-events-per-container.md.
--
-- Replay builds its schema with `tally_create_projection_schema`; as in the earlier
-- migrations that changed the projection's tables, the current function is kept under
-- another name and the new one changes what it creates.

ALTER FUNCTION tally_create_projection_schema(TEXT)
    RENAME TO tally_create_projection_schema_before_lifecycle_limit;

CREATE FUNCTION tally_container_lifecycle_limit(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format($ddl$
        -- How many lifecycle events the fold has taken of the container, past the limit
        -- too; voided ones are not.
        ALTER TABLE %1$I.container ADD COLUMN lifecycle_total BIGINT NOT NULL DEFAULT 0
            CHECK (lifecycle_total >= 0);
        ALTER TABLE %1$I.container_anomaly DROP CONSTRAINT container_anomaly_kind_check;
        ALTER TABLE %1$I.container_anomaly ADD CONSTRAINT container_anomaly_kind_check
            CHECK (kind IN ('duplicate_create', 'resume_before_create',
                            'resume_while_running', 'resume_past_interval_limit',
                            'stop_while_not_running', 'command_while_not_running',
                            'lifecycle_past_limit'));
    $ddl$, target);
END;
$function$;

CREATE FUNCTION tally_create_projection_schema(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    PERFORM tally_create_projection_schema_before_lifecycle_limit(target);
    PERFORM tally_container_lifecycle_limit(target);
END;
$function$;

SELECT tally_container_lifecycle_limit('proj');

-- The live projection's containers count what it has folded: their lifecycle events up to
-- its checkpoint, voided ones left out. A projection that already holds a container past
-- the limit keeps its fold until `tally replay` folds the ledger again under the limit, or
-- a late lifecycle event or a void refolds the container; one still running, which no
-- fold gives, the projector refolds at its next event. Older instances must be stopped before this runs: they would
-- go on projecting without the count.
UPDATE proj.container c SET lifecycle_total = n.total
FROM (
    SELECT l.org_id, l.container_id, count(*) AS total
    FROM ledger l
    WHERE l.type IN ('container.created', 'container.resumed', 'container.stopped')
      AND l.position <= (SELECT position FROM proj.checkpoint)
      AND NOT EXISTS (SELECT 1 FROM proj.voided v WHERE v.event_id = l.id)
    GROUP BY l.org_id, l.container_id
) n
WHERE c.org_id = n.org_id AND c.container_id = n.container_id;

-- The first `first_max` lifecycle events of each container (`org_ids[i]`, `container_ids[i]`)
-- by (occurred_at, position), up to and including `until`, voided ones left out; each row
-- names its container by `i`. A lifecycle refold reads them (store::read_histories). The
-- read has to walk the lifecycle index in its order and stop at `first_max`: planned for a
-- container the statistics do not know yet (the usual case: its events are new), Postgres
-- read every one of a million lifecycle events and sorted them to keep the first 260 000
-- (1.19 s, against 0.29 s in the index's order), so sorting is off for this function alone.
CREATE FUNCTION tally_first_lifecycle_events(
    org_ids TEXT[], container_ids TEXT[], until BIGINT, first_max BIGINT
) RETURNS TABLE (owner BIGINT, event_position BIGINT, event_id UUID, event_type TEXT,
                 event_occurred_at TIMESTAMPTZ)
LANGUAGE sql STABLE
SET enable_sort = off
AS $function$
    SELECT k.i, l.position, l.id, l.type, l.occurred_at
    FROM UNNEST(org_ids, container_ids) WITH ORDINALITY k (org_id, container_id, i)
    CROSS JOIN LATERAL (
        SELECT position, id, type, occurred_at FROM ledger
        WHERE ledger.container_id = k.container_id AND ledger.org_id = k.org_id
          AND type IN ('container.created', 'container.resumed', 'container.stopped')
          AND position <= until
          AND NOT EXISTS (SELECT 1 FROM proj.voided v WHERE v.event_id = ledger.id)
        ORDER BY occurred_at, position
        LIMIT first_max) l
$function$;
