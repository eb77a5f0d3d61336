-- A container has at most 100 000 running intervals (INTERVALS_MAX in
-- src/runtime/container.rs): a `resumed` that would start one more starts nothing and is
-- the anomaly `resume_past_interval_limit`. A container's intervals are one `jsonb` value
-- that every projector round moving them reads and writes whole, so one container stopped
-- and resumed without end made each of its rounds slower than the last, until Postgres
-- refused the value (past about six million intervals) and no round could commit. See
-- docs/decisions/0053-intervals-per-container.md.
--
-- A projection made before this migration can only hold a container past the limit if it
-- was stopped and resumed that often; `tally replay` folds it again under the limit.
--
-- Replay builds its schema with `tally_create_projection_schema`; as in the earlier
-- migrations that changed the projection's tables, the current function is kept under
-- another name and the new one changes what it creates.

ALTER FUNCTION tally_create_projection_schema(TEXT)
    RENAME TO tally_create_projection_schema_before_interval_limit;

CREATE FUNCTION tally_container_anomaly_past_interval_limit(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format($ddl$
        ALTER TABLE %1$I.container_anomaly DROP CONSTRAINT container_anomaly_kind_check;
        ALTER TABLE %1$I.container_anomaly ADD CONSTRAINT container_anomaly_kind_check
            CHECK (kind IN ('duplicate_create', 'resume_before_create',
                            'resume_while_running', 'resume_past_interval_limit',
                            'stop_while_not_running', 'command_while_not_running'));
    $ddl$, target);
END;
$function$;

CREATE FUNCTION tally_create_projection_schema(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    PERFORM tally_create_projection_schema_before_interval_limit(target);
    PERFORM tally_container_anomaly_past_interval_limit(target);
END;
$function$;

SELECT tally_container_anomaly_past_interval_limit('proj');
