-- Plan versions are `plan.defined` events in the ledger; this index finds a plan's
-- versions in time order without scanning the ledger.
CREATE INDEX ledger_plan_definitions ON ledger ((data->>'id'), occurred_at, position)
    WHERE type = 'plan.defined';

-- Admission reservations (DESIGN §4): operational state, not part of the ledger. A
-- reservation holds one running slot of its org while it is live: not expired, not
-- released, not consumed by its container's `created`/`resumed`. Rows are never deleted,
-- so they are also the audit record of who reserved, when, and what became of it.
CREATE TABLE admission_reservation (
    id           UUID        PRIMARY KEY,
    org_id       TEXT        NOT NULL,
    container_id TEXT,
    action       TEXT        NOT NULL CHECK (action IN ('create', 'resume')),
    -- Who asked: the token's id ('bootstrap' for TALLY_BOOTSTRAP_TOKEN).
    reserved_by  TEXT        NOT NULL,
    created_at   TIMESTAMPTZ NOT NULL,
    expires_at   TIMESTAMPTZ NOT NULL CHECK (expires_at > created_at),
    released_at  TIMESTAMPTZ,
    released_by  TEXT,
    consumed_at  TIMESTAMPTZ,
    -- The `created` or `resumed` event that consumed it.
    consumed_by  UUID,
    CHECK ((released_at IS NULL) = (released_by IS NULL)),
    CHECK ((consumed_at IS NULL) = (consumed_by IS NULL))
);
CREATE INDEX admission_reservation_live ON admission_reservation (org_id, expires_at)
    WHERE released_at IS NULL AND consumed_at IS NULL;
CREATE INDEX admission_reservation_container ON admission_reservation (org_id, container_id)
    WHERE released_at IS NULL AND consumed_at IS NULL;

-- Refused reservation requests, for audit: who asked, when, and why not.
CREATE TABLE admission_refusal (
    id           BIGSERIAL   PRIMARY KEY,
    org_id       TEXT        NOT NULL,
    container_id TEXT,
    action       TEXT        NOT NULL,
    requested_by TEXT        NOT NULL,
    requested_at TIMESTAMPTZ NOT NULL,
    reasons      TEXT[]      NOT NULL
);
CREATE INDEX admission_refusal_org ON admission_refusal (org_id, requested_at);
