-- A projector round updates the row of every container it touched. Most of those updates
-- change only `last_at` (a command or a port of a running container), but `last_at` was a
-- key of the `container_org` index (org_id, last_at), so Postgres could never update such a
-- row in place (a HOT update): each update wrote a new index entry into every one of the
-- table's five indexes. Now the org index is keyed by the hour of `last_at` (UTC), a
-- generated column, so an update within the hour leaves every indexed value as it was,
-- and the table leaves a fifth of each page free for the new row versions. See
-- docs/decisions/0037-container-updates-in-place.md.
--
-- The one reader of that index, admission's facts statement (containers of an org with an
-- event after the check's instant), asks for `last_hour >= the instant's hour` and keeps
-- `last_at > the instant` of what it finds.
--
-- Replay builds its schema with `tally_create_projection_schema`; as in the earlier
-- migrations that changed the container table, the current function is kept under another
-- name and the new one changes what it creates.

ALTER FUNCTION tally_create_projection_schema(TEXT)
    RENAME TO tally_create_projection_schema_before_last_hour;

CREATE FUNCTION tally_container_last_hour(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format($ddl$
        -- First, so that the rewrite the new column causes leaves the room already.
        ALTER TABLE %1$I.container SET (fillfactor = 80);
        -- The hour `last_at` falls in, in UTC: what the org index is keyed by.
        ALTER TABLE %1$I.container ADD COLUMN last_hour TIMESTAMP
            GENERATED ALWAYS AS (date_trunc('hour', last_at AT TIME ZONE 'UTC')) STORED;
        DROP INDEX %1$I.container_org;
        CREATE INDEX container_org_hour ON %1$I.container (org_id, last_hour);
    $ddl$, target);
END;
$function$;

CREATE FUNCTION tally_create_projection_schema(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    PERFORM tally_create_projection_schema_before_last_hour(target);
    PERFORM tally_container_last_hour(target);
END;
$function$;

SELECT tally_container_last_hour('proj');
