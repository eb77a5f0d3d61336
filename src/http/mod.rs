//! The HTTP API (contract §6, §7): `app(state)` builds the router; each feature module owns
//! its routes and their OpenAPI paths (its `router()`), and [`openapi`] is the document of
//! those same routers. Handlers are thin: extract, parse into domain types, call the ledger,
//! map.

pub mod admission;
pub mod audit;
pub mod auth;
pub mod body;
pub mod consistency;
pub mod console;
pub mod corrections;
pub mod error;
pub mod events;
pub mod exports;
pub mod ledger;
pub mod listing;
pub mod ops;
pub mod orgs;
pub mod plans;
pub mod query;
pub mod recheck;
pub mod reconciliation_lines;
pub mod reconciliations;
pub mod replica;
pub mod reports;
pub mod status;
pub mod tokens;
mod turn;
pub mod usage;

pub mod server;

/// How many of an instance's requests of one kind that hold a connection for long may run
/// at once: a quarter of its pool, at least one, so that the rest of the pool serves
/// everything else.
pub fn quarter_of_pool(pool_max: u32) -> usize {
    usize::try_from(pool_max / 4).unwrap_or(1).max(1)
}

/// The 503 of a usage export or report import that found [`AppState::finance_streams`] taken.
pub(crate) const FINANCE_STREAMS_BUSY: &str =
    "too many usage exports and report imports are in progress on this instance; retry later";

/// Waits for one of `permits` as long as a read waits for the projection; past it, 503
/// `overloaded` with `busy` as its message.
pub(crate) async fn take_turn(
    state: &AppState,
    permits: &Arc<tokio::sync::Semaphore>,
    busy: &str,
) -> Result<tokio::sync::OwnedSemaphorePermit, error::ApiError> {
    let turn = tokio::time::timeout(state.read_wait, permits.clone().acquire_owned());
    match turn.await {
        Ok(Ok(permit)) => Ok(permit),
        _ => Err(error::ApiError::unavailable(
            crate::error_code::ErrorCode::Overloaded,
            busy,
        )),
    }
}

use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{middleware, BoxError, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use sqlx::PgPool;
use tower::ServiceBuilder;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;

use crate::error_code::ErrorCode;
use crate::ledger::Appender;
use error::ApiError;

/// Everything a handler may use; cheap to clone.
#[derive(Clone)]
pub struct AppState(Arc<Inner>);

pub struct Inner {
    pub pool: PgPool,
    pub appender: Appender,
    /// For admission's read-your-writes.
    pub freshness: crate::projection::Freshness,
    /// Admission checks, read in groups.
    pub checker: crate::admission::Checker,
    pub nats: async_nats::Client,
    pub metrics: PrometheusHandle,
    pub tokens: auth::Tokens,
    pub body_max_bytes: usize,
    pub batch_events_max: usize,
    pub backdate_max: chrono::Duration,
    pub request_timeout: Duration,
    /// Requests in progress at once before new ones are shed with 503.
    pub concurrency_max: usize,
    /// The largest provider report accepted, as sent and inflated.
    pub report_limits: crate::finance::reports::Limits,
    /// The largest audit page.
    pub page_events_max: usize,
    /// Whether the relay halted on a stream message that is not the ledger (`/readyz`).
    pub relay_status: crate::bus::relay::RelayStatus,
    /// The streams the server refuses to keep as defined (`/readyz`).
    pub stream_health: crate::bus::StreamHealth,
    /// Stream names, for `GET /v1/ledger/verify?stream=true`.
    pub nats_names: crate::bus::Names,
    /// Requests in progress per token (`TALLY_TOKEN_CONCURRENCY_MAX`).
    pub token_limits: auth::TokenLimits,
    /// Verify passes in progress on this instance: [`ledger::VERIFY_PASSES_MAX`].
    pub verify_passes: Arc<tokio::sync::Semaphore>,
    /// Per-day usage reads in progress on this instance: [`quarter_of_pool`].
    pub day_reads: Arc<tokio::sync::Semaphore>,
    /// Usage exports and report imports in progress on this instance: [`quarter_of_pool`].
    /// Each holds a connection (an export its snapshot, an import its transaction) for as
    /// long as its client takes to read or send, so a few slow clients could otherwise hold
    /// every connection.
    pub finance_streams: Arc<tokio::sync::Semaphore>,
    /// Reconciliations running on this instance, each on a session of its own:
    /// [`reconciliations::RECONCILIATIONS_RUNNING_MAX`].
    pub reconciliations: Arc<tokio::sync::Semaphore>,
    /// The correction being stored by this instance: one at a time, so that at most one
    /// connection per instance waits for the corrections' lock ([`corrections`]).
    pub corrections: Arc<tokio::sync::Semaphore>,
    /// The plan definition being stored by this instance, likewise ([`plans`]).
    pub plan_definitions: Arc<tokio::sync::Semaphore>,
    /// Orgs per batch of a period close or usage export.
    pub finance_batch_orgs: i64,
    /// How long a read of derived figures waits for the projection (`TALLY_READ_WAIT_MS`).
    pub read_wait: Duration,
    /// What "now" is for the rules: periods, event time bounds, `as_of`, expiry.
    pub clock: crate::clock::Clock,
    /// The read database (`TALLY_READ_DATABASE_URL`) for audit pages and exports, if any:
    /// [`replica`].
    pub read_pool: Option<PgPool>,
}

impl AppState {
    pub fn new(inner: Inner) -> AppState {
        AppState(Arc::new(inner))
    }
}

impl std::ops::Deref for AppState {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        &self.0
    }
}

