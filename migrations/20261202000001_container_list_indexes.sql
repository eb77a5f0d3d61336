-- The console lists an org's containers a page at a time in container_id order, all of
-- them or only the running or only the stopped (GET /v1/orgs/{org_id}/containers, decision
-- 0026). The container table's primary key is (container_id, org_id) and its other index
-- is (org_id, last_at): neither finds one org's containers in id order, so a page read
-- the org's every container and sorted them. With these three, a page reads only the
-- org's containers in the state asked for, from the cursor on.
--
-- A container is running when its last interval is open: the last pair of `intervals`
-- has a JSON null end. `intervals -> -1` is SQL NULL for a container with no interval
-- (never created or resumed), which `IS TRUE` / `IS NOT TRUE` count as not running, as the
-- API shows such a container: stopped. The queries spell the condition exactly so
-- (RUNNING_SQL in src/projection/org.rs), or the planner would not match the partial
-- indexes. Ids are ordered bytewise (COLLATE "C") whatever the database's collation, so
-- that "id order" means one thing everywhere.
--
-- Replay builds its schema with `tally_create_projection_schema`; as in the
-- `container_anomalies` migration, the current function is kept under another name and
-- the new one adds these indexes to what it creates.

ALTER FUNCTION tally_create_projection_schema(TEXT)
    RENAME TO tally_create_projection_schema_before_container_list;

CREATE FUNCTION tally_container_list_indexes(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format($ddl$
        -- All of an org's containers in id order, after a cursor.
        CREATE INDEX container_org_id ON %1$I.container (org_id, container_id COLLATE "C");
        -- Only the running ones.
        CREATE INDEX container_org_running ON %1$I.container (org_id, container_id COLLATE "C")
            WHERE (intervals -> -1 -> 1 = 'null'::JSONB) IS TRUE;
        -- Only the stopped ones (and those never started).
        CREATE INDEX container_org_stopped ON %1$I.container (org_id, container_id COLLATE "C")
            WHERE (intervals -> -1 -> 1 = 'null'::JSONB) IS NOT TRUE;
    $ddl$, target);
END;
$function$;

CREATE FUNCTION tally_create_projection_schema(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    PERFORM tally_create_projection_schema_before_container_list(target);
    PERFORM tally_container_list_indexes(target);
END;
$function$;

SELECT tally_container_list_indexes('proj');
