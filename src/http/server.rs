//! The HTTP server: the accept loop and each connection's life, around `app(state)`.
//!
//! axum's `serve` has no timeouts and no cap on connections, so a client that opens
//! connections and sends nothing, trickles a head, or sends one byte of a declared body
//! could hold file descriptors and request slots for as long as it liked. This drives
//! hyper's HTTP/1 connections itself, with (docs/decisions/0015-http-connection-limits.md):
//! - a header read timeout, from a connection's accept or a request's first byte until its
//!   head is in, and an idle timeout between keep-alive requests ([`TimedIo`]);
//! - a body read timeout: the longest a handler waits for the next piece of a body
//!   ([`TimedBody`]); past it the request is answered 408 `body_timeout`;
//! - a write timeout: the longest a response waits for the client to read ([`TimedIo`]);
//! - a cap on open connections; past it the longest-waiting connection without a request in
//!   progress is closed, or, when every one has a request in progress, the new one is
//!   answered 503 `too_many_connections` and closed ([`Registry`]);
//! - front-door refusals that hyper's router cannot express as JSON: a URI longer than
//!   [`URI_MAX_BYTES`] (414 `uri_too_long`), a head of more than [`HEADER_FIELDS_MAX`]
//!   fields or [`HEAD_MAX_BYTES`] (431 `headers_too_large`), a path that is not UTF-8 once
//!   decoded (400 `invalid_path`), a repeated query parameter (422
//!   `duplicate_query_parameter`, as every route answers an unknown one) and a header that
//!   must come once given twice (400 `duplicate_header`).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{ready, Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderValue, Request, Response, StatusCode};
use axum::response::IntoResponse;
use axum::{BoxError, Router};
use bytes::Bytes;
use futures::task::AtomicWaker;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt as _;

use super::error::ApiError;
use crate::config::Config;
use crate::error_code::ErrorCode;

/// The longest request target (path and query) served, in bytes. Every route's path is
/// a few ids of at most 64 characters and its query a few short parameters, well under
/// 1 KiB; 8 KiB is what common proxies allow by default.
pub const URI_MAX_BYTES: usize = 8 * 1024;
/// The longest request line read before it is refused with a JSON 414 `uri_too_long` at
/// the socket ([`TimedIo`]): a target of [`URI_MAX_BYTES`] plus room for the method and
/// the version. A longer line would otherwise reach hyper, whose parser answers a target
/// over 65 534 bytes with a bare 414 that has no body.
const REQUEST_LINE_MAX_BYTES: usize = URI_MAX_BYTES + 1024;
/// The most header fields a request may have: hyper's parser takes no more, and answers
/// one over with a bare 431 that has no body.
pub const HEADER_FIELDS_MAX: usize = 100;
/// The largest request head (request line and header fields) read before it is refused
/// with a JSON 431 `headers_too_large` at the socket ([`TimedIo`]). Far above any head a
/// client of tally sends (a token, a few CloudEvents attributes of at most 4 KiB), below
/// hyper's own read buffer (about 408 KiB), past which hyper would answer a bare 431.
pub const HEAD_MAX_BYTES: usize = 64 * 1024;
/// File descriptors kept free of HTTP connections when the open-files limit is low: the
/// database pool, NATS, the listener, logs and report files.
const FILES_RESERVED: u64 = 256;
/// How long the accept loop pauses after an error that is not the client's (such as no
/// file descriptor left), so that it does not spin while none frees up.
const ACCEPT_ERROR_PAUSE_MS: u64 = 1_000;

/// The server's connection limits (see `config.rs` for each default and why).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub idle_timeout: Duration,
    pub connections_max: usize,
    pub write_timeout: Duration,
}

impl Limits {
    pub fn from_config(config: &Config) -> Limits {
        Limits {
            header_read_timeout: Duration::from_millis(config.http_header_read_timeout_ms),
            body_read_timeout: Duration::from_millis(config.http_body_read_timeout_ms),
            idle_timeout: Duration::from_millis(config.http_idle_timeout_ms),
            connections_max: config.http_connections_max,
            write_timeout: Duration::from_millis(config.http_write_timeout_ms),
        }
    }
}

