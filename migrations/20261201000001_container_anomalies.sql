-- A container's anomalies become rows of their own (issue 17, item 11). They were one JSONB
-- array in `container.anomalies`, which the projector read, decoded, re-encoded and wrote
-- back whole for every event of the container: commands of a container that was never
-- created (each an anomaly) cost more the more such commands it already had. Now an event
-- inserts its anomaly, `container.anomalies_total` counts every one, and the API reads
-- them a page at a time. See docs/decisions/container-anomalies-paged.md.
--
-- Replay builds its schema with `tally_create_projection_schema`; the function of the
-- `projections` migration is kept under another name and this one adds to what it creates,
-- so that the two definitions never drift apart.

ALTER FUNCTION tally_create_projection_schema(TEXT)
    RENAME TO tally_create_projection_schema_before_anomaly_rows;

-- The new shape of one schema's container anomalies, for a schema that has a `container`
-- table with the old `anomalies` column (empty or not): its anomalies move into rows.
CREATE FUNCTION tally_container_anomaly_rows(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format($ddl$
        -- How many anomalies the container's history has caused: every one, also those
        -- past the number kept (ANOMALIES_KEPT_MAX in src/projection/model.rs).
        ALTER TABLE %1$I.container ADD COLUMN anomalies_total BIGINT NOT NULL DEFAULT 0
            CHECK (anomalies_total >= 0);

        -- The first anomalies of each container in (occurred_at, position) order, at most
        -- 10 000 (ANOMALIES_KEPT_MAX). The primary key is the order the API pages in and the
        -- order the projector trims from the end of, so both are one range scan.
        CREATE TABLE %1$I.container_anomaly (
            org_id       TEXT        NOT NULL,
            container_id TEXT        NOT NULL,
            -- The event's occurred_at and ledger position: the fold's order, unique per
            -- container because positions are.
            occurred_at  TIMESTAMPTZ NOT NULL,
            position     BIGINT      NOT NULL,
            kind         TEXT        NOT NULL CHECK (kind IN ('duplicate_create',
                             'resume_before_create', 'resume_while_running',
                             'stop_while_not_running', 'command_while_not_running')),
            -- The event that caused it.
            event_id     UUID        NOT NULL,
            PRIMARY KEY (container_id, org_id, occurred_at, position)
        );

        -- Existing anomalies, in the order they were stored (the fold's), as
        -- [kind, event_id, occurred_at_ms, position]; only the first 10 000 are kept, as a
        -- replay would keep them, and the count keeps them all.
        INSERT INTO %1$I.container_anomaly
            (org_id, container_id, occurred_at, position, kind, event_id)
        SELECT c.org_id, c.container_id,
               TIMESTAMPTZ 'epoch' + (a.value->>2)::BIGINT * INTERVAL '1 millisecond',
               (a.value->>3)::BIGINT, a.value->>0, (a.value->>1)::UUID
        FROM %1$I.container c
        CROSS JOIN LATERAL jsonb_array_elements(c.anomalies) WITH ORDINALITY AS a(value, n)
        WHERE a.n <= 10000;
        UPDATE %1$I.container SET anomalies_total = jsonb_array_length(anomalies)
            WHERE jsonb_array_length(anomalies) > 0;

        ALTER TABLE %1$I.container DROP COLUMN anomalies;
    $ddl$, target);
END;
$function$;

CREATE FUNCTION tally_create_projection_schema(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    PERFORM tally_create_projection_schema_before_anomaly_rows(target);
    PERFORM tally_container_anomaly_rows(target);
END;
$function$;

SELECT tally_container_anomaly_rows('proj');
