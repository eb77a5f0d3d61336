//! Reconciliation: a report derived from the ledger with one planted discrepancy
//! of every kind is reconciled to exactly those, with exact deltas and costs to the cent.

use chrono::{Duration, DurationRound, Utc};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::helpers::{answered, projected_to_head, run_tally_exit, TestApp};

#[tokio::test]
async fn a_report_with_planted_discrepancies_reconciles_to_exactly_them() {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let lifecycle = |org: &str, container: &str, start: i64, stop: i64| {
        vec![
            json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org, "container_id": container, "occurred_at": at(start)}),
            json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org, "container_id": container, "occurred_at": at(stop)}),
        ]
    };
    let mut events = Vec::new();
    events.extend(lifecycle("acme", "c_match", 5, 3)); // 2 h
    events.extend(lifecycle("acme", "c_over", 5, 4)); // 1 h
    events.extend(lifecycle("beta", "c_under", 5, 3)); // 2 h
    events.extend(lifecycle("beta", "c_wrong", 5, 4)); // 1 h, billed to acme
    events.extend(lifecycle("acme", "c_silent", 5, 4)); // 1 h, not in the report
    let (status, response) = app.post_events(&json!({"events": events})).await;
    assert_eq!(status, 200, "{response}");
    projected_to_head(&app.pool, "the events are projected").await;

    let (start, end) = (at(6), at(2));
    let line = |container: &str, org: &str, quantity: &str, unit: &str, cost: &str| {
        format!(
            r#"{start},{end},{container},{quantity},{unit},{cost},USD,"{{""org_id"":""{org}""}}",Usage"#
        )
    };
    let csv = [
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory".to_owned(),
        line("c_match", "acme", "7200", "Seconds", "1.44"),
        line("c_over", "acme", "3660", "Seconds", "0.61"),
        line("c_under", "beta", "1.5", "Hours", "3.00"),
        line("c_ghost", "acme", "100", "Seconds", "0.01"),
        line("c_wrong", "acme", "3600", "Seconds", "0.50"),
    ]
    .join("\n");
    let report = answered(201, app.post_report(csv).await);

    let (status, result) = app
        .post_reconciliation(&json!({"report_id": report["report_id"]}))
        .await;
    assert_eq!(status, 201, "{result}");
    assert_eq!(
        result["counts"],
        json!({"matched": 1, "provider_over": 1, "provider_under": 1, "missing_in_ledger": 1,
               "org_mismatch": 1, "missing_in_provider": 1, "not_runtime": 0})
    );
    assert_eq!(
        result["totals"]["currencies"]["USD"]["by_status"]["provider_under"]["cost_delta"],
        "-1.00"
    );

    let id = result["reconciliation_id"].as_str().unwrap();
    let (_, csv) = app.get_lines(id).await;
    let mut lines = csv.lines();
    assert_eq!(
        lines.next().unwrap(),
        "org_id,container_id,charge_period_start,charge_period_end,ledger_runtime_ms,provider_runtime_ms,delta_ms,status,provider_cost,expected_cost,cost_delta,currency,provider_org_id,report_line,charge_category"
    );
    let rows: Vec<Vec<&str>> = lines.map(|line| line.split(',').collect()).collect();
    assert_eq!(rows.len(), 6);
    let row = |container: &str| rows.iter().find(|row| row[1] == container).unwrap().clone();
    assert_eq!(
        row("c_match")[4..],
        [
            "7200000", "7200000", "0", "matched", "1.44", "1.44", "0.00", "USD", "acme", "2",
            "Usage"
        ]
    );
    assert_eq!(
        row("c_over")[4..],
        [
            "3600000",
            "3660000",
            "60000",
            "provider_over",
            "0.61",
            "0.60",
            "0.01",
            "USD",
            "acme",
            "3",
            "Usage"
        ]
    );
    assert_eq!(
        row("c_under")[4..],
        [
            "7200000",
            "5400000",
            "-1800000",
            "provider_under",
            "3.00",
            "4.00",
            "-1.00",
            "USD",
            "beta",
            "4",
            "Usage"
        ]
    );
    assert_eq!(row("c_ghost")[7], "missing_in_ledger");
    assert_eq!(
        (
            row("c_wrong")[0],
            row("c_wrong")[4],
            row("c_wrong")[7],
            row("c_wrong")[12]
        ),
        ("acme", "0", "org_mismatch", "acme"),
        "beta's container, billed to acme: listed under the provider's tag, compared with none"
    );
    assert_eq!(row("c_silent")[0..1], ["acme"]);
    assert_eq!(
        row("c_silent")[4..8],
        ["3600000", "0", "-3600000", "missing_in_provider"]
    );

    let (_, json_lines) = app
        .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
        .await;
    assert_eq!(json_lines["lines"].as_array().unwrap().len(), 6);
    let wrong = json_lines["lines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|line| line["status"] == "org_mismatch")
        .unwrap();
    assert_eq!(
        (&wrong["org_id"], &wrong["provider_org_id"]),
        (&json!("acme"), &json!("acme"))
    );

    for (body, status, code) in [
        (
            json!({"report_id": Uuid::new_v4()}),
            404,
            "report_not_found",
        ),
        (json!({"report_id": "nope"}), 422, "invalid_report_id"),
        (
            json!({"report_id": report["report_id"], "tolerance_ratio": 2}),
            422,
            "invalid_tolerance",
        ),
        (
            json!({"report_id": report["report_id"], "tolerance_ratio": "1.0000000000000000000000000000000001"}),
            422,
            "invalid_tolerance",
        ),
        (
            json!({"report_id": report["report_id"], "tolerance_ms": -1}),
            422,
            "invalid_tolerance",
        ),
    ] {
        let (actual, error) = app.post_reconciliation(&body).await;
        assert_eq!(
            (actual, error["error"]["code"].as_str()),
            (status, Some(code)),
            "{body}"
        );
    }
    // Under 1, but in more significant digits than a decimal holds: the message says so.
    let body = json!({"report_id": report["report_id"],
                      "tolerance_ratio": "0.99999999999999999999999999999"});
    let (status, error) = app.post_reconciliation(&body).await;
    assert_eq!(status, 422, "{error}");
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("28 significant digits"),
        "{error}"
    );
    // Read as the decimals they are: a number a double prints with an exponent, and zeros
    // past what a decimal holds (kept to the scale it holds).
    for (ratio, stored) in [
        (json!(1e-7), "0.0000001"),
        (
            json!("1.0000000000000000000000000000000000"),
            "1.0000000000000000000000000000",
        ),
    ] {
        let body = json!({"report_id": report["report_id"], "tolerance_ratio": ratio});
        let (status, run) = app.post_reconciliation(&body).await;
        assert_eq!(status, 201, "{body}: {run}");
        let id = run["reconciliation_id"].as_str().unwrap();
        let (_, summary) = app.get_json(&format!("/v1/reconciliations/{id}")).await;
        assert_eq!(summary["tolerance_ratio"], stored, "{body}");
    }
    app.stop().await;
}

