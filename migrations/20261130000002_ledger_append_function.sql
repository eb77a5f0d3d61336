-- The appender's fast path: one round trip per group commit.
--
-- The appender keeps the head (position, hash) it last committed and prepares the next rows
-- — positions, hashes, digests — before it calls this, so that the ledger lock is held only
-- while Postgres checks and inserts. Under the lock the function re-reads the head (each
-- statement of a VOLATILE function takes a fresh snapshot, so it sees every commit made
-- before the lock was granted) and inserts only when the prepared rows still follow it and
-- none of their ids is already stored. Otherwise it inserts nothing and says why, with the
-- facts the appender needs to prepare again: the actual head ('head_moved', e.g. another
-- instance appended) and the stored rows among the ids ('known', duplicates or conflicts).
-- Called outside an explicit transaction, the statement is its own transaction, and the
-- transaction-scoped lock is released by its commit.
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
    -- The appender prepared these rows to follow the head it saw; a bug there must not
    -- reach the ledger.
    IF p_position[1] <> current_position + 1 THEN
        RAISE EXCEPTION 'ledger_append: rows start at position %, the head is %',
            p_position[1], current_position;
    END IF;

    INSERT INTO ledger (position, id, type, org_id, container_id, occurred_at, recorded_at,
                        data, source, source_event_id, content_digest, hash)
    SELECT * FROM unnest(p_position, p_id, p_type, p_org_id, p_container_id, p_occurred_at,
                         p_recorded_at, p_data, p_source, p_source_event_id,
                         p_content_digest, p_hash);
    RETURN QUERY SELECT 'appended'::TEXT, p_position[cardinality(p_position)],
        p_hash[cardinality(p_hash)], NULL::UUID, NULL::BIGINT, NULL::BYTEA;
END;
$$;
