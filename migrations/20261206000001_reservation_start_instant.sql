-- The instant from which the container of a consumed reservation counts as running: the
-- `occurred_at` of the `created` or `resumed` event that consumed it. An event may be dated
-- up to five minutes ahead of the server's clock; until its instant the container does not
-- count, so the reservation it consumed still holds the slot (see `admission::load_facts`).
-- A start now consumes every live reservation of its container, not only the oldest: two
-- grants for one container (a retried request) would otherwise leave one holding a slot
-- next to the running container until it expired. A nullable column without a default: no
-- table rewrite; reservations consumed before it have started long ago.
ALTER TABLE admission_reservation ADD COLUMN consumed_starts_at TIMESTAMPTZ;
ALTER TABLE admission_reservation ADD CONSTRAINT admission_reservation_consumed_starts_at
    CHECK (consumed_starts_at IS NULL OR consumed_at IS NOT NULL);
CREATE INDEX admission_reservation_starting ON admission_reservation (org_id, consumed_starts_at)
    WHERE consumed_starts_at IS NOT NULL;
