//! Admission (contract §4, §6): `POST /v1/admission/check`, `POST /v1/admission/reservations`,
//! `DELETE /v1/admission/reservations/{id}`.

use axum::extract::{FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::body::{present, RequestBody, StrictJson};
use super::consistency::{reachable, Consistency, ConsistencyParams};
use super::error::{ApiError, ErrorBody};
use super::query::StrictQuery;
use super::AppState;
use crate::admission::{self, AdmissionError, Answer, Released, Request, Wait};
use crate::billing::Action;
use crate::error_code::ErrorCode;
use crate::event::canonical;
use crate::event::{ContainerId, OrgId};
use axum::Extension;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(post_check))
        .routes(routes!(post_reservation))
        .routes(routes!(delete_reservation))
}

/// The body of a check. Each field is checked by the route, with its own code.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckRequest {
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, required = true, example = "acme")]
    org_id: Option<Value>,
    /// `create`, `resume`, `run` or `publish_port`.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, required = true, example = "create")]
    action: Option<Value>,
    /// Required for `run` and `publish_port`.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    container_id: Option<Value>,
}

impl RequestBody for CheckRequest {
    const WHAT: &'static str = "this request";
}

/// The body of a reservation: a check's, for a create or resume, and how long to hold.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReservationRequest {
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, required = true, example = "acme")]
    org_id: Option<Value>,
    /// `create` or `resume`.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = String, required = true, example = "create")]
    action: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    container_id: Option<Value>,
    /// 1–300, default 60.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = u64, minimum = 1, maximum = 300)]
    ttl_seconds: Option<Value>,
}

impl RequestBody for ReservationRequest {
    const WHAT: &'static str = "this request";
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CheckResponse {
    /// The ledger position the facts reflect: the projection's checkpoint they were read
    /// at, at least `min_position` and every event of the org this instance acknowledged.
    position: i64,
    allowed: bool,
    /// Every reason that applies, in the order of contract §4.
    reasons: Vec<&'static str>,
    plan: String,
    period: String,
    runtime_used_ms: i64,
    runtime_included_ms: i64,
    overage: bool,
    running_containers: u64,
    max_running_containers: u64,
}

impl From<&Answer> for CheckResponse {
    fn from(answer: &Answer) -> Self {
        CheckResponse {
            position: answer.position,
            allowed: answer.decision.allowed,
            reasons: answer
                .decision
                .reasons
                .iter()
                .map(|reason| reason.as_str())
                .collect(),
            plan: answer.plan.as_str().to_owned(),
            period: answer.period.to_string(),
            runtime_used_ms: answer.runtime_used_ms,
            runtime_included_ms: answer.decision.runtime_included_ms,
            overage: answer.decision.overage,
            running_containers: answer.running_containers,
            max_running_containers: answer.max_running_containers,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReservationResponse {
    reservation_id: Uuid,
    expires_at: String,
    #[serde(flatten)]
    check: CheckResponse,
}

/// May the org do this now?
#[utoipa::path(
    post,
    path = "/v1/admission/check",
    tag = "admission",
    request_body(content = CheckRequest),
    params(
        ConsistencyParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 200, body = CheckResponse),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = LAGGING),
    ),
    security(("bearer" = []))
)]
pub async fn post_check(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    AdmissionWait(wait): AdmissionWait,
    StrictJson(body): StrictJson<CheckRequest>,
) -> Result<Json<CheckResponse>, ApiError> {
    let request = parse_request(&body.org_id, &body.action, &body.container_id)?;
    principal.check_org(request.org_id.as_str())?;
    let answer = state
        .checker
        .check_with(&request, wait)
        .await
        .map_err(admission_error)?;
    metrics::counter!(crate::telemetry::ADMISSION_CHECKS, "allowed" => answer.decision.allowed.to_string())
        .increment(1);
    Ok(Json(CheckResponse::from(&answer)))
}

