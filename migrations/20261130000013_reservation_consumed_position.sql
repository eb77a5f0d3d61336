-- The ledger position of the event that consumed a reservation. After a replay's swap the
-- checkpoint can be behind events that were projected live and consumed reservations: the
-- new projection does not count those containers yet, so their reservations must hold the
-- slot until the projection passes that position again (see `admission::load_facts`).
-- A nullable column without a default: no table rewrite.
ALTER TABLE admission_reservation ADD COLUMN consumed_position BIGINT;
-- Only a position past the checkpoint is ever counted, so only those are filled in: a
-- handful of rows, whatever the table's size. NULL counts as projected.
UPDATE admission_reservation r SET consumed_position = l.position
    FROM ledger l
    WHERE l.id = r.consumed_by AND l.position > (SELECT position FROM proj.checkpoint);
-- Loose on purpose: instances of the previous version, still running during a rolling
-- deploy, consume without setting the position, and must not fail their rounds.
ALTER TABLE admission_reservation ADD CONSTRAINT admission_reservation_consumed_position
    CHECK (consumed_position IS NULL OR consumed_at IS NOT NULL);
CREATE INDEX admission_reservation_unprojected ON admission_reservation (org_id, consumed_position)
    WHERE consumed_position IS NOT NULL;
