//! Wiring for `tally serve` (and for tests and the benchmark, which run the same thing
//! in-process): prepare the database, connect to NATS, start the appender, the relay, the
//! projector, the ingest consumer and the HTTP server; stop them in the order that loses nothing.

use std::net::SocketAddr;
use std::time::Duration;

// anyhow, not a typed error: a start that fails is reported (the chain printed) and the
// process exits; no caller tells its failures apart.
use anyhow::Context as _;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admission::{self, Checker};
use crate::bus::{self, ingest, relay, Names};
use crate::clock::Clock;
use crate::config::Config;
use crate::http::{self, auth::Tokens, AppState, Inner};
use crate::ledger::{db, partitions, AppendLimits, Appender};
use crate::projection::{projector, Freshness, ProjectorSettings};
use crate::telemetry;

/// How long shutdown waits for in-flight HTTP requests before giving up on them.
const SHUTDOWN_GRACE_MS: u64 = 10_000;

/// A running service.
pub struct Service {
    pub local_addr: SocketAddr,
    pub pool: PgPool,
    pub appender: Appender,
    pub freshness: Freshness,
    pub checker: Checker,
    /// What "now" is for this service's rules (`Config::clock`).
    pub clock: Clock,
    shutdown: CancellationToken,
    server: JoinHandle<std::io::Result<()>>,
    workers: Vec<JoinHandle<()>>,
    appender_task: JoinHandle<()>,
    read_pool: Option<PgPool>,
}

