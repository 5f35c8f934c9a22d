-- A replica polls for cancels of its runs in flight (every half second and
-- on each wake-up). runs_active_replica made that a walk over all of them
-- (10 000 at scale) for what is almost always none; this index holds only
-- runs in flight with a cancel recorded.
CREATE INDEX runs_cancelled ON runs (replica) WHERE ended_ms IS NULL AND cancel_reason IS NOT NULL;
