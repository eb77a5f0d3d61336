//! The finance lists a reader browses (decision 0027): periods with their close states,
//! provider reports and reconciliations newest first by keyset pages, a reconciliation's
//! stored summary, and a page of its lines filtered, sorted and counted, each checked
//! against the export it must agree with.

use std::cmp::Reverse;
use std::str::FromStr;

use chrono::{Duration, DurationRound};
use rust_decimal::Decimal;
use serde_json::{json, Value};
use sqlx::Connection;
use tally::runtime::Period;
use uuid::Uuid;

use crate::helpers::{answered, ok, projected_to_head, TestApp};

const REPORT_HEADER: &str = "ChargePeriodStart,ChargePeriodEnd,ResourceId,ConsumedQuantity,ConsumedUnit,BilledCost,BillingCurrency,Tags,ChargeCategory";

/// The state and period of each listed period, in the list's order.
fn period_states(list: &Value) -> Vec<(String, String)> {
    list["periods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| {
            (
                entry["period"].as_str().unwrap().to_owned(),
                entry["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn before(period: Period, months: u32) -> Period {
    (0..months).fold(period, |period, _| {
        Period::containing(period.start() - Duration::milliseconds(1))
    })
}

/// A close job row as a close of `period` would leave it.
async fn job(app: &TestApp, period: Period, status: &str) {
    let failed = status == "failed";
    sqlx::query(
        "INSERT INTO period_close_job (id, period, status, requested_by, started_at, finished_at, \
             error_code, error) \
         VALUES ($1, $2, $3, 'test', now(), CASE WHEN $3 = 'running' THEN NULL ELSE now() END, $4, $5)",
    )
    .bind(Uuid::new_v4())
    .bind(period.to_string())
    .bind(status)
    .bind(failed.then_some("close_failed"))
    .bind(failed.then_some("the close failed"))
    .execute(&app.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn the_period_list_runs_from_the_first_events_month_to_now_with_each_close_state() {
    let app = TestApp::spawn_mid_period().await;
    let current = Period::containing(app.now());
    let list = ok(app.get_json("/v1/periods").await);
    assert_eq!(
        period_states(&list),
        [(current.to_string(), "open".to_owned())],
        "an empty ledger lists the current month"
    );

    // The earliest event is in the month before; a later one in this month.
    let at = |instant: chrono::DateTime<chrono::Utc>| tally::event::canonical::timestamp(instant);
    let earliest = current.start() - Duration::days(10);
    let events = json!({"events": [
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": "beta", "container_id": "c1", "occurred_at": at(current.start() + Duration::days(1))},
        {"id": Uuid::new_v4(), "type": "container.created", "org_id": "acme", "container_id": "c2", "occurred_at": at(earliest)},
        {"id": Uuid::new_v4(), "type": "container.stopped", "org_id": "acme", "container_id": "c2", "occurred_at": at(earliest + Duration::hours(2))},
    ]});
    assert_eq!(app.post_events(&events).await.0, 200);
    projected_to_head(&app.pool, "the events are projected").await;
    let previous = before(current, 1);
    let list = ok(app.get_json("/v1/periods").await);
    assert_eq!(
        period_states(&list),
        [
            (current.to_string(), "open".to_owned()),
            (previous.to_string(), "open".to_owned())
        ]
    );

    // The month before closed; older periods with a failed, an abandoned and a running job.
    let (status, _, _) = app.close_period(&previous.to_string()).await;
    assert_eq!(status, 202);
    let closed = loop {
        let (_, job) = app.get_close(&previous.to_string()).await;
        if job["status"] != "running" {
            break job["closed"].clone();
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    let (failed, abandoned, closing) = (before(current, 3), before(current, 4), before(current, 5));
    job(&app, failed, "failed").await;
    job(&app, abandoned, "running").await;
    // A close running elsewhere holds its period's lock (class 'peri', key YYYYMM).
    let mut holder = sqlx::PgConnection::connect(&app.db.url).await.unwrap();
    let key = closing.to_string().replace('-', "").parse::<i32>().unwrap();
    sqlx::query("SELECT pg_advisory_lock($1, $2)")
        .bind(0x7065_7269_i32)
        .bind(key)
        .execute(&mut holder)
        .await
        .unwrap();
    job(&app, closing, "running").await;

    let list = ok(app.get_json("/v1/periods").await);
    assert_eq!(
        period_states(&list),
        [
            (current.to_string(), "open".to_owned()),
            (previous.to_string(), "closed".to_owned()),
            (failed.to_string(), "failed".to_owned()),
            (abandoned.to_string(), "failed".to_owned()),
            (closing.to_string(), "closing".to_owned()),
        ],
        "newest first, the months without events or closes left out"
    );
    let entry = &list["periods"][1];
    assert_eq!(
        (&entry["closed_at"], &entry["orgs"], &entry["sha256"]),
        (&closed["closed_at"], &closed["orgs"], &closed["sha256"])
    );
    let open = &list["periods"][0];
    assert_eq!(
        (&open["closed_at"], &open["orgs"], &open["sha256"]),
        (&Value::Null, &Value::Null, &Value::Null)
    );

    let list = ok(app.get_json("/v1/periods?limit=2").await);
    assert_eq!(period_states(&list).len(), 2);
    assert_eq!(
        ok(app.get_json("/v1/periods?limit=120").await)["periods"]
            .as_array()
            .unwrap()
            .len(),
        5
    );
    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=121", "invalid_limit"),
        ("limit=two", "invalid_limit"),
        ("after=2026-01", "unknown_parameter"),
    ] {
        let (status, body) = app.get_json(&format!("/v1/periods?{query}")).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (422, Some(code)),
            "{query}"
        );
    }
    drop(holder);
    app.stop().await;
}

/// A report of one runtime line for `container`, distinct per `cost`.
fn small_report(app: &TestApp, container: &str, cost: &str) -> String {
    let (start, end) = (app.ago(7200), app.ago(3600));
    format!("{REPORT_HEADER}\n{start},{end},{container},3600,Seconds,{cost},USD,,Usage\n")
}

/// Every page of a keyset list, `limit` at a time: the rows and the number of pages.
async fn every_page(
    app: &TestApp,
    path: &str,
    field: &str,
    id: &str,
    limit: usize,
) -> (Vec<Value>, usize) {
    let (mut rows, mut pages, mut after) = (Vec::new(), 0, None::<String>);
    loop {
        let separator = if path.contains('?') { '&' } else { '?' };
        let mut query = format!("{path}{separator}limit={limit}");
        if let Some(after) = &after {
            query.push_str(&format!("&after={after}"));
        }
        let page = ok(app.get_json(&query).await);
        let found = page[field].as_array().unwrap().clone();
        assert!(found.len() <= limit);
        pages += 1;
        rows.extend(found.iter().cloned());
        match page["next_after"].as_str() {
            Some(next) => {
                assert_eq!(found.len(), limit, "only a full page has a next one");
                assert_eq!(found.last().unwrap()[id], next);
                after = Some(next.to_owned());
            }
            None => return (rows, pages),
        }
    }
}

#[tokio::test]
async fn provider_reports_are_listed_newest_import_first_a_page_at_a_time() {
    let app = TestApp::spawn().await;
    let empty = ok(app.get_json("/v1/provider-reports").await);
    assert_eq!(empty, json!({"reports": [], "next_after": null}));
    let mut imported = Vec::new();
    for cost in ["0.10", "0.20", "0.30", "0.40", "0.50"] {
        imported.push(answered(
            201,
            app.post_report(small_report(&app, "c1", cost)).await,
        ));
    }
    imported.reverse();
    for limit in [1, 2, 5, 1000] {
        let (reports, pages) =
            every_page(&app, "/v1/provider-reports", "reports", "report_id", limit).await;
        assert_eq!(pages, 5usize.div_ceil(limit).max(1), "limit {limit}");
        let ids: Vec<&Value> = reports.iter().map(|report| &report["report_id"]).collect();
        let expected: Vec<&Value> = imported.iter().map(|report| &report["report_id"]).collect();
        assert_eq!(ids, expected, "newest import first, limit {limit}");
        for (listed, answer) in reports.iter().zip(&imported) {
            for field in ["sha256", "lines", "window_start", "window_end"] {
                assert_eq!(listed[field], answer[field], "{field}");
            }
            assert!(listed["imported_at"].as_str().unwrap().ends_with('Z'));
        }
    }
    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("after=x", "invalid_after"),
        (
            &format!("after={}", Uuid::new_v4()) as &str,
            "invalid_after",
        ),
        ("report_id=x", "unknown_parameter"),
    ] {
        let (status, body) = app.get_json(&format!("/v1/provider-reports?{query}")).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (422, Some(code)),
            "{query}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn reconciliations_are_listed_newest_first_by_report_and_each_reads_as_its_run_answered() {
    let app = TestApp::spawn().await;
    let first = answered(201, app.post_report(small_report(&app, "c1", "0.10")).await);
    let second = answered(201, app.post_report(small_report(&app, "c1", "0.20")).await);
    let mut runs = Vec::new();
    for (report, tolerance) in [
        (&first, json!(1000)),
        (&second, json!(0)),
        (&first, json!(5000)),
    ] {
        let body = json!({"report_id": report["report_id"], "tolerance_ms": tolerance, "tolerance_ratio": "0.01"});
        runs.push((
            report["report_id"].clone(),
            answered(201, app.post_reconciliation(&body).await),
        ));
    }
    runs.reverse();
    let (all, pages) = every_page(
        &app,
        "/v1/reconciliations",
        "reconciliations",
        "reconciliation_id",
        2,
    )
    .await;
    assert_eq!(pages, 2);
    let ids: Vec<&Value> = all.iter().map(|run| &run["reconciliation_id"]).collect();
    let expected: Vec<&Value> = runs
        .iter()
        .map(|(_, run)| &run["reconciliation_id"])
        .collect();
    assert_eq!(ids, expected, "newest first");
    for (listed, (report_id, answer)) in all.iter().zip(&runs) {
        assert_eq!(listed["report_id"], *report_id);
        assert_eq!(listed["counts"], answer["counts"]);
        assert_eq!(listed["position"], answer["position"]);
        assert_eq!(listed["tolerance_ratio"], "0.01");
    }
    assert_eq!(all[0]["tolerance_ms"], 5000);

    let path = format!(
        "/v1/reconciliations?report_id={}",
        first["report_id"].as_str().unwrap()
    );
    let (of_first, _) = every_page(&app, &path, "reconciliations", "reconciliation_id", 1).await;
    let ids: Vec<&Value> = of_first
        .iter()
        .map(|run| &run["reconciliation_id"])
        .collect();
    assert_eq!(
        ids,
        [
            &runs[0].1["reconciliation_id"],
            &runs[2].1["reconciliation_id"]
        ]
    );
    // A cursor is a row of its own list: the second report's run is not in the first's.
    let foreign = format!(
        "{path}&after={}",
        runs[1].1["reconciliation_id"].as_str().unwrap()
    );
    assert_eq!(runs[1].0, second["report_id"]);
    let (status, body) = app.get_json(&foreign).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("invalid_after")),
        "{body}"
    );
    let unknown = format!("/v1/reconciliations?report_id={}", Uuid::new_v4());
    assert_eq!(
        ok(app.get_json(&unknown).await)["reconciliations"],
        json!([])
    );

    for (_, answer) in &runs {
        let id = answer["reconciliation_id"].as_str().unwrap();
        let summary = ok(app.get_json(&format!("/v1/reconciliations/{id}")).await);
        for field in ["reconciliation_id", "counts", "totals", "position"] {
            assert_eq!(summary[field], answer[field], "{field}");
        }
        let (_, csv) = app.get_lines(id).await;
        assert_eq!(
            summary["lines"],
            csv.lines().count() - 1,
            "lines counts the export's"
        );
        assert!(summary["created_at"].as_str().unwrap().ends_with('Z'));
    }
    let (status, body) = app
        .get_json(&format!("/v1/reconciliations/{}", Uuid::new_v4()))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("reconciliation_not_found"))
    );
    let (status, body) = app.get_json("/v1/reconciliations/nope").await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (422, Some("invalid_reconciliation_id"))
    );
    for (query, code) in [
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("after=x", "invalid_after"),
        (
            &format!("after={}", Uuid::new_v4()) as &str,
            "invalid_after",
        ),
        ("report_id=x", "invalid_report_id"),
        ("sort=created_at", "unknown_parameter"),
    ] {
        let (status, body) = app.get_json(&format!("/v1/reconciliations?{query}")).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (422, Some(code)),
            "{query}"
        );
    }
    app.stop().await;
}

