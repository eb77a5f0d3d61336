-- A reconciliation asked of the service runs as a job: its row says `running` from the
-- request until the run commits (`done`, with the reconciliation stored under the same id
-- in that commit) or fails (`failed`, with why, and nothing stored). The session running
-- it holds a two-key advisory lock ('reco', the low half of its id); a `running` row whose
-- lock nobody holds was left by a process that stopped, and reads as failed.
CREATE TABLE reconciliation_job (
    id              UUID        PRIMARY KEY,
    report_id       UUID        NOT NULL REFERENCES provider_report (id),
    tolerance_ms    BIGINT      NOT NULL CHECK (tolerance_ms >= 0),
    tolerance_ratio NUMERIC     NOT NULL CHECK (tolerance_ratio >= 0),
    status          TEXT        NOT NULL CHECK (status IN ('running', 'done', 'failed')),
    requested_by    TEXT        NOT NULL,
    started_at      TIMESTAMPTZ NOT NULL,
    finished_at     TIMESTAMPTZ,
    error_code      TEXT,
    error           TEXT,
    CHECK ((status = 'running') = (finished_at IS NULL)),
    CHECK ((status = 'failed') = (error_code IS NOT NULL AND error IS NOT NULL))
);
