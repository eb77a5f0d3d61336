-- The appender's fast path planned for the ledger as it is at each call, not as it was
-- when the session first ran it.
--
-- PL/pgSQL keeps each statement's plan for the session. A statement without parameters
-- keeps its first plan for as long as nothing invalidates it, and one with parameters
-- switches to a generic plan after five calls. The appender's session lives as long as the
-- process, and a database made fresh has its tables analyzed empty by the migrations: the
-- plans made then scan `ledger_ids` and the month's table whole and sort, which costs
-- nothing on an empty ledger and about 30 ms a call on 250 000 events. Without autovacuum
-- nothing ever replaces them (measured: single events at 1 000 events/s where the same
-- build did 6 900 before the ledger was partitioned). So:
--   - the head is looked up with EXECUTE, which plans the statement at every call;
--   - the function runs with plan_cache_mode = force_custom_plan, so the statements with
--     parameters (the head's hash, the duplicate check) are planned for their values and
--     the ledger's present size at every call, whatever the caller's session says.
-- Planning costs some tens of microseconds a call; one call appends a whole group.
-- Otherwise as in 20261202002900_ledger_partitions.sql.

CREATE OR REPLACE FUNCTION ledger_append(
    expected_position BIGINT,
    expected_hash     BYTEA,
    p_position        BIGINT[],
    p_id              UUID[],
    p_type            TEXT[],
    p_org_id          TEXT[],
    p_container_id    TEXT[],
    p_occurred_at     TIMESTAMPTZ[],
    p_recorded_at     TIMESTAMPTZ[],
    p_data            JSONB[],
    p_source          TEXT[],
    p_source_event_id TEXT[],
    p_attributes      JSONB[],
    p_content_digest  BYTEA[],
    p_hash            BYTEA[]
) RETURNS TABLE (outcome TEXT, head_position BIGINT, head_hash BYTEA,
                 known_id UUID, known_position BIGINT, known_digest BYTEA)
LANGUAGE plpgsql VOLATILE
SET plan_cache_mode = force_custom_plan
AS $$
DECLARE
    current_position    BIGINT;
    current_recorded_at TIMESTAMPTZ;
    current_hash        BYTEA;
BEGIN
    -- The same key as LEDGER_LOCK_KEY in src/ledger/append.rs.
    PERFORM pg_advisory_xact_lock(499850701945);
    EXECUTE 'SELECT i.position, i.recorded_at FROM ledger_ids i ORDER BY i.position DESC LIMIT 1'
        INTO current_position, current_recorded_at;
    IF current_position IS NULL THEN
        current_position := 0;
        current_hash := decode(repeat('00', 32), 'hex');
    ELSE
        SELECT l.hash INTO STRICT current_hash FROM ledger l
            WHERE l.position = current_position AND l.recorded_at = current_recorded_at;
    END IF;

    RETURN QUERY SELECT 'known'::TEXT, NULL::BIGINT, NULL::BYTEA, i.id, i.position, i.content_digest
        FROM ledger_ids i WHERE i.id = ANY(p_id);
    IF current_position <> expected_position OR current_hash <> expected_hash THEN
        RETURN QUERY SELECT 'head_moved'::TEXT, current_position, current_hash,
            NULL::UUID, NULL::BIGINT, NULL::BYTEA;
        RETURN;
    END IF;
    IF FOUND THEN
        RETURN;
    END IF;
    IF p_position[1] <> current_position + 1 THEN
        RAISE EXCEPTION 'ledger_append: rows start at position %, the head is %',
            p_position[1], current_position;
    END IF;

    INSERT INTO ledger (position, id, type, org_id, container_id, occurred_at, recorded_at,
                        data, source, source_event_id, attributes, content_digest, hash)
    SELECT * FROM unnest(p_position, p_id, p_type, p_org_id, p_container_id, p_occurred_at,
                         p_recorded_at, p_data, p_source, p_source_event_id, p_attributes,
                         p_content_digest, p_hash);
    RETURN QUERY SELECT 'appended'::TEXT, p_position[cardinality(p_position)],
        p_hash[cardinality(p_hash)], NULL::UUID, NULL::BIGINT, NULL::BYTEA;
END;
$$;
