//! Every error code tally answers, as one closed list (contract §7).
//!
//! A code is the stable, machine-readable part of an error: the `code` of an error body,
//! of each of its `details`, of a dead letter's header, of a failed close job. The list
//! lives in a module of its own, below every layer, so that the event rules, the plan and
//! report parsers, the ledger and the HTTP layer all draw from it, and the OpenAPI
//! document enumerates it (`docs/decisions/0018-error-codes.md`).

use serde::Serialize;

/// Declares [`ErrorCode`] from `Variant = "wire"` pairs, so that the serialized form,
/// [`ErrorCode::as_str`] and [`ErrorCode::ALL`] come from one list.
macro_rules! error_codes {
    ($($variant:ident = $wire:tt,)*) => {
        /// A stable snake_case error code.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, utoipa::ToSchema)]
        pub enum ErrorCode {
            $(
                #[serde(rename = $wire)]
                $variant,
            )*
        }

        impl ErrorCode {
            /// Every code, in the order of the list.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant),*];

            /// The code as it goes on the wire.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $wire,)*
                }
            }
        }
    };
}

error_codes! {
    AlreadyVoided = "already_voided",
    AmbiguousContainer = "ambiguous_container",
    AmountsOutOfRange = "amounts_out_of_range",
    BatchTooLarge = "batch_too_large",
    BodyTimeout = "body_timeout",
    BodyTooLarge = "body_too_large",
    CloseAbandoned = "close_abandoned",
    CloseFailed = "close_failed",
    CloseNotFound = "close_not_found",
    CloseStarting = "close_starting",
    ConcurrencyLimit = "concurrency_limit",
    ContainerNotFound = "container_not_found",
    ContainerNotRunning = "container_not_running",
    ContainerRunning = "container_running",
    CurrencyMismatch = "currency_mismatch",
    DatabaseUnavailable = "database_unavailable",
    DuplicateColumn = "duplicate_column",
    DuplicateField = "duplicate_field",
    DuplicateHeader = "duplicate_header",
    DuplicateQueryParameter = "duplicate_query_parameter",
    EmptyBatch = "empty_batch",
    EmptyReport = "empty_report",
    EndBeforeStart = "end_before_start",
    EventNotFound = "event_not_found",
    ExtensionsTooLarge = "extensions_too_large",
    ForbiddenScope = "forbidden_scope",
    HeadersTooLarge = "headers_too_large",
    IdempotencyConflict = "idempotency_conflict",
    Internal = "internal",
    IntervalLimit = "interval_limit",
    InvalidAction = "invalid_action",
    InvalidAfter = "invalid_after",
    InvalidAllowance = "invalid_allowance",
    InvalidAnomaliesAfter = "invalid_anomalies_after",
    InvalidAnomaliesLimit = "invalid_anomalies_limit",
    InvalidAsOf = "invalid_as_of",
    InvalidBody = "invalid_body",
    InvalidCloudevent = "invalid_cloudevent",
    InvalidConsistency = "invalid_consistency",
    InvalidContainerId = "invalid_container_id",
    InvalidCurrency = "invalid_currency",
    InvalidData = "invalid_data",
    InvalidEvent = "invalid_event",
    InvalidEventId = "invalid_event_id",
    InvalidEvents = "invalid_events",
    InvalidExtension = "invalid_extension",
    InvalidFormat = "invalid_format",
    InvalidFull = "invalid_full",
    InvalidId = "invalid_id",
    InvalidLimit = "invalid_limit",
    InvalidMinPosition = "invalid_min_position",
    InvalidNumber = "invalid_number",
    InvalidOffset = "invalid_offset",
    InvalidOrgId = "invalid_org_id",
    InvalidOverage = "invalid_overage",
    InvalidParameter = "invalid_parameter",
    InvalidPath = "invalid_path",
    InvalidPeriod = "invalid_period",
    InvalidPlan = "invalid_plan",
    InvalidPlanId = "invalid_plan_id",
    InvalidPrice = "invalid_price",
    InvalidReason = "invalid_reason",
    InvalidReconciliationId = "invalid_reconciliation_id",
    InvalidReportId = "invalid_report_id",
    InvalidReservationId = "invalid_reservation_id",
    InvalidResourceId = "invalid_resource_id",
    InvalidScopes = "invalid_scopes",
    InvalidSort = "invalid_sort",
    InvalidStatus = "invalid_status",
    InvalidStream = "invalid_stream",
    InvalidTags = "invalid_tags",
    InvalidTimestamp = "invalid_timestamp",
    InvalidTokenId = "invalid_token_id",
    InvalidTolerance = "invalid_tolerance",
    InvalidTtl = "invalid_ttl",
    InvalidType = "invalid_type",
    InvalidWindow = "invalid_window",
    LeapSecond = "leap_second",
    LifecycleLimit = "lifecycle_limit",
    MalformedCsv = "malformed_csv",
    MalformedGzip = "malformed_gzip",
    MalformedJson = "malformed_json",
    MethodNotAllowed = "method_not_allowed",
    MissingColumn = "missing_column",
    MissingContainerId = "missing_container_id",
    MissingField = "missing_field",
    MissingValue = "missing_value",
    NotBillingEligible = "not_billing_eligible",
    NotFound = "not_found",
    NotVerified = "not_verified",
    NotVoidable = "not_voidable",
    OccurredAtInFuture = "occurred_at_in_future",
    OccurredAtTooOld = "occurred_at_too_old",
    OrgBoundToken = "org_bound_token",
    OrgNotAllowed = "org_not_allowed",
    Overloaded = "overloaded",
    PeriodClosed = "period_closed",
    PeriodNotClosed = "period_not_closed",
    PeriodRunning = "period_running",
    PlanExcludesSandbox = "plan_excludes_sandbox",
    PlanIdMismatch = "plan_id_mismatch",
    PortLimit = "port_limit",
    PriceNotAString = "price_not_a_string",
    ProjectionLagging = "projection_lagging",
    ReadDatabaseUnavailable = "read_database_unavailable",
    ReconciliationAbandoned = "reconciliation_abandoned",
    ReconciliationFailed = "reconciliation_failed",
    ReconciliationNotFound = "reconciliation_not_found",
    ReconciliationRunning = "reconciliation_running",
    ReconciliationsBusy = "reconciliations_busy",
    RecordTooLong = "record_too_long",
    ReportInflatedTooLarge = "report_inflated_too_large",
    ReportNotFound = "report_not_found",
    ReplicaLagging = "replica_lagging",
    ReportTooLarge = "report_too_large",
    ReservationConsumed = "reservation_consumed",
    ReservationNotFound = "reservation_not_found",
    ReservedOrgId = "reserved_org_id",
    ReservedType = "reserved_type",
    RuntimeAllowanceExhausted = "runtime_allowance_exhausted",
    ShuttingDown = "shutting_down",
    StreamUnavailable = "stream_unavailable",
    Timeout = "timeout",
    TokenNotFound = "token_not_found",
    TooLong = "too_long",
    TooManyConnections = "too_many_connections",
    TooManyRequests = "too_many_requests",
    Unauthorized = "unauthorized",
    UnexpectedContainerId = "unexpected_container_id",
    UnknownField = "unknown_field",
    UnknownParameter = "unknown_parameter",
    UnknownPlan = "unknown_plan",
    UnknownType = "unknown_type",
    UnreadableBody = "unreadable_body",
    UnreadableHeaders = "unreadable_headers",
    UnreadableSubject = "unreadable_subject",
    UnstorableEvent = "unstorable_event",
    UnstorableText = "unstorable_text",
    UnsupportedContentEncoding = "unsupported_content_encoding",
    UnsupportedMediaType = "unsupported_media_type",
    UriTooLong = "uri_too_long",
    VerifyInProgress = "verify_in_progress",
    WrongFieldCount = "wrong_field_count",
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code the service answers, spelled out by hand: a code leaves the enum or changes
    /// its spelling only together with this list, and either is a change of the contract.
    const WIRE: &[&str] = &[
        "already_voided",
        "ambiguous_container",
        "amounts_out_of_range",
        "batch_too_large",
        "body_timeout",
        "body_too_large",
        "close_abandoned",
        "close_failed",
        "close_not_found",
        "close_starting",
        "concurrency_limit",
        "container_not_found",
        "container_not_running",
        "container_running",
        "currency_mismatch",
        "database_unavailable",
        "duplicate_column",
        "duplicate_field",
        "duplicate_header",
        "duplicate_query_parameter",
        "empty_batch",
        "empty_report",
        "end_before_start",
        "event_not_found",
        "extensions_too_large",
        "forbidden_scope",
        "headers_too_large",
        "idempotency_conflict",
        "internal",
        "interval_limit",
        "invalid_action",
        "invalid_after",
        "invalid_allowance",
        "invalid_anomalies_after",
        "invalid_anomalies_limit",
        "invalid_as_of",
        "invalid_body",
        "invalid_cloudevent",
        "invalid_consistency",
        "invalid_container_id",
        "invalid_currency",
        "invalid_data",
        "invalid_event",
        "invalid_event_id",
        "invalid_events",
        "invalid_extension",
        "invalid_format",
        "invalid_full",
        "invalid_id",
        "invalid_limit",
        "invalid_min_position",
        "invalid_number",
        "invalid_offset",
        "invalid_org_id",
        "invalid_overage",
        "invalid_parameter",
        "invalid_path",
        "invalid_period",
        "invalid_plan",
        "invalid_plan_id",
        "invalid_price",
        "invalid_reason",
        "invalid_reconciliation_id",
        "invalid_report_id",
        "invalid_reservation_id",
        "invalid_resource_id",
        "invalid_scopes",
        "invalid_sort",
        "invalid_status",
        "invalid_stream",
        "invalid_tags",
        "invalid_timestamp",
        "invalid_token_id",
        "invalid_tolerance",
        "invalid_ttl",
        "invalid_type",
        "invalid_window",
        "leap_second",
        "lifecycle_limit",
        "malformed_csv",
        "malformed_gzip",
        "malformed_json",
        "method_not_allowed",
        "missing_column",
        "missing_container_id",
        "missing_field",
        "missing_value",
        "not_billing_eligible",
        "not_found",
        "not_verified",
        "not_voidable",
        "occurred_at_in_future",
        "occurred_at_too_old",
        "org_bound_token",
        "org_not_allowed",
        "overloaded",
        "period_closed",
        "period_not_closed",
        "period_running",
        "plan_excludes_sandbox",
        "plan_id_mismatch",
        "port_limit",
        "price_not_a_string",
        "projection_lagging",
        "read_database_unavailable",
        "reconciliation_abandoned",
        "reconciliation_failed",
        "reconciliation_not_found",
        "reconciliation_running",
        "reconciliations_busy",
        "record_too_long",
        "report_inflated_too_large",
        "report_not_found",
        "replica_lagging",
        "report_too_large",
        "reservation_consumed",
        "reservation_not_found",
        "reserved_org_id",
        "reserved_type",
        "runtime_allowance_exhausted",
        "shutting_down",
        "stream_unavailable",
        "timeout",
        "token_not_found",
        "too_long",
        "too_many_connections",
        "too_many_requests",
        "unauthorized",
        "unexpected_container_id",
        "unknown_field",
        "unknown_parameter",
        "unknown_plan",
        "unknown_type",
        "unreadable_body",
        "unreadable_headers",
        "unreadable_subject",
        "unstorable_event",
        "unstorable_text",
        "unsupported_content_encoding",
        "unsupported_media_type",
        "uri_too_long",
        "verify_in_progress",
        "wrong_field_count",
    ];

    #[test]
    fn the_enum_serializes_to_exactly_the_known_wire_codes() {
        let serialized: Vec<String> = ErrorCode::ALL
            .iter()
            .map(|code| match serde_json::to_value(code).unwrap() {
                serde_json::Value::String(text) => text,
                other => panic!("{code:?} serializes to {other}"),
            })
            .collect();
        let mut sorted = serialized.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), serialized.len(), "a wire code appears twice");
        let mut wire: Vec<&str> = WIRE.to_vec();
        wire.sort();
        assert_eq!(sorted, wire);
    }

    #[test]
    fn as_str_and_display_match_the_serialized_code() {
        for code in ErrorCode::ALL {
            assert_eq!(serde_json::to_value(code).unwrap(), code.as_str());
            assert_eq!(code.to_string(), code.as_str());
        }
    }
}
