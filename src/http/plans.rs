//! Plans (contract §4, §6): `PUT /v1/plans/{plan_id}` defines or changes a plan by appending a
//! `plan.defined` event (a new version, in effect from now); `GET /v1/plans` lists the
//! current version of each.

use std::time::Duration;

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::SubsecRound;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::{Postgres, Transaction};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::body::{present, RequestBody, StrictJson};
use super::error::{ApiError, ErrorBody};
use super::turn::{in_turn, Queue};
use super::AppState;
use crate::admission;
use crate::billing::overage::is_currency;
use crate::billing::Plan;
use crate::error_code::ErrorCode;
use crate::event::canonical;
use crate::event::{Event, EventData, EventError, EventId, EventType, OrgId, PlanId, PLANS_ORG_ID};
use crate::ledger::plans::{self, PlanVersion};
use crate::ledger::read;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(get_plans))
        .routes(routes!(put_plan))
}

/// The body of a plan definition. The fields are checked together by [`Plan::parse`], which
/// reports every problem at once, so each is read as it was sent.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanDefinition {
    /// The plan id of the path, when given.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = String)]
    id: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = bool, required = true)]
    sandbox_runtime: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = u64, required = true)]
    included_runtime_seconds: Option<Value>,
    /// `deny` or `bill`.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = String, required = true, example = "bill")]
    overage: Option<Value>,
    /// A decimal string with at most 6 places.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = String, required = true, example = "0.12")]
    overage_price_per_hour: Option<Value>,
    /// ISO 4217.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = String, required = true, example = "USD")]
    currency: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = u64, required = true)]
    max_running_containers: Option<Value>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    #[schema(value_type = u64, required = true)]
    max_published_ports: Option<Value>,
}

impl RequestBody for PlanDefinition {
    const WHAT: &'static str = "a plan";

    /// As [`Plan::parse`] reports them: problems of the plan, one per field.
    fn unknown_fields(unknown: &[&str]) -> ApiError {
        let problems: Vec<EventError> = unknown
            .iter()
            .map(|name| {
                EventError::new(
                    ErrorCode::UnknownField,
                    format!("{name}: is not a plan field"),
                )
            })
            .collect();
        invalid_plan(&problems)
    }
}

/// The plan id of the path, read before the body so that a bad id is answered first.
pub struct PlanIdPath(PlanId);

impl FromRequestParts<AppState> for PlanIdPath {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        let Path(plan_id) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        PlanId::parse(&plan_id).map(PlanIdPath).map_err(|error| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ErrorCode::InvalidPlanId,
                error.to_string(),
            )
            .into_response()
        })
    }
}

/// 422 `invalid_plan`, with each problem in the details.
fn invalid_plan(problems: &[EventError]) -> ApiError {
    ApiError::new(
        StatusCode::UNPROCESSABLE_ENTITY,
        ErrorCode::InvalidPlan,
        format!(
            "{} problem(s) with the plan; nothing was stored",
            problems.len()
        ),
    )
    .with_details(
        problems
            .iter()
            .map(|problem| json!({"code": problem.code, "message": problem.message}))
            .collect(),
    )
}

/// A plan version as the API shows it: the plan's fields, its version and since when it
/// is in effect. Prices are decimal strings.
#[derive(Debug, Serialize, ToSchema)]
pub struct PlanResponse {
    id: String,
    sandbox_runtime: bool,
    included_runtime_seconds: u64,
    #[schema(example = "bill")]
    overage: String,
    #[schema(example = "0.12")]
    overage_price_per_hour: String,
    #[schema(example = "USD")]
    currency: String,
    max_running_containers: u64,
    max_published_ports: u64,
    /// 1 for the first definition; 0 for the built-in `free`.
    version: i64,
    effective_from: String,
}

