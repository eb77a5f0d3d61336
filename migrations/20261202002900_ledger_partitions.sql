-- The ledger partitioned by month of `recorded_at` (UTC), one table per calendar month,
-- named `ledger_y<YYYY>m<MM>` (decision 0029). The month that is written stays small and
-- its indexes stay in memory; a closed month is never written again and can be dumped,
-- moved to cheaper storage or backed up on its own.
--
-- This migration converts the unpartitioned ledger in place, in the one transaction sqlx
-- runs it in: every row is copied in position order with every column as it was, so the
-- hash chain (which covers position, recorded_at and the content) is unchanged and
-- `tally verify` passes as before. The old table is then dropped and every index, check
-- and trigger it had is on the new one.
--
-- What a partitioned table cannot give, a side table does: Postgres requires the
-- partition key in every unique index, so `id UNIQUE` and `position PRIMARY KEY` can no
-- longer be enforced on the ledger across months. `ledger_ids` holds one small row per
-- event — its id, its position, its month key and its content digest — with both unique,
-- filled by a trigger in the statement that inserts the event. It is also how tally finds
-- an event by id, or the head, without visiting every month.

-- The ledger's rows, as before; the table's name changes only after the copy.
ALTER TABLE ledger RENAME TO ledger_unpartitioned;

CREATE TABLE ledger (
    position        BIGINT      NOT NULL CONSTRAINT ledger_position_check CHECK (position > 0),
    id              UUID        NOT NULL,
    type            TEXT        NOT NULL,
    org_id          TEXT        NOT NULL,
    container_id    TEXT,
    occurred_at     TIMESTAMPTZ NOT NULL,
    -- The partition key: the server's clock when tally committed the row.
    recorded_at     TIMESTAMPTZ NOT NULL,
    data            JSONB       NOT NULL,
    source          TEXT,
    source_event_id TEXT,
    content_digest  BYTEA       NOT NULL
        CONSTRAINT ledger_content_digest_check CHECK (octet_length(content_digest) = 32),
    hash            BYTEA       NOT NULL CONSTRAINT ledger_hash_check CHECK (octet_length(hash) = 32),
    attributes      JSONB,
    CONSTRAINT ledger_check CHECK ((source IS NULL) = (source_event_id IS NULL)),
    -- As in 20261201000023_ledger_attributes.sql; validated here, as every row is copied.
    CONSTRAINT ledger_attributes_shape CHECK (
        attributes IS NULL
        OR (jsonb_typeof(attributes) = 'object'
            AND attributes <> '{}'::jsonb
            AND source IS NOT NULL)
    )
) PARTITION BY RANGE (recorded_at);

-- One row per ledger row, written with it: the global uniqueness of ids and positions,
-- and the way from an id or a position to its month (`recorded_at`), so that a lookup
-- reads one month's index rather than every month's.
CREATE TABLE ledger_ids (
    id             UUID        PRIMARY KEY,
    position       BIGINT      NOT NULL UNIQUE CHECK (position > 0),
    recorded_at    TIMESTAMPTZ NOT NULL,
    -- The appender's duplicate check ("same id, same content") reads only this table.
    content_digest BYTEA       NOT NULL CHECK (octet_length(content_digest) = 32)
);

-- Append-only like the ledger: the same refusal, whoever asks.
CREATE TRIGGER ledger_ids_no_update_or_delete
    BEFORE UPDATE OR DELETE ON ledger_ids
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER ledger_ids_no_truncate
    BEFORE TRUNCATE ON ledger_ids
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
ALTER TABLE ledger_ids ENABLE ALWAYS TRIGGER ledger_ids_no_update_or_delete;
ALTER TABLE ledger_ids ENABLE ALWAYS TRIGGER ledger_ids_no_truncate;

