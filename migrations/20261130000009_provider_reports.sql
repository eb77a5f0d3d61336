-- Provider usage reports (DESIGN §5), stored as imported: never changed. The sha256 of
-- the bytes identifies a report, so importing the same bytes again finds the same one.
CREATE TABLE provider_report (
    id           UUID        PRIMARY KEY,
    sha256       BYTEA       NOT NULL UNIQUE CHECK (octet_length(sha256) = 32),
    lines        BIGINT      NOT NULL CHECK (lines > 0),
    window_start TIMESTAMPTZ NOT NULL,
    window_end   TIMESTAMPTZ NOT NULL CHECK (window_end > window_start),
    imported_at  TIMESTAMPTZ NOT NULL,
    imported_by  TEXT        NOT NULL
);

-- No foreign key to provider_report: lines and their report are written in one
-- transaction (the report row last, once every line parsed) and neither is ever changed,
-- while a deferred key check at commit costs as much as the COPY of the lines itself.
CREATE TABLE provider_report_line (
    report_id           UUID        NOT NULL,
    -- The line number in the file (the header is line 1).
    line                BIGINT      NOT NULL,
    charge_period_start TIMESTAMPTZ NOT NULL,
    charge_period_end   TIMESTAMPTZ NOT NULL CHECK (charge_period_end > charge_period_start),
    container_id        TEXT        NOT NULL,
    -- Tags.org_id, when the line has one.
    org_id              TEXT,
    consumed_quantity   NUMERIC     NOT NULL CHECK (consumed_quantity >= 0),
    consumed_unit       TEXT        NOT NULL CHECK (consumed_unit IN ('Seconds', 'Hours')),
    billed_cost         NUMERIC     NOT NULL,
    billing_currency    TEXT        NOT NULL,
    provider_name       TEXT,
    charge_category     TEXT,
    PRIMARY KEY (report_id, line)
);

CREATE FUNCTION provider_report_refuse_change() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'provider reports are immutable: % is not allowed', TG_OP
        USING ERRCODE = 'insufficient_privilege';
END;
$$;
CREATE TRIGGER provider_report_immutable BEFORE UPDATE OR DELETE ON provider_report
    FOR EACH STATEMENT EXECUTE FUNCTION provider_report_refuse_change();
CREATE TRIGGER provider_report_line_immutable BEFORE UPDATE OR DELETE ON provider_report_line
    FOR EACH STATEMENT EXECUTE FUNCTION provider_report_refuse_change();
