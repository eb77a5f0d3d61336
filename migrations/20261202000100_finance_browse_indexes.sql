-- Browsing finance (the console, decision 0027): the provider reports and reconciliations
-- are listed newest first a page at a time, each page after the last row of the one before
-- (keyset paging), so each list needs an index in that order; without one every page
-- would sort the whole table. These tables get a row per import or run, so the indexes
-- cost nothing that matters when writing.
--
-- A reconciliation's lines get no index per sort order: one such index measured to double
-- the time to store a reconciliation's lines, the slow part of a run; a page sorted by a
-- figure reads the reconciliation's lines on the primary key instead.
CREATE INDEX provider_report_imported ON provider_report (imported_at, id);
CREATE INDEX reconciliation_created ON reconciliation (created_at, id);
-- A report's reconciliations (`?report_id=`), newest first.
CREATE INDEX reconciliation_report_created ON reconciliation (report_id, created_at, id);
