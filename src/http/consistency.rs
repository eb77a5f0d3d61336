//! How fresh a read of derived figures must be (contract §8): by default every event
//! acknowledged before the read began, by any instance; `min_position` (query parameter or
//! `Tally-Min-Position` header) for a given position; `consistency=eventual` for the
//! projection as it stands. Every answer names the checkpoint its figures reflect.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use axum::http::HeaderMap;
use serde::Deserialize;
use utoipa::IntoParams;

use super::error::ApiError;
use super::replica::{self, ReadPool, Replayed};
use super::AppState;
use crate::error_code::ErrorCode;
use crate::ledger::read;
use crate::projection::query::AtPosition;
use crate::projection::{store, WaitError};

/// The header a producer may send instead of `?min_position=`.
pub const MIN_POSITION_HEADER: &str = "tally-min-position";

/// The query parameters of this module, read as text and checked by [`Consistency::parse`];
/// the whole query of a route that has no others. A route with others has these two fields
/// as well, left out of its own parameters in the document (`#[param(ignore)]`), which
/// lists these.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ConsistencyParams {
    /// Wait only until the projection has reached this ledger position (the highest
    /// `position` an ingest answer gave), rather than the head. Also accepted as the header
    /// `Tally-Min-Position`.
    #[param(value_type = Option<i64>, minimum = 0)]
    pub min_position: Option<String>,
    /// `eventual`: answer at once from the projection as it stands; its `position` says how
    /// fresh it is.
    #[param(pattern = "^eventual$")]
    pub consistency: Option<String>,
}

impl super::query::QueryParams for ConsistencyParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this route"),
        )
    }
}

/// What a read waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Consistency {
    /// Every event acknowledged before the read began: the ledger head taken at its start.
    Head,
    /// The projection at this position or later.
    AtLeast(i64),
    /// No wait.
    Eventual,
}

impl Consistency {
    /// From the query parameters `min_position` and `consistency` and the headers.
    /// `min_position` given both ways must agree, and does not go with
    /// `consistency=eventual` (which would not wait for it).
    pub fn parse(
        query_min_position: Option<&str>,
        consistency: Option<&str>,
        headers: &HeaderMap,
    ) -> Result<Consistency, ApiError> {
        let from_query = query_min_position
            .map(|value| min_position("min_position", value))
            .transpose()?;
        let from_header = match headers.get(MIN_POSITION_HEADER) {
            None => None,
            Some(value) => Some(min_position(
                "Tally-Min-Position",
                value.to_str().map_err(|_| {
                    ApiError::invalid(
                        ErrorCode::InvalidMinPosition,
                        "Tally-Min-Position: is not a whole number",
                    )
                })?,
            )?),
        };
        let wanted = match (from_query, from_header) {
            (Some(query), Some(header)) if query != header => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidMinPosition,
                    format!(
                        "min_position {query} and Tally-Min-Position {header} disagree; give one"
                    ),
                ))
            }
            (query, header) => query.or(header),
        };
        let eventual = match consistency {
            None => false,
            Some("eventual") => true,
            Some(other) => {
                return Err(ApiError::invalid(
                    ErrorCode::InvalidConsistency,
                    format!("consistency: {other:?} is not eventual"),
                ))
            }
        };
        match (eventual, wanted) {
            (true, Some(_)) => Err(ApiError::invalid(
                ErrorCode::InvalidConsistency,
                "consistency=eventual does not wait, so it does not go with min_position",
            )),
            (true, None) => Ok(Consistency::Eventual),
            (false, Some(position)) => Ok(Consistency::AtLeast(position)),
            (false, None) => Ok(Consistency::Head),
        }
    }

    /// The position the projection must reach: the ledger head for the default mode, read
    /// on the primary key's index.
    async fn wanted(self, state: &AppState) -> Result<i64, ApiError> {
        Ok(match self {
            Consistency::Eventual => 0,
            Consistency::AtLeast(position) => reachable(state, position).await?,
            Consistency::Head => read::head(&state.pool).await?.position,
        })
    }

    /// Checks what this asks without waiting for it, for a read that has nothing to wait for
    /// (a closed period's snapshot): a `min_position` past the ledger's head is 422 all the
    /// same.
    pub async fn check(self, state: &AppState) -> Result<(), ApiError> {
        if let Consistency::AtLeast(position) = self {
            reachable(state, position).await?;
        }
        Ok(())
    }

    /// Waits as this asks, within `TALLY_READ_WAIT_MS`; returns the projection's checkpoint.
    /// Past the wait: 503 `projection_lagging`.
    pub async fn settle(self, state: &AppState) -> Result<i64, ApiError> {
        let wanted = self.wanted(state).await?;
        wait(state, wanted, state.read_wait).await
    }

    /// Waits as this asks on the database exports read (the read database when one is set,
    /// [`replica::projected`]), within `TALLY_READ_WAIT_MS`; returns that database. The
    /// position wanted is taken on the primary.
    pub async fn settle_reads(self, state: &AppState) -> Result<ReadPool, ApiError> {
        let wanted = self.wanted(state).await?;
        let Some(replica) = replica::replica(state) else {
            wait(state, wanted, state.read_wait).await?;
            return Ok(ReadPool::primary(state));
        };
        match replica::projected(state, &replica, wanted).await? {
            Replayed::Reached => Ok(replica),
            Replayed::Short(replayed) => {
                // Name the part that is behind: the projection itself, or the replay of it.
                let mut connection = state.pool.acquire().await?;
                let projected = store::checkpoint(&mut connection, store::LIVE).await?;
                if projected < wanted {
                    Err(lagging(state, wanted, projected))
                } else {
                    Err(replica::replica_lagging(
                        state,
                        "projection",
                        wanted,
                        replayed,
                    ))
                }
            }
        }
    }

    /// Reads figures that reflect what this asks. `read` returns them with the checkpoint of
    /// the snapshot they come from, which is the answer's `position`; while that snapshot is
    /// behind the position wanted, this waits for the projection and reads again, all
    /// within `TALLY_READ_WAIT_MS`.
    pub async fn read<T, E, Read>(
        self,
        state: &AppState,
        mut read: impl FnMut() -> Read,
    ) -> Result<AtPosition<T>, ApiError>
    where
        Read: Future<Output = Result<AtPosition<T>, E>>,
        ApiError: From<E>,
    {
        let deadline = Instant::now() + state.read_wait;
        let wanted = self.wanted(state).await?;
        loop {
            // Read first: a caught-up projection, the usual case, answers from this one
            // snapshot, with no separate look at the checkpoint.
            let found = read().await?;
            if found.position >= wanted {
                return Ok(found);
            }
            if Instant::now() >= deadline {
                return Err(lagging(state, wanted, found.position));
            }
            wait(
                state,
                wanted,
                deadline.saturating_duration_since(Instant::now()),
            )
            .await?;
        }
    }
}