/// A reconciliation with lines of every kind and many ties: runtime lines over, under and
/// matched for two orgs (one tagged to the other org), containers the report misses, lines
/// of containers the ledger never saw, and tax lines without figures.
async fn varied_reconciliation(app: &TestApp) -> String {
    let now = app.now().duration_trunc(Duration::minutes(1)).unwrap();
    let at =
        |minutes_ago: i64| tally::event::canonical::timestamp(now - Duration::minutes(minutes_ago));
    let org = |i: usize| if i.is_multiple_of(3) { "beta" } else { "acme" };
    let runtime_minutes = |i: usize| 10 + (i as i64 % 7) * 5;
    let mut events = Vec::new();
    for i in 0..24 {
        let container = format!("c_{i}");
        events.push(json!({"id": Uuid::new_v4(), "type": "container.created", "org_id": org(i), "container_id": container, "occurred_at": at(300)}));
        events.push(json!({"id": Uuid::new_v4(), "type": "container.stopped", "org_id": org(i), "container_id": container, "occurred_at": at(300 - runtime_minutes(i))}));
    }
    assert_eq!(app.post_events(&json!({"events": events})).await.0, 200);
    projected_to_head(&app.pool, "the containers are projected").await;

    let (start, end) = (at(360), at(60));
    let mut lines = vec![REPORT_HEADER.to_owned()];
    for i in 0..20 {
        let seconds = runtime_minutes(i) * 60 + [0, 0, 120, -180, 600, 0, -60][i % 7];
        let tag = if i == 4 { "beta" } else { org(i) };
        let cost = format!("{}.{:02}", i % 3, (i * 37) % 100);
        lines.push(format!(
            r#"{start},{end},c_{i},{seconds},Seconds,{cost},USD,"{{""org_id"":""{tag}""}}",Usage"#
        ));
        if i % 6 == 2 {
            lines.push(format!("{start},{end},,,,0.{i:02},USD,,Tax"));
        }
    }
    lines.push(format!(
        r#"{start},{end},c_ghost_1,600,Seconds,0.30,USD,"{{""org_id"":""acme""}}",Usage"#
    ));
    lines.push(format!(
        r#"{start},{end},c_ghost_2,600,Seconds,0.30,USD,,Usage"#
    ));
    let report = answered(201, app.post_report(lines.join("\n")).await);
    let run = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    run["reconciliation_id"].as_str().unwrap().to_owned()
}

