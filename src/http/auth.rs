//! Authentication and authorization for `/v1/*`, in one place.
//!
//! `require_token` runs on every `/v1` route after routing: it counts the request against
//! its token's limit of requests in progress ([`TokenLimits`], 429 past it), finds the
//! principal behind the bearer token (401 when there is none or it is not valid — revoked
//! tokens at once, since every request looks its token up, and looks it up again when its
//! body ends late: [`super::recheck`]), then the scope and the org
//! rule of the matched route ([`ROUTES`], one table for the whole API): 403 when the
//! principal lacks the scope, and for a token bound to one org, 403 on a global route or
//! on another org's path. Handlers receive the [`Principal`] as an extension and check the
//! org they act on with [`Principal::check_org`] (403 for a bound token on another org),
//! or serve a bound token only its org's rows, as the route's [`OrgRule`] says.
//!
//! `TALLY_BOOTSTRAP_TOKEN` is the admin token; only its sha256 is kept in memory and it is
//! compared digest to digest in constant time. Other tokens are stored as the sha256 of
//! their secret and found by it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::{FromRequestParts, MatchedPath, RawPathParams, Request, State};
use axum::http::request::Parts;
use axum::http::{header, Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use super::error::ApiError;
use super::{recheck, AppState};
use crate::error_code::ErrorCode;
use crate::event::{Event, EventType};

/// What a 429 for a token past its limit asks the client to wait, in seconds: its other
/// requests are typically done in milliseconds.
pub const TOKEN_LIMITED_RETRY_AFTER_SECONDS: u64 = 1;

/// What a token may do (contract §6). `admin` implies every other scope.
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

/// How a route treats a token bound to one org: every route is listed in
/// [`ROUTES`] with one of these, and the rule is enforced either here, before the handler
/// runs ([`OrgRule::PathOrg`], [`OrgRule::Global`]), or by the handler, which alone knows
/// the org once it has parsed the body or looked the resource up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrgRule {
    /// Serves no org's data (the plan catalogue): a bound token is served like any other.
    NoOrgData,
    /// The org is the path's `{org_id}`: another org is 403 `org_not_allowed`, here.
    PathOrg,
    /// The org is named in the body (each event, an admission request): the handler checks
    /// it with [`Principal::check_org`] once parsed; another org is 403 `org_not_allowed`.
    BodyOrg,
    /// The path names a resource of one org (a reservation): the handler looks its org up
    /// and checks it; another org's is 403 `org_not_allowed`.
    OwnedByOrg,
    /// Reads rows of many orgs (exports, reconciliation lines, audit reads, a container by
    /// id): a bound token is served only its org's rows; naming another org is 403.
    FilteredToOrg,
    /// Acts on or answers for every org at once (a period close, a whole provider report,
    /// the whole ledger's chain, tokens, plans, corrections): 403 `org_bound_token`, here.
    Global,
}

/// One route of `/v1`: the scope it needs and its org rule.
#[derive(Debug, Clone, Copy)]
pub struct RouteRule {
    pub method: &'static str,
    /// As the router spells it (axum's `MatchedPath`).
    pub path: &'static str,
    /// The scope it needs; `None` for a route any valid token may use (`/v1/whoami`).
    pub scope: Option<Scope>,
    pub org: OrgRule,
}

const fn route(method: &'static str, path: &'static str, scope: Scope, org: OrgRule) -> RouteRule {
    RouteRule {
        method,
        path,
        scope: Some(scope),
        org,
    }
}

/// A route any valid token may use, whatever its scopes.
const fn any_token_route(method: &'static str, path: &'static str, org: OrgRule) -> RouteRule {
    RouteRule {
        method,
        path,
        scope: None,
        org,
    }
}