/// A container-day of the generated month: (org, container, day start, session start and
/// length in seconds).
struct Session {
    org: String,
    container: String,
    day: chrono::DateTime<Utc>,
    start: chrono::DateTime<Utc>,
    seconds: i64,
}

#[tokio::test]
async fn a_generated_month_for_twenty_orgs_reconciles_to_exactly_the_planted_discrepancies() {
    use rust_decimal::Decimal;

    let app = TestApp::spawn().await;
    let today = Utc::now().duration_trunc(Duration::days(1)).unwrap();
    let mut sessions = Vec::new();
    for org in 0..20 {
        for k in 0..3 {
            for n in 0..10i64 {
                let day = today - Duration::days(1 + (n * 3 + org + k) % 27);
                if sessions
                    .iter()
                    .any(|s: &Session| s.container == format!("c{org:02}_{k}") && s.day == day)
                {
                    continue;
                }
                let seconds = 3_600 + (org * 7 + k * 13 + n) * 60 + org;
                sessions.push(Session {
                    org: format!("org_{org:02}"),
                    container: format!("c{org:02}_{k}"),
                    day,
                    start: day + Duration::hours(6 + k),
                    seconds,
                });
            }
        }
    }
    // The ledger: each container's sessions in time order (created, then resumed).
    let mut events = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let mut ordered: Vec<&Session> = sessions.iter().collect();
    ordered.sort_by_key(|s| (s.container.clone(), s.start));
    for s in &ordered {
        let first = seen.insert(s.container.clone());
        let stamp = tally::event::canonical::timestamp;
        events.push(json!({"id": Uuid::new_v4(), "type": if first { "container.created" } else { "container.resumed" },
            "org_id": s.org, "container_id": s.container, "occurred_at": stamp(s.start)}));
        events.push(json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": s.org,
            "container_id": s.container, "occurred_at": stamp(s.start + Duration::seconds(s.seconds))}));
    }
    for chunk in events.chunks(1000) {
        let (status, response) = app.post_events(&json!({"events": chunk})).await;
        assert_eq!(status, 200, "{response}");
    }
    projected_to_head(&app.pool, "the events are projected").await;

    // The report: one line per container-day at 0.36 an hour, derived from the ledger, with
    // planted discrepancies; most other lines a second off (within tolerance).
    let price = Decimal::new(36, 2);
    let cost = |seconds: i64| (Decimal::from(seconds) * price / Decimal::from(3600)).round_dp(2);
    let stamp = tally::event::canonical::timestamp;
    let mut lines = vec!["ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory".to_owned()];
    let mut planted = std::collections::HashMap::new();
    for (index, s) in sessions.iter().enumerate() {
        if s.container == "c09_0" {
            continue; // left out: missing_in_provider
        }
        let (seconds, tag, plant) = match (s.container.as_str(), index % 10) {
            ("c03_0", 2) => (s.seconds + 90, s.org.clone(), true),
            ("c05_1", 4) => (s.seconds - 600, s.org.clone(), true),
            ("c07_2", 1) => (s.seconds, "org_08".to_owned(), true),
            _ => (s.seconds + (index as i64 % 2), s.org.clone(), false),
        };
        if plant {
            planted.insert(
                s.container.clone(),
                (seconds - s.seconds, cost(seconds), s.seconds),
            );
        }
        lines.push(format!(
            r#"{},{},{},{seconds},Seconds,{},USD,"{{""org_id"":""{tag}""}}",Usage"#,
            stamp(s.day),
            stamp(s.day + Duration::days(1)),
            s.container,
            cost(seconds)
        ));
    }
    lines.push(format!(
        r#"{},{},ghost,100,Seconds,0.01,USD,"{{""org_id"":""org_00""}}",Usage"#,
        stamp(today - Duration::days(2)),
        stamp(today - Duration::days(1))
    ));
    let report_lines = lines.len() - 1;
    let report = answered(201, app.post_report(lines.join("\n")).await);
    let result = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    assert_eq!(
        result["counts"],
        json!({"matched": report_lines - 4, "provider_over": 1, "provider_under": 1,
               "missing_in_ledger": 1, "org_mismatch": 1, "missing_in_provider": 1, "not_runtime": 0})
    );
    let id = result["reconciliation_id"].as_str().unwrap();
    let (_, csv) = app.get_lines(id).await;
    let rows: Vec<Vec<String>> = csv
        .lines()
        .skip(1)
        .map(|line| line.split(',').map(str::to_owned).collect())
        .collect();
    for (status, container) in [("provider_over", "c03_0"), ("provider_under", "c05_1")] {
        let row = rows.iter().find(|row| row[7] == status).unwrap();
        let (delta_s, provider_cost, ledger_s) = &planted[container];
        assert_eq!(row[1], container);
        assert_eq!(row[6], (delta_s * 1000).to_string(), "exact delta_ms");
        assert_eq!(row[4], (ledger_s * 1000).to_string());
        assert_eq!(
            row[8],
            provider_cost.to_string(),
            "provider cost to the cent"
        );
        // Expected: ledger hours at the line's own unit price.
        let expected = (*provider_cost * Decimal::from(*ledger_s)
            / Decimal::from(ledger_s + delta_s))
        .round_dp_with_strategy(2, rust_decimal::RoundingStrategy::MidpointAwayFromZero);
        assert_eq!(
            row[9],
            format!("{expected:.2}"),
            "expected cost to the cent"
        );
    }
    let silent = rows
        .iter()
        .find(|row| row[7] == "missing_in_provider")
        .unwrap();
    let silent_total: i64 = sessions
        .iter()
        .filter(|s| s.container == "c09_0")
        .map(|s| s.seconds * 1000)
        .sum();
    assert_eq!(
        (silent[1].as_str(), silent[4].clone()),
        ("c09_0", silent_total.to_string())
    );
    assert_eq!(
        rows.iter().find(|row| row[7] == "org_mismatch").unwrap()[1],
        "c07_2"
    );
    app.stop().await;
}

