//! FOCUS exports as providers write them — the FinOps Foundation's FOCUS 1.0 sample and
//! FOCUS 1.2 files in the shapes of AWS, Azure and Google Cloud exports — imported whole and
//! reconciled: every line gets a status, and the totals are the file's `BilledCost`, exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use rust_decimal::{Decimal, RoundingStrategy};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::helpers::{answered, projected_to_head, TestApp};

fn data(name: &str) -> String {
    let path = format!("{}/tests/data/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|error| panic!("{path}: {error}"))
}

/// One line of a FOCUS file as the file has it: the cells by column name, and its file
/// line (the header is line 1).
struct FileLine {
    line: i64,
    cells: BTreeMap<String, String>,
}

impl FileLine {
    fn cell(&self, column: &str) -> &str {
        self.cells.get(column).map_or("", String::as_str)
    }
}

fn file_lines(text: &str) -> Vec<FileLine> {
    let mut reader = csv::Reader::from_reader(text.as_bytes());
    let header = reader.headers().unwrap().clone();
    reader
        .records()
        .map(|record| {
            let record = record.unwrap();
            FileLine {
                line: record.position().unwrap().line() as i64,
                cells: header
                    .iter()
                    .map(str::to_owned)
                    .zip(record.iter().map(str::to_owned))
                    .collect(),
            }
        })
        .collect()
}

fn decimal(value: &Value) -> Decimal {
    Decimal::from_str(value.as_str().unwrap_or_else(|| panic!("{value}"))).unwrap()
}

/// What a reconciled FOCUS file gave: the import's answer, the reconciliation's, each report
/// line's JSON line by file line, and the `missing_in_provider` lines.
struct Reconciled {
    report: Value,
    result: Value,
    lines: BTreeMap<i64, Value>,
    missing: Vec<Value>,
}

impl Reconciled {
    fn statuses(&self) -> Vec<(i64, &str)> {
        self.lines
            .iter()
            .map(|(line, value)| (*line, value["status"].as_str().unwrap()))
            .collect()
    }
}

/// Imports `text` and reconciles it, checking what every FOCUS file must give: each line of
/// the file once in `lines.csv`, with a status and its `BilledCost` as the file wrote it;
/// per currency, the exact total, the sum of the exact totals of the statuses and the sum
/// of the `provider_cost` column all equal the file's `BilledCost` sum (in `Decimal`), and
/// the rounded total is that sum rounded once to the minor unit.
async fn reconcile_exactly(app: &TestApp, text: String) -> Reconciled {
    let file = file_lines(&text);
    let mut sums: BTreeMap<String, Decimal> = BTreeMap::new();
    for line in &file {
        *sums
            .entry(line.cell("BillingCurrency").to_owned())
            .or_default() += Decimal::from_str(line.cell("BilledCost")).unwrap();
    }
    let report = answered(201, app.post_report(text).await);
    assert_eq!(report["lines"], file.len(), "every line is kept: {report}");
    let result = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    let totals = &result["totals"];
    assert_eq!(
        totals["rounding"], "half_away_from_zero_to_minor_unit_once_per_total",
        "{totals}"
    );
    assert_eq!(
        totals["currencies"].as_object().unwrap().len(),
        sums.len(),
        "{totals}"
    );
    for (currency, sum) in &sums {
        let figures = &totals["currencies"][currency];
        assert_eq!(
            decimal(&figures["total"]["provider_cost_exact"]),
            *sum,
            "{currency}: {figures}"
        );
        let by_status: Decimal = figures["by_status"]
            .as_object()
            .unwrap()
            .values()
            .map(|tally| decimal(&tally["provider_cost_exact"]))
            .sum();
        assert_eq!(by_status, *sum, "{currency}: {figures}");
        let digits = figures["minor_unit_digits"].as_u64().unwrap() as u32;
        let rounded = sum.round_dp_with_strategy(digits, RoundingStrategy::MidpointAwayFromZero);
        assert_eq!(
            decimal(&figures["total"]["provider_cost"]),
            rounded,
            "{currency}: {figures}"
        );
    }

    let id = result["reconciliation_id"].as_str().unwrap();
    let (status, csv_text) = app.get_lines(id).await;
    assert_eq!(status, 200, "{csv_text}");
    let rows = file_lines(&csv_text);
    let by_line: BTreeMap<i64, &FileLine> = file.iter().map(|line| (line.line, line)).collect();
    let mut column_sums: BTreeMap<String, Decimal> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for row in &rows {
        assert!(!row.cell("status").is_empty(), "{csv_text}");
        *column_sums
            .entry(row.cell("currency").to_owned())
            .or_default() += Decimal::from_str(row.cell("provider_cost")).unwrap();
        if row.cell("status") == "missing_in_provider" {
            assert_eq!(row.cell("report_line"), "");
            continue;
        }
        let line: i64 = row.cell("report_line").parse().unwrap();
        assert!(seen.insert(line), "line {line} twice");
        assert_eq!(
            row.cell("provider_cost"),
            by_line[&line].cell("BilledCost"),
            "line {line}: the cost as the report wrote it"
        );
    }
    assert_eq!(seen, by_line.keys().copied().collect(), "every line once");
    assert_eq!(column_sums, sums, "the provider_cost column adds up");

    let (status, json_lines) = app
        .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
        .await;
    assert_eq!(status, 200, "{json_lines}");
    let mut lines = BTreeMap::new();
    let mut missing = Vec::new();
    for line in json_lines["lines"].as_array().unwrap() {
        match line["report_line"].as_i64() {
            Some(number) => {
                lines.insert(number, line.clone());
            }
            None => missing.push(line.clone()),
        }
    }
    Reconciled {
        report,
        result,
        lines,
        missing,
    }
}

/// `container` of `org` ran from `from` to `to` (RFC 3339).
async fn ran(app: &TestApp, org: &str, container: &str, from: &str, to: &str) {
    let events = json!({"events": [
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": org,
         "container_id": container, "occurred_at": from},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org,
         "container_id": container, "occurred_at": to},
    ]});
    let (status, body) = app.post_events(&events).await;
    assert_eq!(status, 200, "{body}");
}

