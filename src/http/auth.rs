//! Authentication and authorization for `/v1/*`, in one place.
//!
//! `require_token` runs on every `/v1` route after routing: it finds the principal behind
//! the bearer token (401 when there is none or it is not valid — revoked tokens at once,
//! since every request looks its token up), then the scope the matched route needs
//! ([`required_scope`], one table for the whole API) and answers 403 when the principal
//! lacks it. Handlers receive the [`Principal`] as an extension and check the org they act
//! on with [`Principal::check_org`] (403 for an org-bound token on another org).
//!
//! `TALLY_BOOTSTRAP_TOKEN` is the admin token; only its sha256 is kept in memory and it is
//! compared digest to digest in constant time. Other tokens are stored as the sha256 of
//! their secret and found by it.

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use super::error::ApiError;
use super::AppState;

/// What a token may do (DESIGN §6). `admin` implies every other scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scope {
    EventsWrite,
    UsageRead,
    Admission,
    Finance,
    Audit,
    Admin,
}

impl Scope {
    pub const ALL: [Scope; 6] = [
        Scope::EventsWrite,
        Scope::UsageRead,
        Scope::Admission,
        Scope::Finance,
        Scope::Audit,
        Scope::Admin,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::EventsWrite => "events:write",
            Scope::UsageRead => "usage:read",
            Scope::Admission => "admission",
            Scope::Finance => "finance",
            Scope::Audit => "audit",
            Scope::Admin => "admin",
        }
    }

    pub fn parse(value: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|scope| scope.as_str() == value)
    }
}

/// The scope each route needs: the one table of DESIGN §6. A route missing here is
/// refused to everyone but admins, so a new route is closed until it is listed.
pub fn required_scope(method: &Method, route: &str) -> Scope {
    match (method.as_str(), route) {
        ("POST", "/v1/events") => Scope::EventsWrite,
        ("GET", "/v1/orgs/{org_id}/usage") => Scope::UsageRead,
        ("GET", "/v1/containers/{container_id}") => Scope::UsageRead,
        ("GET", "/v1/plans") => Scope::UsageRead,
        ("PUT", "/v1/plans/{plan_id}") => Scope::Admin,
        ("POST", "/v1/admission/check") => Scope::Admission,
        ("POST", "/v1/admission/reservations") => Scope::Admission,
        ("DELETE", "/v1/admission/reservations/{reservation_id}") => Scope::Admission,
        ("GET", "/v1/events") => Scope::Audit,
        ("GET", "/v1/containers/{container_id}/events") => Scope::Audit,
        ("GET", "/v1/ledger/verify") => Scope::Audit,
        ("POST", "/v1/tokens") => Scope::Admin,
        ("DELETE", "/v1/tokens/{token_id}") => Scope::Admin,
        ("POST", "/v1/provider-reports") => Scope::Finance,
        ("POST", "/v1/reconciliations") => Scope::Finance,
        ("GET", "/v1/exports/usage.csv") => Scope::Finance,
        ("POST", "/v1/periods/{period}/close") => Scope::Finance,
        ("GET", "/v1/periods/{period}") => Scope::Finance,
        ("GET", "/v1/reconciliations/{reconciliation_id}/lines.csv") => Scope::Finance,
        ("POST", "/v1/corrections/voids") => Scope::Admin,
        ("POST", "/v1/corrections/events") => Scope::Admin,
        _ => Scope::Admin,
    }
}

/// Who is calling.
#[derive(Debug, Clone)]
pub struct Principal {
    /// `bootstrap`, or the token's id: recorded where the principal acts (reservations).
    pub id: String,
    pub scopes: Vec<Scope>,
    /// Set for a token bound to one org.
    pub org_id: Option<String>,
}

impl Principal {
    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&Scope::Admin) || self.scopes.contains(&scope)
    }

    /// 403 unless the principal may act on `org_id`.
    pub fn check_org(&self, org_id: &str) -> Result<(), ApiError> {
        match &self.org_id {
            Some(bound) if bound != org_id => Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "org_not_allowed",
                format!("this token is bound to org {bound} and may not act on {org_id}"),
            )),
            _ => Ok(()),
        }
    }
}

/// The tokens this instance accepts without asking the database: the bootstrap token.
#[derive(Clone, Default)]
pub struct Tokens {
    bootstrap_digest: Option<[u8; 32]>,
}

impl Tokens {
    pub fn new(bootstrap: Option<&str>) -> Tokens {
        Tokens {
            bootstrap_digest: bootstrap
                .filter(|t| !t.is_empty())
                .map(|t| Sha256::digest(t.as_bytes()).into()),
        }
    }

    fn is_bootstrap(&self, digest: &[u8; 32]) -> bool {
        let Some(expected) = &self.bootstrap_digest else {
            return false;
        };
        digest
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The principal behind a presented secret: the bootstrap admin, a live stored token, or
/// nobody.
async fn principal(
    tokens: &Tokens,
    pool: &PgPool,
    presented: &str,
) -> Result<Option<Principal>, ApiError> {
    let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    if tokens.is_bootstrap(&digest) {
        return Ok(Some(Principal {
            id: "bootstrap".to_owned(),
            scopes: vec![Scope::Admin],
            org_id: None,
        }));
    }
    let row: Option<(Uuid, Vec<String>, Option<String>)> = sqlx::query_as(
        "SELECT id, scopes, org_id FROM api_token WHERE secret_sha256 = $1 AND revoked_at IS NULL",
    )
    .bind(&digest[..])
    .fetch_optional(pool)
    .await?;
    Ok(row.map(|(id, scopes, org_id)| Principal {
        id: id.to_string(),
        scopes: scopes
            .iter()
            .filter_map(|scope| Scope::parse(scope))
            .collect(),
        org_id,
    }))
}

pub async fn require_token(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(presented) = presented else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send Authorization: Bearer <token>",
        ));
    };
    let Some(principal) = principal(&state.tokens, &state.pool, presented).await? else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not valid",
        ));
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|path| path.as_str().to_owned())
        .unwrap_or_default();
    let needed = required_scope(request.method(), &route);
    if !principal.has(needed) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden_scope",
            format!("this route needs the {} scope", needed.as_str()),
        ));
    }
    request.extensions_mut().insert(principal);
    Ok(next.run(request).await)
}
