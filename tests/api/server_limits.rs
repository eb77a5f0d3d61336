//! The HTTP server's connection limits, from raw TCP clients: trickled heads, stalled
//! bodies, unread responses and idle connections are closed by their timeouts, the cap makes room
//! or refuses, slow clients do not stop others, and what the router cannot answer in JSON
//! (a repeated query parameter, an overlong target) is answered in JSON at the front door.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::helpers::*;

/// Generous: each wait below ends in well under a second when the limit works.
const DISCONNECT_WAIT_SECONDS: u64 = 10;

async fn connect(app: &TestApp) -> TcpStream {
    let stream = TcpStream::connect(app.address).await.unwrap();
    stream.set_nodelay(true).unwrap();
    stream
}

/// Reads and discards until the server closes the connection; false if it is still open
/// after `seconds`.
async fn closed_within(stream: &mut TcpStream, seconds: u64) -> bool {
    let mut buffer = [0u8; 4096];
    let read_to_end = async {
        loop {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(seconds), read_to_end)
        .await
        .is_ok()
}

/// One HTTP/1.1 response read off the socket: status and body (by Content-Length); None
/// if none arrived within `seconds` or the connection closed first.
async fn read_response(stream: &mut TcpStream, seconds: u64) -> Option<(u16, String)> {
    let read = async {
        let mut received = Vec::new();
        let mut buffer = [0u8; 4096];
        loop {
            if let Some(end) = find(&received, b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&received[..end]).to_lowercase();
                let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
                let length: usize = head
                    .lines()
                    .find_map(|line| line.strip_prefix("content-length:"))
                    .map_or(Some(0), |value| value.trim().parse().ok())?;
                if received.len() >= end + 4 + length {
                    let body = &received[end + 4..end + 4 + length];
                    return Some((status, String::from_utf8_lossy(body).into_owned()));
                }
            }
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => return None,
                Ok(read) => received.extend_from_slice(&buffer[..read]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(seconds), read)
        .await
        .ok()
        .flatten()
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack
        .windows(needle.len())
        .position(|window| window == needle)
}

fn error_code(body: &str) -> String {
    let body: Value = serde_json::from_str(body)
        .unwrap_or_else(|error| panic!("the body is not JSON ({error}): {body:?}"));
    body["error"]["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The head of an event post that declares `length` bytes of body.
fn event_post_head(length: usize) -> String {
    format!(
        "POST /v1/events HTTP/1.1\r\nhost: tally\r\nauthorization: Bearer {TOKEN}\r\n\
         content-type: application/json\r\ncontent-length: {length}\r\n\r\n"
    )
}

const HEALTH_REQUEST: &[u8] = b"GET /healthz HTTP/1.1\r\nhost: tally\r\n\r\n";

async fn health_answers(app: &TestApp) -> bool {
    matches!(
        app.client.get(app.url("/healthz")).send().await,
        Ok(response) if response.status() == 200
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_trickles_its_head_is_disconnected_within_the_header_timeout() {
    let app = TestApp::spawn_with(|config| config.http_header_read_timeout_ms = 500).await;
    let mut stream = connect(&app).await;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nx-padding: ")
        .await
        .unwrap();
    // One byte every 100 ms for up to 12 s: never a whole head.
    let mut disconnected = false;
    for _ in 0..120 {
        if stream.write_all(b"a").await.is_err() {
            disconnected = true;
            break;
        }
        let read =
            tokio::time::timeout(Duration::from_millis(100), stream.read(&mut [0u8; 64])).await;
        if matches!(read, Ok(Ok(0) | Err(_))) {
            disconnected = true;
            break;
        }
    }
    assert!(
        disconnected,
        "a head trickled for 12 s was still being read"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_that_sends_nothing_is_closed_within_the_header_timeout() {
    let app = TestApp::spawn_with(|config| config.http_header_read_timeout_ms = 500).await;
    let mut stream = connect(&app).await;
    assert!(
        closed_within(&mut stream, DISCONNECT_WAIT_SECONDS).await,
        "a connection that sent nothing was still open after {DISCONNECT_WAIT_SECONDS} s"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stalls_after_one_byte_is_answered_408_and_its_request_slot_freed() {
    let app = TestApp::spawn_with(|config| {
        config.http_body_read_timeout_ms = 500;
        config.http_concurrency_max = 2;
    })
    .await;
    // Two stalled bodies hold both request slots.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut stream = connect(&app).await;
        stream
            .write_all(event_post_head(1000).as_bytes())
            .await
            .unwrap();
        stream.write_all(b"{").await.unwrap();
        stalled.push(stream);
    }
    for stream in &mut stalled {
        let (status, body) = read_response(stream, DISCONNECT_WAIT_SECONDS)
            .await
            .expect("a stalled body is answered within the wait");
        assert_eq!(status, 408, "{body}");
        assert_eq!(error_code(&body), "body_timeout");
        assert!(
            closed_within(stream, DISCONNECT_WAIT_SECONDS).await,
            "the connection of a stalled body was kept open"
        );
    }
    // Both slots are free again.
    let (first, second) = tokio::join!(health_answers(&app), health_answers(&app));
    assert!(first && second, "a request slot was still held");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_sent_steadily_for_longer_than_the_body_timeout_is_read_whole() {
    let app = TestApp::spawn_with(|config| config.http_body_read_timeout_ms = 500).await;
    let body = json!({"events": valid_events(20)}).to_string().into_bytes();
    let mut stream = connect(&app).await;
    stream
        .write_all(event_post_head(body.len()).as_bytes())
        .await
        .unwrap();
    // Ten pieces 250 ms apart: 2.5 s in all, five times the body timeout.
    for piece in body.chunks(body.len().div_ceil(10)) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        stream.write_all(piece).await.unwrap();
    }
    let (status, answer) = read_response(&mut stream, 30)
        .await
        .expect("the upload is answered");
    assert_eq!(status, 200, "{answer}");
    assert_eq!(app.ledger_count().await, 20);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_the_idle_timeout() {
    let app = TestApp::spawn_with(|config| {
        config.http_idle_timeout_ms = 500;
        // Only the idle timeout can close it within the wait.
        config.http_header_read_timeout_ms = 60_000;
    })
    .await;
    let mut stream = connect(&app).await;
    stream.write_all(HEALTH_REQUEST).await.unwrap();
    let (status, _) = read_response(&mut stream, DISCONNECT_WAIT_SECONDS)
        .await
        .expect("/healthz answers");
    assert_eq!(status, 200);
    assert!(
        closed_within(&mut stream, DISCONNECT_WAIT_SECONDS).await,
        "an idle keep-alive connection was still open after {DISCONNECT_WAIT_SECONDS} s"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keep_alive_connection_idle_for_longer_than_the_header_timeout_is_kept_for_its_next_request(
) {
    let app = TestApp::spawn_with(|config| config.http_header_read_timeout_ms = 300).await;
    let mut stream = connect(&app).await;
    for _ in 0..2 {
        stream.write_all(HEALTH_REQUEST).await.unwrap();
        let (status, _) = read_response(&mut stream, DISCONNECT_WAIT_SECONDS)
            .await
            .expect("/healthz answers on the kept connection");
        assert_eq!(status, 200);
        // Five header timeouts, well within the idle timeout.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_the_oldest_idle_connection_makes_room_for_a_new_client() {
    const CAP: usize = 20;
    let app = TestApp::spawn_with(|config| config.http_connections_max = CAP).await;
    let mut idle = Vec::new();
    for _ in 0..CAP {
        let mut stream = connect(&app).await;
        stream.write_all(HEALTH_REQUEST).await.unwrap();
        let (status, _) = read_response(&mut stream, DISCONNECT_WAIT_SECONDS)
            .await
            .expect("/healthz answers");
        assert_eq!(status, 200);
        idle.push(stream);
    }
    // The cap is reached with idle keep-alive connections; one more client is served.
    let mut newcomer = connect(&app).await;
    newcomer.write_all(HEALTH_REQUEST).await.unwrap();
    let (status, _) = read_response(&mut newcomer, DISCONNECT_WAIT_SECONDS)
        .await
        .expect("a client past the cap is answered");
    assert_eq!(status, 200);
    assert!(
        closed_within(&mut idle[0], DISCONNECT_WAIT_SECONDS).await,
        "the oldest idle connection was kept open past the cap"
    );
    for stream in &mut idle[1..] {
        assert!(
            !closed_within(stream, 0).await,
            "a connection other than the oldest idle one was closed"
        );
    }
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_connection_cap_with_every_connection_busy_a_new_one_gets_503_then_healthz_answers(
) {
    const CAP: usize = 4;
    let app = TestApp::spawn_with(|config| {
        config.http_connections_max = CAP;
        config.http_body_read_timeout_ms = 1_000;
    })
    .await;
    // Every connection has a request in progress, waiting for its body.
    let mut stalled = Vec::new();
    for _ in 0..CAP {
        let mut stream = connect(&app).await;
        stream
            .write_all(event_post_head(1000).as_bytes())
            .await
            .unwrap();
        stream.write_all(b"{").await.unwrap();
        stalled.push(stream);
    }
    // Let the server read each head, so that each is a request in progress.
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The refusal is written on accept, before anything is read.
    let mut refused = connect(&app).await;
    let (status, body) = read_response(&mut refused, DISCONNECT_WAIT_SECONDS)
        .await
        .expect("a connection past the cap is answered at once");
    assert_eq!(status, 503, "{body}");
    assert_eq!(error_code(&body), "too_many_connections");
    assert!(closed_within(&mut refused, DISCONNECT_WAIT_SECONDS).await);
    // Once the stalled bodies time out, their connections close and there is room again.
    for stream in &mut stalled {
        assert!(closed_within(stream, DISCONNECT_WAIT_SECONDS).await);
    }
    eventually(DISCONNECT_WAIT_SECONDS, "/healthz answers", || {
        health_answers(&app)
    })
    .await;
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_slow_clients_do_not_stop_a_normal_client_from_getting_answers() {
    const SLOW: usize = 300;
    let app = TestApp::spawn_with(|config| {
        config.http_header_read_timeout_ms = 1_000;
        config.http_body_read_timeout_ms = 1_000;
        // Fewer request slots than stalled bodies, as in the attack (1 030 against 1 024).
        config.http_concurrency_max = 128;
    })
    .await;
    let mut slow = Vec::new();
    for n in 0..SLOW {
        let mut stream = connect(&app).await;
        if n % 3 == 0 {
            // A head that never ends.
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nx-padding: a")
                .await
                .unwrap();
        } else {
            // A body that never comes.
            stream
                .write_all(event_post_head(1000).as_bytes())
                .await
                .unwrap();
            stream.write_all(b"{").await.unwrap();
        }
        slow.push(stream);
    }
    eventually(
        DISCONNECT_WAIT_SECONDS,
        "a normal client gets an answer",
        || health_answers(&app),
    )
    .await;
    let closed = futures::future::join_all(
        slow.iter_mut()
            .map(|stream| closed_within(stream, DISCONNECT_WAIT_SECONDS)),
    )
    .await;
    let open = closed.iter().filter(|closed| !**closed).count();
    assert_eq!(open, 0, "{open} slow connections were kept open");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_none_of_its_responses_is_disconnected_within_the_write_timeout() {
    let app = TestApp::spawn_with(|config| config.http_write_timeout_ms = 500).await;
    let document = app
        .client
        .get(app.url("/openapi.json"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    // More responses than the sockets' buffers on loopback hold (a few MiB each way).
    let requests = (32 * 1024 * 1024 / document.len()).clamp(1, 20_000);
    let mut stream = connect(&app).await;
    let request: &[u8] = b"GET /openapi.json HTTP/1.1\r\nhost: tally\r\n\r\n";
    let pipelined = request.repeat(requests);
    // Written while the server writes its answers, which this client does not read yet.
    let written = tokio::time::timeout(Duration::from_secs(3), stream.write_all(&pipelined)).await;
    drop(written);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        closed_within(&mut stream, DISCONNECT_WAIT_SECONDS).await,
        "a connection whose client read nothing for 3 s was still open"
    );
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_query_parameter_is_a_json_422_naming_it() {
    let app = TestApp::spawn().await;
    let reply = app
        .get("/v1/orgs/org_a/usage?period=2026-11&period=2026-12")
        .await;
    assert_eq!(reply.status, 422);
    let body = reply.text;
    assert_eq!(error_code(&body), "duplicate_query_parameter");
    assert!(body.contains("period"), "{body}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_that_must_come_once_given_twice_is_a_400_naming_it_and_nothing_is_stored() {
    let app = TestApp::spawn().await;
    let body = valid_event("org_twice", "ctr_1", 0).to_string();
    for (name, first, second) in [
        (
            "authorization",
            format!("Bearer {TOKEN}"),
            "Bearer another".to_owned(),
        ),
        (
            "content-type",
            "application/json".to_owned(),
            "application/cloudevents+json".to_owned(),
        ),
        ("content-encoding", "identity".to_owned(), "gzip".to_owned()),
        ("tally-min-position", "0".to_owned(), "1".to_owned()),
    ] {
        let mut request = app
            .without_token()
            .request(reqwest::Method::POST, "/v1/events")
            .body(body.clone());
        if name != "content-type" {
            request = request.header("content-type", "application/json");
        }
        if name != "authorization" {
            request = request.header("authorization", format!("Bearer {TOKEN}"));
        }
        let reply = request
            .header(name, first)
            .header(name, second)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 400, "{name}");
        let text = reply.text().await.unwrap();
        assert_eq!(error_code(&text), "duplicate_header", "{name}: {text}");
        assert!(text.contains(name), "{text}");
    }
    assert_eq!(app.ledger_count().await, 0);
    let (status, body) = app.post_raw("application/json", body.into_bytes()).await;
    assert_eq!(status, 200, "once each, it is stored: {body}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_target_longer_than_8_kib_is_a_json_414_however_long_it_is() {
    let app = TestApp::spawn().await;
    // 10 000 reaches the router; 100 000 is past what hyper's parser takes (65 534), where
    // hyper would answer a bare 414 of its own. Raw TCP: no client library sends either.
    for length in [10_000, 100_000] {
        let mut stream = connect(&app).await;
        let request = format!(
            "GET /v1/containers/{} HTTP/1.1\r\nhost: tally\r\nauthorization: Bearer {TOKEN}\r\n\r\n",
            "a".repeat(length)
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let (status, body) = read_response(&mut stream, 10)
            .await
            .unwrap_or_else(|| panic!("no answer to a path of {length} characters"));
        assert_eq!(status, 414, "a path of {length} characters: {body}");
        assert_eq!(
            error_code(&body),
            "uri_too_long",
            "a path of {length} characters"
        );
    }
    let healthy = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(healthy.status(), 200);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_of_more_than_100_fields_or_64_kib_is_a_json_431_and_one_at_the_limits_is_served() {
    let app = TestApp::spawn().await;
    let fields =
        |count: usize| -> String { (0..count).map(|n| format!("x-f{n}: v\r\n")).collect() };
    let long_field = |bytes: usize| format!("x-long: {}\r\n", "a".repeat(bytes));
    // `host` is one of the fields. 500 000 bytes is past hyper's own buffer (about 408 KiB)
    // and 101 fields past its parser's 100, where hyper would answer a 431 with no body.
    let cases = [
        (fields(99), 200),
        (fields(100), 431),
        (long_field(60 * 1024), 200),
        (long_field(64 * 1024), 431),
        (long_field(500_000), 431),
    ];
    for (extra, expected) in cases {
        let mut stream = connect(&app).await;
        let request = format!("GET /healthz HTTP/1.1\r\nhost: tally\r\n{extra}\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let what = format!("a head of {} bytes", request.len());
        let (status, body) = read_response(&mut stream, 10)
            .await
            .unwrap_or_else(|| panic!("no answer to {what}"));
        assert_eq!(status, expected, "{what}: {body}");
        if expected == 431 {
            assert_eq!(error_code(&body), "headers_too_large", "{what}");
        }
    }
    assert!(health_answers(&app).await);
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_that_is_not_utf8_once_decoded_is_a_json_400_on_every_route() {
    let app = TestApp::spawn().await;
    for path in [
        "/v1/containers/%FF",
        "/v1/orgs/%C3/usage",
        "/v1/reconciliations/%FF/lines.csv",
        "/console/%FF",
    ] {
        let reply = app
            .client
            .get(app.url(path))
            .header("authorization", format!("Bearer {TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 400, "{path}");
        let text = reply.text().await.unwrap();
        assert_eq!(error_code(&text), "invalid_path", "{path}: {text}");
    }
    let reply = app
        .client
        .delete(app.url("/v1/admission/reservations/%FF"))
        .header("authorization", format!("Bearer {TOKEN}"))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 400);
    assert_eq!(error_code(&reply.text().await.unwrap()), "invalid_path");
    let (status, body) = app.get_json("/v1/containers/%C3%A9").await;
    assert_eq!(status, 422, "text, but not a container id: {body}");
    app.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_lets_a_request_in_progress_finish_and_closes_idle_connections() {
    let mut app = TestApp::spawn().await;
    let mut idle = connect(&app).await;
    idle.write_all(HEALTH_REQUEST).await.unwrap();
    assert_eq!(
        read_response(&mut idle, DISCONNECT_WAIT_SECONDS)
            .await
            .map(|(status, _)| status),
        Some(200)
    );
    let body = json!({"events": valid_events(5)}).to_string().into_bytes();
    let mut in_progress = connect(&app).await;
    in_progress
        .write_all(event_post_head(body.len()).as_bytes())
        .await
        .unwrap();
    let (first, rest) = body.split_at(body.len() / 2);
    in_progress.write_all(first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let service = app.service.take().expect("running");
    let stopping = tokio::spawn(service.stop());
    assert!(
        closed_within(&mut idle, DISCONNECT_WAIT_SECONDS).await,
        "an idle connection was kept open while stopping"
    );
    in_progress.write_all(rest).await.unwrap();
    let (status, answer) = read_response(&mut in_progress, DISCONNECT_WAIT_SECONDS)
        .await
        .expect("the request in progress is answered");
    assert_eq!(status, 200, "{answer}");
    stopping.await.unwrap();
    assert_eq!(app.ledger_count().await, 5);
}

/// Per-day usage reads each read their org's commands from the ledger; one token's burst
/// of them once held every connection of the pool. With the ledger locked, so that a day
/// read holds its connection until the test lets go, a burst of them gets one turn (a
/// quarter of a pool of four) and 503 `overloaded` for the rest after the wait, while the
/// pool still serves the readiness check; the read that had the turn then answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_per_day_usage_reads_takes_a_quarter_of_the_pool_and_the_rest_are_503() {
    let app = TestApp::spawn_with(|config| {
        config.db_pool_max = 4;
        config.read_wait_ms = 300;
    })
    .await;
    let (status, body) = app.post_events(&valid_event("org_day", "ctr_1", 0)).await;
    assert_eq!(status, 200, "{body}");
    projected_to_head(&app.pool, "the event is projected").await;
    let period = tally::runtime::Period::containing(app.now()).to_string();
    let path = format!("/v1/orgs/org_day/usage?period={period}&window=day");

    let mut lock = app.pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE ledger IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap();
    let reads: Vec<_> = (0..8)
        .map(|_| {
            let api = app.with_min_position(None);
            let path = path.clone();
            tokio::spawn(async move { api.get(&path).await.status_json() })
        })
        .collect();
    eventually(10, "a day read waits for the ledger", || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        waiting >= 1
    })
    .await;
    // Longer than a turn is waited for: every read without one has been refused by now.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let (status, ready) = app.without_token().get_json("/readyz").await;
    assert_eq!(status, 200, "the pool still serves: {ready}");
    lock.rollback().await.unwrap();

    let mut answered = Vec::new();
    for read in reads {
        let (status, body) = read.await.unwrap();
        answered.push((status, body["error"]["code"].as_str().map(str::to_owned)));
    }
    answered.sort();
    let mut expected = vec![(503, Some("overloaded".to_owned())); 7];
    expected.insert(0, (200, None));
    assert_eq!(answered, expected);
    app.stop().await;
}
