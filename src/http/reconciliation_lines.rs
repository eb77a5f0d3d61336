//! `GET /v1/reconciliations/{id}/lines` (contract §6): a page of a stored reconciliation's
//! lines, filtered and sorted, for a reader (the console) rather than a download: offset
//! paging with the total matching, since a reader sorts by several columns and jumps to
//! any page (decision 0027). The rows are those of `lines.csv?format=json`.

use axum::extract::{Path, State};
use axum::{Extension, Json};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;
use uuid::Uuid;

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::listing;
use super::query::{QueryParams, StrictQuery};
use super::reconciliations::{self, LineRow, LINE_COLUMNS};
use super::AppState;
use crate::billing::reconcile::Status;
use crate::billing::report::RESOURCE_ID_MAX;
use crate::error_code::ErrorCode;
use crate::event::OrgId;
use crate::finance::catalog;

/// Lines per page when `limit` is not given.
pub const LINES_DEFAULT: usize = 100;
/// The most lines one page holds.
pub const LINES_MAX: usize = 1_000;
/// The largest `offset`: past any reconciliation's size in practice (a report is bounded by
/// `TALLY_REPORT_MAX_BYTES`), and a bound on how many rows one page may make the database
/// step over.
pub const OFFSET_MAX: u64 = 10_000_000;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new().routes(routes!(get_lines_page))
}

/// The orders a page can be sorted in. Every order ends with the line's stored order (its
/// report line, then the `missing_in_provider` lines), and puts lines without the figure
/// (`not_runtime`, null) last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sort {
    ReportLine,
    CostDelta,
    CostDeltaDescending,
    DeltaMs,
    DeltaMsDescending,
    AbsCostDelta,
}

impl Sort {
    const ALL: [(&'static str, Sort); 6] = [
        ("report_line", Sort::ReportLine),
        ("cost_delta", Sort::CostDelta),
        ("-cost_delta", Sort::CostDeltaDescending),
        ("delta_ms", Sort::DeltaMs),
        ("-delta_ms", Sort::DeltaMsDescending),
        ("abs_cost_delta", Sort::AbsCostDelta),
    ];

    fn parse(value: Option<&str>) -> Result<Sort, ApiError> {
        let Some(value) = value else {
            return Ok(Sort::ReportLine);
        };
        Sort::ALL
            .iter()
            .find(|(name, _)| *name == value)
            .map(|(_, sort)| *sort)
            .ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidSort,
                    format!(
                        "sort: {value:?} is not one of report_line, cost_delta, -cost_delta, \
                         delta_ms, -delta_ms, abs_cost_delta"
                    ),
                )
            })
    }

    /// The `ORDER BY` of the order, on the table named `line`; `seq` is unique within a
    /// reconciliation, so the order is total and a page never repeats or skips a line. The
    /// columns are qualified: unqualified, `cost_delta` would name the output column
    /// `cost_delta::TEXT` and sort as text.
    fn order_by(self) -> &'static str {
        match self {
            Sort::ReportLine => "line.seq",
            Sort::CostDelta => "line.cost_delta ASC NULLS LAST, line.seq",
            Sort::CostDeltaDescending => "line.cost_delta DESC NULLS LAST, line.seq",
            Sort::DeltaMs => "line.delta_ms ASC NULLS LAST, line.seq",
            Sort::DeltaMsDescending => "line.delta_ms DESC NULLS LAST, line.seq",
            Sort::AbsCostDelta => "abs(line.cost_delta) DESC NULLS LAST, line.seq",
        }
    }
}

/// The query of a page of lines, read as text and checked by the route.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct LinesPageParams {
    /// Only lines of this status.
    #[param(
        pattern = "^(matched|provider_over|provider_under|missing_in_ledger|org_mismatch|missing_in_provider|not_runtime)$"
    )]
    status: Option<String>,
    /// Only lines whose ledger org (`org_id`) or tagged org (`provider_org_id`) is this one.
    org_id: Option<String>,
    /// Only lines of this resource (`container_id`, the report's `ResourceId`).
    container_id: Option<String>,
    /// `report_line` (the default: the report's order, then the `missing_in_provider`
    /// lines), `cost_delta`, `-cost_delta`, `delta_ms`, `-delta_ms`, or `abs_cost_delta`
    /// (largest |cost_delta| first). Lines without the figure come last; ties keep the
    /// stored order.
    #[param(pattern = "^(report_line|-?cost_delta|-?delta_ms|abs_cost_delta)$")]
    sort: Option<String>,
    /// Lines to skip, 0–10000000; default 0.
    #[param(value_type = Option<u64>, minimum = 0, maximum = 10_000_000)]
    offset: Option<String>,
    /// 1–1000, default 100.
    #[param(value_type = Option<usize>, minimum = 1, maximum = 1000)]
    limit: Option<String>,
}

