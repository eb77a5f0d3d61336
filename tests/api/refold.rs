//! A late lifecycle event refolds its container from the ledger: from its lifecycle events
//! and the commands that fall where it was not running, never its commands while running
//! nor another org's events under its id; and the projection it leaves is the one a replay
//! of the whole ledger builds.

use chrono::Duration;
use sqlx::{Connection, PgConnection, PgPool};

use tally::clock::Clock;
use tally::ledger::Appender;
use tally::projection::model::{
    ContainerKey, IdleCommands, ANOMALIES_KEPT_MAX, LIFECYCLE_READ_MAX,
};
use tally::projection::{project_once, store, Round};
use tally::runtime::{IdleSpan, Interval, LIFECYCLE_EVENTS_MAX};

use crate::helpers::TestDb;
use crate::projection_handoff::{append_all, projection_rows, Script, LIMITS};

/// Projects until caught up; returns the events read again to refold late containers.
async fn project(pool: &PgPool) -> usize {
    let mut reread = 0;
    loop {
        match project_once(pool, (1_000, Clock::system()), None, None, None)
            .await
            .unwrap()
        {
            Round::Projected { reread: read, .. } => reread += read,
            Round::CaughtUp { .. } => return reread,
            // Not even the round before, which found nothing to project: it has ended its
            // transaction.
            Round::Busy => panic!("no other projector runs"),
        }
    }
}

async fn replay(url: &str) {
    let mut connection = PgConnection::connect(url).await.unwrap();
    let mut helper = PgConnection::connect(url).await.unwrap();
    tally::projection::replay(&mut connection, &mut helper)
        .await
        .unwrap();
    connection.close().await.unwrap();
    helper.close().await.unwrap();
}

/// Replays the ledger at `url` and checks that the projection is the one it held, row for
/// row.
async fn replay_builds_the_same(pool: &PgPool, url: &str) {
    let projected = projection_rows(pool).await;
    replay(url).await;
    assert_eq!(projection_rows(pool).await, projected, "as replay folds it");
}

#[tokio::test]
async fn a_late_stop_or_resume_brings_back_the_lifecycle_and_the_idle_commands_alone_and_leaves_what_a_replay_builds(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _relay, _task) = Appender::start(pool.clone(), LIMITS);
    let s = Script::new();
    // acme's c1 runs from minute 10 and runs a command each minute from 11 to 110; one
    // more, at minute 5, arrives last: a late command, placed without a refold. globex's
    // c1 is another container under the same id, with 50 commands of its own.
    let mut events = vec![s.created("acme", "c1", 10), s.created("globex", "c1", 10)];
    events.extend((11..=110).map(|minute| s.command("acme", "c1", minute, 1)));
    events.extend((11..=60).map(|minute| s.command("globex", "c1", minute, 1)));
    events.push(s.command("acme", "c1", 5, 1));
    let voided = events[2 + 89].clone();
    append_all(&appender, &[events]).await;
    assert_eq!(
        project(&pool).await,
        0,
        "events in order and late commands refold nothing"
    );
    // In one round, the void of acme's command of minute 100 refolds acme's c1 from its
    // whole history, which leaves it out (the created and 100 commands), and globex's c1,
    // stopped at minute 30, from its created and stop and its 31 commands from then on.
    let round = vec![s.void(&voided, 120), s.stopped("globex", "c1", 30)];
    append_all(&appender, &[round]).await;
    assert_eq!(project(&pool).await, (1 + 100) + (2 + 31));

    // Stopped at minute 60, late: the created and the stop, the command of minute 5 and
    // the 50 of minutes 60 to 110 left, now run while stopped; not the 49 while running.
    append_all(&appender, &[vec![s.stopped("acme", "c1", 60)]]).await;
    assert_eq!(project(&pool).await, 2 + 1 + 50);
    // Resumed at minute 80, late: three lifecycle events, and the commands of minutes 5
    // and 60 to 79.
    append_all(&appender, &[vec![s.resumed("acme", "c1", 80)]]).await;
    assert_eq!(project(&pool).await, 3 + 1 + 20);

    let (container, anomalies): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT anomalies_total FROM proj.container \
                 WHERE org_id = 'acme' AND container_id = 'c1'), \
                (SELECT count(*) FROM proj.container_anomaly \
                 WHERE org_id = 'acme' AND container_id = 'c1')",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (container, anomalies),
        (21, 21),
        "commands while not running"
    );
    replay_builds_the_same(&pool, &db.url).await;
}

