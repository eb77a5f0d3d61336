-- A late lifecycle event (a `created`, `resumed` or `stopped` earlier than something its
-- container has already projected) refolds its container. Reading the container's whole
-- history for it, and decoding every command, made one late stop of a container that had
-- run a million commands hold the projector for over three seconds, every org waiting
-- behind it. Commands never move an interval, so the projector now folds the lifecycle
-- events alone, read by instant from this index, and has Postgres count the commands that
-- fall where the container was not running (by the container index). Commands are not
-- in this index, so it costs them nothing to write. See
-- docs/decisions/0055-late-lifecycle-events-refold-the-lifecycle.md.
--
-- `org_id` follows `container_id`, so that another org's events under the same id are
-- never read.
CREATE INDEX ledger_container_lifecycle ON ledger (container_id, org_id, occurred_at, position)
    WHERE type IN ('container.created', 'container.resumed', 'container.stopped');