/// Waits, at most `TALLY_READ_WAIT_MS`, until the projection holds every event of `org`
/// this instance acknowledged: 503 `projection_lagging` past it.
pub(super) async fn own_writes_of(state: &AppState, org: &str) -> Result<(), ApiError> {
    let wanted = state.freshness.wanted_for(org);
    if state.freshness.projected_at_least(wanted) {
        return Ok(());
    }
    wait(state, wanted, state.read_wait).await.map(|_| ())
}

/// Waits until the projection reaches `wanted`, for at most `within`.
async fn wait(state: &AppState, wanted: i64, within: Duration) -> Result<i64, ApiError> {
    match state
        .freshness
        .wait_projected(&state.pool, wanted, within)
        .await
    {
        Ok(checkpoint) => Ok(checkpoint),
        Err(WaitError::Lagging { wanted, checkpoint }) => Err(lagging(state, wanted, checkpoint)),
        Err(WaitError::Database(error)) => Err(error.into()),
    }
}

fn lagging(state: &AppState, wanted: i64, checkpoint: i64) -> ApiError {
    metrics::counter!(crate::telemetry::READ_LAGGING).increment(1);
    ApiError::unavailable(
        ErrorCode::ProjectionLagging,
        format!(
            "the projection is at position {checkpoint}, short of {wanted} after {} ms; retry later",
            state.read_wait.as_millis()
        ),
    )
}

/// `min_position` as a position a read can wait for: 422 `invalid_min_position` when it is
/// past the ledger's head, for no event was acknowledged there and no wait would reach it
/// (a 503 would have the caller retry for ever). The head is read only when neither the
/// projection nor this instance's appender is known to be there already.
pub async fn reachable(state: &AppState, position: i64) -> Result<i64, ApiError> {
    if state.freshness.projected_at_least(position) || state.freshness.committed_at_least(position)
    {
        return Ok(position);
    }
    let head = read::head(&state.pool).await?.position;
    if position > head {
        return Err(ApiError::invalid(
            ErrorCode::InvalidMinPosition,
            format!(
                "min_position {position} is past the ledger's head {head}: no event was \
                 acknowledged there"
            ),
        ));
    }
    Ok(position)
}

fn min_position(name: &str, value: &str) -> Result<i64, ApiError> {
    super::listing::whole_number::<i64>(value).ok_or_else(|| {
        ApiError::invalid(
            ErrorCode::InvalidMinPosition,
            format!("{name}: {value:?} is not a whole number from 0"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(query: &[(&str, &str)], header: Option<&str>) -> Result<Consistency, &'static str> {
        let param = |wanted: &str| {
            query
                .iter()
                .find(|(name, _)| *name == wanted)
                .map(|(_, value)| *value)
        };
        let mut headers = HeaderMap::new();
        if let Some(header) = header {
            headers.insert(MIN_POSITION_HEADER, header.parse().unwrap());
        }
        Consistency::parse(param("min_position"), param("consistency"), &headers)
            .map_err(|error| error.code.as_str())
    }

    #[test]
    fn the_modes_parse_from_the_query_and_the_header() {
        assert_eq!(parse(&[], None), Ok(Consistency::Head));
        assert_eq!(
            parse(&[("min_position", "7")], None),
            Ok(Consistency::AtLeast(7))
        );
        assert_eq!(parse(&[], Some("7")), Ok(Consistency::AtLeast(7)));
        assert_eq!(
            parse(&[("min_position", "7")], Some("7")),
            Ok(Consistency::AtLeast(7))
        );
        assert_eq!(
            parse(&[("consistency", "eventual")], None),
            Ok(Consistency::Eventual)
        );
    }

    #[test]
    fn bad_values_are_refused_with_their_code() {
        for (query, header, code) in [
            (vec![("min_position", "-1")], None, "invalid_min_position"),
            (vec![("min_position", "x")], None, "invalid_min_position"),
            (vec![("min_position", "1.5")], None, "invalid_min_position"),
            (vec![], Some("-3"), "invalid_min_position"),
            (
                vec![("min_position", "7")],
                Some("8"),
                "invalid_min_position",
            ),
            (vec![("consistency", "strong")], None, "invalid_consistency"),
            (
                vec![("consistency", "eventual"), ("min_position", "7")],
                None,
                "invalid_consistency",
            ),
        ] {
            assert_eq!(parse(&query, header), Err(code), "{query:?} {header:?}");
        }
    }
}