/// Hold a running slot for a create or resume, for `ttl_seconds` (1–300, default 60). A
/// container that runs already holds its slot: a reservation naming one is refused with the
/// reason `container_running`.
#[utoipa::path(
    post,
    path = "/v1/admission/reservations",
    tag = "admission",
    request_body(content = ReservationRequest),
    params(
        ConsistencyParams,
        ("Tally-Min-Position" = Option<i64>, Header, description = "as `min_position`"),
    ),
    responses(
        (status = 201, body = ReservationResponse),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "refused; the code is the first reason, details list them all, each as `{\"code\", \"message\", \"position\"}` with the ledger position the facts reflect"),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = LAGGING),
    ),
    security(("bearer" = []))
)]
pub async fn post_reservation(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    AdmissionWait(wait): AdmissionWait,
    StrictJson(body): StrictJson<ReservationRequest>,
) -> Result<(StatusCode, Json<ReservationResponse>), ApiError> {
    let request = parse_request(&body.org_id, &body.action, &body.container_id)?;
    principal.check_org(request.org_id.as_str())?;
    if !request.action.takes_slot() {
        return Err(ApiError::invalid(
            ErrorCode::InvalidAction,
            "reservations hold a running slot: action must be \"create\" or \"resume\"",
        ));
    }
    let ttl_seconds = ttl_seconds(body.ttl_seconds.as_ref())?;
    let (answer, reservation) = admission::reserve_with(
        &state.pool,
        &state.freshness,
        state.checker.cache(),
        state.clock,
        &request,
        ttl_seconds,
        &principal.id,
        wait,
    )
    .await
    .map_err(admission_error)?;
    let Some(reservation) = reservation else {
        metrics::counter!(crate::telemetry::RESERVATIONS, "outcome" => "refused").increment(1);
        return Err(refused(&answer));
    };
    metrics::counter!(crate::telemetry::RESERVATIONS, "outcome" => "granted").increment(1);
    Ok((
        StatusCode::CREATED,
        Json(ReservationResponse {
            reservation_id: reservation.id,
            expires_at: canonical::timestamp(reservation.expires_at),
            check: CheckResponse::from(&answer),
        }),
    ))
}

/// The reservation's time to live: from [`admission::TTL_SECONDS_MIN`] to
/// [`admission::TTL_SECONDS_MAX`] seconds, [`admission::TTL_SECONDS_DEFAULT`] unless given.
fn ttl_seconds(ttl_seconds: Option<&Value>) -> Result<u64, ApiError> {
    match ttl_seconds {
        None => Ok(admission::TTL_SECONDS_DEFAULT),
        Some(value) => value
            .as_u64()
            .filter(|ttl| (admission::TTL_SECONDS_MIN..=admission::TTL_SECONDS_MAX).contains(ttl))
            .ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidTtl,
                    format!(
                        "ttl_seconds: must be a whole number from {} to {}",
                        admission::TTL_SECONDS_MIN,
                        admission::TTL_SECONDS_MAX
                    ),
                )
            }),
    }
}

/// 409 for a refused reservation: the code is the first reason, the details list them all.
fn refused(answer: &Answer) -> ApiError {
    let reasons = &answer.decision.reasons;
    ApiError::new(
        StatusCode::CONFLICT,
        reasons[0].code(),
        format!(
            "admission refused: {}",
            reasons
                .iter()
                .map(|reason| reason.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    )
    .with_details(
        reasons
            .iter()
            .map(|reason| {
                json!({"code": reason.code(), "message": reason.as_str(),
                       "position": answer.position})
            })
            .collect(),
    )
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReleaseResponse {
    reservation_id: Uuid,
    #[schema(example = "released")]
    status: &'static str,
}

/// Release a reservation: its slot is free at once. Releasing again answers the same. As a
/// grant, it first waits until the projection holds the org's events this instance
/// acknowledged (past `TALLY_READ_WAIT_MS`, 503 `projection_lagging`), so that a start
/// acknowledged before it has consumed the reservation: 409 `reservation_consumed`.
#[utoipa::path(
    delete,
    path = "/v1/admission/reservations/{reservation_id}",
    tag = "admission",
    params(("reservation_id" = String, Path, description = "the id a grant returned")),
    responses(
        (status = 200, body = ReleaseResponse),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "already consumed by its container"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody, description = "`projection_lagging` (with `Retry-After`)"),
    ),
    security(("bearer" = []))
)]
pub async fn delete_reservation(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(reservation_id): Path<String>,
) -> Result<Json<ReleaseResponse>, ApiError> {
    let id = Uuid::try_parse(&reservation_id).map_err(|_| {
        ApiError::invalid(
            ErrorCode::InvalidReservationId,
            "reservation_id: must be a UUID",
        )
    })?;
    if let Some(org_id) = admission::reservation_org(&state.pool, id).await? {
        principal.check_org(&org_id)?;
        // As a grant reads: the org's events this instance acknowledged are projected
        // first, so that a start acknowledged before the release has consumed the
        // reservation (409), not seen it released while its container takes the slot.
        super::consistency::own_writes_of(&state, &org_id).await?;
    }
    let cache = state.checker.cache();
    let clock = state.checker.clock();
    match admission::release(&state.pool, cache, clock, id, &principal.id).await? {
        Released::Released | Released::AlreadyReleased => Ok(Json(ReleaseResponse {
            reservation_id: id,
            status: "released",
        })),
        Released::Consumed => Err(ApiError::new(
            StatusCode::CONFLICT,
            ErrorCode::ReservationConsumed,
            "the reservation was consumed by its container's event; stop the container to free the slot",
        )),
        Released::NotFound => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::ReservationNotFound,
            format!("no reservation {id}"),
        )),
    }
}

