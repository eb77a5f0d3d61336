-- Reconciliations of provider reports against the ledger (DESIGN §5): each run's result,
-- kept as computed (counts and money totals per status and per org), and its lines.
CREATE TABLE reconciliation (
    id              UUID        PRIMARY KEY,
    report_id       UUID        NOT NULL REFERENCES provider_report (id),
    tolerance_ms    BIGINT      NOT NULL CHECK (tolerance_ms >= 0),
    tolerance_ratio NUMERIC     NOT NULL CHECK (tolerance_ratio >= 0),
    -- Ledger runtime is counted up to this instant.
    as_of           TIMESTAMPTZ NOT NULL,
    -- The projection's checkpoint the ledger figures come from.
    ledger_position BIGINT      NOT NULL,
    counts          JSONB       NOT NULL,
    totals          JSONB       NOT NULL,
    created_at      TIMESTAMPTZ NOT NULL,
    created_by      TEXT        NOT NULL
);

CREATE TABLE reconciliation_line (
    reconciliation_id   UUID        NOT NULL
        REFERENCES reconciliation (id) DEFERRABLE INITIALLY DEFERRED,
    seq                 BIGINT      NOT NULL,
    org_id              TEXT,
    container_id        TEXT        NOT NULL,
    charge_period_start TIMESTAMPTZ NOT NULL,
    charge_period_end   TIMESTAMPTZ NOT NULL,
    ledger_runtime_ms   BIGINT      NOT NULL,
    provider_runtime_ms BIGINT      NOT NULL,
    delta_ms            BIGINT      NOT NULL,
    status              TEXT        NOT NULL,
    provider_cost       NUMERIC     NOT NULL,
    expected_cost       NUMERIC     NOT NULL,
    cost_delta          NUMERIC     NOT NULL,
    currency            TEXT        NOT NULL,
    PRIMARY KEY (reconciliation_id, seq)
);