/// Every `/v1` route, the one table of contract §6 plus the org rule of each (recorded in
/// `docs/decisions/0014-org-bound-tokens.md`). A route missing here is refused to everyone but
/// unbound admins, so a new route is closed until it is listed; the org-binding test walks
/// this table and the OpenAPI document and fails on a route it has no case for.
pub const ROUTES: &[RouteRule] = {
    use OrgRule::*;
    use Scope::*;
    &[
        route("POST", "/v1/events", EventsWrite, BodyOrg),
        route("GET", "/v1/orgs/{org_id}/usage", UsageRead, PathOrg),
        route(
            "GET",
            "/v1/containers/{container_id}",
            UsageRead,
            FilteredToOrg,
        ),
        route("GET", "/v1/plans", UsageRead, NoOrgData),
        route("PUT", "/v1/plans/{plan_id}", Admin, Global),
        route("POST", "/v1/admission/check", Admission, BodyOrg),
        route("POST", "/v1/admission/reservations", Admission, BodyOrg),
        route(
            "DELETE",
            "/v1/admission/reservations/{reservation_id}",
            Admission,
            OwnedByOrg,
        ),
        route("GET", "/v1/events", Audit, FilteredToOrg),
        route(
            "GET",
            "/v1/containers/{container_id}/events",
            Audit,
            FilteredToOrg,
        ),
        route("GET", "/v1/ledger/verify", Audit, Global),
        route("POST", "/v1/tokens", Admin, Global),
        route("DELETE", "/v1/tokens/{token_id}", Admin, Global),
        route("POST", "/v1/provider-reports", Finance, Global),
        route("POST", "/v1/reconciliations", Finance, Global),
        route("GET", "/v1/exports/usage.csv", Finance, FilteredToOrg),
        route("POST", "/v1/periods/{period}/close", Finance, Global),
        route("GET", "/v1/periods/{period}/close", Finance, Global),
        route("GET", "/v1/periods/{period}", Finance, Global),
        route(
            "GET",
            "/v1/reconciliations/{reconciliation_id}/lines.csv",
            Finance,
            FilteredToOrg,
        ),
        route("POST", "/v1/corrections/voids", Admin, Global),
        route("POST", "/v1/corrections/events", Admin, Global),
        route("GET", "/v1/periods", Finance, Global),
        route("GET", "/v1/provider-reports", Finance, Global),
        route("GET", "/v1/reconciliations", Finance, Global),
        route(
            "GET",
            "/v1/reconciliations/{reconciliation_id}",
            Finance,
            Global,
        ),
        route(
            "GET",
            "/v1/reconciliations/{reconciliation_id}/lines",
            Finance,
            FilteredToOrg,
        ),
        any_token_route("GET", "/v1/whoami", NoOrgData),
        route("GET", "/v1/orgs/{org_id}", UsageRead, PathOrg),
        route("GET", "/v1/orgs/{org_id}/containers", UsageRead, PathOrg),
        route("GET", "/v1/status", Audit, Global),
    ]
};

/// The row of [`ROUTES`] for a matched route (a HEAD's is its GET's), if it is listed.
pub fn route_rule(method: &Method, route: &str) -> Option<&'static RouteRule> {
    // A HEAD is its GET's handler and operation, with its rules.
    let method = if method == Method::HEAD {
        &Method::GET
    } else {
        method
    };
    ROUTES
        .iter()
        .find(|rule| rule.method == method.as_str() && rule.path == route)
}

/// The scope a route needs (`None`: any valid token); admin for a route not listed.
pub fn required_scope(method: &Method, route: &str) -> Option<Scope> {
    route_rule(method, route).map_or(Some(Scope::Admin), |rule| rule.scope)
}

/// A route's org rule; global (refused to a bound token) for a route not listed.
pub fn org_rule(method: &Method, route: &str) -> OrgRule {
    route_rule(method, route).map_or(OrgRule::Global, |rule| rule.org)
}