#[tokio::test]
async fn report_numbers_past_the_bound_are_refused_and_a_stored_report_whose_figures_overflow_is_422(
) {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let events = json!({"events": [
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme", "container_id": "c_big", "occurred_at": at(5)},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme", "container_id": "c_big", "occurred_at": at(3)},
    ]});
    answered(200, app.post_events(&events).await);
    projected_to_head(&app.pool, "the events are projected").await;
    let csv = |cost: &str| {
        format!(
            "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory\n\
             {},{},c_big,0.001,Seconds,{cost},USD,\"{{\"\"org_id\"\":\"\"acme\"\"}}\",Usage",
            at(6),
            at(2)
        )
    };
    let refused = answered(422, app.post_report(csv("1000000000000000.01")).await);
    assert_eq!(
        refused["error"]["details"][0]["code"], "invalid_number",
        "{refused}"
    );
    let reports: i64 = sqlx::query_scalar("SELECT count(*) FROM provider_report")
        .fetch_one(&app.pool)
        .await
        .unwrap();
    assert_eq!(reports, 0, "a refused report stores nothing");

    // At the bound: 2 h in the ledger against 1 ms billed is 7 200 000 times the cost.
    let report = answered(201, app.post_report(csv("1000000000000000")).await);
    let result = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    assert_eq!(
        result["totals"]["currencies"]["USD"]["total"]["expected_cost_exact"],
        "7200000000000000000000.00",
        "{result}"
    );

    // As a version that did not bound the numbers could have stored it: the expected
    // cost of 2 h at the largest decimal a millisecond is past what a decimal holds.
    sqlx::raw_sql(
        "ALTER TABLE provider_report_line DISABLE TRIGGER provider_report_line_immutable;
         UPDATE provider_report_line SET billed_cost = 79228162514264337593543950335;
         ALTER TABLE provider_report_line ENABLE TRIGGER provider_report_line_immutable;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
    let count = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT (SELECT count(*) FROM reconciliation) + (SELECT count(*) FROM reconciliation_line)",
        )
        .fetch_one(&app.pool)
        .await
        .unwrap()
    };
    let before = count().await;
    let (status, refused) = app
        .post_reconciliation(&json!({"report_id": report["report_id"]}))
        .await;
    assert_eq!(status, 422, "{refused}");
    assert_eq!(
        refused["error"]["code"], "amounts_out_of_range",
        "{refused}"
    );
    assert!(
        refused["error"]["message"]
            .as_str()
            .unwrap()
            .contains("line 2"),
        "{refused}"
    );
    assert_eq!(
        count().await,
        before,
        "a refused reconciliation stores nothing"
    );
    // The service still answers, and answers the same again.
    let (again, _) = app
        .post_reconciliation(&json!({"report_id": report["report_id"]}))
        .await;
    assert_eq!(again, 422);
    // Each refused run is a failed job that says why, as a GET of it reads.
    let failed: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT id, error_code FROM reconciliation_job WHERE status = 'failed' ORDER BY id",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    assert_eq!(failed.len(), 2, "{failed:?}");
    let (_, job) = app
        .get_json(&format!("/v1/reconciliations/{}", failed[0].0))
        .await;
    assert_eq!(
        (job["status"].as_str(), job["error"]["code"].as_str()),
        (Some("failed"), Some("amounts_out_of_range")),
        "{job}"
    );
    assert!(
        job["error"]["message"].as_str().unwrap().contains("line 2"),
        "{job}"
    );
}

