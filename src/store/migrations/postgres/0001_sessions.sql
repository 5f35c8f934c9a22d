-- Sessions, their append-only transcripts, runs with leases, approvals.
-- Times are integer milliseconds since the Unix epoch (the database's clock).

CREATE TABLE sessions (
    id               TEXT PRIMARY KEY,
    agent            TEXT NOT NULL,
    owner            TEXT NOT NULL,
    extra_hooks      TEXT NOT NULL,            -- JSON array of hook names
    metadata         TEXT NOT NULL,            -- JSON object
    created_ms       BIGINT NOT NULL,
    last_active_ms   BIGINT NOT NULL,
    run_count        BIGINT NOT NULL DEFAULT 0,
    active_run       TEXT,
    next_seq         BIGINT NOT NULL DEFAULT 0,
    transcript_bytes BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX sessions_page ON sessions (created_ms, id);
CREATE INDEX sessions_owner_page ON sessions (owner, created_ms, id);
CREATE INDEX sessions_idle ON sessions (last_active_ms) WHERE active_run IS NULL;

-- One row per committed message, in order; never updated.
CREATE TABLE messages (
    session_id TEXT NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq        BIGINT NOT NULL,
    run_id     TEXT NOT NULL,
    body       TEXT NOT NULL,                  -- JSON of the message
    PRIMARY KEY (session_id, seq)
);

CREATE TABLE runs (
    id               TEXT PRIMARY KEY,
    session_id       TEXT NOT NULL,
    replica          TEXT NOT NULL,            -- lease holder
    epoch            BIGINT NOT NULL,          -- bumped on every claim
    lease_expires_ms BIGINT NOT NULL,
    started_ms       BIGINT NOT NULL,
    ended_ms         BIGINT,
    outcome          TEXT,
    reason           TEXT,
    input_tokens     BIGINT NOT NULL DEFAULT 0,
    output_tokens    BIGINT NOT NULL DEFAULT 0,
    turns            BIGINT NOT NULL DEFAULT 0,
    cancel_reason    TEXT,
    pending_turn     TEXT                      -- JSON of the model turn whose tools run
);
-- Exactly one active run per session.
CREATE UNIQUE INDEX runs_one_active ON runs (session_id) WHERE ended_ms IS NULL;
CREATE INDEX runs_active_replica ON runs (replica) WHERE ended_ms IS NULL;
CREATE INDEX runs_active_lease ON runs (lease_expires_ms) WHERE ended_ms IS NULL;
CREATE INDEX runs_session ON runs (session_id);

CREATE TABLE approvals (
    run_id  TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    call_id TEXT NOT NULL,
    state   TEXT NOT NULL,                     -- pending, approved, denied, expired
    note    TEXT NOT NULL DEFAULT '',
    PRIMARY KEY (run_id, call_id)
);
