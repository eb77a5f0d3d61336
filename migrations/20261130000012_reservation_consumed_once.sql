-- An event consumes at most one reservation, also when it is projected a second time (a
-- replay's projection starts at the head the replay began from, so the projector projects
-- again the events appended while it was built). The projector looks its events up here
-- before consuming.
CREATE INDEX admission_reservation_consumed_by ON admission_reservation (consumed_by)
    WHERE consumed_by IS NOT NULL;