impl Service {
    /// Prepares the database, binds the port, starts the appender, the workers and the
    /// HTTP server, in that order.
    // Long: the order in which components start is the order of this function, read top to
    // bottom; split up, it would be spread over functions that each take half of it.
    pub async fn start(config: Config) -> anyhow::Result<Service> {
        // First, so that every family is described and at zero before any component counts.
        let metrics = telemetry::metrics_handle();
        let names = Names::new(&config.nats_namespace)?.with_replicas(config.stream_replicas)?;
        // Checked before anything starts, so that a bad entry stops start-up at once.
        bus::Servers::parse(&config.nats_url)?;
        // Before anything is touched: a read database URL that does not parse fails the
        // start; a replica that does not answer fails only the reads sent to it
        // (`http::replica`).
        let read_pool = db::connect_read(&config).context("TALLY_READ_DATABASE_URL")?;
        let pool = db::prepare(&config)
            .await
            .context("cannot prepare the database")?;
        // Bound before any task is spawned, so that a taken port fails start-up cleanly.
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let local_addr = listener.local_addr()?;
        if let Some(read_pool) = &read_pool {
            tokio::spawn(crate::http::replica::probe(read_pool.clone()));
        }
        let nats = bus::connect(&config.nats_url).await?;
        let context = bus::jetstream(nats.clone());
        // The months ahead made before the first append (which would make its own month
        // anyway), and kept made by the upkeep worker below.
        let upkeep_wait = partitions::upkeep_once(&pool, config.ledger_clock.now()).await;
        let (appender, committed, appender_task) = Appender::start_dated(
            pool.clone(),
            AppendLimits {
                queue_max: config.append_queue_max,
                group_events_max: config.append_group_events_max,
            },
            config.ledger_clock,
        );
        let projector_handoff = appender.handoff();
        let freshness = Freshness::new(appender.head(), appender.acknowledged());
        let checker = Checker::new(pool.clone(), freshness.clone(), config.clock);
        let shutdown = CancellationToken::new();
        let relay_status = relay::RelayStatus::default();
        let stream_health = bus::StreamHealth::default();
        let workers = vec![
            tokio::spawn(partitions::upkeep(
                pool.clone(),
                config.ledger_clock,
                upkeep_wait,
                shutdown.clone(),
            )),
            tokio::spawn(relay::run(
                pool.clone(),
                context.clone(),
                names.clone(),
                relay::RelaySettings {
                    batch_max: config.relay_batch_max,
                    poll: Duration::from_millis(config.relay_poll_ms),
                },
                appender.head(),
                Some(committed),
                relay_status.clone(),
                stream_health.clone(),
                shutdown.clone(),
            )),
            projector::start(
                &config,
                ProjectorSettings {
                    batch_max: config.projector_batch_max,
                    poll: Duration::from_millis(config.projector_poll_ms),
                    linger: Duration::from_millis(config.projector_linger_ms),
                    clock: config.clock,
                },
                freshness.clone(),
                Some(projector_handoff),
                Some(checker.cache().rounds()),
                shutdown.clone(),
            ),
            tokio::spawn(admission::cache::listen(
                pool.clone(),
                checker.cache().clone(),
                shutdown.clone(),
            )),
            tokio::spawn(ingest::run(
                context,
                names.clone(),
                pool.clone(),
                appender.clone(),
                ingest::IngestSettings {
                    nats_url: config.nats_url.clone(),
                    fetch_max: config.ingest_fetch_max,
                    batch_events_max: config.batch_events_max,
                    backdate_max: config.backdate_max(),
                    clock: config.clock,
                },
                stream_health.clone(),
                shutdown.clone(),
            )),
        ];
        let state = AppState::new(Inner {
            pool: pool.clone(),
            appender: appender.clone(),
            freshness: freshness.clone(),
            checker: checker.clone(),
            nats,
            metrics,
            tokens: Tokens::new(config.bootstrap_token.as_deref()),
            body_max_bytes: config.body_max_bytes,
            batch_events_max: config.batch_events_max,
            backdate_max: config.backdate_max(),
            request_timeout: config.request_timeout(),
            concurrency_max: config.http_concurrency_max,
            report_limits: crate::finance::reports::Limits {
                max_bytes: config.report_max_bytes,
                max_inflated_bytes: config.report_max_inflated_bytes,
            },
            page_events_max: config.page_events_max,
            relay_status,
            stream_health,
            nats_names: names,
            token_limits: crate::http::auth::TokenLimits::new(config.token_concurrency_max),
            verify_passes: std::sync::Arc::new(tokio::sync::Semaphore::new(
                crate::http::ledger::VERIFY_PASSES_MAX,
            )),
            day_reads: std::sync::Arc::new(tokio::sync::Semaphore::new(
                crate::http::quarter_of_pool(config.db_pool_max),
            )),
            finance_streams: std::sync::Arc::new(tokio::sync::Semaphore::new(
                crate::http::quarter_of_pool(config.db_pool_max),
            )),
            reconciliations: std::sync::Arc::new(tokio::sync::Semaphore::new(
                crate::http::reconciliations::RECONCILIATIONS_RUNNING_MAX,
            )),
            corrections: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            plan_definitions: std::sync::Arc::new(tokio::sync::Semaphore::new(1)),
            finance_batch_orgs: i64::from(config.finance_batch_orgs),
            read_wait: Duration::from_millis(config.read_wait_ms),
            clock: config.clock,
            read_pool: read_pool.clone(),
        });
        if config.bootstrap_token.as_deref().unwrap_or("").is_empty() {
            tracing::warn!("TALLY_BOOTSTRAP_TOKEN is not set: every /v1 request will get 401");
        }
        let server = tokio::spawn(http::server::serve(
            listener,
            http::app(state),
            crate::http::server::Limits::from_config(&config),
            shutdown.clone(),
        ));
        tracing::info!(%local_addr, "tally is serving");
        Ok(Service {
            local_addr,
            pool,
            appender,
            freshness,
            checker,
            clock: config.clock,
            shutdown,
            server,
            workers,
            appender_task,
            read_pool,
        })
    }

    /// Stops accepting work, lets in-flight requests and the ingest batch in hand finish,
    /// drains the append queue, then returns.
    pub async fn stop(self) {
        self.shutdown.cancel();
        let grace = Duration::from_millis(SHUTDOWN_GRACE_MS);
        match tokio::time::timeout(grace, self.server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::error!(error = %error, "HTTP server failed"),
            Ok(Err(error)) => tracing::error!(error = %error, "HTTP server task failed"),
            Err(_) => tracing::warn!("in-flight requests did not finish within the grace period"),
        }
        for worker in self.workers {
            let _ = worker.await;
        }
        // The last handles go here; the appender then drains its queue and exits.
        drop(self.appender);
        let _ = self.appender_task.await;
        self.pool.close().await;
        if let Some(read_pool) = self.read_pool {
            read_pool.close().await;
        }
        tracing::info!("tally stopped");
    }

    /// Runs until SIGINT or SIGTERM, then stops gracefully.
    pub async fn run_until_signal(self) {
        wait_for_signal().await;
        tracing::info!("stopping on signal");
        self.stop().await;
    }
}

async fn wait_for_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