/// Serves `app` on `listener` until `shutdown`; then stops accepting, lets requests in
/// progress finish (idle connections are closed at once) and returns when every
/// connection is closed.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let limits = Limits {
        connections_max: open_files_allow(limits.connections_max),
        ..limits
    };
    let registry = Arc::new(Registry::new(limits.connections_max));
    let refusal = refusal_bytes();
    // Each connection task holds a receiver; `closed()` resolves when the last is dropped.
    let (closed_tx, closed_rx) = watch::channel(());
    loop {
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(error) if is_connection_error(&error) => continue,
                Err(error) => {
                    tracing::error!(%error, "cannot accept a connection");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(ACCEPT_ERROR_PAUSE_MS)) => continue,
                    }
                }
            },
        };
        // Responses go out as soon as written: without TCP_NODELAY, Nagle's algorithm holds
        // a small write back while an earlier one is unacknowledged, up to the client's
        // delayed ACK (tens of milliseconds).
        if let Err(error) = stream.set_nodelay(true) {
            tracing::debug!(%error, "cannot set TCP_NODELAY on a connection");
        }
        let Some(connection) = registry.admit() else {
            metrics::counter!(crate::telemetry::HTTP_CONNECTIONS_REFUSED).increment(1);
            // A fresh socket's send buffer is empty, so this one write does not block; if it
            // fails the client sees the connection close, which is what it would get anyway.
            let _ = stream.try_write(&refusal);
            continue;
        };
        tokio::spawn(serve_connection(
            stream,
            connection,
            app.clone(),
            limits,
            registry.clone(),
            shutdown.clone(),
            closed_rx.clone(),
        ));
    }
    drop(listener);
    drop(closed_rx);
    closed_tx.closed().await;
    Ok(())
}

async fn serve_connection(
    stream: TcpStream,
    connection: Arc<Connection>,
    app: Router,
    limits: Limits,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    _closed: watch::Receiver<()>,
) {
    let io = TokioIo::new(TimedIo::new(stream, connection.clone(), limits));
    let service = {
        let connection = connection.clone();
        hyper::service::service_fn(move |request| {
            // Here, not in `handle`: hyper reads on before it first polls the request.
            connection.set_phase(Phase::Busy);
            handle(
                app.clone(),
                connection.clone(),
                limits.body_read_timeout,
                request,
            )
        })
    };
    // No hyper timer: hyper's header timeout runs from when a connection starts waiting for
    // a request, so it cannot tell an idle keep-alive connection from a trickled head;
    // `TimedIo` keeps both timeouts instead.
    let served = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut served = std::pin::pin!(served);
    let mut cancelled = std::pin::pin!(shutdown.cancelled());
    let mut stopping = false;
    loop {
        tokio::select! {
            result = served.as_mut() => {
                if let Err(error) = result {
                    tracing::debug!(%error, "connection closed with an error");
                }
                break;
            }
            _ = &mut cancelled, if !stopping => {
                // Closes the connection if idle; otherwise after the response in progress.
                served.as_mut().graceful_shutdown();
                stopping = true;
            }
            _ = connection.evicted.notified() => {
                tracing::debug!("connection closed to make room for a new one");
                break;
            }
        }
    }
    registry.remove(&connection);
}

/// One request: the front-door checks, then the router, with the body timed.
async fn handle(
    app: Router,
    connection: Arc<Connection>,
    body_read_timeout: Duration,
    request: Request<Incoming>,
) -> Result<Response<ResponseBody>, Infallible> {
    connection.body_open.store(
        !http_body::Body::is_end_stream(request.body()),
        Ordering::Relaxed,
    );
    let response = match refuse_at_front_door(&request) {
        Some(error) => error.into_response(),
        None => {
            let request = request
                .map(|body| Body::new(TimedBody::new(body, body_read_timeout, connection.clone())));
            let response = match app.oneshot(request).await {
                Ok(response) => response,
                Err(never) => match never {},
            };
            if connection.body_timed_out.swap(false, Ordering::Relaxed) {
                body_timeout(body_read_timeout)
            } else {
                response
            }
        }
    };
    Ok(response.map(|body| ResponseBody {
        inner: body,
        connection,
    }))
}