-- Fills `ledger_ids` from the rows a statement inserted into the ledger (or into one
-- month directly), once per statement: a duplicate id or position fails the whole
-- statement, so no row is stored without its ids. Statement-level with a transition table
-- rather than a row trigger: a group commit of 1 000 rows costs one INSERT, not 1 000.
-- Left at the default (not ALWAYS): under `session_replication_role = replica` a
-- logical replica receives `ledger_ids` rows of their own and must not make them twice.
CREATE FUNCTION ledger_record_ids() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO ledger_ids (id, position, recorded_at, content_digest)
    SELECT id, position, recorded_at, content_digest FROM inserted ORDER BY position;
    RETURN NULL;
END;
$$;

-- The triggers every month carries. A statement-level trigger on the partitioned table
-- fires only for statements that name it, so a statement naming one month (an UPDATE of
-- `ledger_y2026m12`) would pass by the ledger's own refusal: each month refuses it too.
CREATE FUNCTION ledger_partition_triggers(partition TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format($ddl$
        CREATE TRIGGER ledger_no_update_or_delete
            BEFORE UPDATE OR DELETE ON %1$I
            FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
        CREATE TRIGGER ledger_no_truncate
            BEFORE TRUNCATE ON %1$I
            FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
        ALTER TABLE %1$I ENABLE ALWAYS TRIGGER ledger_no_update_or_delete;
        ALTER TABLE %1$I ENABLE ALWAYS TRIGGER ledger_no_truncate;
        CREATE TRIGGER ledger_record_ids
            AFTER INSERT ON %1$I REFERENCING NEW TABLE AS inserted
            FOR EACH STATEMENT EXECUTE FUNCTION ledger_record_ids();
    $ddl$, partition);
END;
$function$;

-- Makes sure a month of the ledger exists for every month from `from_at` to `until_at`
-- (UTC), creating the missing ones with their triggers; returns how many it created.
-- Idempotent, and safe to call from several instances at once: they take turns on an
-- advisory lock, and each checks again under it.
--
-- A month is created as a table of its own and then attached, not with `CREATE TABLE …
-- PARTITION OF`: attaching takes a SHARE UPDATE EXCLUSIVE lock on the ledger, which lets
-- appends and reads go on, where `PARTITION OF` takes an ACCESS EXCLUSIVE lock that would
-- stop them. The new table is empty, so attaching it scans nothing and builds its
-- indexes (those of the ledger, made for each month by Postgres) at once.
--
-- There is no DEFAULT partition on purpose: a row that lands in one would make creating
-- its month later fail (Postgres refuses a month whose rows sit in the default), so
-- instead every writer makes sure of its month before it writes (the appender does, see
-- src/ledger/partitions.rs).
--
-- One call spans at most 600 months (50 years): a call past it comes from a clock far
-- off, which must fail loudly rather than create hundreds of tables.
CREATE FUNCTION ledger_ensure_partitions(from_at TIMESTAMPTZ, until_at TIMESTAMPTZ)
RETURNS INTEGER
LANGUAGE plpgsql AS $function$
DECLARE
    -- Month arithmetic in UTC whatever the session's TimeZone.
    month_start TIMESTAMP := date_trunc('month', from_at AT TIME ZONE 'UTC');
    last_start  TIMESTAMP := date_trunc('month', until_at AT TIME ZONE 'UTC');
    month_end   TIMESTAMP;
    partition   TEXT;
    created     INTEGER := 0;
BEGIN
    IF from_at IS NULL OR until_at IS NULL OR until_at < from_at THEN
        RAISE EXCEPTION 'ledger_ensure_partitions: % to % is not a range of time', from_at, until_at;
    END IF;
    IF last_start > month_start + interval '600 months' THEN
        RAISE EXCEPTION 'ledger_ensure_partitions: % to % spans more than 600 months',
            from_at, until_at;
    END IF;
    -- Arbitrary but fixed, next to the appender's ledger lock: 'tallz'.
    PERFORM pg_advisory_xact_lock(499850701946);
    WHILE month_start <= last_start LOOP
        month_end := month_start + interval '1 month';
        partition := 'ledger_' || to_char(month_start, '"y"YYYY"m"MM');
        IF NOT EXISTS (SELECT 1 FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
                       WHERE i.inhparent = 'ledger'::regclass AND c.relname = partition) THEN
            EXECUTE format('CREATE TABLE %I (LIKE ledger INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                           partition);
            EXECUTE format('ALTER TABLE ledger ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           partition, month_start AT TIME ZONE 'UTC', month_end AT TIME ZONE 'UTC');
            PERFORM ledger_partition_triggers(partition);
            created := created + 1;
        END IF;
        month_start := month_end;
    END LOOP;
    RETURN created;
END;
$function$;

-- A month for every month the ledger holds rows of, and three ahead.
SELECT ledger_ensure_partitions(
    COALESCE((SELECT min(recorded_at) FROM ledger_unpartitioned), now()),
    GREATEST((SELECT max(recorded_at) FROM ledger_unpartitioned), now()) + interval '3 months');

-- The copy, in position order, with every value as it was. `ledger_ids` is filled from the
-- same rows here rather than by the trigger, which is created just after: one pass over
-- the old table each, with no transition table holding the whole ledger.
INSERT INTO ledger (position, id, type, org_id, container_id, occurred_at, recorded_at, data,
                    source, source_event_id, content_digest, hash, attributes)
SELECT position, id, type, org_id, container_id, occurred_at, recorded_at, data,
       source, source_event_id, content_digest, hash, attributes
FROM ledger_unpartitioned ORDER BY position;
INSERT INTO ledger_ids (id, position, recorded_at, content_digest)
SELECT id, position, recorded_at, content_digest FROM ledger_unpartitioned ORDER BY position;

DROP TABLE ledger_unpartitioned;

-- Every index the ledger had (their reasons are in the migrations that made them), now
-- partitioned indexes: Postgres builds each on every month, and on every month attached
-- later. The primary key must hold the partition key; positions alone are unique in
-- `ledger_ids`. The id index is gone: ids are unique, and found, in `ledger_ids`.
ALTER TABLE ledger ADD CONSTRAINT ledger_pkey PRIMARY KEY (position, recorded_at);
CREATE INDEX ledger_org_occurred_at ON ledger (org_id, occurred_at, position);
CREATE INDEX ledger_org_position ON ledger (org_id, position);
CREATE INDEX ledger_container_position ON ledger (container_id, position)
    WHERE container_id IS NOT NULL;
CREATE INDEX ledger_plan_definitions ON ledger ((data->>'id'), occurred_at, position)
    WHERE type = 'plan.defined';
CREATE INDEX ledger_voids ON ledger ((data->>'event_id'))
    WHERE type = 'ledger.event_voided';

-- Append-only, on the ledger and (ledger_partition_triggers, above) on every month.
CREATE TRIGGER ledger_no_update_or_delete
    BEFORE UPDATE OR DELETE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER ledger_no_truncate
    BEFORE TRUNCATE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_update_or_delete;
ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_truncate;
CREATE TRIGGER ledger_record_ids
    AFTER INSERT ON ledger REFERENCING NEW TABLE AS inserted
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_record_ids();

-- The appender's fast path for the partitioned ledger; otherwise as in
-- 20261130000002_ledger_append_function.sql, whose comments explain it. The head is the
-- highest position in `ledger_ids` and its hash is read from that row's month alone; the
-- duplicate check reads `ledger_ids` alone. The insert names the ledger, so its trigger
-- writes the ids in the same statement.
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
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    current_position    BIGINT;
    current_recorded_at TIMESTAMPTZ;
    current_hash        BYTEA;
BEGIN
    -- The same key as LEDGER_LOCK_KEY in src/ledger/append.rs.
    PERFORM pg_advisory_xact_lock(499850701945);
    SELECT i.position, i.recorded_at INTO current_position, current_recorded_at
        FROM ledger_ids i ORDER BY i.position DESC LIMIT 1;
    IF NOT FOUND THEN
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

ANALYZE ledger;
ANALYZE ledger_ids;
