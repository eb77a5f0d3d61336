-- Projections: figures derived from the ledger alone, kept current by the projector (see
-- src/projection). They live in schema `proj`. `tally replay` builds a fresh copy in another
-- schema with this same function, fills it from the ledger and swaps the schemas in one
-- transaction, so readers see either the old projection or the whole new one.
--
-- Every table is written in the same transaction as `checkpoint`, which names the last
-- ledger position whose effects they hold: the projection is exactly the ledger up to it.
CREATE FUNCTION tally_create_projection_schema(target TEXT) RETURNS void
LANGUAGE plpgsql AS $function$
BEGIN
    EXECUTE format('CREATE SCHEMA %I', target);
    EXECUTE format($ddl$
        CREATE TABLE %1$I.checkpoint (
            singleton    BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
            position     BIGINT      NOT NULL CHECK (position >= 0),
            projected_at TIMESTAMPTZ NOT NULL DEFAULT now()
        );
        INSERT INTO %1$I.checkpoint (position) VALUES (0);

        -- One container as one org knows it (a container id reused by another org is a
        -- different container there): the state machine's carried state.
        CREATE TABLE %1$I.container (
            org_id       TEXT        NOT NULL,
            container_id TEXT        NOT NULL,
            -- [[start_ms, end_ms or null], ...] in time order, epoch milliseconds.
            intervals    JSONB       NOT NULL,
            -- [[kind, event_id, occurred_at_ms, position], ...] in (occurred_at, position) order.
            anomalies    JSONB       NOT NULL,
            -- The latest occurred_at of any of its events: an event after it advances the
            -- state in place, one at or before it refolds the container's history.
            last_at      TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (container_id, org_id)
        );
        -- By org; `last_at` finds the few containers with events after an instant (only
        -- those can be running at it other than by an open interval).
        CREATE INDEX container_org ON %1$I.container (org_id, last_at);

        -- An org's totals per period (YYYY-MM): closed intervals' runtime within the
        -- period, commands, command time, distinct (container, port) pairs. The projector
        -- adds signed deltas with INSERT ... ON CONFLICT, and Postgres checks CHECK
        -- constraints on the proposed row before it finds the conflict, so this table and
        -- org_open have none on their sums.
        CREATE TABLE %1$I.org_period (
            org_id            TEXT   NOT NULL,
            period            TEXT   NOT NULL,
            closed_runtime_ms BIGINT NOT NULL,
            commands          BIGINT NOT NULL,
            command_ms        BIGINT NOT NULL,
            ports_published   BIGINT NOT NULL,
            PRIMARY KEY (org_id, period)
        );

        -- An org's open intervals by the period they started in: how many, and the sum of
        -- their starts in milliseconds from that period's start.
        CREATE TABLE %1$I.org_open (
            org_id          TEXT   NOT NULL,
            since_period    TEXT   NOT NULL,
            running         BIGINT NOT NULL,
            since_offset_ms BIGINT NOT NULL,
            PRIMARY KEY (org_id, since_period)
        );

        -- The latest occurred_at of any container event of the org: usage as of any later
        -- instant comes from the totals alone.
        CREATE TABLE %1$I.org (
            org_id    TEXT        PRIMARY KEY,
            latest_at TIMESTAMPTZ NOT NULL
        );

        -- Each org event, reduced to the value it sets (plan, verified or billing
        -- eligible); an org's account state at an instant is folded from these at read
        -- time, whatever order they arrived in.
        CREATE TABLE %1$I.account_change (
            org_id           TEXT        NOT NULL,
            position         BIGINT      NOT NULL,
            occurred_at      TIMESTAMPTZ NOT NULL,
            event_id         UUID        NOT NULL,
            plan             TEXT,
            verified         BOOLEAN,
            billing_eligible BOOLEAN,
            PRIMARY KEY (org_id, position),
            CHECK (num_nonnulls(plan, verified, billing_eligible) = 1)
        );

        -- Events voided by a `ledger.event_voided` (at `position`): every history the
        -- projection reads leaves them out, as if they had never been stored.
        CREATE TABLE %1$I.voided (
            event_id UUID   PRIMARY KEY,
            position BIGINT NOT NULL
        );

        -- Each (container, port) published in a period, with its first publication.
        CREATE TABLE %1$I.port (
            org_id       TEXT        NOT NULL,
            period       TEXT        NOT NULL,
            container_id TEXT        NOT NULL,
            port         INTEGER     NOT NULL CHECK (port BETWEEN 1 AND 65535),
            first_at     TIMESTAMPTZ NOT NULL,
            PRIMARY KEY (org_id, period, container_id, port)
        );
    $ddl$, target);
END;
$function$;

SELECT tally_create_projection_schema('proj');
