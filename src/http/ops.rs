//! Operations endpoints that need no token: `/healthz`, `/readyz`, `/metrics`,
//! `/openapi.json`; and the OpenAPI document itself.

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use serde_json::json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use super::AppState;

/// How long a readiness probe waits for each dependency.
const READY_PROBE_TIMEOUT_MS: u64 = 1_000;

pub(super) fn router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
        .routes(routes!(metrics_text))
        .routes(routes!(openapi_json))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Object)))]
pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Postgres and NATS both answer, the relay has not halted on a `TALLY_LEDGER` message that
/// is not the ledger (`"relay"` says which message and why), and the server keeps every
/// stream as defined (`"streams"` names one it refused, with its answer: say, three copies
/// asked of a server that is not in a cluster).
#[utoipa::path(
    get,
    path = "/readyz",
    tag = "operations",
    responses((status = 200, body = Object), (status = 503, body = Object))
)]
pub async fn readyz(State(state): State<AppState>) -> impl IntoResponse {
    let timeout = Duration::from_millis(READY_PROBE_TIMEOUT_MS);
    let postgres = matches!(
        tokio::time::timeout(timeout, sqlx::query("SELECT 1").execute(&state.pool)).await,
        Ok(Ok(_))
    );
    let nats = state.nats.connection_state() == async_nats::connection::State::Connected
        && matches!(
            tokio::time::timeout(timeout, state.nats.flush()).await,
            Ok(Ok(()))
        );
    let word = |up: bool| if up { "up" } else { "down" };
    let halted = state.relay_status.halted();
    let relay = match &halted {
        None => "up".to_owned(),
        Some(mismatch) => format!("halted: {mismatch}"),
    };
    let refused = state.stream_health.refused();
    let streams = if refused.is_empty() {
        "up".to_owned()
    } else {
        format!("refused: {}", refused.join("; "))
    };
    let ready = postgres && nats && halted.is_none() && refused.is_empty();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(json!({
            "ready": ready,
            "postgres": word(postgres),
            "nats": word(nats),
            "relay": relay,
            "streams": streams,
        })),
    )
}

/// Prometheus text exposition.
#[utoipa::path(get, path = "/metrics", tag = "operations", responses((status = 200, body = String, content_type = "text/plain")))]
pub async fn metrics_text(State(state): State<AppState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
}

/// The document, built and serialized once: it never changes while the process runs, and
/// building it takes far longer than sending it.
static OPENAPI_JSON: std::sync::LazyLock<bytes::Bytes> = std::sync::LazyLock::new(|| {
    serde_json::to_vec(&super::openapi())
        .expect("the OpenAPI document serializes")
        .into()
});

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations", responses((status = 200, body = Object)))]
pub async fn openapi_json() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        OPENAPI_JSON.clone(),
    )
}

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document's top level: its info and the bearer scheme. The paths and their schemas
/// come from the feature routers ([`super::openapi`]).
#[derive(OpenApi)]
#[openapi(
    info(title = "tally", description = "An event-sourced usage and billing ledger"),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

#[cfg(test)]
mod tests {
    /// The JSON request bodies whose schema is a bare object: nothing about their fields.
    fn untyped_request_bodies(document: &serde_json::Value) -> Vec<String> {
        let mut untyped = Vec::new();
        let paths = document["paths"].as_object().expect("paths");
        for (path, operations) in paths {
            for (method, operation) in operations.as_object().expect("operations") {
                let schema = &operation["requestBody"]["content"]["application/json"]["schema"];
                if schema.is_null() {
                    continue;
                }
                let described = schema.get("$ref").is_some()
                    || schema.get("properties").is_some()
                    || schema.get("type").is_some_and(|kind| kind != "object");
                if !described {
                    untyped.push(format!("{method} {path}"));
                }
            }
        }
        untyped
    }

    #[test]
    fn every_json_request_body_in_the_openapi_document_names_its_fields() {
        let document =
            serde_json::to_value(crate::http::openapi()).expect("the document serializes");
        assert_eq!(untyped_request_bodies(&document), Vec::<String>::new());
        let schemas = &document["components"]["schemas"];
        for name in [
            "CheckRequest",
            "ReservationRequest",
            "PlanDefinition",
            "TokenRequest",
            "VoidRequest",
            "AddedRequest",
            "ReconciliationRequest",
        ] {
            assert!(
                schemas[name]["properties"].is_object(),
                "{name} is not in the document's schemas"
            );
            assert_eq!(schemas[name]["additionalProperties"], false, "{name}");
        }
    }
}
