//! Provider report import: FOCUS CSV, all-or-nothing, errors naming line and
//! column, the same bytes again are the same report.

use reqwest::Method;
use serde_json::Value;

use crate::helpers::TestApp;

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