#[tokio::test]
async fn an_untagged_line_for_a_container_id_two_orgs_share_is_charged_to_neither_and_neither_sees_it(
) {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    // beta, say a tenant who took acme's container id, sorts first; acme ran it first.
    let mut events = Vec::new();
    for (org, start, stop) in [("acme", 5, 2), ("a_beta", 4, 3)] {
        for (kind, hours_ago) in [("container.created", start), ("container.stopped", stop)] {
            events.push(json!({"id": Uuid::new_v4(), "type": kind, "org_id": org,
                               "container_id": "shared", "occurred_at": at(hours_ago)}));
        }
    }
    answered(200, app.post_events(&json!({"events": events})).await);
    projected_to_head(&app.pool, "the events are projected").await;
    let csv = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory\n\
         {},{},shared,3,Hours,0.30,USD,Usage",
        at(6),
        at(1)
    );
    let (result, lines) = reconcile_csv(&app, csv).await;
    let line = &lines["lines"][0];
    assert_eq!(
        (
            &line["status"],
            &line["org_id"],
            &line["ledger_runtime_ms"],
            &line["expected_cost"],
            &line["cost_delta"]
        ),
        (
            &json!("org_mismatch"),
            &Value::Null,
            &json!(0),
            &json!("0.00"),
            &json!("0.30")
        ),
        "{lines}"
    );
    // Neither org's runtime was matched by the line: both are missing from the report.
    let missing: Vec<(&Value, &Value)> = lines["lines"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|line| line["status"] == "missing_in_provider")
        .map(|line| (&line["org_id"], &line["ledger_runtime_ms"]))
        .collect();
    assert_eq!(
        missing,
        [
            (&json!("a_beta"), &json!(3_600_000)),
            (&json!("acme"), &json!(3 * 3_600_000))
        ],
        "{result}"
    );
    // A token bound to either org reads its own container's line, not the provider's.
    for org in ["acme", "a_beta"] {
        let token = answered(
            201,
            app.post_token(&json!({"scopes": ["finance"], "org_id": org}))
                .await,
        );
        let id = result["reconciliation_id"].as_str().unwrap();
        let seen = answered(
            200,
            app.with_token(token["token"].as_str().unwrap())
                .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
                .await,
        );
        let statuses: Vec<&Value> = seen["lines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|line| &line["status"])
            .collect();
        assert_eq!(statuses, [&json!("missing_in_provider")], "{org}: {seen}");
    }
}

