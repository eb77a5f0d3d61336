-- The advisory locks a grant takes, in their order: the plan versions' lock shared (so that
-- a grant waiting for a plan version to be projected holds nothing the projector needs),
-- the org's admission lock alone, then the consuming lock shared (a projector round that
-- starts containers holds it alone). The order keeps a grant from ever holding one of them
-- while it waits for another that a plan definition or a projector round holds while
-- waiting for the first. Grants took them as three entries of one `SELECT`, which Postgres
-- evaluates left to right in practice but does not promise to: the order of evaluating
-- subexpressions is not defined. Statements of a PL/pgSQL function run one after another.
--
-- `org_key` is the org's lock key, computed by the caller (`hashtextextended('tally.admission.'
-- || org, 0)`, as the releases of reservations take it).
CREATE FUNCTION admission_grant_locks(plan_versions BIGINT, org_key BIGINT, consuming BIGINT)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(plan_versions);
    PERFORM pg_advisory_xact_lock(org_key);
    PERFORM pg_advisory_xact_lock_shared(consuming);
END;
$$;
