//! What finance's jobs share: a period close and a reconciliation each run as a job, a row
//! that says `running`, `done` or `failed`, held by the session that runs it through a
//! two-key advisory lock. A `running` row whose lock no session holds was left by a process
//! that stopped: it reads as failed.

use sqlx::PgConnection;

use super::Error;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobStatus {
    Running,
    Done,
    Failed,
}

impl JobStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Running => "running",
            JobStatus::Done => "done",
            JobStatus::Failed => "failed",
        }
    }

    /// The status stored in `table`'s `status` column.
    pub(super) fn parse(text: &str, table: &str) -> Result<JobStatus, Error> {
        match text {
            "running" => Ok(JobStatus::Running),
            "done" => Ok(JobStatus::Done),
            "failed" => Ok(JobStatus::Failed),
            other => Err(Error::Corrupt(format!(
                "{table}.status {other:?} is not a status"
            ))),
        }
    }
}

/// Why a job failed, as its caller is told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobError {
    pub code: String,
    pub message: String,
}

impl JobError {
    /// As an answer gives it: `{"code", "message"}`.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({"code": self.code, "message": self.message})
    }

    /// The stored pair, when the job stored one.
    pub(super) fn stored(code: Option<String>, message: Option<String>) -> Option<JobError> {
        code.zip(message)
            .map(|(code, message)| JobError { code, message })
    }
}

/// Some session of this database holds the two-key advisory lock (`class`, `key`), so a
/// `running` job it marks is really running. Advisory locks belong to a database;
/// `pg_locks` lists every database's.
pub async fn lock_held(connection: &mut PgConnection, class: i32, key: i32) -> sqlx::Result<bool> {
    // A two-key lock is listed with its keys as `classid` and `objid` (OIDs, unsigned) and
    // `objsubid` 2; the keys are compared as the unsigned numbers they are listed as.
    sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted \
           AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) \
           AND classid::BIGINT = $1 AND objid::BIGINT = $2 AND objsubid = 2)",
    )
    .bind(i64::from(class as u32))
    .bind(i64::from(key as u32))
    .fetch_one(connection)
    .await
}

/// Marks the running job `id` of `table` failed with `error`, on the session that holds its
/// lock, before that session ends. When it cannot, the job reads as abandoned once the
/// session has ended: logged, not returned.
pub(super) async fn mark_failed(
    connection: &mut PgConnection,
    table: &str,
    id: uuid::Uuid,
    error: &JobError,
) {
    let marked = sqlx::query(&format!(
        "UPDATE {table} SET status = 'failed', finished_at = now(), error_code = $2, error = $3 \
         WHERE id = $1 AND status = 'running'"
    ))
    .bind(id)
    .bind(&error.code)
    .bind(&error.message)
    .execute(connection)
    .await;
    if let Err(failure) = marked {
        tracing::warn!(job_id = %id, table, error = %failure, "cannot mark the job failed");
    }
}
