-- The appender's duplicate check looks up a group's ids in `ledger_ids` (`id = ANY(…)`).
-- Planned for its values at every call (20261202003200), it is planned for a group of a
-- thousand ids or more as a read of the whole table once the table is a few tens of
-- thousands of rows, because the planner prices each index lookup as a random read from
-- disk. The whole read grows with the ledger: measured on a table shaped like `ledger_ids`
-- of 364 000 rows, 41 ms for 2 000 ids (a parallel sequential scan, workers started for
-- every call) against 7 ms by the primary key; the bench's HTTP batches commit about
-- 2 000 events a group. Every statement of the function has an index that answers it
-- (the head by position, its hash by the month's primary key, the ids by theirs), so the
-- function runs with sequential scans off: a lookup costs what its ids cost, not what
-- the ledger holds.
ALTER FUNCTION ledger_append(BIGINT, BYTEA, BIGINT[], UUID[], TEXT[], TEXT[], TEXT[],
                             TIMESTAMPTZ[], TIMESTAMPTZ[], JSONB[], TEXT[], TEXT[], JSONB[],
                             BYTEA[], BYTEA[])
    SET enable_seqscan = off;