fn decimal(value: &Value) -> Option<Decimal> {
    value.as_str().map(|text| Decimal::from_str(text).unwrap())
}

/// `lines` (in stored order) in the order `sort` asks for, sorted here: nulls last, ties
/// in stored order (a stable sort).
fn sorted(lines: &[Value], sort: &str) -> Vec<Value> {
    let mut lines = lines.to_vec();
    match sort {
        "report_line" => {}
        "cost_delta" => lines.sort_by_cached_key(|line| {
            let delta = decimal(&line["cost_delta"]);
            (delta.is_none(), delta)
        }),
        "-cost_delta" => lines.sort_by_cached_key(|line| {
            let delta = decimal(&line["cost_delta"]);
            (delta.is_none(), Reverse(delta))
        }),
        "delta_ms" => lines.sort_by_cached_key(|line| {
            let delta = line["delta_ms"].as_i64();
            (delta.is_none(), delta)
        }),
        "-delta_ms" => lines.sort_by_cached_key(|line| {
            let delta = line["delta_ms"].as_i64();
            (delta.is_none(), Reverse(delta))
        }),
        "abs_cost_delta" => lines.sort_by_cached_key(|line| {
            let delta = decimal(&line["cost_delta"]).map(|delta| delta.abs());
            (delta.is_none(), Reverse(delta))
        }),
        other => panic!("{other} is not a sort"),
    }
    lines
}

