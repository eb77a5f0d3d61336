//! A token revoked while its request's body is still arriving.
//!
//! [`super::auth::require_token`] looks the token up when the request's head arrives; the
//! body may follow for as long as the body read timeout lets each gap last and the request
//! deadline lets the whole take. A request whose body ends later than [`RECHECK_AFTER`]
//! after that look-up is let end only once its token has been looked up again: if it was
//! revoked meanwhile, the body ends in an error instead (so the handler, which acts only
//! on a whole body, stores nothing) and the request is answered 401. A body that arrives
//! with its head, as nearly every one does, costs no second look-up.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::BoxError;

use super::error::ApiError;
use crate::error_code::ErrorCode;

/// How long after its token's look-up a body may end without a second one.
pub const RECHECK_AFTER: Duration = Duration::from_millis(100);

/// What the second look-up found, shared by the body and the middleware that answers.
#[derive(Clone, Default)]
pub struct Verdict(Arc<AtomicU8>);

const REVOKED: u8 = 1;
const UNAVAILABLE: u8 = 2;

impl Verdict {
    /// The answer in place of the handler's, when the second look-up refused the body.
    pub fn refusal(&self) -> Option<ApiError> {
        match self.0.load(Ordering::Acquire) {
            REVOKED => Some(ApiError::new(
                StatusCode::UNAUTHORIZED,
                ErrorCode::Unauthorized,
                "the bearer token was revoked while the request's body was arriving; \
                 nothing was stored",
            )),
            UNAVAILABLE => Some(ApiError::unavailable(
                ErrorCode::DatabaseUnavailable,
                "the bearer token could not be looked up again after the request's body; \
                 nothing was stored; retry",
            )),
            _ => None,
        }
    }
}

/// The look-up of the token again: `Ok(true)` while it is still valid.
pub type Lookup = Pin<Box<dyn Future<Output = Result<bool, ApiError>> + Send>>;

/// The request body, ended only after the token is looked up again when it ends late.
pub struct Rechecked {
    inner: Body,
    looked_up: Instant,
    /// Makes the second look-up; taken when it starts.
    lookup: Option<Box<dyn FnOnce() -> Lookup + Send>>,
    running: Option<Lookup>,
    verdict: Verdict,
}

/// The refused body's error, for whatever reads it; the middleware answers the request.
#[derive(Debug, thiserror::Error)]
#[error("the request's token could not be confirmed after its body")]
struct Refused;

impl Rechecked {
    pub fn new(
        inner: Body,
        looked_up: Instant,
        lookup: Box<dyn FnOnce() -> Lookup + Send>,
        verdict: Verdict,
    ) -> Rechecked {
        Rechecked {
            inner,
            looked_up,
            lookup: Some(lookup),
            running: None,
            verdict,
        }
    }
}

impl http_body::Body for Rechecked {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if this.running.is_none() {
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                None if this.looked_up.elapsed() > RECHECK_AFTER => match this.lookup.take() {
                    Some(lookup) => this.running = Some(lookup()),
                    None => return Poll::Ready(None),
                },
                frame => return Poll::Ready(frame.map(|frame| frame.map_err(BoxError::from))),
            }
        }
        let running = this.running.as_mut().expect("a look-up runs");
        let found = ready!(running.as_mut().poll(cx));
        this.running = None;
        let verdict = match found {
            Ok(true) => return Poll::Ready(None),
            Ok(false) => REVOKED,
            Err(_) => UNAVAILABLE,
        };
        this.verdict.0.store(verdict, Ordering::Release);
        Poll::Ready(Some(Err(Refused.into())))
    }

    fn is_end_stream(&self) -> bool {
        // Ended only once polled to its end: a late end is looked up first.
        self.running.is_none()
            && self.inner.is_end_stream()
            && (self.lookup.is_none() || self.looked_up.elapsed() <= RECHECK_AFTER)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}
