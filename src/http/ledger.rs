//! `GET /v1/ledger/verify`: recompute the hash chain and name the first broken position —
//! from the last verified checkpoint, or from the start with `?full=true`; with
//! `?stream=true` also compare every row with its `TALLY_LEDGER` message.
//!
//! One pass runs at a time on an instance: a pass holds a pool connection and a core
//! for as long as it walks the ledger, and twenty at once would take every connection and
//! stall everyone's reads and writes. A request that finds a pass running is answered at
//! once with 503 `verify_in_progress` and `Retry-After`; see
//! `docs/decisions/0014-org-bound-tokens.md`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::error::{ApiError, ErrorBody};
use super::query::{QueryParams, StrictQuery};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::ledger::verify::{self, VerifyReport};

/// Verify passes in progress at once on one instance: one pass already uses a whole core
/// and a pool connection; a second would only halve the speed of both.
pub const VERIFY_PASSES_MAX: usize = 1;

/// What a refused verify asks the client to wait, in seconds: a full pass over a million
/// rows takes a few seconds.
pub const VERIFY_RETRY_AFTER_SECONDS: u64 = 5;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_verify))
}

/// The query of a verify, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct VerifyParams {
    /// verify from the first row (default false)
    #[param(value_type = Option<bool>)]
    full: Option<String>,
    /// also compare every row with its TALLY_LEDGER message (default false)
    #[param(value_type = Option<bool>)]
    stream: Option<String>,
}

impl QueryParams for VerifyParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of verify"),
        )
    }
}

/// Verify the hash chain: the rows after the last verified checkpoint, or every row with
/// `full=true`.
#[utoipa::path(
    get,
    path = "/v1/ledger/verify",
    tag = "audit",
    params(VerifyParams),
    responses(
        (status = 200, body = VerifyReportSchema),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody, description = "the token is bound to an org: verify answers for the whole ledger"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "`verify_in_progress`: another pass is running; retry after `Retry-After`"),
    ),
    security(("bearer" = []))
)]
pub async fn get_verify(
    State(state): State<AppState>,
    StrictQuery(params): StrictQuery<VerifyParams>,
) -> Result<Json<VerifyReport>, ApiError> {
    let full = match params.full.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidFull,
                format!("full: {other:?} is not true or false"),
            ))
        }
    };
    let stream = match params.stream.as_deref() {
        None | Some("false") => false,
        Some("true") => true,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidStream,
                format!("stream: {other:?} is not true or false"),
            ))
        }
    };
    let Ok(pass) = state.verify_passes.clone().try_acquire_owned() else {
        metrics::counter!(crate::telemetry::VERIFY_REFUSED).increment(1);
        return Err(ApiError {
            retry_after_seconds: Some(VERIFY_RETRY_AFTER_SECONDS),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorCode::VerifyInProgress,
                "a verify pass is already running on this instance; retry later",
            )
        });
    };
    // A pass hashes every row it reads: run on a runtime worker, that CPU work delayed the
    // tasks queued behind it (a write's answer waited for the whole pass). It runs on a
    // blocking-pool thread instead, its queries still driven by the runtime, and it keeps
    // its permit until it ends, even when the request is dropped before. A stream
    // comparison is part of the same pass.
    let pool = state.pool.clone();
    let nats = state.nats.clone();
    let names = state.nats_names.clone();
    let runtime = tokio::runtime::Handle::current();
    let report = tokio::task::spawn_blocking(move || {
        let _pass = pass;
        runtime.block_on(async move {
            let report = if full {
                verify::verify(&pool).await?
            } else {
                verify::verify_incremental(&pool).await?
            };
            if !stream {
                return Ok(report);
            }
            let context = crate::bus::jetstream(nats);
            let compared = crate::bus::check::verify_stream(&pool, &context, &names)
                .await
                .map_err(stream_error)?;
            Ok::<_, ApiError>(report.with_stream(compared))
        })
    })
    .await
    .map_err(|error| ApiError::internal(&error))??;
    Ok(Json(report))
}

/// A failure to read the stream is NATS being unavailable (503, retry); one to read the
/// ledger is mapped as any store error.
fn stream_error(error: crate::bus::check::Error) -> ApiError {
    if let crate::bus::check::Error::Ledger(error) = error {
        return ApiError::from(error);
    }
    tracing::warn!(
        error = crate::telemetry::cause_chain(&error),
        "cannot compare the ledger stream"
    );
    ApiError::unavailable(
        ErrorCode::StreamUnavailable,
        "cannot read the TALLY_LEDGER stream; try again",
    )
}

/// The verification report.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct VerifyReportSchema {
    ok: bool,
    events_checked: u64,
    head_position: i64,
    head_hash: String,
    first_bad_position: Option<i64>,
    /// 0 for a full pass; the stored checkpoint for an incremental one.
    from_position: i64,
    problem: Option<String>,
    /// Present with `stream=true`: the ledger compared with its `TALLY_LEDGER` copy.
    stream: Option<StreamReportSchema>,
}

/// Every ledger row compared with its `TALLY_LEDGER` message (event id, position, hash
/// and content); `first_bad_position` is the first that differs.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct StreamReportSchema {
    ok: bool,
    messages_checked: u64,
    /// The stream's last sequence when the pass began.
    last_sequence: u64,
    /// The ledger position of the stream's first message (1 unless seeded; 0 when empty).
    first_position: i64,
    /// Ledger rows after `last_sequence`: not relayed yet.
    rows_not_in_stream: u64,
    first_bad_position: Option<i64>,
    problem: Option<String>,
}