/// A request refused before routing, for what the router's extractors would refuse in
/// plain text, or hyper with an empty body.
fn refuse_at_front_door<B>(request: &Request<B>) -> Option<ApiError> {
    let target = request
        .uri()
        .path_and_query()
        .map_or("", |target| target.as_str());
    if target.len() > URI_MAX_BYTES {
        return Some(ApiError::new(
            StatusCode::URI_TOO_LONG,
            ErrorCode::UriTooLong,
            format!("the request target is longer than {URI_MAX_BYTES} bytes"),
        ));
    }
    if !decodes_as_text(request.uri().path()) {
        return Some(ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::InvalidPath,
            "the request path is not UTF-8 text once its %-escapes are decoded",
        ));
    }
    if let Some(name) = SINGLE_HEADERS
        .iter()
        .find(|name| request.headers().get_all(**name).iter().nth(1).is_some())
    {
        return Some(ApiError::new(
            StatusCode::BAD_REQUEST,
            ErrorCode::DuplicateHeader,
            format!("{name}: is given more than once; send it once"),
        ));
    }
    let query = request.uri().query()?;
    repeated_parameter(query).map(|name| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            ErrorCode::DuplicateQueryParameter,
            format!("{name}: is given more than once"),
        )
    })
}

/// Headers a request may carry once: which of two a handler reads (the first) and which a
/// proxy in front reads (often the last) would otherwise be a matter of chance, and the two
/// could name another token or another body type.
const SINGLE_HEADERS: [&str; 4] = [
    "authorization",
    "content-type",
    "content-encoding",
    super::consistency::MIN_POSITION_HEADER,
];

/// Whether `path` is UTF-8 text once its `%XX` escapes are decoded, as every path parameter
/// must be; a `%` not followed by two hex digits stays as written, as the router keeps it.
fn decodes_as_text(path: &str) -> bool {
    if !path.contains('%') {
        return true;
    }
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escape = bytes
            .get(at + 1..at + 3)
            .filter(|hex| bytes[at] == b'%' && hex.iter().all(u8::is_ascii_hexdigit));
        match escape.and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok()) {
            Some(byte) => {
                decoded.push(byte);
                at += 3;
            }
            None => {
                decoded.push(bytes[at]);
                at += 1;
            }
        }
    }
    std::str::from_utf8(&decoded).is_ok()
}

/// The first query parameter name that appears twice, once decoded: no route takes a
/// list, and which of two values a route would read is not something to leave to chance.
fn repeated_parameter(query: &str) -> Option<String> {
    let mut names: Vec<_> = url::form_urlencoded::parse(query.as_bytes())
        .map(|(name, _)| name)
        .collect();
    names.sort_unstable();
    names
        .windows(2)
        .find(|pair| pair[0] == pair[1])
        .map(|pair| pair[0].clone().into_owned())
}

fn body_timeout(body_read_timeout: Duration) -> axum::response::Response {
    let mut response = ApiError::new(
        StatusCode::REQUEST_TIMEOUT,
        ErrorCode::BodyTimeout,
        format!(
            "the request body sent nothing for {} ms; send it without pauses",
            body_read_timeout.as_millis()
        ),
    )
    .into_response();
    // The rest of the body may still come; the connection cannot be reused.
    response
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// The answer past the cap when no connection can be closed to make room: written raw,
/// because the connection is never handed to hyper.
fn refusal_bytes() -> Vec<u8> {
    let body = serde_json::json!({"error": {
        "code": ErrorCode::TooManyConnections,
        "message": "too many connections are open; retry later",
        "details": [],
    }})
    .to_string();
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// Why a request head is refused while it is read, before hyper parses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadRefusal {
    /// A request line longer than [`REQUEST_LINE_MAX_BYTES`].
    RequestLine,
    /// More than [`HEADER_FIELDS_MAX`] header fields.
    Fields,
    /// A head larger than [`HEAD_MAX_BYTES`].
    Bytes,
}

impl HeadRefusal {
    /// The answer, written raw by [`TimedIo`]: it closes the connection.
    fn response_bytes(self) -> Vec<u8> {
        let (status, code, message) = match self {
            HeadRefusal::RequestLine => (
                StatusCode::URI_TOO_LONG,
                ErrorCode::UriTooLong,
                format!("the request target is longer than {URI_MAX_BYTES} bytes"),
            ),
            HeadRefusal::Fields => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                ErrorCode::HeadersTooLarge,
                format!("the request has more than {HEADER_FIELDS_MAX} header fields"),
            ),
            HeadRefusal::Bytes => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                ErrorCode::HeadersTooLarge,
                format!("the request head is larger than {HEAD_MAX_BYTES} bytes"),
            ),
        };
        let body = serde_json::json!({"error": {
            "code": code,
            "message": message,
            "details": [],
        }})
        .to_string();
        format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\n\
             connection: close\r\ncontent-length: {}\r\n\r\n{body}",
            status.as_str(),
            status.canonical_reason().unwrap_or_default(),
            body.len()
        )
        .into_bytes()
    }

    fn metric(self) -> &'static str {
        match self {
            HeadRefusal::RequestLine => crate::telemetry::HTTP_REQUEST_LINE_REFUSED,
            HeadRefusal::Fields | HeadRefusal::Bytes => crate::telemetry::HTTP_HEADS_REFUSED,
        }
    }
}

