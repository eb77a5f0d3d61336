//! `GET /v1/exports/usage.csv?period=YYYY-MM` (DESIGN §6): usage per org, streamed as CSV
//! (or `?format=json`).

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::extract::Path;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use chrono::{SubsecRound, Utc};
use futures::StreamExt;

use super::auth::Principal;
use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::exports::{self, USAGE_CSV_HEADER};
use crate::periods::CloseError;
use crate::runtime::Period;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/v1/exports/usage.csv", get(get_usage_export))
        .route("/v1/periods/{period}/close", post(post_close))
        .route("/v1/periods/{period}", get(get_period))
}

#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct PeriodResponse {
    period: String,
    closed_at: String,
    orgs: i64,
    /// Of the snapshot's usage-export bytes.
    sha256: String,
    /// The stored snapshot still hashes to `sha256`.
    verified: bool,
}

impl From<crate::periods::Closed> for PeriodResponse {
    fn from(closed: crate::periods::Closed) -> Self {
        PeriodResponse {
            period: closed.period.to_string(),
            closed_at: crate::event::canonical::timestamp(closed.closed_at),
            orgs: closed.orgs,
            sha256: closed.sha256,
            verified: closed.verified,
        }
    }
}

/// Close a finished period: freeze every org's figures in a hashed snapshot. Global: a
/// token bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    post,
    path = "/v1/periods/{period}/close",
    tag = "finance",
    params(("period" = String, Path, description = "YYYY-MM")),
    responses(
        (status = 201, body = PeriodResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 409, body = ErrorBody, description = "still running, or already closed"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn post_close(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(period): Path<String>,
) -> Result<(StatusCode, Json<PeriodResponse>), ApiError> {
    let period = Period::parse(&period)
        .map_err(|error| ApiError::invalid("invalid_period", error.to_string()))?;
    match crate::periods::close(&state.pool, period, &principal.id).await {
        Ok(closed) => Ok((StatusCode::CREATED, Json(closed.into()))),
        Err(CloseError::Running(period, until)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "period_running",
            format!(
                "period {period} runs until {}",
                crate::event::canonical::timestamp(until)
            ),
        )),
        Err(CloseError::AlreadyClosed(period)) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "period_closed",
            format!("period {period} is already closed"),
        )),
        Err(CloseError::Store(error)) => Err(ApiError::from(error)),
    }
}

/// A closed period, with its snapshot verified against its hash. Global (the snapshot and
/// its hash cover every org): a token bound to an org gets 403 `org_bound_token`.
#[utoipa::path(
    get,
    path = "/v1/periods/{period}",
    tag = "finance",
    params(("period" = String, Path, description = "YYYY-MM")),
    responses(
        (status = 200, body = PeriodResponse),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody, description = "not closed"),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_period(
    State(state): State<AppState>,
    Path(period): Path<String>,
) -> Result<Json<PeriodResponse>, ApiError> {
    let period = Period::parse(&period)
        .map_err(|error| ApiError::invalid("invalid_period", error.to_string()))?;
    match crate::periods::get(&state.pool, period).await? {
        Some(closed) => Ok(Json(closed.into())),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "period_not_closed",
            format!("period {period} is not closed"),
        )),
    }
}

/// Usage of every org in a period, priced: one row per org (a token bound to an org gets
/// that org's row only).
#[utoipa::path(
    get,
    path = "/v1/exports/usage.csv",
    tag = "finance",
    params(
        ("period" = String, Query, description = "YYYY-MM"),
        ("format" = Option<String>, Query, description = "csv (default) or json"),
    ),
    responses(
        (status = 200, content_type = "text/csv", body = String),
        (status = 401, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn get_usage_export(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Query(params): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    if let Some(unknown) = params
        .keys()
        .find(|name| !["period", "format"].contains(&name.as_str()))
    {
        return Err(ApiError::invalid(
            "unknown_parameter",
            format!("{unknown}: is not a parameter of this export"),
        ));
    }
    let period = params
        .get("period")
        .ok_or_else(|| ApiError::invalid("invalid_period", "period is required: YYYY-MM"))
        .and_then(|period| {
            Period::parse(period)
                .map_err(|error| ApiError::invalid("invalid_period", error.to_string()))
        })?;
    let json_format = match params.get("format").map(String::as_str) {
        None | Some("csv") => false,
        Some("json") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "invalid_format",
                format!("format: {other:?} is not csv or json"),
            ))
        }
    };
    let as_of = Utc::now().trunc_subsecs(3).min(period.end());
    // A token bound to one org is served that org's row and adjustments only.
    let bound = principal.org_id.clone();
    let rows = match bound.clone() {
        None => exports::usage_rows(state.pool.clone(), period, as_of).boxed(),
        Some(org_id) => {
            let pool = state.pool.clone();
            futures::stream::once(async move {
                exports::org_usage_row(&pool, period, as_of, &org_id).await
            })
            .filter_map(|row| async move { row.transpose() })
            .boxed()
        }
    }
    .enumerate();
    let head = futures::stream::once(async move {
        Ok::<Bytes, std::io::Error>(Bytes::from(if json_format {
            "{\"rows\":[".to_owned()
        } else {
            format!("{USAGE_CSV_HEADER}\n")
        }))
    });
    let body = rows.map(move |(index, row)| match row {
        Ok(row) if json_format => {
            let separator = if index == 0 { "" } else { "," };
            Ok(Bytes::from(format!("{separator}{}", row.json())))
        }
        Ok(row) => Ok(Bytes::from(row.csv())),
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "usage export failed midway");
            Err(std::io::Error::other(error.to_string()))
        }
    });
    // Adjustments of closed periods whose next open period is this one, after the rows.
    let pool = state.pool.clone();
    let tail = futures::stream::once(async move {
        let mut adjustments = crate::periods::adjustments(&pool, period)
            .await
            .map_err(|error| std::io::Error::other(error.to_string()))?;
        if let Some(bound) = &bound {
            adjustments.retain(|adjustment| &adjustment.delta.org_id == bound);
        }
        let text = if json_format {
            let listed: Vec<_> = adjustments
                .iter()
                .map(|adjustment| adjustment.json())
                .collect();
            format!("],\"adjustments\":{}}}", serde_json::Value::from(listed))
        } else {
            adjustments
                .iter()
                .map(|adjustment| adjustment.delta.csv())
                .collect()
        };
        Ok::<Bytes, std::io::Error>(Bytes::from(text))
    });
    let content_type = if json_format {
        "application/json"
    } else {
        "text/csv; charset=utf-8"
    };
    Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from_stream(head.chain(body).chain(tail)))
        .map_err(|error| ApiError::internal(&error))
}