impl From<&PlanVersion> for PlanResponse {
    fn from(version: &PlanVersion) -> Self {
        let data = version.plan.to_data();
        let text = |name: &str| data[name].as_str().unwrap_or_default().to_owned();
        PlanResponse {
            id: version.plan.id.as_str().to_owned(),
            sandbox_runtime: version.plan.sandbox_runtime,
            included_runtime_seconds: version.plan.included_runtime_seconds,
            overage: text("overage"),
            overage_price_per_hour: text("overage_price_per_hour"),
            currency: version.plan.currency.clone(),
            max_running_containers: version.plan.max_running_containers,
            max_published_ports: version.plan.max_published_ports,
            version: version.version,
            effective_from: canonical::timestamp(version.effective_from),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct PlansResponse {
    /// The ledger position the list reflects: the head of the snapshot the plans were read
    /// in, so every plan definition at or below it is counted.
    position: i64,
    plans: Vec<PlanResponse>,
}

/// The version a definition stored or found, with the ledger position of its
/// `plan.defined` event (0 for the built-in `free`): a `min_position` for an admission
/// check that must count the plan.
#[derive(Debug, Serialize, ToSchema)]
pub struct StoredPlanResponse {
    position: i64,
    #[serde(flatten)]
    plan: PlanResponse,
}

impl From<&PlanVersion> for StoredPlanResponse {
    fn from(version: &PlanVersion) -> Self {
        StoredPlanResponse {
            position: version.position,
            plan: PlanResponse::from(version),
        }
    }
}

/// The current version of every plan.
#[utoipa::path(
    get,
    path = "/v1/plans",
    tag = "plans",
    responses(
        (status = 200, body = PlansResponse),
        (status = 401, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_plans(State(state): State<AppState>) -> Result<Json<PlansResponse>, ApiError> {
    // The head and the plans from one snapshot, so that the head names exactly the
    // definitions listed. Positions commit in order: the snapshot holds every event up to
    // its head.
    let mut snapshot = crate::ledger::db::read_snapshot(&state.pool).await?;
    let position = read::head(&mut *snapshot).await?.position;
    let current = plans::current(&mut *snapshot).await?;
    snapshot.commit().await?;
    Ok(Json(PlansResponse {
        position,
        plans: current.iter().map(PlanResponse::from).collect(),
    }))
}

/// Define a plan or change it: a new version, in effect from now. The same definition
/// again changes nothing (200); a new one is stored (201).
#[utoipa::path(
    put,
    path = "/v1/plans/{plan_id}",
    tag = "plans",
    params(("plan_id" = String, Path, description = "1-64 of [A-Za-z0-9_-]")),
    request_body(content = PlanDefinition),
    responses(
        (status = 200, body = StoredPlanResponse, description = "unchanged"),
        (status = 201, body = StoredPlanResponse, description = "a new version"),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 413, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn put_plan(
    State(state): State<AppState>,
    PlanIdPath(id): PlanIdPath,
    StrictJson(definition): StrictJson<PlanDefinition>,
) -> Result<(StatusCode, Json<StoredPlanResponse>), ApiError> {
    // Back to the fields as sent: `Plan::parse` also reads stored `plan.defined` data.
    let body = serde_json::to_value(&definition).map_err(|error| ApiError::internal(&error))?;
    let plan = Plan::parse(&id, &body).map_err(|problems| invalid_plan(&problems))?;
    // Checked here rather than by `Plan::parse`, which must go on reading versions stored
    // before the list was.
    if !is_currency(&plan.currency) {
        return Err(invalid_plan(&[EventError::new(
            ErrorCode::InvalidCurrency,
            format!(
                "currency: {:?} is not an ISO 4217 currency in use",
                plan.currency
            ),
        )]));
    }
    let (status, stored) = in_turn(&state, TURNS, define(state.clone(), id, plan)).await?;
    Ok((status, Json(stored)))
}

/// Plan definitions wait for this instance's permit, then for the lock every instance's
/// take: each is checked against the plans stored before it.
const TURNS: Queue = Queue {
    lock_key: PLANS_LOCK_KEY,
    busy: "another plan definition is being stored; retry later",
    permit: |state| &state.plan_definitions,
};

/// The advisory lock every instance's plan definitions take in turn.
pub const PLANS_LOCK_KEY: i64 = 0x0070_6c61_6e73;

/// Takes the plan versions' lock alone, in a transaction of its own: grants wait.
async fn hold_grants(state: &AppState) -> Result<Transaction<'static, Postgres>, ApiError> {
    let mut held = crate::ledger::db::begin(&state.pool).await?;
    sqlx::query(&format!(
        "SELECT pg_advisory_xact_lock($1), {}",
        crate::ledger::db::BOUND_LOCK_IDLE
    ))
    .bind(admission::PLAN_VERSION_LOCK_KEY)
    .execute(&mut *held)
    .await?;
    Ok(held)
}

/// How often the held lock's session says it is alive while the version is appended: well
/// inside the lock's idle bound, which lets go of the lock of an instance that hangs.
const HELD_KEEPALIVE: Duration = Duration::from_millis(crate::ledger::db::LOCK_IDLE_TIMEOUT_MS / 5);

/// `work` (the version's append), with the held lock's session kept from going idle
/// meanwhile: however long the append waits for its turn, no grant decides before it.
async fn while_held<T>(
    held: &mut Transaction<'static, Postgres>,
    work: impl std::future::Future<Output = T>,
) -> T {
    tokio::pin!(work);
    loop {
        tokio::select! {
            done = &mut work => return done,
            () = tokio::time::sleep(HELD_KEEPALIVE) => {
                if let Err(error) = sqlx::query("SELECT 1").execute(&mut **held).await {
                    tracing::warn!(%error, "the plan versions' lock was lost while appending");
                }
            }
        }
    }
}

/// Lets grants go on once the version at `position` is projected, or the wait is over:
/// at most `TALLY_READ_WAIT_MS`, and half the lock's idle bound. The checkpoint is read on
/// the held connection, so the wait takes none of the pool the waiting grants hold. Past
/// the wait, grants go on with the facts they find.
async fn release_grants(state: &AppState, mut held: Transaction<'static, Postgres>, position: i64) {
    let wait = state.read_wait.min(Duration::from_millis(
        crate::ledger::db::LOCK_IDLE_TIMEOUT_MS / 2,
    ));
    if let Err(error) = state
        .freshness
        .wait_projected_on(&mut held, position, wait)
        .await
    {
        tracing::warn!(%error, position, "a plan version was not projected before grants went on");
    }
    if let Err(error) = held.rollback().await {
        tracing::warn!(%error, "the plan versions' lock did not end cleanly; its connection drops it");
    }
}

/// Stores `plan` as the next version of `id`, in turn: the same definition again changes
/// nothing (200); a plan that prices overage must be in the currency every other such
/// plan is in.
async fn define(
    state: AppState,
    id: PlanId,
    plan: Plan,
) -> Result<(StatusCode, StoredPlanResponse), ApiError> {
    let versions = plans::versions(&state.pool, &id).await?;
    if let Some(current) = versions.last().filter(|current| current.plan == plan) {
        return Ok((StatusCode::OK, StoredPlanResponse::from(current)));
    }
    if !plan.overage_price_per_hour.is_zero() {
        if let Some((currency, priced)) = plans::billing_currency(&state.pool).await? {
            if currency != plan.currency {
                return Err(invalid_plan(&[EventError::new(
                    ErrorCode::CurrencyMismatch,
                    format!(
                        "currency: plans that price overage are in {currency} (plan {priced} \
                         first), and every figure is in one currency; {} would mix them",
                        plan.currency
                    ),
                )]));
            }
        }
    }
    // No grant decides while the version's instant has passed and its facts are not yet
    // projected (admission::PLAN_VERSION_LOCK_KEY): held from before the instant is taken.
    let mut grants_held = hold_grants(&state).await?;
    let event = Event {
        id: EventId::from_uuid(uuid::Uuid::now_v7()).expect("a v7 UUID is not nil"),
        event_type: EventType::PlanDefined,
        org_id: OrgId::parse(PLANS_ORG_ID).expect("a valid org id"),
        container_id: None,
        occurred_at: state.clock.now().trunc_subsecs(3),
        data: EventData::PlanDefined(plan.to_data()),
        origin: None,
    };
    let appended = while_held(&mut grants_held, state.appender.append(vec![event])).await?;
    let position = appended[0].position;
    release_grants(&state, grants_held, position).await;
    let versions = plans::versions(&state.pool, &id).await?;
    let stored = versions
        .iter()
        .find(|version| version.position == position)
        .ok_or_else(|| {
            ApiError::internal(&std::io::Error::other(
                "the appended plan version is not readable",
            ))
        })?;
    tracing::info!(plan = %id, version = stored.version, "plan defined");
    Ok((StatusCode::CREATED, StoredPlanResponse::from(stored)))
}
