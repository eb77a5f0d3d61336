//! Tokens (contract §6): `POST /v1/tokens` creates one — the secret is in the answer and
//! nowhere else, since only its sha256 is stored — and `DELETE /v1/tokens/{id}` revokes one,
//! at once.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use chrono::Utc;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};
use utoipa::ToSchema;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::{Principal, Scope};
use super::body::{present, RequestBody, StrictJson};
use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::event::OrgId;

/// Random bytes in a secret: 256 bits.
const SECRET_BYTES: usize = 32;
/// Every secret starts with this, so that a leaked one is easy to recognise in logs.
pub const SECRET_PREFIX: &str = "tly_";

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(post_token))
        .routes(routes!(delete_token))
}

/// The body of a token's creation. Each field is checked by the route, with its own code.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    /// At least one of `events:write`, `usage:read`, `admission`, `finance`, `audit`,
    /// `admin`; `admin` not with `org_id`.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Vec<String>, required = true, example = json!(["usage:read"]))]
    scopes: Option<Value>,
    /// The org the token is bound to: it acts on that org only.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<String>)]
    org_id: Option<Value>,
}

impl RequestBody for TokenRequest {
    const WHAT: &'static str = "a token";
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenCreated {
    id: Uuid,
    /// The secret: shown this once, stored only as its sha256.
    token: String,
    scopes: Vec<&'static str>,
    org_id: Option<String>,
}

/// Create a token with some scopes, optionally bound to one org.
#[utoipa::path(
    post,
    path = "/v1/tokens",
    tag = "tokens",
    request_body(content = TokenRequest),
    responses(
        (status = 201, body = TokenCreated),
        (status = 400, body = ErrorBody),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 415, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn post_token(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    StrictJson(body): StrictJson<TokenRequest>,
) -> Result<(StatusCode, Json<TokenCreated>), ApiError> {
    let scopes = token_scopes(body.scopes.as_ref())?;
    let org_id = token_org(body.org_id.as_ref())?;
    if org_id.is_some() && scopes.contains(&Scope::Admin) {
        return Err(ApiError::invalid(
            ErrorCode::InvalidScopes,
            "an org-bound token cannot be admin: admin acts on every org",
        ));
    }
    let secret = format!(
        "{SECRET_PREFIX}{}",
        hex::encode(rand::rng().random::<[u8; SECRET_BYTES]>())
    );
    let id = Uuid::new_v4();
    let names: Vec<&'static str> = scopes.iter().map(|scope| scope.as_str()).collect();
    sqlx::query(
        "INSERT INTO api_token (id, secret_sha256, scopes, org_id, created_at, created_by) \
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(&Sha256::digest(secret.as_bytes())[..])
    .bind(&names)
    .bind(org_id.as_ref().map(OrgId::as_str))
    .bind(Utc::now())
    .bind(&principal.id)
    .execute(&state.pool)
    .await?;
    tracing::info!(token = %id, scopes = ?names, org = ?org_id.as_ref().map(OrgId::as_str), by = %principal.id, "token created");
    Ok((
        StatusCode::CREATED,
        Json(TokenCreated {
            id,
            token: secret,
            scopes: names,
            org_id: org_id.map(|org| org.as_str().to_owned()),
        }),
    ))
}

/// The token's scopes: a non-empty list of scope names, sorted, each once.
fn token_scopes(scopes: Option<&Value>) -> Result<Vec<Scope>, ApiError> {
    let mut scopes: Vec<Scope> = scopes
        .and_then(Value::as_array)
        .filter(|scopes| !scopes.is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                ErrorCode::InvalidScopes,
                "scopes: a non-empty list is required",
            )
        })?
        .iter()
        .map(|scope| {
            scope.as_str().and_then(Scope::parse).ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidScopes,
                    format!(
                        "scopes: {scope} is not one of {}",
                        Scope::ALL.map(Scope::as_str).join(", ")
                    ),
                )
            })
        })
        .collect::<Result<_, _>>()?;
    scopes.sort_unstable();
    scopes.dedup();
    Ok(scopes)
}

/// The org a token is bound to: none when `org_id` is absent or null.
fn token_org(org_id: Option<&Value>) -> Result<Option<OrgId>, ApiError> {
    match org_id {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(org)) => OrgId::parse_unreserved(org)
            .map(Some)
            .map_err(|error| ApiError::invalid(error.org_code(), format!("org_id: {error}"))),
        Some(_) => Err(ApiError::invalid(
            ErrorCode::InvalidOrgId,
            "org_id: must be a string",
        )),
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenRevoked {
    id: Uuid,
    revoked: bool,
}

/// Revoke a token: it stops working at once. Revoking again is harmless.
#[utoipa::path(
    delete,
    path = "/v1/tokens/{token_id}",
    tag = "tokens",
    params(("token_id" = String, Path, description = "the id returned when it was created")),
    responses(
        (status = 200, body = TokenRevoked),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn delete_token(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(token_id): Path<String>,
) -> Result<Json<TokenRevoked>, ApiError> {
    let id = Uuid::try_parse(&token_id)
        .map_err(|_| ApiError::invalid(ErrorCode::InvalidTokenId, "token_id: must be a UUID"))?;
    let found: Option<bool> = sqlx::query_scalar(
        "UPDATE api_token SET revoked_at = COALESCE(revoked_at, now()), \
                              revoked_by = COALESCE(revoked_by, $2) \
         WHERE id = $1 RETURNING true",
    )
    .bind(id)
    .bind(&principal.id)
    .fetch_optional(&state.pool)
    .await?;
    match found {
        Some(_) => Ok(Json(TokenRevoked { id, revoked: true })),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            ErrorCode::TokenNotFound,
            format!("no token {id}"),
        )),
    }
}