#[tokio::test]
async fn a_tenant_that_takes_a_container_id_billed_to_another_neither_reads_nor_takes_its_line() {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    // The provider bills `victim` for vx, which the ledger does not know yet.
    let csv = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory\n\
         {},{},vx,1,Hours,42.17,USD,\"{{\"\"org_id\"\":\"\"victim\"\"}}\",Usage",
        at(3),
        at(2)
    );
    let report = answered(201, app.post_report(csv).await);
    let (before, _) = reconcile_report(&app, &report["report_id"]).await;
    assert_eq!(before["counts"]["missing_in_ledger"], 1, "{before}");
    // Another tenant, with a token bound to its org, runs a container of that id.
    let token = |scopes: Value, org: &str| {
        let app = &app;
        let org = org.to_owned();
        async move {
            let made = answered(
                201,
                app.post_token(&json!({"scopes": scopes, "org_id": org}))
                    .await,
            );
            app.with_token(made["token"].as_str().unwrap())
        }
    };
    let squatter = token(json!(["events:write", "finance"]), "squat").await;
    for (kind, hours_ago) in [("container.created", 4), ("container.stopped", 1)] {
        let event = json!({"id": Uuid::new_v4(), "type": kind, "org_id": "squat",
                           "container_id": "vx", "occurred_at": at(hours_ago)});
        answered(200, squatter.post_events(&event).await);
    }
    projected_to_head(&app.pool, "the squatter's container is projected").await;
    let (after, lines) = reconcile_report(&app, &report["report_id"]).await;
    let line = &lines["lines"][0];
    assert_eq!(
        (
            &line["status"],
            &line["org_id"],
            &line["provider_org_id"],
            &line["ledger_runtime_ms"]
        ),
        (
            &json!("org_mismatch"),
            &json!("victim"),
            &json!("victim"),
            &json!(0)
        ),
        "{lines}"
    );
    // The line names the squatter's container, so it is not missing from the report.
    assert_eq!(after["counts"]["missing_in_provider"], 0, "{after}");
    let id = after["reconciliation_id"].as_str().unwrap();
    let path = format!("/v1/reconciliations/{id}/lines.csv?format=json");
    let seen = answered(200, squatter.get_json(&path).await);
    assert_eq!(
        seen["lines"],
        json!([]),
        "the squatter reads nothing: {seen}"
    );
    let victim = token(json!(["finance"]), "victim").await;
    let seen = answered(200, victim.get_json(&path).await);
    assert_eq!(seen["lines"].as_array().unwrap().len(), 1, "{seen}");
    assert_eq!(seen["lines"][0]["ledger_runtime_ms"], 0, "{seen}");
}

