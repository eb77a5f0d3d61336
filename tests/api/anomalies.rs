//! Container anomalies: an event of a container costs the projection
//! the same whatever anomalies the container already has, the API pages them, a container
//! keeps at most `ANOMALIES_KEPT_MAX` and counts the rest, replay keeps the same rows, and
//! the migration moves anomalies stored as one JSON array into rows without losing one. A
//! container has at most `INTERVALS_MAX` running intervals.

use std::borrow::Cow;

use chrono::{DateTime, Duration, DurationRound, Utc};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};
use uuid::Uuid;

use tally::event::canonical::timestamp;
use tally::projection::model::ANOMALIES_KEPT_MAX;
use tally::runtime::{INTERVALS_MAX, LIFECYCLE_EVENTS_MAX};

use crate::helpers::{mid_period, projected_to_head, projected_to_head_within, TestApp, TestDb};

/// A command of `container`, which nobody created: each is a `command_while_not_running`.
fn command(container: &str, at: DateTime<Utc>) -> Value {
    json!({
        "id": Uuid::new_v4().to_string(),
        "type": "container.command_ran",
        "org_id": "org_a",
        "container_id": container,
        "occurred_at": timestamp(at),
        "data": {"command_id": "c", "exit_code": 0, "duration_ms": 5},
    })
}

