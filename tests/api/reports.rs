//! Provider report import: FOCUS CSV, all-or-nothing, errors naming line and
//! column, the same bytes again are the same report.

use reqwest::Method;
use serde_json::Value;

use crate::helpers::{Api, TestApp};

const HEADER: &str = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ProviderName,ChargeCategory";

/// A report of usage lines: each line gets its `ChargeCategory`.
fn report(lines: &[&str]) -> String {
    std::iter::once(HEADER.to_owned())
        .chain(lines.iter().map(|line| format!("{line},Usage")))
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

async fn stored(app: &TestApp) -> (i64, i64) {
    let reports: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_report")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    let lines: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_report_line")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    (reports, lines)
}

#[tokio::test]
async fn a_report_is_stored_once_by_its_bytes_with_exact_decimals() {
    let app = TestApp::spawn().await;
    // More lines than one insert batch, so the streaming path is taken in full.
    let lines: Vec<String> = (0..12_000)
        .map(|n| {
            format!(
                r#"2026-11-01T{:02}:00:00Z,2026-11-01T{:02}:30:00Z,c{n},1800,Seconds,0.012345,USD,"{{""org_id"":""org{}""}}",acme-cloud"#,
                n % 23,
                n % 23,
                n % 50
            )
        })
        .collect();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let body = report(&refs);
    let (status, first) = app.post_report(body.clone()).await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["lines"], 12_000);
    assert_eq!(first["window_start"], "2026-11-01T00:00:00.000Z");
    assert_eq!(first["window_end"], "2026-11-01T22:30:00.000Z");
    let expected_sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(body.as_bytes()))
    };
    assert_eq!(first["sha256"], expected_sha);
    let (status, again) = app.post_report(body).await;
    assert_eq!(status, 200, "the same bytes: the same report");
    assert_eq!(again["report_id"], first["report_id"]);
    assert_eq!(stored(&app).await, (1, 12_000));
    let cost: String =
        sqlx::query_scalar("SELECT billed_cost::TEXT FROM provider_report_line WHERE line = 2")
            .fetch_one(&app.pool)
            .await
            .unwrap();
    assert_eq!(cost, "0.012345", "stored as an exact decimal");
    let updated = sqlx::query("UPDATE provider_report_line SET billed_cost = 0")
        .execute(&app.pool)
        .await;
    assert!(updated.is_err(), "stored reports are immutable");

    // The CLI imports a file the same way.
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(
        file.path(),
        report(&["2026-11-02T00:00:00Z,2026-11-02T01:00:00Z,c1,1,Hours,2.5,EUR,,"]),
    )
    .unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["reports", "import"])
        .arg(file.path())
        .env("DATABASE_URL", &app.db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let printed: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(
        (printed["lines"].clone(), printed["new"].clone()),
        (1.into(), true.into())
    );
    app.stop().await;
}

#[tokio::test]
async fn broken_reports_are_refused_naming_line_and_column_and_store_nothing() {
    let app = TestApp::spawn().await;
    let good = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,";
    let cases: Vec<(String, u64, Option<&str>, &str)> = vec![
        (
            "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,BilledCost,BillingCurrency\n".into(),
            1,
            Some("ChargeCategory"),
            "missing_column",
        ),
        (report(&[good, "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,ten,Seconds,0.5,USD,,"]), 3, Some("ConsumedQuantity"), "invalid_number"),
        (report(&[good, "2026-11-01T02:00:00Z,2026-11-01T01:00:00Z,c1,1,Seconds,0.5,USD,,"]), 3, Some("ChargePeriodEnd"), "end_before_start"),
        (report(&["2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,1,Minutes,NULL,USD,,"]), 2, Some("BilledCost"), "missing_value"),
        (
            "ResourceId,ChargePeriodStart,ChargePeriodEnd,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,BilledCost\n".into(),
            1,
            Some("BilledCost"),
            "duplicate_column",
        ),
        ("%PDF-1.7 binary garbage\u{1}\u{2}".into(), 1, Some("ChargePeriodStart"), "missing_column"),
        (String::new(), 1, None, "empty_report"),
        (report(&[]), 2, None, "empty_report"),
    ];
    for (body, line, column, code) in cases {
        let (status, error) = app.post_report(body.clone()).await;
        assert_eq!(status, 422, "{body:?}: {error}");
        assert_eq!(error["error"]["code"], code, "{body:?}");
        assert_eq!(error["error"]["more_errors"], 0, "{body:?}");
        assert_eq!(error["error"]["details"][0]["line"], line, "{body:?}");
        assert_eq!(
            error["error"]["details"][0]["column"].as_str(),
            column,
            "{body:?}"
        );
    }
    let response = app
        .request(Method::POST, "/v1/provider-reports")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 415);
    assert_eq!(stored(&app).await, (0, 0), "nothing stored");
    app.stop().await;
}

