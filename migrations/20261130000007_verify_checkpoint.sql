-- The last position a verification found intact, with its hash: an incremental
-- verification starts there, so that its cost follows the ledger's growth, not its size.
CREATE TABLE verify_checkpoint (
    singleton   BOOLEAN     PRIMARY KEY DEFAULT true CHECK (singleton),
    position    BIGINT      NOT NULL CHECK (position >= 0),
    hash        BYTEA       NOT NULL CHECK (octet_length(hash) = 32),
    verified_at TIMESTAMPTZ NOT NULL
);
