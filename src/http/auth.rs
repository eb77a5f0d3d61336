//! Bearer-token authentication for `/v1/*`. For now one token, `TALLY_BOOTSTRAP_TOKEN`,
//! which is the admin token. Only its sha256 is kept in memory, and comparisons are made
//! between digests in constant time, so response timing says nothing about the secret.

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::AppState;

/// The tokens this instance accepts.
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

    fn accepts(&self, presented: &str) -> bool {
        let Some(expected) = &self.bootstrap_digest else {
            return false;
        };
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        digest
            .iter()
            .zip(expected)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
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
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match presented {
        Some(token) if state.tokens.accepts(token) => Ok(next.run(request).await),
        Some(_) => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not valid",
        )),
        None => Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "send Authorization: Bearer <token>",
        )),
    }
}