/// The 503 of a check that the projection did not catch up with.
const LAGGING: &str = "`projection_lagging` (with `Retry-After`): the projection did not reach this instance's appends of the org or `min_position` within `TALLY_READ_WAIT_MS`; `overloaded` (checks): too many checks waiting";

/// What the answer must reflect besides this instance's own appends of the org, from the
/// query and headers. The default needs nothing more: admission is read-your-writes for
/// the instance asked, and a caller that wrote elsewhere names its write's position.
/// `consistency=eventual` is the same, as no admission answer leaves out the instance's own
/// appends (see docs/decisions/read-consistency.md).
/// The [`Wait`] of the query and headers, read before the body so that a bad query is
/// answered first.
pub struct AdmissionWait(Wait);

impl FromRequestParts<AppState> for AdmissionWait {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Response> {
        let StrictQuery(params) =
            StrictQuery::<ConsistencyParams>::from_request_parts(parts, state).await?;
        let mut wait = wait(state, &params, &parts.headers).map_err(IntoResponse::into_response)?;
        wait.min_position = reachable(state, wait.min_position)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(AdmissionWait(wait))
    }
}

fn wait(
    state: &AppState,
    params: &ConsistencyParams,
    headers: &HeaderMap,
) -> Result<Wait, ApiError> {
    let min_position = match Consistency::parse(
        params.min_position.as_deref(),
        params.consistency.as_deref(),
        headers,
    )? {
        Consistency::AtLeast(position) => position,
        Consistency::Head | Consistency::Eventual => 0,
    };
    Ok(Wait {
        min_position,
        within: state.read_wait,
    })
}

fn parse_request(
    org_id: &Option<Value>,
    action: &Option<Value>,
    container_id: &Option<Value>,
) -> Result<Request, ApiError> {
    let text = |field: &Option<Value>| field.as_ref().and_then(Value::as_str).map(str::to_owned);
    let org_id = text(org_id)
        .ok_or_else(|| ApiError::invalid(ErrorCode::InvalidOrgId, "org_id: is required"))
        .and_then(|value| {
            OrgId::parse(&value).map_err(|error| {
                ApiError::invalid(ErrorCode::InvalidOrgId, format!("org_id: {error}"))
            })
        })?;
    let action = text(action)
        .as_deref()
        .and_then(Action::parse)
        .ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidAction,
                "action: must be \"create\", \"resume\", \"run\" or \"publish_port\"",
            )
        })?;
    let container_id = match container_id {
        None | Some(Value::Null) => None,
        Some(Value::String(value)) => Some(ContainerId::parse(value).map_err(|error| {
            ApiError::invalid(
                ErrorCode::InvalidContainerId,
                format!("container_id: {error}"),
            )
        })?),
        Some(_) => {
            return Err(ApiError::invalid(
                ErrorCode::InvalidContainerId,
                "container_id: must be a string",
            ))
        }
    };
    if action.needs_running_container() && container_id.is_none() {
        return Err(ApiError::invalid(
            ErrorCode::MissingContainerId,
            "container_id: is required for run and publish_port",
        ));
    }
    Ok(Request {
        org_id,
        action,
        container_id,
    })
}

fn admission_error(error: AdmissionError) -> ApiError {
    match error {
        AdmissionError::Stale { .. } => {
            metrics::counter!(crate::telemetry::READ_LAGGING).increment(1);
            ApiError::unavailable(ErrorCode::ProjectionLagging, error.to_string())
        }
        AdmissionError::Busy(_) => ApiError::unavailable(ErrorCode::Overloaded, error.to_string()),
        AdmissionError::Database(_)
        | AdmissionError::Projection(_)
        | AdmissionError::Corrupt(_)
        | AdmissionError::Group(_)
        | AdmissionError::LeadStopped => ApiError::failure(&error, error.database()),
    }
}