/// What has been read of a request's head while it is not whole: enough to refuse it, at
/// the limits above, before hyper would refuse it with no body.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct HeadRead {
    /// Bytes of the head so far.
    bytes: usize,
    /// Lines ended so far, blank lines before the request line aside: the request line, then
    /// one a header field.
    lines: usize,
    /// Bytes of the line being read, its carriage returns aside.
    line: usize,
    /// The request line's method has been read: the bytes are a request's head.
    method: bool,
}

/// The longest method a head is counted for; tally's are at most 7 letters.
const METHOD_MAX_BYTES: usize = 16;

/// What a read did to a head being counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Counted {
    /// The head goes on.
    Open,
    /// The head ended after the read's first `n` bytes (what follows is body or another
    /// request).
    Ended(usize),
    /// The bytes do not begin with a method (upper-case letters and a space): they are not
    /// the start of a head (the rest of a body hyper drains, or of a head it began reading
    /// during the request before), and are left to hyper's own limits.
    NotAHead,
}

impl HeadRead {
    /// Counts `read`; past a limit, the refusal.
    fn count(&mut self, read: &[u8]) -> Result<Counted, HeadRefusal> {
        for (at, &byte) in read.iter().enumerate() {
            self.bytes += 1;
            if self.bytes > HEAD_MAX_BYTES {
                return Err(HeadRefusal::Bytes);
            }
            match byte {
                b'\n' if self.line == 0 && self.lines > 0 => return Ok(Counted::Ended(at + 1)),
                b'\n' if !self.method && self.line > 0 => return Ok(Counted::NotAHead),
                b'\n' => {
                    self.lines += usize::from(self.line > 0);
                    self.line = 0;
                }
                b'\r' => {}
                b' ' if !self.method && self.lines == 0 && self.line > 0 => {
                    self.method = true;
                    self.line += 1;
                }
                _ if !self.method
                    && (!byte.is_ascii_uppercase() || self.line >= METHOD_MAX_BYTES) =>
                {
                    return Ok(Counted::NotAHead)
                }
                _ => self.line += 1,
            }
            if self.lines == 0 && self.line > REQUEST_LINE_MAX_BYTES {
                return Err(HeadRefusal::RequestLine);
            }
            if self.lines > HEADER_FIELDS_MAX + 1 {
                return Err(HeadRefusal::Fields);
            }
        }
        Ok(Counted::Open)
    }
}

/// Errors of one connection, not of the listener (as hyper's and axum's servers sort them).
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Where a connection is in its request cycle; which timeout applies follows from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Phase {
    /// Between requests, nothing of the next one read: the idle timeout.
    Idle = 0,
    /// A head is arriving (or, on a new connection, awaited): the header read timeout.
    Head = 1,
    /// A request is in progress, until its response is written: the body timeout applies
    /// to its body, and nothing else is timed here (the request deadline is the router's).
    Busy = 2,
}

/// What the accept loop, the connection's I/O and its requests share about it.
struct Connection {
    /// Its order of admission: the oldest is closed first to make room.
    id: u64,
    phase: AtomicU8,
    /// Set by the request body when it timed out, so that the answer is 408 whatever the
    /// handler made of the read error. HTTP/1 serves one request at a time per connection.
    body_timed_out: AtomicBool,
    /// The request's body may have bytes hyper has not read yet: set when the request comes,
    /// cleared by its body's end.
    body_open: AtomicBool,
    /// Closed to make room for a new connection.
    evicted: Notify,
    /// The connection task, as last seen reading during a request. hyper polls the socket
    /// for the next request only when woken, and its last poll came while the request was
    /// in progress, before the idle timeout could start: the written response wakes it so
    /// that the timeout starts. (A waker, not a `Notify` in the connection's `select!`,
    /// which would take a lock at every poll of the connection.)
    reader: AtomicWaker,
}