impl QueryParams for LinesPageParams {
    fn unknown_parameter(name: &str) -> ApiError {
        ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!("{name}: is not a parameter of this list"),
        )
    }
}

/// A page of a reconciliation's lines.
#[derive(Serialize, ToSchema)]
pub struct LinesPage {
    /// The ledger position the reconciliation reflected.
    position: i64,
    reconciliation_id: Uuid,
    /// The lines matching the filters, on every page.
    total: i64,
    offset: u64,
    limit: usize,
    /// At most `limit`, in the order asked for: the objects of `lines.csv?format=json`.
    lines: Vec<LineRow>,
}

/// What a page is filtered to: each is left out of the statement when not asked for.
#[derive(Debug, Default)]
struct Filters {
    status: Option<&'static str>,
    /// Either org of the line.
    org_id: Option<String>,
    container_id: Option<String>,
    /// A bound token's org: the ledger org, as in `lines.csv`.
    bound: Option<String>,
}

impl Filters {
    fn parse(params: &LinesPageParams, principal: &Principal) -> Result<Filters, ApiError> {
        let status = params
            .status
            .as_deref()
            .map(|value| {
                Status::ALL
                    .iter()
                    .map(|status| status.as_str())
                    .find(|status| *status == value)
                    .ok_or_else(|| {
                        ApiError::invalid(
                            ErrorCode::InvalidStatus,
                            format!("status: {value:?} is not a line status"),
                        )
                    })
            })
            .transpose()?;
        let org_id = params
            .org_id
            .as_deref()
            .map(|value| {
                let org_id = OrgId::parse(value).map_err(|error| {
                    ApiError::invalid(ErrorCode::InvalidOrgId, format!("org_id: {error}"))
                })?;
                principal.check_org(org_id.as_str())?;
                Ok::<_, ApiError>(org_id.as_str().to_owned())
            })
            .transpose()?;
        let container_id = params
            .container_id
            .as_deref()
            .map(|value| {
                // A line's resource id is the provider's text (an ARN, a path), as long as
                // a report may give it.
                if value.is_empty() || value.chars().count() > RESOURCE_ID_MAX {
                    return Err(ApiError::invalid(
                        ErrorCode::InvalidContainerId,
                        format!("container_id: 1 to {RESOURCE_ID_MAX} characters"),
                    ));
                }
                Ok(value.to_owned())
            })
            .transpose()?;
        Ok(Filters {
            status,
            org_id,
            container_id,
            bound: principal.org_id.clone(),
        })
    }

    /// The filters as a `WHERE` condition on `$1` (the reconciliation) to `$5`; a filter not
    /// asked for is a test of its (null) parameter, so that the statement uses every
    /// parameter and its plan has only the conditions asked for.
    fn condition(&self) -> String {
        let mut condition = String::from("reconciliation_id = $1");
        condition.push_str(match self.status {
            Some(_) => " AND status = $2",
            None => " AND $2::TEXT IS NULL",
        });
        condition.push_str(match self.org_id {
            Some(_) => " AND (org_id = $3 OR provider_org_id = $3)",
            None => " AND $3::TEXT IS NULL",
        });
        condition.push_str(match self.container_id {
            Some(_) => " AND container_id = $4",
            None => " AND $4::TEXT IS NULL",
        });
        condition.push_str(match self.bound {
            Some(_) => " AND org_id = $5",
            None => " AND $5::TEXT IS NULL",
        });
        condition
    }

    fn bind<'q, O>(
        &'q self,
        query: sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments>,
        id: Uuid,
    ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, O, sqlx::postgres::PgArguments> {
        query
            .bind(id)
            .bind(self.status)
            .bind(self.org_id.as_deref())
            .bind(self.container_id.as_deref())
            .bind(self.bound.as_deref())
    }

    /// The stored counts answer the total when only the status is filtered.
    fn counted(&self) -> bool {
        self.org_id.is_none() && self.container_id.is_none() && self.bound.is_none()
    }
}

/// Lines to skip: 0 unless given, at most [`OFFSET_MAX`].
fn offset(value: Option<&str>) -> Result<u64, ApiError> {
    match value {
        None => Ok(0),
        Some(value) => super::listing::whole_number::<u64>(value)
            .filter(|offset| *offset <= OFFSET_MAX)
            .ok_or_else(|| {
                ApiError::invalid(
                    ErrorCode::InvalidOffset,
                    format!("offset: must be a whole number from 0 to {OFFSET_MAX}"),
                )
            }),
    }
}