/// The principal id of `TALLY_BOOTSTRAP_TOKEN`.
pub const BOOTSTRAP_ID: &str = "bootstrap";

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
                ErrorCode::OrgNotAllowed,
                format!("this token is bound to org {bound} and may not act on {org_id}"),
            )),
            _ => Ok(()),
        }
    }

    /// 403 unless the principal may send every one of `events`: each of an org it may act
    /// on, and, for a token bound to an org, a container event.
    pub fn check_events(&self, events: &[Event]) -> Result<(), ApiError> {
        for (index, event) in events.iter().enumerate() {
            self.check_org(event.org_id.as_str())?;
            self.check_account_event(index, event.event_type)?;
            self.check_native_id(index, event)?;
        }
        Ok(())
    }

    /// 403 when a bound token sends a native event with a name-based (version 5) id. A
    /// CloudEvent's ledger id is the version 5 UUID of its org, source and id, which any org
    /// can compute: stored first as another org's native event, it would make that
    /// CloudEvent a 409 for ever (decision 0044). A bound token's own CloudEvents are scoped
    /// to its org and cannot collide.
    fn check_native_id(&self, index: usize, event: &Event) -> Result<(), ApiError> {
        if self.org_id.is_none() || event.origin.is_some() || !event.id.is_name_based() {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::OrgBoundToken,
            format!(
                "event {index}: id {} is name-based (UUID version 5), the kind of id CloudEvents \
                 are stored under, which a token bound to an org may not give a native event; \
                 use a random (version 4) or time-ordered (version 7) id, or send a CloudEvent; \
                 nothing was stored",
                event.id
            ),
        ))
    }

    /// 403 when a bound token sends an account event (`org.*`), the `index`th of its
    /// batch: plans, verification and billing eligibility set what an org is billed and
    /// allowed, so they come from the platform's account system, not from the org itself.
    fn check_account_event(&self, index: usize, event_type: EventType) -> Result<(), ApiError> {
        if self.org_id.is_none() || event_type.is_container_event() {
            return Ok(());
        }
        Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::OrgBoundToken,
            format!(
                "event {index}: {} is an account event, which a token bound to an org may \
                 not send; nothing was stored",
                event_type.as_str()
            ),
        ))
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
    digest: &[u8; 32],
) -> Result<Option<Principal>, ApiError> {
    if tokens.is_bootstrap(digest) {
        return Ok(Some(Principal {
            id: BOOTSTRAP_ID.to_owned(),
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
    // A token bound to an org tally records its own events under (made before such orgs
    // were reserved) is nobody's: it would read every org's corrections or plans.
    let row =
        row.filter(|(_, _, org_id)| !org_id.as_deref().is_some_and(crate::event::is_reserved_org));
    Ok(row.map(|(id, scopes, org_id)| Principal {
        id: id.to_string(),
        scopes: scopes
            .iter()
            .filter_map(|scope| Scope::parse(scope))
            .collect(),
        org_id,
    }))
}

/// Requests in progress per token, so that one token cannot take every request slot:
/// past `max` a request is refused at once with 429 `too_many_requests`.
///
/// The map holds an entry only while its token has a request in progress (a permit removes
/// its entry when the count drops to 0), so it never holds more entries than there are
/// requests in progress, which the service-wide limit bounds.
#[derive(Clone)]
pub struct TokenLimits {
    max: usize,
    in_progress: Arc<Mutex<HashMap<[u8; 32], usize>>>,
}

/// One request's place in its token's count, given back when dropped.
pub struct TokenPermit {
    key: [u8; 32],
    in_progress: Arc<Mutex<HashMap<[u8; 32], usize>>>,
}

impl TokenLimits {
    pub fn new(max: usize) -> TokenLimits {
        TokenLimits {
            max: max.max(1),
            in_progress: Arc::default(),
        }
    }

    /// A permit for one more request of the token with this digest, or `None` when it
    /// already has `max` in progress.
    pub fn try_acquire(&self, key: [u8; 32]) -> Option<TokenPermit> {
        let mut in_progress = self.in_progress.lock().expect("never held across a panic");
        let count = in_progress.entry(key).or_insert(0);
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(TokenPermit {
            key,
            in_progress: self.in_progress.clone(),
        })
    }

    /// Tokens with a request in progress (the map's size).
    pub fn tokens_in_progress(&self) -> usize {
        self.in_progress
            .lock()
            .expect("never held across a panic")
            .len()
    }
}

impl Drop for TokenPermit {
    fn drop(&mut self) {
        let mut in_progress = self.in_progress.lock().expect("never held across a panic");
        let count = in_progress
            .get_mut(&self.key)
            .expect("a permit's token is counted until its last permit is dropped");
        assert!(*count > 0, "a counted token has a request in progress");
        *count -= 1;
        if *count == 0 {
            in_progress.remove(&self.key);
        }
    }
}

/// The secret of `Authorization: Bearer <secret>`; the scheme is case-insensitive
/// (RFC 7235 §2.1), so `bearer` and `BEARER` are the same.
fn bearer_secret(value: &str) -> Option<&str> {
    let (scheme, secret) = value.trim_start().split_once(' ')?;
    let secret = secret.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !secret.is_empty()).then_some(secret)
}

pub async fn require_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_secret);
    let Some(presented) = presented else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "send Authorization: Bearer <token>",
        ));
    };
    let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
    // Counted before the token is looked up, so that one token's flood cannot hold the
    // pool connections of the look-ups either.
    let Some(permit) = state.token_limits.try_acquire(digest) else {
        metrics::counter!(crate::telemetry::HTTP_TOKEN_LIMITED).increment(1);
        return Err(token_limited(state.token_limits.max));
    };
    let Some(principal) = principal(&state.tokens, &state.pool, &digest).await? else {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            ErrorCode::Unauthorized,
            "the bearer token is not valid",
        ));
    };
    let looked_up = std::time::Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|path| path.as_str().to_owned())
        .unwrap_or_default();
    if let Some(needed) =
        required_scope(request.method(), &route).filter(|needed| !principal.has(*needed))
    {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::ForbiddenScope,
            format!("this route needs the {} scope", needed.as_str()),
        ));
    }
    let (mut parts, body) = request.into_parts();
    check_org_binding(&principal, &mut parts, &route, &state).await?;
    let verdict = recheck::Verdict::default();
    let body = rechecked(&state, &principal, (digest, looked_up), body, &verdict);
    let mut request = Request::from_parts(parts, body);
    request.extensions_mut().insert(principal);
    let response = next.run(request).await;
    if let Some(refusal) = verdict.refusal() {
        return Err(refusal);
    }
    Ok(held_until_sent(response, permit))
}

