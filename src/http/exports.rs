//! `GET /v1/exports/usage.csv?period=YYYY-MM` (DESIGN §6): usage per org, streamed as CSV
//! (or `?format=json`).

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use chrono::{SubsecRound, Utc};
use futures::StreamExt;

use super::error::{ApiError, ErrorBody};
use super::AppState;
use crate::exports::{self, USAGE_CSV_HEADER};
use crate::runtime::Period;

pub fn router() -> Router<AppState> {
    Router::new().route("/v1/exports/usage.csv", get(get_usage_export))
}

/// Usage of every org in a period, priced: one row per org.
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
    Query(params): Query<HashMap<String, String>>,
) -> Result<Response, ApiError> {
    if let Some(unknown) = params
        .keys()
        .find(|name| !["period", "format"].contains(&name.as_str()))
    {
        return Err(invalid(
            "unknown_parameter",
            format!("{unknown}: is not a parameter of this export"),
        ));
    }
    let period = params
        .get("period")
        .ok_or_else(|| invalid("invalid_period", "period is required: YYYY-MM"))
        .and_then(|period| {
            Period::parse(period).map_err(|error| invalid("invalid_period", error.to_string()))
        })?;
    let json_format = match params.get("format").map(String::as_str) {
        None | Some("csv") => false,
        Some("json") => true,
        Some(other) => {
            return Err(invalid(
                "invalid_format",
                format!("format: {other:?} is not csv or json"),
            ))
        }
    };
    let as_of = Utc::now().trunc_subsecs(3).min(period.end());
    let rows = exports::usage_rows(state.pool.clone(), period, as_of).enumerate();
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
    let tail = futures::stream::once(async move {
        Ok::<Bytes, std::io::Error>(Bytes::from(if json_format { "]}" } else { "" }))
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

fn invalid(code: &'static str, message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, message)
}
