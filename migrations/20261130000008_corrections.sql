-- Finds the void of an event (to refuse voiding it twice) without scanning the ledger.
CREATE INDEX ledger_voids ON ledger ((data->>'event_id'))
    WHERE type = 'ledger.event_voided';
