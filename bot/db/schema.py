"""The schema of both backends, as numbered migrations.

Each step runs in its own transaction together with the version bump, so a database is always at
exactly one version. Never edit a released step; append a new one. SQLite keeps its history (a
data directory written by any earlier Dejafix upgrades in place); PostgreSQL starts at the
schema SQLite reached with step 6.
"""

from __future__ import annotations

SQLITE: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE deliveries (
            delivery_id     TEXT PRIMARY KEY,
            event           TEXT NOT NULL,
            action          TEXT,
            repo            TEXT,
            installation_id INTEGER,
            received_at     REAL NOT NULL,
            updated_at      REAL NOT NULL,
            state           TEXT NOT NULL
                CHECK (state IN ('queued', 'running', 'done', 'failed'))
        );
        CREATE INDEX deliveries_state_updated ON deliveries (state, updated_at);
        CREATE TABLE jobs (
            id           INTEGER PRIMARY KEY AUTOINCREMENT,
            delivery_id  TEXT NOT NULL UNIQUE
                REFERENCES deliveries (delivery_id) ON DELETE CASCADE,
            payload      BLOB NOT NULL,
            attempts     INTEGER NOT NULL DEFAULT 0,
            state        TEXT NOT NULL
                CHECK (state IN ('queued', 'running', 'done', 'failed')),
            lease_until  REAL,
            available_at REAL NOT NULL,
            last_error   TEXT
        );
        CREATE INDEX jobs_state_available ON jobs (state, available_at);
        CREATE TABLE comments (
            repo       TEXT NOT NULL,
            issue      INTEGER NOT NULL,
            comment_id INTEGER NOT NULL,
            cluster    TEXT,
            score      REAL,
            body_hash  TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        """,
    ),
    (
        2,
        """
        CREATE TABLE learned_clusters (
            repo       TEXT NOT NULL,
            public_id  TEXT NOT NULL,
            record     TEXT NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (repo, public_id)
        );
        CREATE TABLE learned_members (
            repo      TEXT NOT NULL,
            kind      TEXT NOT NULL,
            number    INTEGER NOT NULL,
            public_id TEXT NOT NULL,
            PRIMARY KEY (repo, kind, number)
        );
        CREATE TABLE cursors (
            name       TEXT PRIMARY KEY,
            value      TEXT NOT NULL,
            updated_at REAL NOT NULL
        );
        """,
    ),
    (
        3,
        """
        CREATE TABLE feedback (
            repo       TEXT NOT NULL,
            issue      INTEGER NOT NULL,
            cluster    TEXT NOT NULL,
            kind       TEXT NOT NULL CHECK (kind IN ('dismissed', 'confirmed')),
            login      TEXT,
            created_at REAL NOT NULL,
            PRIMARY KEY (repo, issue, cluster)
        );
        CREATE TABLE pauses (
            repo         TEXT PRIMARY KEY,
            paused       INTEGER NOT NULL,
            reason       TEXT NOT NULL,
            config_hash  TEXT NOT NULL,
            issue        INTEGER,
            announced    INTEGER NOT NULL DEFAULT 0,
            paused_at    REAL NOT NULL,
            resumed_at   REAL,
            resumed_by   TEXT
        );
        """,
    ),
    (
        4,
        # Payloads in a table of their own: a job row is rewritten at every state change, and
        # with its 10-20 kB payload inside that was most of the bytes the store wrote.
        """
        DROP INDEX jobs_state_available;
        CREATE INDEX jobs_state_id ON jobs (state, id, available_at);
        CREATE TABLE payloads (
            delivery_id TEXT PRIMARY KEY
                REFERENCES deliveries (delivery_id) ON DELETE CASCADE,
            body        BLOB NOT NULL
        );
        INSERT INTO payloads (delivery_id, body) SELECT delivery_id, payload FROM jobs;
        UPDATE jobs SET payload = X'';
        """,
    ),
    (
        5,
        # Written by the journal of earlier versions: where a body was kept outside SQLite.
        """
        ALTER TABLE payloads ADD COLUMN ref TEXT;
        CREATE INDEX payloads_ref ON payloads (ref) WHERE ref IS NOT NULL;
        """,
    ),
    (
        6,
        # One delivery path for both backends. A job knows its repository and issue, so that
        # the claim can run one job per issue and a bounded number per repository at a time,
        # across processes. A body that an earlier version left in its journal cannot be read
        # any more: its job is kept as failed, with the reason. The daily cap reserves a slot
        # before posting (comment_slots) so that two workers cannot both take the last one; a
        # pause is announced by whoever claims the announcement (announcing_until). The learned
        # clusters' version is a counter, read in O(1) before a match. ``claim`` counts a job's
        # claims: a worker whose claim is no longer the job's changes nothing.
        """
        ALTER TABLE jobs ADD COLUMN repo TEXT;
        ALTER TABLE jobs ADD COLUMN issue_key TEXT;
        ALTER TABLE jobs ADD COLUMN claim INTEGER NOT NULL DEFAULT 0;
        UPDATE jobs SET repo = (SELECT lower(d.repo) FROM deliveries d
                                WHERE d.delivery_id = jobs.delivery_id);
        UPDATE jobs SET state = 'failed',
            last_error = 'its body was kept in a journal file, which this version no longer reads'
            WHERE state IN ('queued', 'running') AND delivery_id IN
            (SELECT delivery_id FROM payloads WHERE ref IS NOT NULL AND length(body) = 0);
        UPDATE deliveries SET state = 'failed' WHERE delivery_id IN
            (SELECT delivery_id FROM jobs WHERE state = 'failed');
        DROP INDEX jobs_state_id;
        CREATE INDEX jobs_pending ON jobs (id) WHERE state IN ('queued', 'running');
        CREATE INDEX jobs_running ON jobs (repo, issue_key) WHERE state = 'running';
        CREATE INDEX jobs_running_issue ON jobs (issue_key) WHERE state = 'running';
        CREATE INDEX jobs_failed ON jobs (id) WHERE state = 'failed';
        ALTER TABLE pauses ADD COLUMN announcing_until REAL;
        CREATE TABLE comment_slots (
            repo        TEXT NOT NULL,
            issue       INTEGER NOT NULL,
            reserved_at REAL NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        CREATE INDEX comments_repo_created ON comments (repo, created_at);
        CREATE TABLE counters (
            name  TEXT PRIMARY KEY,
            value INTEGER NOT NULL
        );
        INSERT INTO counters (name, value) SELECT 'learned', count(*) FROM learned_clusters;
        """,
    ),
    (
        7,
        # The latest suggestion on each issue, posted or not (shadow mode): what a maintainer
        # can read before the bot speaks, and after.
        """
        CREATE TABLE suggestions (
            repo       TEXT NOT NULL,
            issue      INTEGER NOT NULL,
            cluster    TEXT NOT NULL,
            score      REAL NOT NULL,
            mode       TEXT NOT NULL CHECK (mode IN ('comment', 'shadow')),
            body       TEXT NOT NULL,
            evidence   TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        CREATE INDEX suggestions_repo_updated ON suggestions (repo, updated_at);
        """,
    ),
    (
        8,
        # A possible regression is recorded too, labelled (mode ``label``) or not: the web
        # page's "fixes that look incomplete" reads them. SQLite cannot change a CHECK in
        # place, so the table is copied.
        """
        CREATE TABLE suggestions_new (
            repo       TEXT NOT NULL,
            issue      INTEGER NOT NULL,
            cluster    TEXT NOT NULL,
            score      REAL NOT NULL,
            mode       TEXT NOT NULL CHECK (mode IN ('comment', 'shadow', 'label')),
            body       TEXT NOT NULL,
            evidence   TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            regression TEXT,
            PRIMARY KEY (repo, issue)
        );
        INSERT INTO suggestions_new (repo, issue, cluster, score, mode, body, evidence,
            created_at, updated_at)
            SELECT repo, issue, cluster, score, mode, body, evidence, created_at, updated_at
            FROM suggestions;
        DROP TABLE suggestions;
        ALTER TABLE suggestions_new RENAME TO suggestions;
        CREATE INDEX suggestions_repo_updated ON suggestions (repo, updated_at);
        CREATE INDEX suggestions_repo_cluster ON suggestions (repo, cluster);
        """,
    ),
    (
        9,
        # Cluster feeds: each feed's last good version (its valid lines), shared by every
        # process; a restart does not fetch what was fetched within the interval.
        """
        CREATE TABLE feeds (
            url        TEXT PRIMARY KEY,
            etag       TEXT,
            body       TEXT NOT NULL,
            clusters   INTEGER NOT NULL,
            problems   TEXT NOT NULL,
            error      TEXT,
            fetched_at REAL NOT NULL,
            changed_at REAL NOT NULL
        );
        """,
    ),
    (
        10,
        # The worker holding a running job: on PostgreSQL the key of the advisory lock its
        # database session holds (a job whose owner's lock is free is taken over at once);
        # SQLite (one worker per directory) leaves it empty.
        """
        ALTER TABLE jobs ADD COLUMN owner INTEGER;
        """,
    ),
]

POSTGRES: list[tuple[int, str]] = [
    (
        1,
        """
        CREATE TABLE deliveries (
            delivery_id     TEXT PRIMARY KEY,
            event           TEXT NOT NULL,
            action          TEXT,
            repo            TEXT,
            installation_id BIGINT,
            received_at     DOUBLE PRECISION NOT NULL,
            updated_at      DOUBLE PRECISION NOT NULL,
            state           TEXT NOT NULL
                CHECK (state IN ('queued', 'running', 'done', 'failed'))
        );
        CREATE INDEX deliveries_state_updated ON deliveries (state, updated_at);
        CREATE TABLE jobs (
            id           BIGSERIAL PRIMARY KEY,
            delivery_id  TEXT NOT NULL UNIQUE
                REFERENCES deliveries (delivery_id) ON DELETE CASCADE,
            repo         TEXT,
            issue_key    TEXT,
            attempts     INTEGER NOT NULL DEFAULT 0,
            claim        INTEGER NOT NULL DEFAULT 0,
            state        TEXT NOT NULL
                CHECK (state IN ('queued', 'running', 'done', 'failed')),
            lease_until  DOUBLE PRECISION,
            available_at DOUBLE PRECISION NOT NULL,
            last_error   TEXT
        );
        CREATE INDEX jobs_pending ON jobs (id) WHERE state IN ('queued', 'running');
        CREATE INDEX jobs_running ON jobs (repo, issue_key) WHERE state = 'running';
        CREATE INDEX jobs_running_issue ON jobs (issue_key) WHERE state = 'running';
        CREATE INDEX jobs_failed ON jobs (id) WHERE state = 'failed';
        CREATE TABLE payloads (
            delivery_id TEXT PRIMARY KEY
                REFERENCES deliveries (delivery_id) ON DELETE CASCADE,
            body        BYTEA NOT NULL
        );
        CREATE TABLE comments (
            repo       TEXT NOT NULL,
            issue      BIGINT NOT NULL,
            comment_id BIGINT NOT NULL,
            cluster    TEXT,
            score      DOUBLE PRECISION,
            body_hash  TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        CREATE INDEX comments_repo_created ON comments (repo, created_at);
        CREATE TABLE comment_slots (
            repo        TEXT NOT NULL,
            issue       BIGINT NOT NULL,
            reserved_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        CREATE TABLE learned_clusters (
            repo       TEXT NOT NULL,
            public_id  TEXT NOT NULL,
            record     TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (repo, public_id)
        );
        CREATE TABLE learned_members (
            repo      TEXT NOT NULL,
            kind      TEXT NOT NULL,
            number    BIGINT NOT NULL,
            public_id TEXT NOT NULL,
            PRIMARY KEY (repo, kind, number)
        );
        CREATE TABLE cursors (
            name       TEXT PRIMARY KEY,
            value      TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL
        );
        CREATE TABLE feedback (
            repo       TEXT NOT NULL,
            issue      BIGINT NOT NULL,
            cluster    TEXT NOT NULL,
            kind       TEXT NOT NULL CHECK (kind IN ('dismissed', 'confirmed')),
            login      TEXT,
            created_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (repo, issue, cluster)
        );
        CREATE TABLE pauses (
            repo             TEXT PRIMARY KEY,
            paused           INTEGER NOT NULL,
            reason           TEXT NOT NULL,
            config_hash      TEXT NOT NULL,
            issue            BIGINT,
            announced        INTEGER NOT NULL DEFAULT 0,
            paused_at        DOUBLE PRECISION NOT NULL,
            resumed_at       DOUBLE PRECISION,
            resumed_by       TEXT,
            announcing_until DOUBLE PRECISION
        );
        CREATE TABLE counters (
            name  TEXT PRIMARY KEY,
            value BIGINT NOT NULL
        );
        INSERT INTO counters (name, value) VALUES ('learned', 0);
        """,
    ),
    (
        2,
        """
        CREATE TABLE suggestions (
            repo       TEXT NOT NULL,
            issue      BIGINT NOT NULL,
            cluster    TEXT NOT NULL,
            score      DOUBLE PRECISION NOT NULL,
            mode       TEXT NOT NULL CHECK (mode IN ('comment', 'shadow')),
            body       TEXT NOT NULL,
            evidence   TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (repo, issue)
        );
        CREATE INDEX suggestions_repo_updated ON suggestions (repo, updated_at);
        """,
    ),
    (
        3,
        """
        ALTER TABLE suggestions DROP CONSTRAINT suggestions_mode_check;
        ALTER TABLE suggestions ADD CONSTRAINT suggestions_mode_check
            CHECK (mode IN ('comment', 'shadow', 'label'));
        ALTER TABLE suggestions ADD COLUMN regression TEXT;
        CREATE INDEX suggestions_repo_cluster ON suggestions (repo, cluster);
        """,
    ),
    (
        4,
        """
        CREATE TABLE feeds (
            url        TEXT PRIMARY KEY,
            etag       TEXT,
            body       TEXT NOT NULL,
            clusters   INTEGER NOT NULL,
            problems   TEXT NOT NULL,
            error      TEXT,
            fetched_at DOUBLE PRECISION NOT NULL,
            changed_at DOUBLE PRECISION NOT NULL
        );
        """,
    ),
    (
        5,
        # The worker holding a running job: the key of the session advisory lock its database
        # session holds. A job whose owner's lock is free (the session ended with its process)
        # is taken over at once, without waiting for its lease.
        """
        ALTER TABLE jobs ADD COLUMN owner BIGINT;
        """,
    ),
]


def check(steps: list[tuple[int, str]]) -> int:
    """The latest version of ``steps``, which must be numbered 1, 2, 3..."""
    versions = [v for v, _ in steps]
    if versions != list(range(1, len(versions) + 1)):
        raise ValueError(f"migration versions must be 1, 2, 3...; got {versions}")
    return versions[-1]


def statements(script: str) -> list[str]:
    """A step's statements. None of the steps has a ';' inside a statement."""
    return [s.strip() for s in script.split(";") if s.strip()]
