-- An org period whose figures later events took back entirely (a void of its only command
-- or port, a late stop at its container's start instant) kept a row of zeros, which replay
-- never writes; the usage export and a period close list an org by that row. The projector
-- now deletes such rows as it empties them; this deletes those left before it did, so the
-- live projection lists what a replay lists.
DELETE FROM proj.org_period
WHERE closed_runtime_ms = 0 AND commands = 0 AND command_ms = 0 AND ports_published = 0;
