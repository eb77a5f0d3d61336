//! Who is calling and how the service stands, for the console (contract §6, decision 0026):
//! `GET /v1/whoami`, the caller's token, and `GET /v1/status`, the ledger head, the
//! projection's checkpoint, the relay's last published position and the dead letters.
//!
//! Status reads Postgres in one snapshot and asks JetStream for two stream states, each
//! within [`STATUS_NATS_TIMEOUT_MS`]: a NATS figure that does not come in time is `null`,
//! so the page shows what it knows while NATS is down rather than an error.

use std::time::Duration;

use axum::extract::State;
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::auth::{Principal, Scope};
use super::error::{ApiError, ErrorBody};
use super::query::{QueryParams, StrictQuery};
use super::usage::unknown_parameter;
use super::AppState;
use crate::bus::status as streams;
use crate::event::canonical;
use crate::ledger::db::read_snapshot;
use crate::projection::store::{self, LIVE};

/// How long status waits for each NATS figure: an operator's page must answer while NATS
/// is down, and a healthy JetStream answers stream info in milliseconds.
pub const STATUS_NATS_TIMEOUT_MS: u64 = 1_000;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_whoami))
        .routes(routes!(get_status))
}

/// A route that takes no query parameter.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

impl QueryParams for NoParams {
    fn unknown_parameter(name: &str) -> ApiError {
        unknown_parameter(name)
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WhoamiResponse {
    /// `bootstrap` for the bootstrap token, the token's id otherwise.
    token_id: String,
    /// As the token has them; the bootstrap token has `admin`, which implies every other.
    scopes: Vec<&'static str>,
    /// The org the token is bound to; `null` for a token of every org.
    org_id: Option<String>,
}

/// The caller's token: its id, scopes and org. Any valid token may ask, whatever its scopes.
#[utoipa::path(
    get,
    path = "/v1/whoami",
    tag = "tokens",
    responses(
        (status = 200, body = WhoamiResponse),
        (status = 401, body = ErrorBody),
        (status = 422, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_whoami(
    Extension(principal): Extension<Principal>,
    StrictQuery(NoParams {}): StrictQuery<NoParams>,
) -> Json<WhoamiResponse> {
    Json(WhoamiResponse {
        token_id: principal.id,
        scopes: principal
            .scopes
            .iter()
            .map(|scope| Scope::as_str(*scope))
            .collect(),
        org_id: principal.org_id,
    })
}

#[derive(Debug, Serialize, ToSchema)]
pub struct StatusResponse {
    ledger: LedgerStatus,
    projection: ProjectionStatus,
    relay: RelayStatus,
    dlq: DlqStatus,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LedgerStatus {
    /// The last position stored; 0 for an empty ledger.
    head_position: i64,
    /// When it was stored; `null` for an empty ledger.
    head_recorded_at: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ProjectionStatus {
    /// The projection's checkpoint: the last position its figures hold.
    position: i64,
    /// Events stored but not yet projected: `head_position - position`.
    lag_events: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RelayStatus {
    /// The ledger position of `TALLY_LEDGER`'s last message; `null` when NATS did not answer.
    stream_last_position: Option<i64>,
    /// Events stored but not yet published; `null` when NATS did not answer.
    lag_events: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DlqStatus {
    /// Messages in `TALLY_DLQ`; `null` when NATS did not answer.
    messages: Option<u64>,
}

/// How far the projection and the relay are behind the ledger, and the dead letters.
#[utoipa::path(
    get,
    path = "/v1/status",
    tag = "audit",
    responses(
        (status = 200, body = StatusResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody, description = "the token is bound to an org: status answers for the whole service"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "Postgres is unavailable"),
    ),
    security(("bearer" = []))
)]
pub async fn get_status(
    State(state): State<AppState>,
    StrictQuery(NoParams {}): StrictQuery<NoParams>,
) -> Result<Json<StatusResponse>, ApiError> {
    let mut snapshot = read_snapshot(&state.pool).await?;
    let head: Option<(i64, DateTime<Utc>)> = sqlx::query_as(
        "SELECT position, recorded_at FROM ledger_ids ORDER BY position DESC LIMIT 1",
    )
    // Planned at each run, as `read::head` is.
    .persistent(false)
    .fetch_optional(&mut *snapshot)
    .await?;
    let checkpoint = store::checkpoint(&mut snapshot, LIVE).await?;
    snapshot.commit().await?;
    let head_position = head.map_or(0, |(position, _)| position);

    let bound = Duration::from_millis(STATUS_NATS_TIMEOUT_MS);
    let mut context = async_nats::jetstream::new(state.nats.clone());
    context.set_timeout(bound);
    let names = &state.nats_names;
    let (last_position, dlq) = tokio::join!(
        within(bound, streams::ledger_stream_last_position(&context, names)),
        within(bound, streams::dlq_messages(&context, names)),
    );
    Ok(Json(StatusResponse {
        ledger: LedgerStatus {
            head_position,
            head_recorded_at: head.map(|(_, recorded_at)| canonical::timestamp(recorded_at)),
        },
        projection: ProjectionStatus {
            position: checkpoint,
            lag_events: (head_position - checkpoint).max(0),
        },
        relay: RelayStatus {
            stream_last_position: last_position,
            lag_events: last_position.map(|published| (head_position - published).max(0)),
        },
        dlq: DlqStatus { messages: dlq },
    }))
}

/// The figure `read` gives within `bound`; `None` (logged) when it fails or is late.
async fn within<T>(
    bound: Duration,
    read: impl std::future::Future<Output = Result<T, crate::bus::StreamFailure>>,
) -> Option<T> {
    match tokio::time::timeout(bound, read).await {
        Ok(Ok(figure)) => Some(figure),
        Ok(Err(error)) => {
            tracing::warn!(
                error = crate::telemetry::cause_chain(&error),
                "status: a stream figure is unavailable"
            );
            None
        }
        Err(_) => {
            tracing::warn!(
                timeout_ms = STATUS_NATS_TIMEOUT_MS,
                "status: NATS did not answer in time"
            );
            None
        }
    }
}