#[tokio::test]
async fn the_command_line_reconciles_a_stored_report_as_the_api_does_and_refuses_what_it_refuses() {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    for (kind, hours_ago) in [("container.created", 3), ("container.stopped", 1)] {
        let event = json!({"id": Uuid::new_v4(), "type": kind, "org_id": "acme",
                           "container_id": "c1", "occurred_at": at(hours_ago)});
        answered(200, app.post_events(&event).await);
    }
    let csv = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory\n\
         {},{},c1,2,Hours,2.00,USD,Usage\n\
         {},{},c1,1,Hours,1.00,USD,Usage",
        at(4),
        at(0),
        at(3),
        at(2)
    );
    let report = answered(201, app.post_report(csv).await);
    let id = report["report_id"].as_str().unwrap();
    let (over_http, _) = reconcile_report(&app, &report["report_id"]).await;
    let url = app.db.url.clone();
    let (code, stdout, stderr) = run_tally_exit(&url, &["reports", "reconcile", id]);
    assert_eq!(code, Some(0), "{stderr}");
    let by_cli: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (&by_cli["counts"], &by_cli["totals"]),
        (&over_http["counts"], &over_http["totals"]),
        "{by_cli}"
    );
    assert_eq!(by_cli["counts"]["provider_over"], 1, "{by_cli}");
    assert_ne!(by_cli["reconciliation_id"], over_http["reconciliation_id"]);
    let (_, lines) = app
        .get_json(&format!(
            "/v1/reconciliations/{}/lines.csv?format=json",
            by_cli["reconciliation_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(lines["lines"].as_array().unwrap().len(), 2, "{lines}");
    let wide = run_tally_exit(
        &url,
        &[
            "reports",
            "reconcile",
            id,
            "--tolerance-ms",
            "86400000",
            "--tolerance-ratio",
            "1",
        ],
    );
    assert_eq!(wide.0, Some(0), "{}", wide.2);

    let stored = || async {
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM reconciliation")
            .fetch_one(&app.pool)
            .await
            .unwrap();
        count
    };
    let before = stored().await;
    let unknown = Uuid::new_v4().to_string();
    for (args, says) in [
        (vec!["reports", "reconcile", unknown.as_str()], "no report"),
        (
            vec!["reports", "reconcile", "not-a-uuid"],
            "not a report id",
        ),
        (
            vec!["reports", "reconcile", id, "--tolerance-ms", "86400001"],
            "tolerance_ms",
        ),
        (
            vec![
                "reports",
                "reconcile",
                id,
                "--tolerance-ratio",
                "1.0000000001",
            ],
            "tolerance_ratio",
        ),
        (
            vec!["reports", "reconcile", id, "--tolerance-ratio", "1e-3"],
            "not a decimal",
        ),
    ] {
        let (code, _, stderr) = run_tally_exit(&url, &args);
        assert_eq!(code, Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
    assert_eq!(stored().await, before, "a refused run stores nothing");
    app.stop().await;
}

/// Imports a report of one line per `(resource_id, category)`, each an hour ending an hour
/// ago, billed 1.00 USD, and reconciles it: the reconciliation's id.
async fn reconciled(app: &TestApp, lines: &[(&str, &str)]) -> String {
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at =
        |minutes_ago: i64| tally::event::canonical::timestamp(now - Duration::minutes(minutes_ago));
    let mut csv = String::from(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory",
    );
    for (resource_id, category) in lines {
        csv.push_str(&format!(
            "\n{},{},{resource_id},1,Hours,1.00,USD,{category}",
            at(120),
            at(60)
        ));
    }
    let report = answered(201, app.post_report(csv).await);
    let result = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    result["reconciliation_id"].as_str().unwrap().to_owned()
}

#[tokio::test]
async fn provider_text_a_spreadsheet_would_run_is_written_after_an_apostrophe_in_lines_csv_only() {
    let app = TestApp::spawn().await;
    let formula = "=HYPERLINK(\"http://evil.example\",\"x\")";
    let quoted = format!("\"{}\"", formula.replace('"', "\"\""));
    let id = &reconciled(&app, &[(&quoted, "@SUM(A1)")]).await;
    let (status, lines) = app.get_lines(id).await;
    assert_eq!(status, 200, "{lines}");
    let line = lines.lines().nth(1).unwrap();
    assert!(
        line.starts_with(",\"'=HYPERLINK(\"\"http://evil.example\"\",\"\"x\"\")\","),
        "{line}"
    );
    assert!(line.ends_with(",'@SUM(A1)"), "{line}");
    // The JSON keeps the provider's text as given.
    let (_, json) = app
        .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
        .await;
    assert_eq!(json["lines"][0]["container_id"], formula, "{json}");
    assert_eq!(json["lines"][0]["charge_category"], "@SUM(A1)", "{json}");
}

#[tokio::test]
async fn the_lines_of_a_resource_id_as_long_as_a_report_may_give_are_found_by_it() {
    let app = TestApp::spawn().await;
    // The longest ResourceId a report may hold: an Azure-like path. (In a query, an id of
    // that many characters outside ASCII would exceed the request target's 8 192 bytes.)
    let longest = format!(
        "/subscriptions/{}",
        "a".repeat(tally::billing::report::RESOURCE_ID_MAX - 15)
    );
    let id = reconciled(&app, &[(&longest, "Usage"), ("other", "Usage")]).await;
    let page = answered(
        200,
        app.get_json(&format!(
            "/v1/reconciliations/{id}/lines?container_id={longest}"
        ))
        .await,
    );
    assert_eq!(page["total"], 1, "{page}");
    assert_eq!(page["lines"][0]["container_id"], longest.as_str());
    let (status, refused) = app
        .get_json(&format!(
            "/v1/reconciliations/{id}/lines?container_id={longest}a"
        ))
        .await;
    assert_eq!(
        (status, refused["error"]["code"].as_str()),
        (422, Some("invalid_container_id")),
        "{refused}"
    );
}

/// Imports `csv` as a report and reconciles it: the answer, and its lines as JSON.
async fn reconcile_csv(app: &TestApp, csv: String) -> (Value, Value) {
    let report = answered(201, app.post_report(csv).await);
    reconcile_report(app, &report["report_id"]).await
}

/// Reconciles the stored report `report_id`: the answer, and its lines as JSON.
async fn reconcile_report(app: &TestApp, report_id: &Value) -> (Value, Value) {
    let result = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report_id}))
            .await,
    );
    let id = result["reconciliation_id"].as_str().unwrap();
    let (_, lines) = app
        .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
        .await;
    (result, lines)
}