#[tokio::test]
async fn a_report_past_the_size_limit_is_413_and_stores_nothing() {
    let app = TestApp::spawn_with(|config| config.report_max_bytes = 10_000).await;
    let lines: Vec<String> = (0..500)
        .map(|n| format!("2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c{n},3600,Seconds,0.5,USD,,"))
        .collect();
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let (status, error) = app.post_report(report(&refs)).await;
    assert_eq!(status, 413, "{error}");
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

fn gzipped(text: &[u8]) -> Vec<u8> {
    use std::io::Write as _;

    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(text).unwrap();
    encoder.finish().unwrap()
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// POST a report body with these headers: status and JSON answer.
async fn post_with(app: &TestApp, headers: &[(&str, &str)], body: Vec<u8>) -> (u16, Value) {
    let mut request = app.request(Method::POST, "/v1/provider-reports");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    Api::reply(request.body(body)).await.status_json()
}

/// `count` good lines, each for its own container.
fn good_lines(count: usize) -> Vec<String> {
    (0..count)
        .map(|n| format!("2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c{n},3600,Seconds,0.5,USD,,"))
        .collect()
}

/// Runs `tally reports import FILE` against the app's database: exit status, stdout, stderr.
fn cli_import(app: &TestApp, file: &std::path::Path) -> (bool, String, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_tally"))
        .args(["reports", "import"])
        .arg(file)
        .env("DATABASE_URL", &app.db.url)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// 6 000 good lines (more than one insert batch, so lines reach the transaction before the
/// first bad one), then 150 bad ones, one in two a bad number and one in two short a field.
fn report_with_150_bad_lines() -> String {
    let mut lines = good_lines(6_000);
    for n in 0..150 {
        lines.push(if n % 2 == 0 {
            format!("2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,b{n},many,Seconds,0.5,USD,,")
        } else {
            format!("2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,b{n},3600,Seconds,0.5,USD,")
        });
    }
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    report(&refs)
}

#[tokio::test]
async fn a_report_with_150_bad_lines_lists_the_first_100_counts_the_other_50_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let (status, error) = app.post_report(report_with_150_bad_lines()).await;
    assert_eq!(status, 422, "{error}");
    let error = &error["error"];
    let details = error["details"].as_array().unwrap();
    assert_eq!(details.len(), 100);
    assert_eq!(error["more_errors"], 50);
    // The header is line 1 and the good lines 2 to 6 001: the bad ones start at 6 002.
    let listed: Vec<(u64, &str)> = details
        .iter()
        .map(|detail| {
            (
                detail["line"].as_u64().unwrap(),
                detail["code"].as_str().unwrap(),
            )
        })
        .collect();
    let expected: Vec<(u64, &str)> = (0..100)
        .map(|n| {
            let code = if n % 2 == 0 {
                "invalid_number"
            } else {
                "wrong_field_count"
            };
            (6_002 + n, code)
        })
        .collect();
    assert_eq!(listed, expected);
    assert_eq!(details[0]["column"], "ConsumedQuantity");
    assert_eq!(details[1]["column"], Value::Null);
    assert_eq!(
        details[1]["message"],
        "expected 10 fields, as the header has, found 9"
    );
    // The top level still describes the first bad line, as it did before the list.
    assert_eq!(error["code"], "invalid_number");
    let message = error["message"].as_str().unwrap();
    assert!(
        message.starts_with("line 6002, column ConsumedQuantity: "),
        "{message}"
    );
    assert!(message.contains("149 more bad lines"), "{message}");
    assert_eq!(stored(&app).await, (0, 0), "nothing stored");
    app.stop().await;
}

#[tokio::test]
async fn a_refused_report_with_one_bad_line_has_no_more_errors() {
    let app = TestApp::spawn().await;
    let mut lines = good_lines(3);
    lines.insert(
        1,
        "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c9,ten,Seconds,0.5,USD,,".into(),
    );
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let (status, error) = app.post_report(report(&refs)).await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["code"], "invalid_number");
    assert_eq!(error["error"]["details"].as_array().unwrap().len(), 1);
    assert_eq!(error["error"]["details"][0]["line"], 3);
    assert_eq!(error["error"]["more_errors"], 0);
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn rows_with_too_few_or_too_many_fields_are_refused_naming_the_line_and_both_counts() {
    let app = TestApp::spawn().await;
    let good = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,";
    // Before, a short row imported with its missing cells read as empty.
    let short = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c2,3600,Seconds,0.5,USD";
    let long = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c3,3600,Seconds,0.5,USD,,acme,extra";
    for (lines, found) in [([good, short], 8), ([good, long], 11)] {
        let (status, error) = app.post_report(report(&lines)).await;
        assert_eq!(status, 422, "{error}");
        assert_eq!(error["error"]["code"], "wrong_field_count");
        assert_eq!(error["error"]["details"][0]["line"], 3);
        assert_eq!(
            error["error"]["details"][0]["message"],
            format!("expected 10 fields, as the header has, found {found}")
        );
    }
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn a_gzipped_report_is_the_same_report_as_its_text_by_content_encoding_or_content_type() {
    let app = TestApp::spawn().await;
    let lines = good_lines(7_000);
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let text = report(&refs);
    let compressed = gzipped(text.as_bytes());
    let (status, first) = post_with(
        &app,
        &[("content-type", "text/csv"), ("content-encoding", "gzip")],
        compressed.clone(),
    )
    .await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["lines"], 7_000);
    assert_eq!(
        first["sha256"],
        sha256_hex(text.as_bytes()),
        "identified by its CSV text, not by the bytes sent"
    );
    for headers in [
        &[("content-type", "application/gzip")][..],
        &[("content-type", "application/x-gzip")][..],
        &[
            ("content-type", "text/csv; charset=utf-8"),
            ("content-encoding", "x-gzip"),
        ][..],
    ] {
        let (status, again) = post_with(&app, headers, compressed.clone()).await;
        assert_eq!(status, 200, "{headers:?}: {again}");
        assert_eq!(again["report_id"], first["report_id"], "{headers:?}");
    }
    let (status, plain) = app.post_report(text).await;
    assert_eq!(status, 200, "{plain}");
    assert_eq!(plain["report_id"], first["report_id"]);
    assert_eq!(stored(&app).await, (1, 7_000));
    app.stop().await;
}

#[tokio::test]
async fn a_gzipped_report_with_bad_lines_lists_them_as_the_plain_one_does() {
    let app = TestApp::spawn().await;
    let text = report_with_150_bad_lines();
    let (status, error) = post_with(
        &app,
        &[("content-type", "application/gzip")],
        gzipped(text.as_bytes()),
    )
    .await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["details"].as_array().unwrap().len(), 100);
    assert_eq!(error["error"]["more_errors"], 50);
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn a_gzip_bomb_past_the_inflated_limit_is_413_and_stores_nothing() {
    // Sent bytes up to 100 kB, inflated text up to 2 MB.
    let app = TestApp::spawn_with(|config| {
        config.report_max_bytes = 100_000;
        config.report_max_inflated_bytes = 2_000_000;
    })
    .await;
    let line = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,";
    // 20 000 lines, about 1.4 MB of text: inside the inflated limit, though the text is
    // past the limit on sent bytes.
    let within: Vec<&str> = vec![line; 20_000];
    let text = report(&within);
    assert!(text.len() > 1_000_000 && text.len() < 2_000_000);
    let (status, answer) = post_with(
        &app,
        &[("content-type", "application/gzip")],
        gzipped(text.as_bytes()),
    )
    .await;
    assert_eq!(status, 201, "{answer}");
    // 200 000 lines, about 14 MB of text, in a body of a few tens of kilobytes.
    let bomb = gzipped(report(&vec![line; 200_000]).as_bytes());
    assert!(bomb.len() < 100_000, "{} bytes", bomb.len());
    let (status, error) = post_with(&app, &[("content-type", "application/gzip")], bomb).await;
    assert_eq!(status, 413, "{error}");
    assert_eq!(error["error"]["code"], "report_inflated_too_large");
    assert_eq!(stored(&app).await, (1, 20_000), "nothing more stored");
    // A plain body is held to the limit on sent bytes.
    let (status, error) = app.post_report(text).await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (413, Some("report_too_large"))
    );
    app.stop().await;
}

#[tokio::test]
async fn an_endless_line_inflated_from_gzip_is_refused_at_the_record_limit() {
    let app = TestApp::spawn().await;
    // One line of 64 MiB of zeros after the header: about 64 kB gzipped.
    let mut text = HEADER.as_bytes().to_vec();
    text.push(b'\n');
    text.resize(text.len() + 64 * 1024 * 1024, b'0');
    let (status, error) = post_with(
        &app,
        &[("content-type", "text/csv"), ("content-encoding", "gzip")],
        gzipped(&text),
    )
    .await;
    assert_eq!(status, 422, "{error}");
    assert_eq!(error["error"]["code"], "record_too_long");
    assert_eq!(error["error"]["details"][0]["line"], 2);
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn a_corrupt_gzip_body_is_400_malformed_gzip_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let lines = good_lines(2_000);
    let refs: Vec<&str> = lines.iter().map(String::as_str).collect();
    let text = report(&refs);
    let compressed = gzipped(text.as_bytes());
    let mut flipped = compressed.clone();
    let middle = flipped.len() / 2;
    flipped[middle..].iter_mut().for_each(|byte| *byte ^= 0x5a);
    let truncated = compressed[..compressed.len() - 100].to_vec();
    for body in [flipped, truncated, text.into_bytes()] {
        let (status, error) = post_with(
            &app,
            &[("content-type", "text/csv"), ("content-encoding", "gzip")],
            body,
        )
        .await;
        assert_eq!(status, 400, "{error}");
        assert_eq!(error["error"]["code"], "malformed_gzip");
    }
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn an_unknown_content_encoding_is_415_and_stores_nothing() {
    let app = TestApp::spawn().await;
    let body = report(&["2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,"]);
    for headers in [
        &[("content-type", "text/csv"), ("content-encoding", "br")][..],
        &[
            ("content-type", "text/csv"),
            ("content-encoding", "gzip, br"),
        ][..],
        &[
            ("content-type", "text/csv"),
            ("content-encoding", "deflate"),
        ][..],
        // Gzip named twice would mean gzip inside gzip.
        &[
            ("content-type", "application/gzip"),
            ("content-encoding", "gzip"),
        ][..],
    ] {
        let (status, error) = post_with(&app, headers, body.clone().into_bytes()).await;
        assert_eq!(status, 415, "{headers:?}: {error}");
        assert_eq!(
            error["error"]["code"], "unsupported_content_encoding",
            "{headers:?}"
        );
    }
    let (status, error) = post_with(
        &app,
        &[("content-type", "application/zip")],
        body.into_bytes(),
    )
    .await;
    assert_eq!(
        (status, error["error"]["code"].as_str()),
        (415, Some("unsupported_media_type"))
    );
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn a_gz_file_imports_through_the_cli_as_the_same_report_as_its_text() {
    let app = TestApp::spawn().await;
    let text = report(&["2026-11-02T00:00:00Z,2026-11-02T01:00:00Z,c1,1,Hours,2.5,EUR,,"]);
    let folder = tempfile::tempdir().unwrap();
    let gz = folder.path().join("report.csv.gz");
    std::fs::write(&gz, gzipped(text.as_bytes())).unwrap();
    let (ok, stdout, stderr) = cli_import(&app, &gz);
    assert!(ok, "{stderr}");
    let first: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (first["lines"].clone(), first["new"].clone()),
        (1.into(), true.into())
    );
    assert_eq!(first["sha256"], sha256_hex(text.as_bytes()));
    // Gzip under another name is known by its first bytes; the text is the same report.
    let unnamed = folder.path().join("report.export");
    std::fs::write(&unnamed, gzipped(text.as_bytes())).unwrap();
    let plain = folder.path().join("report.csv");
    std::fs::write(&plain, &text).unwrap();
    for file in [&unnamed, &plain] {
        let (ok, stdout, stderr) = cli_import(&app, file);
        assert!(ok, "{file:?}: {stderr}");
        let again: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(again["report_id"], first["report_id"], "{file:?}");
        assert_eq!(again["new"], false, "{file:?}");
    }
    // A file named .gz that is not gzip is refused as such.
    let fake = folder.path().join("fake.csv.gz");
    std::fs::write(&fake, &text).unwrap();
    let (ok, _, stderr) = cli_import(&app, &fake);
    assert!(!ok);
    assert!(stderr.contains("not valid gzip"), "{stderr}");
    assert_eq!(stored(&app).await, (1, 1));
    app.stop().await;
}

#[tokio::test]
async fn the_cli_prints_every_bad_line_up_to_100_and_the_count_of_the_rest() {
    let app = TestApp::spawn().await;
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), report_with_150_bad_lines()).unwrap();
    let (ok, stdout, stderr) = cli_import(&app, file.path());
    assert!(!ok, "{stdout}");
    let listed: Vec<&str> = stderr
        .lines()
        .filter(|line| line.starts_with("  line "))
        .collect();
    assert_eq!(listed.len(), 100, "{stderr}");
    assert!(
        listed[0].starts_with("  line 6002, column ConsumedQuantity: "),
        "{}",
        listed[0]
    );
    assert!(
        listed[1].contains("found 9 [wrong_field_count]"),
        "{}",
        listed[1]
    );
    assert!(
        stderr
            .lines()
            .any(|line| line == "  and 50 more bad lines, not listed"),
        "{stderr}"
    );
    assert!(
        stderr.starts_with("import refused, nothing stored: line 6002"),
        "{stderr}"
    );
    assert_eq!(stored(&app).await, (0, 0));
    app.stop().await;
}