/// `/v1`: each feature's router registers its routes and their OpenAPI paths together.
fn v1() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .merge(events::router())
        .merge(ledger::router())
        .merge(usage::router())
        .merge(plans::router())
        .merge(admission::router())
        .merge(audit::router())
        .merge(tokens::router())
        .merge(corrections::router())
        .merge(reports::router())
        .merge(reconciliations::router())
        .merge(reconciliation_lines::router())
        .merge(exports::router())
        .merge(orgs::router())
        .merge(status::router())
}

/// Every route the service answers, under the document's top level ([`ops::ApiDoc`]).
fn routers(v1: OpenApiRouter<AppState>) -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(ops::ApiDoc::openapi())
        .merge(ops::router())
        .merge(v1)
}

/// The OpenAPI document (`/openapi.json`): the paths of the very routers [`app`] serves.
pub fn openapi() -> utoipa::openapi::OpenApi {
    routers(v1()).into_openapi()
}

pub fn app(state: AppState) -> Router {
    // After the token check (a route layer added later runs first): an unknown caller is
    // 401 whatever it sends.
    let v1 = v1()
        .route_layer(middleware::from_fn_with_state(
            query::parameterless(&v1().into_openapi()),
            query::refuse_any_query,
        ))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_token,
        ));
    let (routes, _document) = routers(v1).split_for_parts();
    let timeout = state.request_timeout;
    let concurrency_max = state.concurrency_max.max(1);
    routes
        // The console is HTML, not API: beside `/v1`, outside its token check and outside
        // the OpenAPI document.
        .merge(console::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(refused))
                .load_shed()
                // Global: `Router::layer` wraps every route on its own, and one semaphore
                // shared by all of them makes the limit the service's, not each route's.
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                    concurrency_max,
                ))
                .timeout(timeout),
        )
        .layer(tower_http::trace::TraceLayer::new_for_http())
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, ErrorCode::NotFound, "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        ErrorCode::MethodNotAllowed,
        "this route does not take that method",
    )
}

/// A request the service would not finish: shed (too many in progress) or past its
/// deadline. Both are 503 with `Retry-After`.
async fn refused(error: BoxError) -> impl IntoResponse {
    if error.is::<tower::load_shed::error::Overloaded>() {
        metrics::counter!(crate::telemetry::HTTP_SHED).increment(1);
        ApiError::unavailable(
            ErrorCode::Overloaded,
            "too many requests in progress; retry later",
        )
    } else if error.is::<tower::timeout::error::Elapsed>() {
        ApiError::unavailable(ErrorCode::Timeout, "the request took too long; retry later")
    } else {
        ApiError::internal(&*error)
    }
}