/// `count` commands of `container`, one millisecond apart from `from` on, posted in the
/// largest batches the service takes; returns their ids in occurred_at order.
async fn store_commands(
    app: &TestApp,
    container: &str,
    from: DateTime<Utc>,
    count: usize,
) -> Vec<String> {
    let events: Vec<Value> = (0..count)
        .map(|index| command(container, from + Duration::milliseconds(index as i64)))
        .collect();
    for chunk in events.chunks(1000) {
        let (status, body) = app.post_events(&json!({ "events": chunk })).await;
        assert_eq!(status, 200, "{body}");
    }
    projected_to_head(&app.pool, "the commands are projected").await;
    events
        .iter()
        .map(|event| event["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Every kept anomaly's event id, page after page of `limit`; also checks that each page
/// but the last is full and names the next.
async fn every_page(app: &TestApp, container: &str, limit: usize) -> (Vec<String>, usize) {
    let mut ids = Vec::new();
    let mut pages = 0;
    let mut after: Option<String> = None;
    loop {
        let mut path = format!("/v1/containers/{container}?anomalies_limit={limit}");
        if let Some(after) = &after {
            path.push_str(&format!("&anomalies_after={after}"));
        }
        let (status, page) = app.get_json(&path).await;
        assert_eq!(status, 200, "{page}");
        pages += 1;
        let anomalies = page["anomalies"].as_array().unwrap();
        ids.extend(
            anomalies
                .iter()
                .map(|anomaly| anomaly["event_id"].as_str().unwrap().to_owned()),
        );
        match page["anomalies_next_after"].as_str() {
            Some(next) => {
                assert_eq!(anomalies.len(), limit, "a page before the last is full");
                after = Some(next.to_owned());
            }
            None => return (ids, pages),
        }
    }
}

/// Replays the ledger into the projection in this process, as `tally replay` does.
async fn replay(app: &TestApp) {
    let mut connection = PgConnection::connect(&app.db.url).await.unwrap();
    let mut helper = PgConnection::connect(&app.db.url).await.unwrap();
    tally::projection::replay(&mut connection, &mut helper)
        .await
        .unwrap();
    connection.close().await.unwrap();
    helper.close().await.unwrap();
}

/// Rows each projection table takes for one projector round, and their bytes as written:
/// row triggers on every table of `proj` record them, so the test sees what the projector
/// writes, statement by statement, and not just what it leaves.
async fn record_projection_writes(app: &TestApp) {
    sqlx::raw_sql(
        "CREATE TABLE public.rows_written (table_name TEXT NOT NULL, bytes INTEGER NOT NULL);
         CREATE FUNCTION public.record_row_written() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO public.rows_written VALUES (TG_TABLE_NAME, pg_column_size(NEW));
             RETURN NEW;
         END $$;
         DO $$
         DECLARE t TEXT;
         BEGIN
             FOR t IN SELECT tablename FROM pg_tables WHERE schemaname = 'proj' LOOP
                 EXECUTE format('CREATE TRIGGER record_row_written BEFORE INSERT OR UPDATE
                     ON proj.%I FOR EACH ROW EXECUTE FUNCTION public.record_row_written()', t);
             END LOOP;
         END $$;",
    )
    .execute(&app.pool)
    .await
    .unwrap();
}

#[tokio::test]
async fn one_more_command_of_a_container_with_thousands_of_anomalies_rewrites_none_of_them() {
    let app = TestApp::spawn().await;
    let start = Utc::now().duration_trunc(Duration::seconds(1)).unwrap() - Duration::hours(1);
    store_commands(&app, "ctr_lost", start, 3_000).await;
    record_projection_writes(&app).await;

    let (status, body) = app
        .post_events(&command("ctr_lost", start + Duration::minutes(30)))
        .await;
    assert_eq!(status, 200, "{body}");
    projected_to_head(&app.pool, "the one more command is projected").await;

    let written: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT table_name, count(*), sum(bytes)::BIGINT FROM public.rows_written \
         GROUP BY table_name ORDER BY table_name",
    )
    .fetch_all(&app.pool)
    .await
    .unwrap();
    let bytes: i64 = written.iter().map(|(_, _, bytes)| bytes).sum();
    // The 3 000 anomalies are about 200 KB as rows or JSON; one event's rows are a few
    // hundred bytes whatever the container has stored.
    assert!(
        bytes < 2_000,
        "one event wrote {bytes} bytes of projection rows: {written:?}"
    );
    // Each table's row once (twice for an upsert: its insert and its update fire), and
    // the one new anomaly.
    let rows: i64 = written.iter().map(|(_, rows, _)| rows).sum();
    assert!(
        rows <= 10,
        "one event wrote {rows} projection rows: {written:?}"
    );
    let anomaly_rows: Vec<i64> = written
        .iter()
        .filter(|(table, _, _)| table == "container_anomaly")
        .map(|(_, rows, _)| *rows)
        .collect();
    assert_eq!(anomaly_rows, [1], "{written:?}");
    let (_, container) = app.get_container("ctr_lost", "anomalies_limit=1").await;
    assert_eq!(container["anomalies_total"], 3_001, "{container}");
    app.stop().await;
}

#[tokio::test]
async fn a_container_with_many_anomalies_is_read_a_page_at_a_time_in_their_order() {
    let app = TestApp::spawn().await;
    let start = Utc::now().duration_trunc(Duration::seconds(1)).unwrap() - Duration::hours(1);
    let ids = store_commands(&app, "ctr_lost", start, 2_500).await;

    let (status, first) = app.get_container("ctr_lost", "").await;
    assert_eq!(status, 200, "{first}");
    assert_eq!(
        first["anomalies"].as_array().unwrap().len(),
        100,
        "the default page"
    );
    assert_eq!(first["anomalies_total"], 2_500);
    assert_eq!(first["anomalies_kept"], 2_500);
    assert_eq!(first["anomalies"][0]["kind"], "command_while_not_running");
    assert_eq!(first["anomalies"][0]["occurred_at"], timestamp(start));
    assert!(first["anomalies_next_after"].is_string(), "{first}");

    let (paged, pages) = every_page(&app, "ctr_lost", 1_000).await;
    assert_eq!(pages, 3);
    assert_eq!(paged, ids, "every anomaly once, in occurred_at order");

    for (query, code) in [
        ("anomalies_limit=0", "invalid_anomalies_limit"),
        ("anomalies_limit=1001", "invalid_anomalies_limit"),
        ("anomalies_limit=ten", "invalid_anomalies_limit"),
        ("anomalies_after=yesterday", "invalid_anomalies_after"),
        ("anomalies_after=1_x", "invalid_anomalies_after"),
        // An instant chrono holds and Postgres does not.
        (
            "anomalies_after=-8000000000000000_1",
            "invalid_anomalies_after",
        ),
    ] {
        let (status, body) = app.get_container("ctr_lost", query).await;
        assert_eq!(status, 422, "{query}: {body}");
        assert_eq!(body["error"]["code"], code, "{query}: {body}");
    }
    app.stop().await;
}

#[tokio::test]
async fn a_container_keeps_its_first_anomalies_up_to_the_limit_counts_the_rest_and_replay_keeps_the_same(
) {
    let app = TestApp::spawn().await;
    let start = Utc::now().duration_trunc(Duration::seconds(1)).unwrap() - Duration::hours(2);
    let kept_max = usize::try_from(ANOMALIES_KEPT_MAX).unwrap();
    let mut ids = store_commands(&app, "ctr_lost", start, kept_max + 50).await;
    // A late command that sorts before the last one kept takes its place.
    let late = command("ctr_lost", start - Duration::seconds(1));
    let (status, body) = app.post_events(&late).await;
    assert_eq!(status, 200, "{body}");
    projected_to_head(&app.pool, "the late command is projected").await;
    ids.insert(0, late["id"].as_str().unwrap().to_owned());
    ids.truncate(kept_max);

    let (_, container) = app.get_container("ctr_lost", "anomalies_limit=1").await;
    assert_eq!(container["anomalies_total"], kept_max + 51);
    assert_eq!(container["anomalies_kept"], kept_max);
    let (paged, _) = every_page(&app, "ctr_lost", 1_000).await;
    assert_eq!(paged, ids, "the first {kept_max} in occurred_at order");

    replay(&app).await;
    let (_, replayed) = app.get_container("ctr_lost", "anomalies_limit=1").await;
    assert_eq!(replayed, container);
    let (replayed_pages, _) = every_page(&app, "ctr_lost", 1_000).await;
    assert_eq!(replayed_pages, ids, "replay keeps the same anomalies");
    app.stop().await;
}

/// An event of `container` in org_a, of `kind`, at `at`.
fn lifecycle_event(container: &str, kind: &str, at: DateTime<Utc>) -> Value {
    json!({
        "id": Uuid::new_v4().to_string(),
        "type": format!("container.{kind}"),
        "org_id": "org_a",
        "container_id": container,
        "occurred_at": timestamp(at),
        "data": {},
    })
}

/// 40 containers of org_a, created and stopped at `at`: with them, admission keeps the org's
/// facts per container asked about rather than holding them all.
fn forty_stopped_containers(at: DateTime<Utc>) -> Vec<Value> {
    (0..40)
        .flat_map(|n| {
            let container = format!("ctr_{n}");
            [
                lifecycle_event(&container, "created", at),
                lifecycle_event(&container, "stopped", at),
            ]
        })
        .collect()
}

/// Asks admission each (action, container of org_a) in turn and checks the last reason of
/// each answer.
async fn assert_last_reasons(app: &TestApp, cases: &[(&str, &str, &str)]) {
    for (action, container, last_reason) in cases {
        let (status, answer) = app
            .check_admission(
                &json!({"org_id": "org_a", "action": action, "container_id": container}),
            )
            .await;
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            answer["reasons"].as_array().unwrap().last(),
            Some(&json!(last_reason)),
            "{action} {container}"
        );
    }
}

#[tokio::test]
async fn a_container_at_its_interval_limit_is_not_resumed_admission_says_so_and_replay_agrees() {
    let app = TestApp::spawn().await;
    let start = mid_period();
    let at = |millisecond: usize| start + Duration::milliseconds(millisecond as i64);
    // Created, then stopped one millisecond after each start and resumed one after each
    // stop until the container has INTERVALS_MAX intervals of 1 ms, and stopped; then
    // resumed once more, ten minutes after the start.
    let mut events = vec![lifecycle_event("ctr_busy", "created", start)];
    events.extend(forty_stopped_containers(start));
    events.extend((1..INTERVALS_MAX * 2).map(|millisecond| {
        let kind = if millisecond % 2 == 1 {
            "stopped"
        } else {
            "resumed"
        };
        lifecycle_event("ctr_busy", kind, at(millisecond))
    }));
    let past_limit = lifecycle_event("ctr_busy", "resumed", start + Duration::minutes(10));
    events.push(past_limit.clone());
    for chunk in events.chunks(1000) {
        let (status, body) = app.post_events(&json!({ "events": chunk })).await;
        assert_eq!(status, 200, "{body}");
    }
    // Each round rewrites the container's intervals whole, up to 100 000 of them, in a
    // debug build on a loaded machine.
    projected_to_head_within(&app.pool, 120, "the stops and resumes are projected").await;

    let (status, container) = app.get_container("ctr_busy", "").await;
    assert_eq!(status, 200, "{container}");
    assert_eq!(container["state"], "stopped");
    assert_eq!(
        container["intervals"].as_array().unwrap().len(),
        INTERVALS_MAX
    );
    assert_eq!(container["runtime_ms"], INTERVALS_MAX, "1 ms an interval");
    assert_eq!(
        container["anomalies"],
        json!([{
            "kind": "resume_past_interval_limit",
            "event_id": past_limit["id"],
            "occurred_at": past_limit["occurred_at"],
        }])
    );
    let period = start.format("%Y-%m").to_string();
    let (_, usage) = app.get_usage("org_a", &format!("period={period}")).await;
    assert_eq!(usage["runtime_ms"], INTERVALS_MAX);
    assert_eq!(usage["running_containers"], 0);
    // Admission says so before a resume is tried; another container may still be resumed
    // and a new one created, whichever was asked about first.
    assert_last_reasons(
        &app,
        &[
            ("resume", "ctr_busy", "interval_limit"),
            ("resume", "ctr_0", "not_billing_eligible"),
            ("create", "ctr_new", "not_billing_eligible"),
            ("resume", "ctr_busy", "interval_limit"),
            ("resume", "ctr_1", "not_billing_eligible"),
        ],
    )
    .await;

    replay(&app).await;
    let (_, replayed) = app.get_container("ctr_busy", "").await;
    assert_eq!(replayed, container, "replay folds the same limit");
    app.stop().await;
}

#[tokio::test]
async fn a_container_stops_at_its_last_lifecycle_event_within_the_limit_admission_says_so_and_replay_agrees(
) {
    let app = TestApp::spawn().await;
    let start = mid_period();
    let at = |millisecond: u64| start + Duration::milliseconds(millisecond as i64);
    // Created, then resumed while running once a millisecond, up to LIFECYCLE_EVENTS_MAX
    // lifecycle events; then stopped and resumed, both past the limit.
    let mut events = vec![lifecycle_event("ctr_busy", "created", start)];
    events.extend(forty_stopped_containers(start));
    events.extend(
        (1..LIFECYCLE_EVENTS_MAX)
            .map(|millisecond| lifecycle_event("ctr_busy", "resumed", at(millisecond))),
    );
    events.push(lifecycle_event("ctr_busy", "stopped", at(600_000)));
    events.push(lifecycle_event("ctr_busy", "resumed", at(700_000)));
    for chunk in events.chunks(1000) {
        let (status, body) = app.post_events(&json!({ "events": chunk })).await;
        assert_eq!(status, 200, "{body}");
    }
    projected_to_head_within(&app.pool, 120, "the lifecycle events are projected").await;

    let (status, container) = app.get_container("ctr_busy", "").await;
    assert_eq!(status, 200, "{container}");
    assert_eq!(container["state"], "stopped");
    let last = LIFECYCLE_EVENTS_MAX - 1;
    assert_eq!(
        container["intervals"],
        json!([{"start": timestamp(start), "end": timestamp(at(last))}]),
        "stopped at its last lifecycle event within the limit"
    );
    assert_eq!(container["runtime_ms"], last);
    assert_eq!(
        container["anomalies_total"],
        (LIFECYCLE_EVENTS_MAX - 1) + 2,
        "every resume while running, and both events past the limit"
    );
    // Admission says so before a resume is tried; another container may still be resumed
    // and a new one created, whichever was asked about first.
    assert_last_reasons(
        &app,
        &[
            ("resume", "ctr_busy", "lifecycle_limit"),
            ("resume", "ctr_0", "not_billing_eligible"),
            ("create", "ctr_new", "not_billing_eligible"),
            ("resume", "ctr_busy", "lifecycle_limit"),
        ],
    )
    .await;

    replay(&app).await;
    let (_, replayed) = app.get_container("ctr_busy", "").await;
    assert_eq!(replayed, container, "replay folds the same limit");
    app.stop().await;
}

/// The version of the migration that moved anomalies into rows.
const ANOMALY_ROWS_MIGRATION: i64 = 20261201000001;

#[tokio::test]
async fn the_migration_moves_anomalies_stored_as_a_json_array_into_rows_without_losing_one() {
    let db = TestDb::new().await;
    let mut connection = PgConnection::connect(&db.url).await.unwrap();
    let mut before = sqlx::migrate!("./migrations");
    before.migrations = Cow::Owned(
        before
            .migrations
            .iter()
            .filter(|migration| migration.version < ANOMALY_ROWS_MIGRATION)
            .cloned()
            .collect(),
    );
    before.run(&mut connection).await.unwrap();
    // As the projector stored them: [kind, event_id, occurred_at_ms, position] in
    // (occurred_at, position) order; two share a millisecond.
    let event = |n: u128| Uuid::from_u128(n).to_string();
    let anomalies = json!([
        ["stop_while_not_running", event(1), 1_764_576_000_123_i64, 1],
        [
            "command_while_not_running",
            event(2),
            1_764_576_000_500_i64,
            7
        ],
        [
            "command_while_not_running",
            event(3),
            1_764_576_000_500_i64,
            9
        ],
    ]);
    sqlx::query(
        "INSERT INTO proj.container (org_id, container_id, intervals, anomalies, last_at) VALUES \
         ('org_a', 'ctr_odd', '[]', $1, now()), ('org_a', 'ctr_fine', '[[0, null]]', '[]', now())",
    )
    .bind(&anomalies)
    .execute(&mut connection)
    .await
    .unwrap();

    sqlx::migrate!("./migrations")
        .run(&mut connection)
        .await
        .unwrap();

    let rows: Vec<(String, String, DateTime<Utc>, i64, Uuid)> = sqlx::query_as(
        "SELECT container_id, kind, occurred_at, position, event_id FROM proj.container_anomaly \
         ORDER BY container_id, occurred_at, position",
    )
    .fetch_all(&mut connection)
    .await
    .unwrap();
    let at = |ms: i64| DateTime::from_timestamp_millis(ms).unwrap();
    assert_eq!(
        rows,
        vec![
            (
                "ctr_odd".into(),
                "stop_while_not_running".into(),
                at(1_764_576_000_123),
                1,
                Uuid::from_u128(1)
            ),
            (
                "ctr_odd".into(),
                "command_while_not_running".into(),
                at(1_764_576_000_500),
                7,
                Uuid::from_u128(2)
            ),
            (
                "ctr_odd".into(),
                "command_while_not_running".into(),
                at(1_764_576_000_500),
                9,
                Uuid::from_u128(3)
            ),
        ]
    );
    let totals: Vec<(String, i64)> = sqlx::query_as(
        "SELECT container_id, anomalies_total FROM proj.container ORDER BY container_id",
    )
    .fetch_all(&mut connection)
    .await
    .unwrap();
    assert_eq!(totals, vec![("ctr_fine".into(), 0), ("ctr_odd".into(), 3)]);
    // A schema built after the migration (as replay builds one) has the same shape.
    sqlx::query("SELECT tally_create_projection_schema('proj_check')")
        .execute(&mut connection)
        .await
        .unwrap();
    let shape = |schema: &'static str| {
        sqlx::query_scalar::<_, String>(
            "SELECT string_agg(table_name || '.' || column_name || ' ' || data_type, ', ' \
                 ORDER BY table_name, column_name) \
             FROM information_schema.columns WHERE table_schema = $1",
        )
        .bind(schema)
    };
    let live = shape("proj").fetch_one(&mut connection).await.unwrap();
    let built = shape("proj_check")
        .fetch_one(&mut connection)
        .await
        .unwrap();
    assert_eq!(live, built);
    connection.close().await.unwrap();
}
