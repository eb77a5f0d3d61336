-- Closed periods (DESIGN §5): each org's figures frozen when the period was closed, with
-- the sha256 of their usage-export bytes so that the snapshot can be verified later. Never
-- changed: a late event affecting a closed period shows as an adjustment in the next open
-- period's export instead.
CREATE TABLE period_close (
    period          TEXT        PRIMARY KEY,
    closed_at       TIMESTAMPTZ NOT NULL,
    closed_by       TEXT        NOT NULL,
    -- The projection's checkpoint the snapshot was taken at: events after it are late.
    ledger_position BIGINT      NOT NULL,
    orgs            BIGINT      NOT NULL,
    sha256          BYTEA       NOT NULL CHECK (octet_length(sha256) = 32)
);

CREATE TABLE period_snapshot (
    period          TEXT    NOT NULL REFERENCES period_close (period) DEFERRABLE INITIALLY DEFERRED,
    org_id          TEXT    NOT NULL,
    plan            TEXT    NOT NULL,
    runtime_ms      BIGINT  NOT NULL,
    included_ms     BIGINT  NOT NULL,
    overage_ms      BIGINT  NOT NULL,
    overage_amount  NUMERIC NOT NULL,
    currency        TEXT    NOT NULL,
    commands        BIGINT  NOT NULL,
    ports_published BIGINT  NOT NULL,
    PRIMARY KEY (period, org_id)
);

CREATE TRIGGER period_close_immutable BEFORE UPDATE OR DELETE ON period_close
    FOR EACH STATEMENT EXECUTE FUNCTION provider_report_refuse_change();
CREATE TRIGGER period_snapshot_immutable BEFORE UPDATE OR DELETE ON period_snapshot
    FOR EACH STATEMENT EXECUTE FUNCTION provider_report_refuse_change();
