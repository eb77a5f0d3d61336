-- Every line of a FOCUS 1.0–1.2 export is kept (decision 0021): tax, credit and purchase
-- lines have no resource, quantity or unit, usage lines come in any unit, and a reversal
-- has a negative quantity. The line's resource is the provider's id, which is a container
-- id only on runtime lines. ChargeCategory is required by the importer; a line stored
-- without one was imported when only container runtime was accepted and reads as `Usage`.
ALTER TABLE provider_report_line RENAME COLUMN container_id TO resource_id;
ALTER TABLE provider_report_line
    ALTER COLUMN resource_id DROP NOT NULL,
    ALTER COLUMN consumed_quantity DROP NOT NULL,
    ALTER COLUMN consumed_unit DROP NOT NULL,
    DROP CONSTRAINT provider_report_line_consumed_quantity_check,
    DROP CONSTRAINT provider_report_line_consumed_unit_check,
    ADD COLUMN charge_class TEXT,
    ADD COLUMN billing_period_start TIMESTAMPTZ,
    ADD COLUMN billing_period_end TIMESTAMPTZ,
    ADD CONSTRAINT provider_report_line_billing_period_check
        CHECK ((billing_period_start IS NULL) = (billing_period_end IS NULL)
               AND billing_period_end > billing_period_start);

-- A `not_runtime` line was not compared: no runtimes, no expected cost. Each line names
-- the report line it comes from, its charge category and the org the provider tagged
-- (beside the ledger's org in `org_id`).
ALTER TABLE reconciliation_line
    ALTER COLUMN container_id DROP NOT NULL,
    ALTER COLUMN ledger_runtime_ms DROP NOT NULL,
    ALTER COLUMN provider_runtime_ms DROP NOT NULL,
    ALTER COLUMN delta_ms DROP NOT NULL,
    ALTER COLUMN expected_cost DROP NOT NULL,
    ALTER COLUMN cost_delta DROP NOT NULL,
    ADD COLUMN provider_org_id TEXT,
    ADD COLUMN report_line BIGINT,
    ADD COLUMN charge_category TEXT;