#[tokio::test]
async fn slow_imports_hold_at_most_a_quarter_of_the_pool_and_others_get_503_while_reads_go_on() {
    // A pool of 8: two imports or usage exports at once.
    let app = TestApp::spawn_with(|config| {
        config.db_pool_max = 8;
        config.read_wait_ms = 500;
    })
    .await;
    let mut slow = Vec::new();
    for _ in 0..2 {
        slow.push(
            crate::helpers::slow_request(
                &app,
                crate::helpers::TOKEN,
                "/v1/provider-reports",
                "text/csv",
                HEADER,
            )
            .await,
        );
    }
    // Each holds its import's transaction open while its body does not come.
    crate::helpers::eventually(10, "both imports hold a transaction", || async {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND state = 'idle in transaction'",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap();
        open == 2
    })
    .await;
    let line = "2026-11-01T00:00:00Z,2026-11-01T01:00:00Z,c1,3600,Seconds,0.5,USD,,acme";
    let (status, refused) = app.post_report(report(&[line])).await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (503, Some("overloaded")),
        "{refused}"
    );
    let (status, export) = app.get_usage_export("period=2026-11").await;
    let export: Value = serde_json::from_str(&export).unwrap();
    assert_eq!(
        (status, export["error"]["code"].as_str()),
        (503, Some("overloaded")),
        "{export}"
    );
    // Everything else is served from the rest of the pool.
    for _ in 0..20 {
        let (status, usage) = app.get_usage("acme", "period=2026-11").await;
        assert_eq!(status, 200, "{usage}");
    }
    for request in slow {
        request.abort();
    }
    crate::helpers::eventually(10, "an import is taken again", || async {
        app.post_report(report(&[line])).await.0 == 201
    })
    .await;
    app.stop().await;
}
