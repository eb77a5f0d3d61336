-- The ledger position of the event that consumed a reservation. After a replay's swap the
-- checkpoint can be behind events that were projected live and consumed reservations: the
-- new projection does not count those containers yet, so their reservations must hold the
-- slot until the projection passes that position again (see `admission::load_facts`).
ALTER TABLE admission_reservation ADD COLUMN consumed_position BIGINT;
UPDATE admission_reservation r SET consumed_position = l.position
    FROM ledger l WHERE l.id = r.consumed_by;
-- Checked for every row written from now on; rows of older versions were filled above.
ALTER TABLE admission_reservation ADD CONSTRAINT admission_reservation_consumed_position
    CHECK ((consumed_at IS NULL) = (consumed_position IS NULL)) NOT VALID;
CREATE INDEX admission_reservation_unprojected ON admission_reservation (org_id, consumed_position)
    WHERE consumed_position IS NOT NULL;
