//! Query strings read into a type: a `Deserialize` struct with `deny_unknown_fields` that
//! is also the route's parameters in the OpenAPI document. A name the type does not have
//! is refused with the route's 422 `unknown_parameter`; a name given twice never gets
//! here (the server refuses it first). Values are read as text and checked by the route,
//! each with its own code.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use axum::extract::{FromRequestParts, MatchedPath, Query, Request};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::Value;
use utoipa::openapi::path::ParameterIn;
use utoipa::openapi::OpenApi;

use super::body::field_names;
use super::error::ApiError;
use crate::error_code::ErrorCode;

/// The query parameters of a route, as a `T`.
#[derive(Debug)]
pub struct StrictQuery<T>(pub T);

/// A type a query string is read into.
pub trait QueryParams: DeserializeOwned {
    /// The refusal of the parameter `name`, which the route does not know: 422
    /// `unknown_parameter`, in the route's words.
    fn unknown_parameter(name: &str) -> ApiError;
}

impl<T: QueryParams, S: Send + Sync> FromRequestParts<S> for StrictQuery<T> {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Response> {
        let Query(params) = Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(IntoResponse::into_response)?;
        typed(params)
            .map(StrictQuery)
            .map_err(IntoResponse::into_response)
    }
}

fn typed<T: QueryParams>(params: HashMap<String, String>) -> Result<T, ApiError> {
    let known = field_names::<T>();
    if let Some(unknown) = params.keys().find(|name| !known.contains(&name.as_str())) {
        return Err(T::unknown_parameter(unknown));
    }
    let params = params
        .into_iter()
        .map(|(name, value)| (name, Value::String(value)))
        .collect();
    serde_json::from_value(Value::Object(params)).map_err(|error| {
        ApiError::invalid(
            ErrorCode::InvalidParameter,
            format!("the query does not fit the route: {error}"),
        )
    })
}

/// The `/v1` operations of an OpenAPI document that take no query parameter, as (method,
/// path) with the method in upper case: their handlers read no query string, so that
/// [`refuse_any_query`] refuses every parameter sent to them rather than ignoring it.
pub(super) fn parameterless(document: &OpenApi) -> Arc<HashSet<(String, String)>> {
    let mut operations = HashSet::new();
    for (path, item) in &document.paths.paths {
        let methods = [
            ("GET", &item.get),
            ("PUT", &item.put),
            ("POST", &item.post),
            ("DELETE", &item.delete),
            ("PATCH", &item.patch),
        ];
        for (method, operation) in methods {
            let Some(operation) = operation else { continue };
            let takes_query = operation
                .parameters
                .iter()
                .flatten()
                .any(|parameter| matches!(parameter.parameter_in, ParameterIn::Query));
            if !takes_query {
                operations.insert((method.to_owned(), path.clone()));
            }
        }
    }
    Arc::new(operations)
}

/// Refuses a request to an operation that takes no query parameter ([`parameterless`])
/// when it sends one: 422 `unknown_parameter`, before the handler runs, so that
/// `POST /v1/events?dry_run=true` stores nothing. Other operations read their query with
/// [`StrictQuery`], which refuses a name it does not know in the route's own words.
pub(super) async fn refuse_any_query(
    operations: axum::extract::State<Arc<HashSet<(String, String)>>>,
    path: MatchedPath,
    request: Request,
    next: Next,
) -> Response {
    let sent = request.uri().query().and_then(|query| {
        url::form_urlencoded::parse(query.as_bytes())
            .map(|(name, _)| name.into_owned())
            .next()
    });
    // HEAD is answered by the GET handler, and is the GET operation of the document.
    let method = match request.method().as_str() {
        "HEAD" => "GET",
        method => method,
    };
    let operation = (method.to_owned(), path.as_str().to_owned());
    match sent {
        Some(name) if operations.contains(&operation) => ApiError::invalid(
            ErrorCode::UnknownParameter,
            format!(
                "{name}: {} {} takes no query parameter; nothing was done",
                operation.0, operation.1
            ),
        )
        .into_response(),
        _ => next.run(request).await,
    }
}

/// Whether `format` asks for JSON rather than CSV (the default).
pub(super) fn wants_json(format: Option<&str>) -> Result<bool, ApiError> {
    match format {
        None | Some("csv") => Ok(false),
        Some("json") => Ok(true),
        Some(other) => Err(ApiError::invalid(
            ErrorCode::InvalidFormat,
            format!("format: {other:?} is not csv or json"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Sample {
        r#type: Option<String>,
        after: Option<String>,
    }

    impl QueryParams for Sample {
        fn unknown_parameter(name: &str) -> ApiError {
            ApiError::invalid(
                ErrorCode::UnknownParameter,
                format!("{name}: is not a filter"),
            )
        }
    }

    fn query(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect()
    }

    #[test]
    fn known_parameters_are_read_as_text() {
        let sample: Sample = typed(query(&[("type", "container.created")])).unwrap();
        assert_eq!(sample.r#type.as_deref(), Some("container.created"));
        assert_eq!(sample.after, None);
    }

    #[test]
    fn a_parameter_the_route_does_not_know_is_refused_in_its_words() {
        let error = typed::<Sample>(query(&[("after", "1"), ("colour", "red")])).unwrap_err();
        assert_eq!(
            (error.status, error.code.as_str(), error.message.as_str()),
            (
                StatusCode::UNPROCESSABLE_ENTITY,
                "unknown_parameter",
                "colour: is not a filter"
            )
        );
    }
}