fn instant(text: &str) -> chrono::DateTime<chrono::Utc> {
    text.parse().unwrap()
}

/// The counts of a reconciliation with `given` statuses and zeros elsewhere.
fn counts(given: &[(&str, usize)]) -> Value {
    let mut counts = json!({"matched": 0, "provider_over": 0, "provider_under": 0,
        "missing_in_ledger": 0, "org_mismatch": 0, "missing_in_provider": 0, "not_runtime": 0});
    for (status, count) in given {
        counts[*status] = json!(count);
    }
    counts
}

#[tokio::test]
async fn the_focus_1_0_sample_is_imported_whole_and_its_reconciliation_adds_up_to_its_billed_cost()
{
    let app = TestApp::spawn().await;
    let text = data("focus-1.0-sample.csv");
    // Told apart without tally's code: usage in hours or seconds of a non-negative quantity
    // on a resource id of tally's id alphabet is runtime, and with an empty ledger, missing
    // from it; everything else (other units, ARNs, Azure paths, Oracle ids, credits) is not.
    let file = file_lines(&text);
    let runtime = |line: &FileLine| {
        let id = line.cell("ResourceId");
        line.cell("ChargeCategory").eq_ignore_ascii_case("usage")
            && ["hours", "seconds"].contains(&line.cell("ConsumedUnit").to_lowercase().as_str())
            && Decimal::from_str(line.cell("ConsumedQuantity")).is_ok_and(|q| q >= Decimal::ZERO)
            && (1..=64).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    let expected_runtime = file.iter().filter(|line| runtime(line)).count();
    assert!(expected_runtime > 0 && expected_runtime < file.len());

    let reconciled = reconcile_exactly(&app, text).await;
    assert_eq!(reconciled.lines.len(), 1_000);
    assert!(reconciled.missing.is_empty());
    assert_eq!(
        reconciled.result["counts"],
        counts(&[
            ("missing_in_ledger", expected_runtime),
            ("not_runtime", file.len() - expected_runtime)
        ])
    );
    for line in &file {
        let status = reconciled.lines[&line.line]["status"].as_str().unwrap();
        let expected = if runtime(line) {
            "missing_in_ledger"
        } else {
            "not_runtime"
        };
        assert_eq!(status, expected, "line {}", line.line);
    }
    let credit = file
        .iter()
        .find(|line| line.cell("ChargeCategory") == "Credit")
        .unwrap();
    let credit = &reconciled.lines[&credit.line];
    assert_eq!(
        (
            &credit["status"],
            &credit["provider_cost"],
            &credit["expected_cost"]
        ),
        (
            &json!("not_runtime"),
            &json!("-2.61370000000"),
            &Value::Null
        )
    );
    // The billing periods (September, and October for one Oracle line), not the span of
    // the charge periods (18 to 30 September).
    assert_eq!(
        (
            &reconciled.report["window_start"],
            &reconciled.report["window_end"]
        ),
        (
            &json!("2024-09-01T00:00:00.000Z"),
            &json!("2024-11-01T00:00:00.000Z")
        )
    );
    app.stop().await;
}

#[tokio::test]
async fn an_aws_focus_1_2_export_reconciles_its_container_lines_and_counts_tax_and_credit_exactly()
{
    let app = TestApp::spawn_at(instant("2026-11-25T00:00:00Z")).await;
    ran(
        &app,
        "acme",
        "ctr_aws_run",
        "2026-11-10T10:00:00.000Z",
        "2026-11-10T12:00:00.000Z",
    )
    .await;
    // Inside the billing period, outside every line's charge period.
    ran(
        &app,
        "acme",
        "ctr_aws_silent",
        "2026-11-03T01:00:00.000Z",
        "2026-11-03T03:00:00.000Z",
    )
    .await;
    projected_to_head(&app.pool, "the containers are projected").await;

    let reconciled = reconcile_exactly(&app, data("focus-1.2-aws.csv")).await;
    assert_eq!(
        reconciled.statuses(),
        [
            (2, "matched"),
            (3, "missing_in_ledger"),
            (4, "not_runtime"), // GB-Month on an S3 bucket
            (5, "not_runtime"), // Hours on an EC2 instance ARN: not a container id
            (6, "not_runtime"), // Tax
            (7, "not_runtime"), // Credit
        ]
    );
    let matched = &reconciled.lines[&2];
    assert_eq!(
        (
            &matched["ledger_runtime_ms"],
            &matched["provider_runtime_ms"]
        ),
        (&json!(7_200_000), &json!(7_200_000))
    );
    assert_eq!(
        (&matched["expected_cost"], &matched["cost_delta"]),
        (&json!("0.0832000000"), &json!("0.0000000000"))
    );
    assert_eq!(
        reconciled.lines[&3]["provider_runtime_ms"], 5_400_000,
        "1.5 Hrs"
    );
    let tax = &reconciled.lines[&6];
    assert_eq!(
        (
            &tax["container_id"],
            &tax["charge_category"],
            &tax["ledger_runtime_ms"]
        ),
        (&Value::Null, &json!("Tax"), &Value::Null)
    );
    assert_eq!(reconciled.missing.len(), 1, "{:?}", reconciled.missing);
    let silent = &reconciled.missing[0];
    assert_eq!(
        (&silent["container_id"], &silent["ledger_runtime_ms"]),
        (&json!("ctr_aws_silent"), &json!(7_200_000))
    );
    assert_eq!(
        (&silent["charge_period_start"], &silent["charge_period_end"]),
        (
            &json!("2026-11-01T00:00:00.000Z"),
            &json!("2026-12-01T00:00:00.000Z")
        ),
        "the report's window is its billing period"
    );
    assert_eq!(
        reconciled.result["counts"],
        counts(&[
            ("matched", 1),
            ("missing_in_ledger", 1),
            ("missing_in_provider", 1),
            ("not_runtime", 4)
        ])
    );
    app.stop().await;
}

#[tokio::test]
async fn an_azure_focus_1_2_export_shows_both_orgs_of_a_mismatch_and_adds_up_in_euros() {
    let app = TestApp::spawn_at(instant("2026-11-25T00:00:00Z")).await;
    ran(
        &app,
        "acme",
        "ctr_az_tagged",
        "2026-11-12T08:00:00.000Z",
        "2026-11-12T10:00:00.000Z",
    )
    .await;
    ran(
        &app,
        "acme",
        "ctr_az_short",
        "2026-11-12T08:00:00.000Z",
        "2026-11-12T11:00:00.000Z",
    )
    .await;
    projected_to_head(&app.pool, "the containers are projected").await;

    let reconciled = reconcile_exactly(&app, data("focus-1.2-azure.csv")).await;
    assert_eq!(
        reconciled.statuses(),
        [
            (2, "org_mismatch"),
            (3, "provider_under"),
            (4, "not_runtime"), // GB/Month on a storage account path
            (5, "not_runtime"), // Purchase
            (6, "not_runtime"), // Adjustment
            (7, "not_runtime"), // Credit
        ]
    );
    let mismatch = &reconciled.lines[&2];
    assert_eq!(
        (
            &mismatch["org_id"],
            &mismatch["provider_org_id"],
            &mismatch["ledger_runtime_ms"]
        ),
        (&json!("beta"), &json!("beta"), &json!(0)),
        "acme's container billed to beta: listed under the provider's tag, compared with none"
    );
    let under = &reconciled.lines[&3];
    assert_eq!(
        (
            &under["ledger_runtime_ms"],
            &under["provider_runtime_ms"],
            &under["expected_cost"],
            &under["cost_delta"]
        ),
        (
            &json!(10_800_000),
            &json!(3_600_000),
            &json!("0.2760000000"),
            &json!("-0.1840000000")
        )
    );
    assert!(reconciled.missing.is_empty());
    let euros = &reconciled.result["totals"]["currencies"]["EUR"];
    assert_eq!(euros["total"]["lines"], 6, "{euros}");
    assert_eq!(
        euros["by_status"]["provider_under"]["cost_delta"], "-0.18",
        "{euros}"
    );
    app.stop().await;
}

#[tokio::test]
async fn a_gcp_focus_1_2_export_with_a_credit_on_a_container_never_makes_it_provider_under() {
    let app = TestApp::spawn_at(instant("2026-11-25T00:00:00Z")).await;
    ran(
        &app,
        "acme",
        "ctr_gcp_over",
        "2026-11-14T06:00:00.000Z",
        "2026-11-14T07:00:00.000Z",
    )
    .await;
    ran(
        &app,
        "acme",
        "ctr_gcp_hour",
        "2026-11-14T06:00:00.000Z",
        "2026-11-14T07:00:00.000Z",
    )
    .await;
    projected_to_head(&app.pool, "the containers are projected").await;

    let reconciled = reconcile_exactly(&app, data("focus-1.2-gcp.csv")).await;
    assert_eq!(
        reconciled.statuses(),
        [
            (2, "provider_over"),
            (3, "matched"),     // 1 hour
            (4, "not_runtime"), // a committed-use credit in seconds on ctr_gcp_over
            (5, "not_runtime"), // Tax
            (6, "not_runtime"), // gibibyte month on a bucket
        ]
    );
    let over = &reconciled.lines[&2];
    assert_eq!(
        (
            &over["delta_ms"],
            &over["expected_cost"],
            &over["cost_delta"]
        ),
        (&json!(400_000), &json!("11.111110"), &json!("1.234568"))
    );
    let yen = &reconciled.result["totals"]["currencies"]["JPY"];
    assert_eq!(yen["minor_unit_digits"], 0, "{yen}");
    assert_eq!(
        reconciled.report["window_start"], "2026-11-01T00:00:00.000Z",
        "BigQuery's `… UTC` instants"
    );
    app.stop().await;
}