/// A page of a reconciliation's lines: filtered by `status`, `org_id` (the ledger's or the
/// tagged org) and `container_id`, sorted by `sort`, `limit` lines from `offset`, with the
/// `total` matching. A token bound to an org gets that org's lines only (by the ledger's
/// org, as `lines.csv`); naming another org is 403 `org_not_allowed`. The lines are those
/// the run stored, so the page does not wait for the projection; `position` is the one
/// the reconciliation reflected.
#[utoipa::path(
    get,
    path = "/v1/reconciliations/{reconciliation_id}/lines",
    tag = "finance",
    params(
        ("reconciliation_id" = String, Path, description = "the id a reconciliation returned"),
        LinesPageParams,
    ),
    responses(
        (status = 200, body = LinesPage),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "`reconciliation_not_found`"),
        (status = 409, body = ErrorBody, description = "`reconciliation_running` (with Retry-After)"),
        (status = 422, body = ErrorBody, description = "`invalid_reconciliation_id`, `invalid_status`, `invalid_org_id`, `invalid_container_id`, `invalid_sort`, `invalid_offset`, `invalid_limit`, `unknown_parameter`"),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_lines_page(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(reconciliation_id): Path<String>,
    StrictQuery(params): StrictQuery<LinesPageParams>,
) -> Result<Json<LinesPage>, ApiError> {
    let id = reconciliations::reconciliation_id(&reconciliation_id)?;
    let filters = Filters::parse(&params, &principal)?;
    let sort = Sort::parse(params.sort.as_deref())?;
    let offset = offset(params.offset.as_deref())?;
    let limit = listing::limit(params.limit.as_deref(), LINES_DEFAULT, LINES_MAX)?;
    let entry = reconciliations::stored(&state.pool, id, || async {
        Ok(catalog::reconciliation(&state.pool, id).await?)
    })
    .await?;
    let total = if filters.counted() {
        let counts = &entry.counts;
        match filters.status {
            Some(status) => counts
                .get(status)
                .and_then(|count| count.as_i64())
                .unwrap_or(0),
            None => entry.lines(),
        }
    } else {
        count(&state.pool, id, &filters).await?
    };
    // A page past the last line is empty, without asking the database to step over them.
    let lines = if offset >= total.max(0) as u64 {
        Vec::new()
    } else {
        page(&state.pool, id, &filters, sort, offset, limit).await?
    };
    Ok(Json(LinesPage {
        position: entry.ledger_position,
        reconciliation_id: id,
        total,
        offset,
        limit,
        lines,
    }))
}

/// How many lines match the filters.
#[tracing::instrument(skip_all)]
async fn count(pool: &PgPool, id: Uuid, filters: &Filters) -> Result<i64, sqlx::Error> {
    let statement = format!(
        "SELECT count(*) FROM reconciliation_line WHERE {}",
        filters.condition()
    );
    let (total,): (i64,) = filters
        .bind(sqlx::query_as(&statement), id)
        .fetch_one(pool)
        .await?;
    Ok(total)
}

/// The page's lines, in the order asked for. The order is found on the lines' sort keys and
/// `seq` alone, and only the page's rows are read whole: a sort by a figure reads every
/// line of the reconciliation that matches (there is no index per order; decision 0027),
/// and keeping its rows narrow keeps that sort in memory.
#[tracing::instrument(skip_all)]
async fn page(
    pool: &PgPool,
    id: Uuid,
    filters: &Filters,
    sort: Sort,
    offset: u64,
    limit: usize,
) -> Result<Vec<LineRow>, sqlx::Error> {
    let (condition, order_by) = (filters.condition(), sort.order_by());
    let statement = format!(
        "SELECT {LINE_COLUMNS} FROM reconciliation_line line \
         WHERE reconciliation_id = $1 AND seq IN ( \
             SELECT seq FROM reconciliation_line line WHERE {condition} \
             ORDER BY {order_by} LIMIT $6 OFFSET $7) \
         ORDER BY {order_by}"
    );
    filters
        .bind(sqlx::query_as(&statement), id)
        .bind(limit as i64)
        .bind(offset as i64)
        .fetch_all(pool)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sort_parses_and_others_are_refused() {
        assert_eq!(Sort::parse(None).unwrap(), Sort::ReportLine);
        for (name, sort) in Sort::ALL {
            assert_eq!(Sort::parse(Some(name)).unwrap(), sort);
        }
        for bad in ["", "abs", "-report_line", "-abs_cost_delta", "COST_DELTA"] {
            assert_eq!(
                Sort::parse(Some(bad)).unwrap_err().code.as_str(),
                "invalid_sort"
            );
        }
    }

    #[test]
    fn an_offset_past_its_bound_is_refused() {
        assert_eq!(offset(None).unwrap(), 0);
        assert_eq!(offset(Some("10000000")).unwrap(), OFFSET_MAX);
        for bad in ["10000001", "-1", "x", "18446744073709551616"] {
            assert_eq!(
                offset(Some(bad)).unwrap_err().code.as_str(),
                "invalid_offset"
            );
        }
    }
}