/// The request's body, ended late only once the token with `digest`, looked up at
/// `looked_up`, is found again ([`recheck`]); the bootstrap token is never revoked.
fn rechecked(
    state: &AppState,
    principal: &Principal,
    (digest, looked_up): ([u8; 32], std::time::Instant),
    body: Body,
    verdict: &recheck::Verdict,
) -> Body {
    if principal.id == BOOTSTRAP_ID {
        return body;
    }
    let pool = state.pool.clone();
    let lookup = move || -> recheck::Lookup {
        Box::pin(async move {
            let still: Option<Uuid> = sqlx::query_scalar(
                "SELECT id FROM api_token WHERE secret_sha256 = $1 AND revoked_at IS NULL",
            )
            .bind(&digest[..])
            .fetch_optional(&pool)
            .await?;
            Ok(still.is_some())
        })
    };
    Body::new(recheck::Rechecked::new(
        body,
        looked_up,
        Box::new(lookup),
        verdict.clone(),
    ))
}

/// 429 for a token with `max` requests in progress.
fn token_limited(max: usize) -> ApiError {
    ApiError {
        retry_after_seconds: Some(TOKEN_LIMITED_RETRY_AFTER_SECONDS),
        ..ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            ErrorCode::TooManyRequests,
            format!("this token has {max} requests in progress; retry when one has finished"),
        )
    }
}

/// An org-bound token's request: refused on a global route, and on a route whose path
/// names another org.
async fn check_org_binding(
    principal: &Principal,
    parts: &mut Parts,
    route: &str,
    state: &AppState,
) -> Result<(), ApiError> {
    let Some(bound) = &principal.org_id else {
        return Ok(());
    };
    match org_rule(&parts.method, route) {
        OrgRule::Global => Err(ApiError::new(
            StatusCode::FORBIDDEN,
            ErrorCode::OrgBoundToken,
            format!(
                "this token is bound to org {bound}; {} {route} acts on every org and needs a token bound to none",
                parts.method
            ),
        )),
        OrgRule::PathOrg => {
            let params = RawPathParams::from_request_parts(parts, state)
                .await
                .map_err(|_| ApiError::invalid(ErrorCode::InvalidOrgId, "org_id: is not readable"))?;
            let org_id = params
                .iter()
                .find_map(|(name, value)| (name == "org_id").then_some(value))
                .expect("a path-org route has {org_id} in its path");
            principal.check_org(org_id)
        }
        OrgRule::NoOrgData
        | OrgRule::BodyOrg
        | OrgRule::OwnedByOrg
        | OrgRule::FilteredToOrg => Ok(()),
    }
}

/// The response, holding the token's permit until its body has been sent (or dropped), not
/// only its headers: a streamed export is in progress until its last row.
fn held_until_sent(response: Response, permit: TokenPermit) -> Response {
    response.map(|body| {
        Body::new(body.map_frame(move |frame| {
            let _held = &permit;
            frame
        }))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_scheme_is_read_in_any_case() {
        for value in [
            "Bearer s3cret",
            "bearer s3cret",
            "BEARER s3cret",
            "bEaReR  s3cret ",
        ] {
            assert_eq!(bearer_secret(value), Some("s3cret"), "{value:?}");
        }
        for value in [
            "Basic s3cret",
            "Bearer",
            "Bearer ",
            "Bearers3cret",
            "s3cret",
        ] {
            assert_eq!(bearer_secret(value), None, "{value:?}");
        }
    }

    #[test]
    fn a_token_past_its_limit_is_refused_and_its_entry_goes_when_its_last_request_ends() {
        let limits = TokenLimits::new(2);
        let (one, other) = ([1u8; 32], [2u8; 32]);
        let first = limits.try_acquire(one).expect("the first is allowed");
        let second = limits.try_acquire(one).expect("the second is allowed");
        assert!(limits.try_acquire(one).is_none(), "the third is refused");
        let theirs = limits
            .try_acquire(other)
            .expect("another token is counted apart");
        assert_eq!(limits.tokens_in_progress(), 2);
        drop(first);
        let third = limits.try_acquire(one).expect("a slot was given back");
        drop((second, third, theirs));
        assert_eq!(
            limits.tokens_in_progress(),
            0,
            "no entry outlives its requests"
        );
    }

    #[test]
    fn every_listed_route_is_listed_once() {
        for (index, rule) in ROUTES.iter().enumerate() {
            assert!(
                ROUTES[index + 1..]
                    .iter()
                    .all(|other| (other.method, other.path) != (rule.method, rule.path)),
                "{} {} is listed twice",
                rule.method,
                rule.path
            );
            assert!(
                rule.org != OrgRule::PathOrg || rule.path.contains("{org_id}"),
                "{} {} takes its org from a path without {{org_id}}",
                rule.method,
                rule.path
            );
        }
    }
}
