-- The run-rate quota (`runs_per_minute`) counts the runs a principal
-- started within the window. A deleted session's ended runs go with it,
-- so before this table a principal could start runs, delete their
-- sessions and start as many again. Deleting a session now keeps the
-- start times of its runs still within the window here, under the
-- session's owner; a row leaves once it is older than the window (each
-- deletion prunes them). No row is rewritten: starts of sessions deleted
-- before this migration are not recovered.
CREATE TABLE deleted_run_starts (
    owner      TEXT NOT NULL,
    started_ms BIGINT NOT NULL
);
CREATE INDEX deleted_run_starts_owner ON deleted_run_starts (owner, started_ms);
CREATE INDEX deleted_run_starts_age ON deleted_run_starts (started_ms);
