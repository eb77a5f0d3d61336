-- CloudEvents attributes kept for audit (decision 0023): a CloudEvent's `datacontenttype`,
-- `dataschema` and extension attributes (`traceparent`, `tracestate`, …), which map to no
-- other column. Covered by the hash chain (the canonical record gains an `attributes`
-- member when, and only when, this is not NULL, so every earlier row's bytes are
-- unchanged) but not by `content_digest`: a retry of the same event through other
-- middleware is still a duplicate.
ALTER TABLE ledger ADD COLUMN attributes JSONB;

-- An object of strings, never empty (no attributes is NULL, so that the record's bytes
-- are those of a row without them), and only on a CloudEvent. NOT VALID: every existing
-- row is NULL, which passes, and validating would scan the whole ledger under a lock.
ALTER TABLE ledger ADD CONSTRAINT ledger_attributes_shape CHECK (
    attributes IS NULL
    OR (jsonb_typeof(attributes) = 'object'
        AND attributes <> '{}'::jsonb
        AND source IS NOT NULL)
) NOT VALID;

-- The appender's fast path, now with the attributes column; otherwise as in
-- 20261130000002_ledger_append_function.sql, whose comments explain it.
DROP FUNCTION ledger_append(BIGINT, BYTEA, BIGINT[], UUID[], TEXT[], TEXT[], TEXT[],
                            TIMESTAMPTZ[], TIMESTAMPTZ[], JSONB[], TEXT[], TEXT[], BYTEA[],
                            BYTEA[]);

CREATE FUNCTION ledger_append(
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
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    current_position BIGINT;
    current_hash     BYTEA;
BEGIN
    -- The same key as LEDGER_LOCK_KEY in src/ledger/append.rs.
    PERFORM pg_advisory_xact_lock(499850701945);
    SELECT l.position, l.hash INTO current_position, current_hash
        FROM ledger l ORDER BY l.position DESC LIMIT 1;
    IF NOT FOUND THEN
        current_position := 0;
        current_hash := decode(repeat('00', 32), 'hex');
    END IF;

    RETURN QUERY SELECT 'known'::TEXT, NULL::BIGINT, NULL::BYTEA, l.id, l.position, l.content_digest
        FROM ledger l WHERE l.id = ANY(p_id);
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