impl Connection {
    fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            0 => Phase::Idle,
            1 => Phase::Head,
            _ => Phase::Busy,
        }
    }

    fn set_phase(&self, phase: Phase) {
        self.phase.store(phase as u8, Ordering::Relaxed);
    }
}

/// The open connections, by age, for the cap.
struct Registry {
    connections_max: usize,
    open: Mutex<Open>,
}

struct Open {
    next_id: u64,
    connections: BTreeMap<u64, Arc<Connection>>,
}

impl Registry {
    fn new(connections_max: usize) -> Registry {
        Registry {
            connections_max: connections_max.max(1),
            open: Mutex::new(Open {
                next_id: 0,
                connections: BTreeMap::new(),
            }),
        }
    }

    /// A place for a new connection: free, or made by closing the oldest idle connection,
    /// else the oldest still sending its head. None when every open connection has a
    /// request in progress.
    fn admit(&self) -> Option<Arc<Connection>> {
        let mut open = self
            .open
            .lock()
            .expect("the registry lock is never poisoned");
        if open.connections.len() >= self.connections_max {
            let oldest_in = |phase| {
                open.connections
                    .values()
                    .find(|connection| connection.phase() == phase)
                    .map(|connection| connection.id)
            };
            let evicted = oldest_in(Phase::Idle).or_else(|| oldest_in(Phase::Head))?;
            let evicted = open
                .connections
                .remove(&evicted)
                .expect("the id was just found");
            evicted.evicted.notify_one();
            metrics::counter!(crate::telemetry::HTTP_CONNECTIONS_EVICTED).increment(1);
        }
        let id = open.next_id;
        open.next_id += 1;
        let connection = Arc::new(Connection {
            id,
            phase: AtomicU8::new(Phase::Head as u8),
            body_timed_out: AtomicBool::new(false),
            body_open: AtomicBool::new(false),
            evicted: Notify::new(),
            reader: AtomicWaker::new(),
        });
        open.connections.insert(id, connection.clone());
        metrics::gauge!(crate::telemetry::HTTP_CONNECTIONS_OPEN).set(open.connections.len() as f64);
        Some(connection)
    }

    fn remove(&self, connection: &Connection) {
        let mut open = self
            .open
            .lock()
            .expect("the registry lock is never poisoned");
        open.connections.remove(&connection.id);
        metrics::gauge!(crate::telemetry::HTTP_CONNECTIONS_OPEN).set(open.connections.len() as f64);
    }
}

/// A connection's socket that fails its reads once the head or idle deadline passes, and
/// its writes once they have waited for the write timeout.
///
/// hyper reads from it only when it wants bytes: while a head is awaited, while a body is
/// read, and, during a request, to notice the client leaving. Only the first is timed here.
struct TimedIo {
    stream: TcpStream,
    connection: Arc<Connection>,
    limits: Limits,
    /// The phase the deadline was set for.
    timed_phase: Phase,
    deadline: Instant,
    timer: Pin<Box<Sleep>>,
    /// A client that does not read its responses.
    write_gap: Gap,
    /// What has been read of the current request's head; `None` once it is whole (until
    /// the next request's head begins).
    head: Option<HeadRead>,
    /// Answered 414 or 431 for its head: what the client still sends is read and dropped
    /// until it closes or the head's deadline passes. Closing at once with its bytes unread
    /// would reset the connection, and the client could lose the answer.
    draining: bool,
}

impl TimedIo {
    fn new(stream: TcpStream, connection: Arc<Connection>, limits: Limits) -> TimedIo {
        let deadline = Instant::now() + limits.header_read_timeout;
        TimedIo {
            stream,
            connection,
            limits,
            timed_phase: Phase::Head,
            deadline,
            timer: Box::pin(tokio::time::sleep_until(deadline)),
            write_gap: Gap::new(limits.write_timeout),
            head: Some(HeadRead::default()),
            draining: false,
        }
    }

    /// Counts what a read added to a head still open; past a limit the client is answered
    /// 414 or 431 and the connection drains (see `draining`), then fails its read, so that
    /// hyper drops it without answering.
    fn check_head(&mut self, read: &[u8]) -> bool {
        let Some(head) = self.head.as_mut() else {
            return true;
        };
        let refusal = match head.count(read) {
            Ok(Counted::Ended(_) | Counted::NotAHead) => {
                self.head = None;
                return true;
            }
            Ok(Counted::Open) => return true,
            Err(refusal) => refusal,
        };
        metrics::counter!(refusal.metric()).increment(1);
        // The response to the head so far has not begun, so the send buffer is empty and
        // this one small write does not block; if it fails the client sees the connection
        // close, which is what it would get anyway.
        let _ = self.stream.try_write(&refusal.response_bytes());
        self.draining = true;
        false
    }

