-- The ledger: every event tally has accepted, once, forever, in commit order.
-- It is the source of truth; every other table is derived from it and can be rebuilt.
CREATE TABLE ledger (
    -- Global order, assigned by the single appender under `pg_advisory_xact_lock`, so that
    -- positions are gap-free and commit in order: a reader tailing `position > last` never
    -- skips a row that commits later with a smaller position.
    position        BIGINT      PRIMARY KEY CHECK (position > 0),
    -- The producer's idempotency key (or the UUIDv5 of a CloudEvent's source and id).
    id              UUID        NOT NULL UNIQUE,
    type            TEXT        NOT NULL,
    org_id          TEXT        NOT NULL,
    -- Absent for org events.
    container_id    TEXT,
    -- When it happened (producer clock, truncated to milliseconds): billing uses this.
    occurred_at     TIMESTAMPTZ NOT NULL,
    -- When tally committed it (server clock, milliseconds): audit uses this.
    recorded_at     TIMESTAMPTZ NOT NULL,
    -- The type-specific payload, only the fields that were given.
    data            JSONB       NOT NULL,
    -- CloudEvents only: the original source and id, kept because the ledger id derives
    -- from them.
    source          TEXT,
    source_event_id TEXT,
    -- sha256 of the event's canonical content: "same id, same content" is a byte compare.
    content_digest  BYTEA       NOT NULL CHECK (octet_length(content_digest) = 32),
    -- sha256(previous row's hash ‖ canonical bytes of this row); see src/event/canonical.rs.
    hash            BYTEA       NOT NULL CHECK (octet_length(hash) = 32),
    CHECK ((source IS NULL) = (source_event_id IS NULL))
);

-- Usage, reconciliation and exports read an org's events by time.
CREATE INDEX ledger_org_occurred_at ON ledger (org_id, occurred_at, position);
-- A container's history, ordered as the runtime rules order it (occurred_at, position).
CREATE INDEX ledger_container_occurred_at ON ledger (container_id, occurred_at, position)
    WHERE container_id IS NOT NULL;

-- Append-only, enforced by the database itself: no UPDATE, DELETE or TRUNCATE, whoever
-- asks. Statement-level, so even a statement that matches no row is refused.
CREATE FUNCTION ledger_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the ledger is append-only: % is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;

CREATE TRIGGER ledger_no_update_or_delete
    BEFORE UPDATE OR DELETE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
CREATE TRIGGER ledger_no_truncate
    BEFORE TRUNCATE ON ledger
    FOR EACH STATEMENT EXECUTE FUNCTION ledger_refuse_change();
-- ALWAYS: `session_replication_role = replica` (logical replication, pg_restore tricks)
-- would otherwise skip them.
ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_update_or_delete;
ALTER TABLE ledger ENABLE ALWAYS TRIGGER ledger_no_truncate;
