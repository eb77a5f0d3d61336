//! The ledger is append-only in the database itself, whoever connects.

use serde_json::json;

use crate::helpers::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_delete_and_truncate_are_refused_by_the_database_even_for_a_superuser() {
    let app = TestApp::spawn().await;
    assert_eq!(
        app.post_events(&json!({"events": valid_events(5)})).await.0,
        200
    );

    let statements = [
        "UPDATE ledger SET org_id = 'evil' WHERE position = 1",
        "UPDATE ledger SET org_id = 'evil' WHERE false",
        "DELETE FROM ledger WHERE position = 2",
        "DELETE FROM ledger",
        "TRUNCATE ledger",
    ];
    for statement in statements {
        let error = sqlx::query(statement)
            .execute(&app.pool)
            .await
            .expect_err(statement);
        assert!(
            error.to_string().contains("append-only"),
            "{statement}: {error}"
        );
    }
    // Replica mode skips ordinary triggers, not ALWAYS ones.
    let mut connection = app.pool.acquire().await.unwrap();
    sqlx::query("SET session_replication_role = replica")
        .execute(&mut *connection)
        .await
        .unwrap();
    let error = sqlx::query("DELETE FROM ledger")
        .execute(&mut *connection)
        .await
        .expect_err("delete in replica mode");
    assert!(error.to_string().contains("append-only"), "{error}");
    sqlx::query("SET session_replication_role = origin")
        .execute(&mut *connection)
        .await
        .unwrap();
    drop(connection);

    assert_eq!(app.ledger_count().await, 5);
    let orgs: Vec<String> = sqlx::query_scalar("SELECT org_id FROM ledger")
        .fetch_all(&app.pool)
        .await
        .unwrap();
    assert!(!orgs.contains(&"evil".to_string()));
    app.stop().await;
}