/// Every page of `query` (filters and sort), `limit` lines at a time, checking each page's
/// echo and total.
async fn paged_lines(
    app: &TestApp,
    id: &str,
    query: &str,
    limit: usize,
    total: usize,
) -> Vec<Value> {
    let mut lines = Vec::new();
    let mut offset = 0;
    loop {
        let page = ok(app
            .get_json(&format!(
                "/v1/reconciliations/{id}/lines?{query}&offset={offset}&limit={limit}"
            ))
            .await);
        assert_eq!(
            (
                page["total"].as_u64(),
                page["offset"].as_u64(),
                page["limit"].as_u64()
            ),
            (Some(total as u64), Some(offset as u64), Some(limit as u64)),
            "{query}"
        );
        assert_eq!(page["reconciliation_id"], id);
        assert!(page["position"].as_i64().unwrap() > 0);
        let found = page["lines"].as_array().unwrap();
        lines.extend(found.iter().cloned());
        if found.len() < limit {
            assert!(
                offset + found.len() >= total,
                "a short page is the last, {query}"
            );
            return lines;
        }
        offset += limit;
    }
}

#[tokio::test]
async fn a_page_of_lines_is_filtered_sorted_and_counted_as_the_lines_export_says() {
    let app = TestApp::spawn().await;
    let id = varied_reconciliation(&app).await;
    let (status, export) = app
        .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
        .await;
    assert_eq!(status, 200);
    let all = export["lines"].as_array().unwrap().clone();
    let summary = ok(app.get_json(&format!("/v1/reconciliations/{id}")).await);
    assert_eq!(summary["lines"], all.len());
    assert!(
        all.iter().any(|line| line["cost_delta"].is_null()),
        "some lines have no cost delta"
    );
    assert!(
        all.iter().any(|line| line["report_line"].is_null()),
        "and some no report line"
    );
    // The stored order is the report's, then the lines no report line names.
    let report_lines: Vec<Option<i64>> = all
        .iter()
        .map(|line| line["report_line"].as_i64())
        .collect();
    let mut in_order = report_lines.clone();
    in_order.sort_by_key(|line| (line.is_none(), *line));
    assert_eq!(report_lines, in_order);

    for sort in [
        "report_line",
        "cost_delta",
        "-cost_delta",
        "delta_ms",
        "-delta_ms",
        "abs_cost_delta",
    ] {
        let expected = sorted(&all, sort);
        for limit in [7, 1000] {
            let paged = paged_lines(&app, &id, &format!("sort={sort}"), limit, all.len()).await;
            assert_eq!(paged, expected, "sort={sort} limit={limit}");
        }
    }
    let default = ok(app
        .get_json(&format!("/v1/reconciliations/{id}/lines"))
        .await);
    assert_eq!(
        default["lines"].as_array().unwrap(),
        &all,
        "report_line is the default"
    );
    assert_eq!(
        (default["offset"].as_u64(), default["limit"].as_u64()),
        (Some(0), Some(100))
    );

    let statuses = [
        "matched",
        "provider_over",
        "provider_under",
        "missing_in_ledger",
        "org_mismatch",
        "missing_in_provider",
        "not_runtime",
    ];
    for status in statuses {
        let expected: Vec<Value> = all
            .iter()
            .filter(|line| line["status"] == status)
            .cloned()
            .collect();
        assert_eq!(summary["counts"][status], expected.len(), "{status}");
        let paged = paged_lines(
            &app,
            &id,
            &format!("status={status}&sort=abs_cost_delta"),
            3,
            expected.len(),
        )
        .await;
        assert_eq!(paged, sorted(&expected, "abs_cost_delta"), "{status}");
    }
    let of_org = |org: &str| -> Vec<Value> {
        all.iter()
            .filter(|line| line["org_id"] == org || line["provider_org_id"] == org)
            .cloned()
            .collect()
    };
    for org in ["acme", "beta", "nobody"] {
        let expected = of_org(org);
        let paged = paged_lines(
            &app,
            &id,
            &format!("org_id={org}&sort=-delta_ms"),
            4,
            expected.len(),
        )
        .await;
        assert_eq!(paged, sorted(&expected, "-delta_ms"), "{org}");
    }
    assert!(
        of_org("beta")
            .iter()
            .any(|line| line["org_id"] == "beta" && line["status"] == "org_mismatch"),
        "a line tagged to another org than its container's is listed under the tag"
    );
    let expected: Vec<Value> = all
        .iter()
        .filter(|line| line["container_id"] == "c_4")
        .cloned()
        .collect();
    assert_eq!(expected.len(), 1);
    assert_eq!(
        paged_lines(&app, &id, "container_id=c_4", 5, 1).await,
        expected
    );
    let expected: Vec<Value> = of_org("acme")
        .into_iter()
        .filter(|line| line["status"] == "provider_over")
        .collect();
    let paged = paged_lines(
        &app,
        &id,
        "org_id=acme&status=provider_over&sort=cost_delta",
        2,
        expected.len(),
    )
    .await;
    assert_eq!(paged, sorted(&expected, "cost_delta"));

    // Past the last line: an empty page with the total, up to the bound of offset.
    for offset in [all.len(), 10_000_000] {
        let page = ok(app
            .get_json(&format!("/v1/reconciliations/{id}/lines?offset={offset}"))
            .await);
        assert_eq!(
            (page["lines"].clone(), page["total"].as_u64()),
            (json!([]), Some(all.len() as u64))
        );
    }
    for (query, code) in [
        ("offset=10000001", "invalid_offset"),
        ("offset=-1", "invalid_offset"),
        ("limit=0", "invalid_limit"),
        ("limit=1001", "invalid_limit"),
        ("sort=status", "invalid_sort"),
        ("sort=-abs_cost_delta", "invalid_sort"),
        ("status=late", "invalid_status"),
        ("org_id=a%20b", "invalid_org_id"),
        ("format=json", "unknown_parameter"),
    ] {
        let (status, body) = app
            .get_json(&format!("/v1/reconciliations/{id}/lines?{query}"))
            .await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (422, Some(code)),
            "{query}"
        );
    }
    assert_eq!(
        ok(app
            .get_json(&format!("/v1/reconciliations/{id}/lines?limit=1000"))
            .await)["limit"],
        1000
    );
    let (status, body) = app
        .get_json(&format!("/v1/reconciliations/{}/lines", Uuid::new_v4()))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("reconciliation_not_found"))
    );

    // A token bound to acme reads acme's lines (by the ledger's org) and no other org's.
    let token = answered(
        201,
        app.post_token(&json!({"scopes": ["finance"], "org_id": "acme"}))
            .await,
    );
    let bound = app.with_token(token["token"].as_str().unwrap());
    let expected: Vec<Value> = all
        .iter()
        .filter(|line| line["org_id"] == "acme")
        .cloned()
        .collect();
    let page = ok(bound
        .get_json(&format!(
            "/v1/reconciliations/{id}/lines?limit=1000&sort=abs_cost_delta"
        ))
        .await);
    assert_eq!(page["total"], expected.len());
    assert_eq!(
        page["lines"].as_array().unwrap(),
        &sorted(&expected, "abs_cost_delta")
    );
    let page = ok(bound
        .get_json(&format!(
            "/v1/reconciliations/{id}/lines?org_id=acme&status=org_mismatch"
        ))
        .await);
    assert!(page["lines"]
        .as_array()
        .unwrap()
        .iter()
        .all(|line| line["org_id"] == "acme"));
    let (status, body) = bound
        .get_json(&format!("/v1/reconciliations/{id}/lines?org_id=beta"))
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("org_not_allowed"))
    );
    for path in [
        "/v1/reconciliations".to_owned(),
        format!("/v1/reconciliations/{id}"),
        "/v1/provider-reports".into(),
        "/v1/periods".into(),
    ] {
        let (status, body) = bound.get_json(&path).await;
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (403, Some("org_bound_token")),
            "{path}"
        );
    }
    app.stop().await;
}