    /// Reads and drops what a client refused for its head still sends, until it
    /// closes (or fails) or the head's deadline passes; then the read fails.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut scratch = [0u8; 8 * 1024];
        loop {
            let mut dropped = ReadBuf::new(&mut scratch);
            match Pin::new(&mut self.stream).poll_read(cx, &mut dropped) {
                Poll::Ready(Ok(())) if !dropped.filled().is_empty() => continue,
                Poll::Ready(_) => break,
                Poll::Pending => {
                    if self.timer.deadline() != self.deadline {
                        self.timer.as_mut().reset(self.deadline);
                    }
                    ready!(self.timer.as_mut().poll(cx));
                    break;
                }
            }
        }
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the request head is too large",
        )))
    }

    /// A write's outcome, failed once writes have waited for the write timeout.
    fn timed_write(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        match written {
            Poll::Ready(result) => {
                self.write_gap.progressed();
                Poll::Ready(result)
            }
            Poll::Pending => {
                ready!(self.write_gap.poll_elapsed(cx));
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the client read nothing of the response for too long",
                )))
            }
        }
    }
}

impl AsyncRead for TimedIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.draining {
            return this.poll_drain(cx);
        }
        let phase = this.connection.phase();
        if phase == Phase::Busy {
            this.timed_phase = Phase::Busy;
            let read = Pin::new(&mut this.stream).poll_read(cx, buf);
            if read.is_pending() {
                this.connection.reader.register(cx.waker());
            }
            return read;
        }
        if phase == Phase::Idle && this.timed_phase != Phase::Idle {
            // The response was written just now: hyper reads for the next request at once.
            this.timed_phase = Phase::Idle;
            this.deadline = Instant::now() + this.limits.idle_timeout;
        }
        let filled = buf.filled().len();
        match Pin::new(&mut this.stream).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if phase == Phase::Idle && buf.filled().len() > filled {
                    this.connection.set_phase(Phase::Head);
                    this.timed_phase = Phase::Head;
                    this.deadline = Instant::now() + this.limits.header_read_timeout;
                    // A request answered before its body was read: what comes now is the
                    // rest of that body, which hyper drains, not a head.
                    let draining = this.connection.body_open.load(Ordering::Relaxed);
                    this.head = (!draining).then(HeadRead::default);
                }
                if this.check_head(&buf.filled()[filled..]) {
                    return Poll::Ready(Ok(()));
                }
                // hyper must not parse the line it was given: the bytes are taken back.
                buf.set_filled(filled);
                this.poll_drain(cx)
            }
            Poll::Ready(Err(error)) => Poll::Ready(Err(error)),
            Poll::Pending => {
                // A read waiting for more of a head may be hyper's last before it serves it.
                this.connection.reader.register(cx.waker());
                if this.timer.deadline() != this.deadline {
                    this.timer.as_mut().reset(this.deadline);
                }
                ready!(this.timer.as_mut().poll(cx));
                let what = match this.timed_phase {
                    Phase::Idle => "the connection was idle for too long",
                    _ => "the request head took too long",
                };
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, what)))
            }
        }
    }
}

impl AsyncWrite for TimedIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.timed_write(cx, written)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let written = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.timed_write(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// A timeout on the gap between pieces of progress: it runs only while a read or write
/// waits, and starts afresh at each wait after progress.
struct Gap {
    timeout: Duration,
    /// Made on the first wait only: most reads and writes never wait.
    timer: Option<Pin<Box<Sleep>>>,
    /// Whether the timer runs for the present wait.
    waiting: bool,
}

impl Gap {
    fn new(timeout: Duration) -> Gap {
        Gap {
            timeout,
            timer: None,
            waiting: false,
        }
    }

    fn progressed(&mut self) {
        self.waiting = false;
    }

    /// Ready once the present wait has lasted the timeout.
    fn poll_elapsed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.waiting {
            self.waiting = true;
            let deadline = Instant::now() + self.timeout;
            match &mut self.timer {
                Some(timer) => timer.as_mut().reset(deadline),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(deadline))),
            }
        }
        let timer = self.timer.as_mut().expect("armed when the wait began");
        timer.as_mut().poll(cx)
    }
}