#[tokio::test]
async fn a_line_for_one_orgs_container_does_not_hide_another_orgs_container_of_the_same_id() {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let mut events = Vec::new();
    for (org, start, stop) in [("acme", 5, 2), ("beta", 5, 3)] {
        for (kind, hours_ago) in [("container.created", start), ("container.stopped", stop)] {
            events.push(json!({"id": Uuid::new_v4(), "type": kind, "org_id": org,
                               "container_id": "shared", "occurred_at": at(hours_ago)}));
        }
    }
    answered(200, app.post_events(&json!({"events": events})).await);
    projected_to_head(&app.pool, "the events are projected").await;
    let csv = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory\n\
         {},{},shared,2,Hours,0.20,USD,\"{{\"\"org_id\"\":\"\"beta\"\"}}\",Usage",
        at(6),
        at(1)
    );
    let (result, lines) = reconcile_csv(&app, csv).await;
    assert_eq!(result["counts"]["matched"], 1, "{result}");
    assert_eq!(
        result["counts"]["missing_in_provider"], 1,
        "acme's 3 h under the same id are not in the report: {result}"
    );
    let missing = &lines["lines"][1];
    assert_eq!(
        (
            &missing["org_id"],
            &missing["status"],
            &missing["ledger_runtime_ms"]
        ),
        (
            &json!("acme"),
            &json!("missing_in_provider"),
            &json!(3 * 3_600_000)
        ),
        "{lines}"
    );
}

