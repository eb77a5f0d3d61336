-- Period close jobs (issue 17): a close of many orgs outlives the request that asked for it,
-- so each close is a job whose status can be read while it runs. The close itself still
-- commits atomically (its `period_close` and `period_snapshot` rows and this row's `done`
-- in one transaction); this table only tells what happened to each attempt.
CREATE TABLE period_close_job (
    id           UUID        PRIMARY KEY,
    period       TEXT        NOT NULL,
    -- `running` while a process holds the period's close lock (a session advisory lock,
    -- see src/periods.rs); a `running` row whose lock nobody holds was abandoned by a
    -- process that stopped, and reads as failed.
    status       TEXT        NOT NULL CHECK (status IN ('running', 'done', 'failed')),
    requested_by TEXT        NOT NULL,
    started_at   TIMESTAMPTZ NOT NULL,
    finished_at  TIMESTAMPTZ,
    -- Why a failed job failed: a stable code and a message for the caller (the cause
    -- itself is logged with the job id, not stored).
    error_code   TEXT,
    error        TEXT,
    CHECK ((status = 'running') = (finished_at IS NULL)),
    CHECK ((status = 'failed') = (error_code IS NOT NULL AND error IS NOT NULL))
);

-- At most one running close per period, whatever the instance: a second request finds this
-- one instead of starting another.
CREATE UNIQUE INDEX period_close_job_running ON period_close_job (period)
    WHERE status = 'running';
-- The latest job of a period answers its status route.
CREATE INDEX period_close_job_period ON period_close_job (period, started_at DESC);

-- Periods closed before jobs existed get a finished job, so that every closed period has
-- one to report.
INSERT INTO period_close_job (id, period, status, requested_by, started_at, finished_at)
SELECT gen_random_uuid(), period, 'done', closed_by, closed_at, closed_at FROM period_close;
