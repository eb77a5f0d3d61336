//! Request bodies every JSON route reads the same way: `application/json` or 415, at most
//! the body limit or 413, JSON or 400, an object or 422, and no field it does not know.

use axum::body::Body;
use axum::http::{header, HeaderMap, StatusCode};
use serde_json::{Map, Value};

use super::error::ApiError;
use super::events::read_body;
use super::AppState;

/// The body as a JSON object.
pub async fn json_object(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Map<String, Value>, ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.split(';').next().map(str::trim) == Some("application/json"));
    if !is_json {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Content-Type must be application/json",
        ));
    }
    let bytes = read_body(body, state.body_max_bytes).await?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(fields)) => Ok(fields),
        Ok(_) => Err(ApiError::invalid(
            "invalid_body",
            "the body must be a JSON object",
        )),
        Err(error) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "malformed_json",
            format!("body is not JSON: {error}"),
        )),
    }
}

/// 422 `unknown_field` for the first field not in `known`.
pub fn only_fields(
    fields: &Map<String, Value>,
    known: &[&str],
    what: &str,
) -> Result<(), ApiError> {
    match fields.keys().find(|name| !known.contains(&name.as_str())) {
        Some(unknown) => Err(ApiError::invalid(
            "unknown_field",
            format!("{unknown}: is not a field of {what}"),
        )),
        None => Ok(()),
    }
}