#[tokio::test]
async fn runtime_billed_on_two_overlapping_lines_is_matched_once_and_over_on_the_second() {
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let events: Vec<_> = [("container.created", 5), ("container.stopped", 3)]
        .into_iter()
        .map(|(kind, hours_ago)| {
            json!({"id": Uuid::new_v4(), "type": kind, "org_id": "acme", "container_id": "c1",
                   "occurred_at": at(hours_ago)})
        })
        .collect();
    answered(200, app.post_events(&json!({"events": events})).await);
    projected_to_head(&app.pool, "the events are projected").await;
    let line =
        |start: i64, end: i64| format!("{},{},c1,2,Hours,0.20,USD,Usage", at(start), at(end));
    let csv = [
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory".to_owned(),
        line(6, 1),
        line(6, 2),
        line(6, 1),
    ]
    .join("\n");
    let (result, lines) = reconcile_csv(&app, csv).await;
    assert_eq!(result["counts"]["matched"], 1, "{result}");
    assert_eq!(result["counts"]["provider_over"], 2, "{result}");
    assert_eq!(
        result["totals"]["currencies"]["USD"]["total"]["cost_delta"], "0.40",
        "the runtime was billed three times: {result}"
    );
    let ledger: Vec<&Value> = (0..3)
        .map(|n| &lines["lines"][n]["ledger_runtime_ms"])
        .collect();
    assert_eq!(ledger, [&json!(7_200_000), &json!(0), &json!(0)], "{lines}");
}

#[tokio::test]
async fn a_container_running_since_before_the_reports_window_and_not_in_it_is_missing_in_provider()
{
    let app = TestApp::spawn().await;
    let now = Utc::now().duration_trunc(Duration::minutes(1)).unwrap();
    let at = |hours_ago: i64| tally::event::canonical::timestamp(now - Duration::hours(hours_ago));
    let event = |kind: &str, container: &str, hours_ago: i64| {
        json!({"id": Uuid::new_v4(), "type": kind, "org_id": "acme", "container_id": container,
               "occurred_at": at(hours_ago)})
    };
    // Created 34 days ago and running since, with no event in the report's window.
    let events = [
        event("container.created", "c_forgotten", 34 * 24),
        event("container.created", "c_known", 3),
        event("container.stopped", "c_known", 1),
    ];
    answered(200, app.post_events(&json!({"events": events})).await);
    projected_to_head(&app.pool, "the events are projected").await;
    let csv = format!(
        "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,ChargeCategory\n\
         {},{},c_known,2,Hours,0.20,USD,Usage",
        at(4),
        at(0)
    );
    let (result, lines) = reconcile_csv(&app, csv).await;
    assert_eq!(result["counts"]["matched"], 1, "{result}");
    assert_eq!(result["counts"]["missing_in_provider"], 1, "{result}");
    let missing = &lines["lines"][1];
    assert_eq!(
        (&missing["container_id"], &missing["ledger_runtime_ms"]),
        (&json!("c_forgotten"), &json!(4 * 3_600_000)),
        "{lines}"
    );
}
