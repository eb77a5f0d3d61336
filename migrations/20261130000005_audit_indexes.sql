-- Audit pages (GET /v1/events, GET /v1/containers/{id}/events) read in position order
-- filtered by org or container: these indexes serve a page of `limit` rows after any
-- cursor without sorting or scanning an org's whole history. The container index
-- replaces the one by time: refolding a container reads its whole history, in any order.
CREATE INDEX ledger_org_position ON ledger (org_id, position);
DROP INDEX ledger_container_occurred_at;
CREATE INDEX ledger_container_position ON ledger (container_id, position)
    WHERE container_id IS NOT NULL;
