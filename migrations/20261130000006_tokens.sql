-- API tokens (DESIGN §6). The secret is shown once, when the token is created; only its
-- sha256 is stored, so a dump of the database holds nothing that authenticates. Revoked
-- tokens are kept (revoked_at), for audit.
CREATE TABLE api_token (
    id            UUID        PRIMARY KEY,
    secret_sha256 BYTEA       NOT NULL UNIQUE CHECK (octet_length(secret_sha256) = 32),
    scopes        TEXT[]      NOT NULL CHECK (cardinality(scopes) > 0),
    -- Set for a token that may act on one org only.
    org_id        TEXT,
    created_at    TIMESTAMPTZ NOT NULL,
    created_by    TEXT        NOT NULL,
    revoked_at    TIMESTAMPTZ,
    revoked_by    TEXT,
    CHECK ((revoked_at IS NULL) = (revoked_by IS NULL))
);