#[tokio::test]
async fn idle_commands_are_counted_in_every_span_and_the_first_ones_read_in_order_across_the_spans()
{
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _relay, _task) = Appender::start(pool.clone(), LIMITS);
    let s = Script::new();
    let mut events: Vec<_> = [1, 2, 4, 5, 6, 7, 9]
        .iter()
        .map(|minute| s.command("acme", "c1", *minute, 1))
        .collect();
    events.extend([
        s.command("globex", "c1", 1, 1),
        s.command("globex", "c1", 5, 1),
        s.command("acme", "c2", 3, 1),
        s.command("acme", "c2", 4, 1),
        s.command("acme", "c3", 6, 1),
        // Last, so that a bound one position short leaves it out.
        s.command("acme", "c1", 10, 1),
    ]);
    append_all(&appender, &[events]).await;
    let head: i64 = sqlx::query_scalar("SELECT max(position) FROM ledger")
        .fetch_one(&pool)
        .await
        .unwrap();
    let at = |minute: i64| Some(s.start + Duration::minutes(minute));
    let span = |from: Option<i64>, until: Option<i64>| IdleSpan {
        from: from.and_then(at),
        until: until.and_then(at),
    };
    let key = |container: &str| ContainerKey {
        org_id: "acme".to_owned(),
        container_id: container.to_owned(),
    };
    // c1 is idle before minute 3, from 5 to 8 and from 9 on: its commands of minute 4
    // ran while running, and globex's c1 is another container. c2 is idle before minute
    // 4, in two spans that meet at 2; c3 before minute 1, when it ran no command.
    let (c1, c2, c3) = (key("c1"), key("c2"), key("c3"));
    let spans = vec![
        (
            &c1,
            vec![
                span(None, Some(3)),
                span(Some(5), Some(8)),
                span(Some(9), None),
            ],
        ),
        (&c2, vec![span(None, Some(2)), span(Some(2), Some(4))]),
        (&c3, vec![span(None, Some(1))]),
    ];
    let mut connection = pool.acquire().await.unwrap();
    let minutes = |idle: &IdleCommands| -> (u64, Vec<i64>) {
        let first = idle.first.iter();
        let first = first.map(|anomaly| (anomaly.occurred_at - s.start).num_minutes());
        (idle.total, first.collect())
    };
    for (first_max, first) in [
        (1, vec![1]),
        (2, vec![1, 2]),
        (3, vec![1, 2, 5]),
        (100, vec![1, 2, 5, 6, 7, 9, 10]),
    ] {
        let idle = store::read_idle_commands(&mut connection, &spans, head, first_max)
            .await
            .unwrap();
        assert_eq!(minutes(&idle[&c1]), (7, first), "the first {first_max}");
        assert_eq!(minutes(&idle[&c2]), (1, vec![3]));
        assert_eq!(minutes(&idle[&c3]), (0, vec![]));
    }
    let idle = store::read_idle_commands(&mut connection, &spans, head - 1, 100)
        .await
        .unwrap();
    assert_eq!(minutes(&idle[&c1]), (6, vec![1, 2, 5, 6, 7, 9]));
}

#[tokio::test]
async fn a_late_lifecycle_event_of_a_container_past_its_lifecycle_limit_reads_no_more_than_the_limit_and_leaves_what_a_replay_builds(
) {
    let db = TestDb::new().await;
    let pool = db.pool().await;
    let (appender, _relay, _task) = Appender::start(pool.clone(), LIMITS);
    let s = Script::new();
    let at = |millisecond: i64| s.start + Duration::milliseconds(millisecond);
    // acme's c1 created at 0 and stopped at 1 ms, then stray stops a millisecond apart,
    // ten lifecycle events more than a refold reads.
    let total = LIFECYCLE_READ_MAX as i64 + 10;
    let mut created = s.created("acme", "c1", 0);
    created.occurred_at = at(0);
    let mut events = vec![created];
    events.extend((1..total).map(|millisecond| {
        let mut stop = s.stopped("acme", "c1", 0);
        stop.occurred_at = at(millisecond);
        stop
    }));
    let appends: Vec<Vec<_>> = events.chunks(1_000).map(<[_]>::to_vec).collect();
    append_all(&appender, &appends).await;
    assert_eq!(project(&pool).await, 0, "events in order refold nothing");
    let stored = |pool: PgPool| async move {
        let (intervals, anomalies, lifecycle): (String, i64, i64) = sqlx::query_as(
            "SELECT intervals::TEXT, anomalies_total, lifecycle_total FROM proj.container \
             WHERE org_id = 'acme' AND container_id = 'c1'",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        let intervals = store::decode_intervals(&intervals).unwrap();
        (intervals, anomalies, lifecycle)
    };
    let past = total - LIFECYCLE_EVENTS_MAX as i64;
    assert_eq!(
        stored(pool.clone()).await,
        (vec![Interval::new(at(0), Some(at(1)))], total - 2, total),
        "the stop ends the interval, every other stop is stray or past the limit ({past})"
    );
    replay_builds_the_same(&pool, &db.url).await;

    // Resumed at 1 ms, after the stop there: the stray stop at 2 ms ends a second interval.
    let mut resumed = s.resumed("acme", "c1", 0);
    resumed.occurred_at = at(1);
    append_all(&appender, &[vec![resumed]]).await;
    assert_eq!(
        project(&pool).await,
        LIFECYCLE_READ_MAX as usize,
        "the first lifecycle events only, and no command"
    );
    assert_eq!(
        stored(pool.clone()).await,
        (
            vec![
                Interval::new(at(0), Some(at(1))),
                Interval::new(at(1), Some(at(2)))
            ],
            total - 3,
            total + 1
        ),
        "one stray stop is a real one, one more stop is past the limit"
    );
    let (last_kind, kept): (String, i64) = sqlx::query_as(
        "SELECT (SELECT kind FROM proj.container_anomaly \
                 ORDER BY occurred_at DESC, position DESC LIMIT 1), \
                (SELECT count(*) FROM proj.container_anomaly)",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(
        (last_kind.as_str(), kept),
        ("stop_while_not_running", ANOMALIES_KEPT_MAX as i64),
        "the first anomalies are kept, all stray stops"
    );
    replay_builds_the_same(&pool, &db.url).await;
}
