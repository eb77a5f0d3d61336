//! Operations endpoints that need no token: `/healthz`, `/readyz`, `/metrics`,
//! `/openapi.json`; and the OpenAPI document itself.

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use serde_json::json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::AppState;

/// How long a readiness probe waits for each dependency.
const READY_PROBE_TIMEOUT_MS: u64 = 1_000;

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .route("/openapi.json", get(openapi_json))
}

/// The process is up.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = Object)))]
pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// Postgres and NATS both answer, and the relay has not halted on a `TALLY_LEDGER`
/// message that is not the ledger (`"relay"` says which message and why).
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
    let ready = postgres && nats && halted.is_none();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (
        status,
        Json(
            json!({"ready": ready, "postgres": word(postgres), "nats": word(nats), "relay": relay}),
        ),
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
    serde_json::to_vec(&ApiDoc::openapi())
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

#[derive(OpenApi)]
#[openapi(
    info(title = "tally", description = "An event-sourced usage and billing ledger"),
    paths(
        healthz,
        readyz,
        metrics_text,
        openapi_json,
        super::events::post_events,
        super::ledger::get_verify,
        super::usage::get_usage,
        super::usage::get_container,
        super::plans::get_plans,
        super::plans::put_plan,
        super::admission::post_check,
        super::admission::post_reservation,
        super::admission::delete_reservation,
        super::audit::get_events,
        super::audit::get_container_events,
        super::tokens::post_token,
        super::tokens::delete_token,
        super::corrections::post_void,
        super::corrections::post_events,
        super::reports::post_report,
        super::reconciliations::post_reconciliation,
        super::reconciliations::get_lines,
        super::exports::get_usage_export,
        super::exports::post_close,
        super::exports::get_period,
        super::exports::get_close,
    ),
    components(schemas(
        super::events::EventInput,
        super::ledger::VerifyReportSchema,
        super::ledger::StreamReportSchema,
        super::events::EventsResponse,
        super::events::EventResult,
        super::usage::UsageResponse,
        super::plans::PlanResponse,
        super::plans::PlansResponse,
        super::plans::StoredPlanResponse,
        super::admission::CheckResponse,
        super::admission::ReservationResponse,
        super::admission::ReleaseResponse,
        super::audit::EventsPage,
        super::tokens::TokenCreated,
        super::tokens::TokenRevoked,
        super::corrections::VoidResponse,
        super::corrections::AddedResponse,
        super::reports::ReportResponse,
        super::reconciliations::ReconciliationResponse,
        super::exports::PeriodResponse,
        super::exports::CloseJobResponse,
        super::usage::ContainerResponse,
        super::usage::IntervalResponse,
        super::usage::AnomalyResponse,
        super::error::ErrorBody,
        super::error::ErrorContent,
    )),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

#[cfg(test)]
mod tests {
    use super::*;

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
        let document = serde_json::to_value(ApiDoc::openapi()).expect("the document serializes");
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