#[tokio::test]
async fn the_last_page_of_a_hundred_thousand_lines_is_the_export_sorted() {
    let app = TestApp::spawn().await;
    let report = answered(201, app.post_report(small_report(&app, "c1", "0.10")).await);
    let run = answered(
        201,
        app.post_reconciliation(&json!({"report_id": report["report_id"]}))
            .await,
    );
    let id: Uuid = run["reconciliation_id"].as_str().unwrap().parse().unwrap();
    // A hundred thousand stored lines more, written as a run writes them: cost deltas
    // and runtime deltas spread, with ties and nulls.
    sqlx::query(
        "INSERT INTO reconciliation_line (reconciliation_id, seq, org_id, container_id, \
             charge_period_start, charge_period_end, ledger_runtime_ms, provider_runtime_ms, \
             delta_ms, status, provider_cost, expected_cost, cost_delta, currency, \
             provider_org_id, report_line, charge_category) \
         SELECT $1, 1 + n, CASE WHEN n % 2 = 0 THEN 'acme' ELSE 'beta' END, 'c_' || n, \
             now() - interval '2 hours', now() - interval '1 hour', \
             CASE WHEN n % 10 = 0 THEN NULL ELSE 1000 END, \
             CASE WHEN n % 10 = 0 THEN NULL ELSE 1000 + (n * 7919) % 5000 END, \
             CASE WHEN n % 10 = 0 THEN NULL ELSE (n * 7919) % 5000 - 2500 END, \
             CASE WHEN n % 10 = 0 THEN 'not_runtime' ELSE 'provider_over' END, 1.00, \
             CASE WHEN n % 10 = 0 THEN NULL ELSE 1.00 END, \
             CASE WHEN n % 10 = 0 THEN NULL ELSE ((n * 104729) % 20001 - 10000) / 100.0 END, \
             'USD', 'acme', 2 + n, 'Usage' \
         FROM generate_series(1::BIGINT, 100000) AS n",
    )
    .bind(id)
    .execute(&app.pool)
    .await
    .unwrap();
    // And its counts, which a run stores with its lines.
    sqlx::query(
        "UPDATE reconciliation SET counts = counts \
             || jsonb_build_object('provider_over', (counts->>'provider_over')::BIGINT + 90000) \
             || jsonb_build_object('not_runtime', (counts->>'not_runtime')::BIGINT + 10000) \
         WHERE id = $1",
    )
    .bind(id)
    .execute(&app.pool)
    .await
    .unwrap();
    let (_, export) = app
        .get_json(&format!("/v1/reconciliations/{id}/lines.csv?format=json"))
        .await;
    let all = export["lines"].as_array().unwrap().clone();
    assert_eq!(all.len(), 100_001);
    let beta: Vec<Value> = all
        .iter()
        .filter(|line| line["org_id"] == "beta")
        .cloned()
        .collect();
    for (query, lines) in [
        ("sort=abs_cost_delta", &all),
        ("sort=-delta_ms&org_id=beta", &beta),
    ] {
        let sort = query.split('&').next().unwrap().trim_start_matches("sort=");
        let expected = sorted(lines, sort);
        for offset in [0, 50_000, lines.len() - 10] {
            let page = ok(app
                .get_json(&format!(
                    "/v1/reconciliations/{id}/lines?{query}&offset={offset}&limit=1000"
                ))
                .await);
            assert_eq!(page["total"], lines.len(), "{query}");
            let end = (offset + 1000).min(lines.len());
            assert_eq!(
                page["lines"].as_array().unwrap(),
                &expected[offset..end],
                "{query} offset {offset}"
            );
        }
    }
    app.stop().await;
}