/// A request body that fails when the handler has waited longer than the body read
/// timeout for its next piece. Time the handler spends elsewhere (storing the previous
/// piece) does not count, so a steady upload of any size goes through.
struct TimedBody {
    inner: Incoming,
    gap: Gap,
    connection: Arc<Connection>,
}

impl TimedBody {
    fn new(inner: Incoming, timeout: Duration, connection: Arc<Connection>) -> TimedBody {
        TimedBody {
            inner,
            gap: Gap::new(timeout),
            connection,
        }
    }
}

/// The request body sent nothing for longer than the body read timeout.
#[derive(Debug, thiserror::Error)]
#[error("the request body sent nothing for too long")]
struct BodyTimedOut;

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.gap.progressed();
                if frame.is_none() || this.inner.is_end_stream() {
                    this.connection.body_open.store(false, Ordering::Relaxed);
                }
                Poll::Ready(frame.map(|frame| frame.map_err(BoxError::from)))
            }
            Poll::Pending => {
                ready!(this.gap.poll_elapsed(cx));
                this.connection
                    .body_timed_out
                    .store(true, Ordering::Relaxed);
                Poll::Ready(Some(Err(BodyTimedOut.into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The response body, which marks the connection idle once hyper has written it (hyper
/// drops it then), so that the idle timeout starts.
struct ResponseBody {
    inner: Body,
    connection: Arc<Connection>,
}

impl Drop for ResponseBody {
    fn drop(&mut self) {
        self.connection.set_phase(Phase::Idle);
        self.connection.reader.wake();
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The connection cap that fits the open-files limit: raises the soft limit towards the
/// hard one when the cap needs it, and lowers the cap when even that is too few.
fn open_files_allow(connections_max: usize) -> usize {
    let wanted = connections_max as u64 + FILES_RESERVED;
    let available = match raise_open_files_limit(wanted) {
        Ok(available) => available,
        Err(error) => {
            tracing::warn!(%error, "cannot read the open-files limit; the connection cap is kept");
            return connections_max;
        }
    };
    if available >= wanted {
        return connections_max;
    }
    let fitted = available.saturating_sub(FILES_RESERVED).max(1) as usize;
    tracing::warn!(
        connections_max,
        open_files_max = available,
        fitted,
        "the open-files limit is too low for TALLY_HTTP_CONNECTIONS_MAX; the cap is lowered to fit"
    );
    fitted
}

/// The soft open-files limit, raised to `wanted` (or the hard limit, if lower) when below.
#[cfg(unix)]
// `rlim_t` is u64 on Linux, not on every unix.
#[allow(clippy::unnecessary_cast)]
fn raise_open_files_limit(wanted: u64) -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a pointer to a live local of that type.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let current = limit.rlim_cur as u64;
    if limit.rlim_cur == libc::RLIM_INFINITY || current >= wanted {
        return Ok(current.max(wanted));
    }
    let raised = if limit.rlim_max == libc::RLIM_INFINITY {
        wanted
    } else {
        wanted.min(limit.rlim_max as u64)
    };
    limit.rlim_cur = raised as libc::rlim_t;
    // SAFETY: setrlimit reads one rlimit through a pointer to a live local of that type.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Ok(current);
    }
    Ok(raised)
}

#[cfg(not(unix))]
fn raise_open_files_limit(wanted: u64) -> io::Result<u64> {
    Ok(wanted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts `head` in reads of `piece` bytes: how the last read left it, or the refusal.
    fn counted(head: &[u8], piece: usize) -> Result<Counted, HeadRefusal> {
        let mut read = HeadRead::default();
        let mut ended = Ok(Counted::Open);
        for chunk in head.chunks(piece) {
            ended = read.count(chunk);
            if ended != Ok(Counted::Open) {
                break;
            }
        }
        ended
    }

    #[test]
    fn a_path_is_text_when_its_escapes_decode_to_utf8_and_stray_percents_stay_as_written() {
        for path in [
            "/v1/orgs/acme",
            "/v1/orgs/%C3%A9t%C3%A9",
            "/v1/orgs/100%",
            "/a%G1",
            "/a%2",
        ] {
            assert!(decodes_as_text(path), "{path}");
        }
        for path in [
            "/v1/containers/%FF",
            "/v1/orgs/%C3",
            "/console/%80x",
            "/a%c3%28",
        ] {
            assert!(!decodes_as_text(path), "{path}");
        }
    }

    #[test]
    fn a_head_ends_at_its_blank_line_however_it_is_split_into_reads() {
        let head = b"\r\nGET /healthz HTTP/1.1\r\nhost: tally\r\n\r\nbody";
        assert_eq!(
            counted(head, head.len()),
            Ok(Counted::Ended(head.len() - 4))
        );
        assert_eq!(counted(head, 1), Ok(Counted::Ended(1)));
        let bare = b"GET / HTTP/1.1\nhost: tally\n\n";
        assert_eq!(counted(bare, 7), Ok(Counted::Ended(7)));
        let open = b"GET / HTTP/1.1\r\nhost: tally\r\n";
        assert_eq!(counted(open, 3), Ok(Counted::Open));
    }

    #[test]
    fn bytes_that_do_not_begin_with_a_method_are_not_counted_as_a_head() {
        // The rest of a body hyper drains, or of a head begun during the request before.
        let body = format!("{{\"events\": [{}]}}", "1,".repeat(40_000));
        let rest_of_head = format!("host: tally\r\n{}\r\n", "x-a: b\r\n".repeat(200));
        let csv = "ChargePeriodStart,ChargePeriodEnd\n".repeat(200);
        let tail = format!("\r\n{}", "a".repeat(70_000));
        for bytes in [body, rest_of_head, csv, tail] {
            assert_eq!(counted(bytes.as_bytes(), 4096), Ok(Counted::NotAHead));
        }
        let long_method = format!("{} / HTTP/1.1\r\n\r\n", "A".repeat(METHOD_MAX_BYTES + 1));
        assert_eq!(counted(long_method.as_bytes(), 64), Ok(Counted::NotAHead));
        for method in ["GET", "POST", "DELETE", "OPTIONS"] {
            let head = format!("{method} /v1/status HTTP/1.1\r\n\r\n");
            assert!(
                matches!(counted(head.as_bytes(), 2), Ok(Counted::Ended(_))),
                "{method}"
            );
        }
    }

    #[test]
    fn a_head_past_a_limit_is_refused_for_that_limit_and_one_at_it_is_not() {
        let fields = |count: usize| {
            let mut head = b"GET / HTTP/1.1\r\n".to_vec();
            for n in 0..count {
                head.extend(format!("x-{n}: v\r\n").bytes());
            }
            head.extend(b"\r\n");
            head
        };
        assert!(matches!(
            counted(&fields(HEADER_FIELDS_MAX), 5),
            Ok(Counted::Ended(_))
        ));
        assert_eq!(
            counted(&fields(HEADER_FIELDS_MAX + 1), 5),
            Err(HeadRefusal::Fields)
        );
        let line = |length: usize| format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(length));
        let at_limit = line(REQUEST_LINE_MAX_BYTES - "GET / HTTP/1.1".len());
        assert!(matches!(
            counted(at_limit.as_bytes(), 100),
            Ok(Counted::Ended(_))
        ));
        let over = line(REQUEST_LINE_MAX_BYTES);
        assert_eq!(counted(over.as_bytes(), 100), Err(HeadRefusal::RequestLine));
        let field = |length: usize| format!("GET / HTTP/1.1\r\nx: {}\r\n\r\n", "a".repeat(length));
        let whole = field(HEAD_MAX_BYTES - field(0).len());
        assert_eq!(whole.len(), HEAD_MAX_BYTES);
        assert!(matches!(
            counted(whole.as_bytes(), 4096),
            Ok(Counted::Ended(_))
        ));
        let over = field(HEAD_MAX_BYTES - field(0).len() + 1);
        assert_eq!(counted(over.as_bytes(), 4096), Err(HeadRefusal::Bytes));
    }

    #[test]
    fn a_parameter_repeated_in_any_spelling_is_found_and_distinct_ones_are_not() {
        assert_eq!(
            repeated_parameter("period=2026-11&period=2026-12").as_deref(),
            Some("period")
        );
        assert_eq!(
            repeated_parameter("a=1&b=2&p%65riod=x&period=y").as_deref(),
            Some("period")
        );
        assert_eq!(repeated_parameter("org_id=a&container_id=b&limit=5"), None);
        assert_eq!(repeated_parameter(""), None);
    }

    #[test]
    fn the_refusal_declares_the_length_of_its_body() {
        let refusal = String::from_utf8(refusal_bytes()).unwrap();
        let (head, body) = refusal.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "too_many_connections");
    }
}
