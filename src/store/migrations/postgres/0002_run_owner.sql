-- Quota checks count a principal's runs by the owner kept on each run, so
-- a check reads what the principal has in flight or started lately, not
-- everything it ever kept (a join through its sessions did).
--
-- NULL: counted through the run's session, if that still exists. Runs
-- started before this migration, or by an older binary during a rolling
-- upgrade, have none; a run in flight loses its own when its session is
-- deleted. Nothing is backfilled, so the migration rewrites no row; the
-- checks find the runs without an owner through these same indexes.
ALTER TABLE runs ADD COLUMN owner TEXT;
-- (owner, ended_ms) and not a partial index on active runs: "ended_ms IS
-- NULL" is then a second equality, so SQLite picks this index without
-- statistics instead of the one below.
CREATE INDEX runs_owner_ended ON runs (owner, ended_ms);
CREATE INDEX runs_owner_started ON runs (owner, started_ms);
