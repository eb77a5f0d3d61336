//! Components whose every wake-up counts (the appender, the projector) run on a thread of
//! their own, with a single-threaded runtime: on the service's runtime, each answer from
//! Postgres would wake their task only for it to wait behind every ready HTTP task. The
//! kernel wakes a thread of its own directly.

use std::future::Future;

use tokio::sync::oneshot;

/// Runs the future that `make` returns on a new thread named `name`, with a
/// single-threaded runtime whose reactor watches every socket the future opens. The
/// receiver resolves when the future has finished; if it panicked, with an error.
pub fn spawn<F, Fut>(name: &str, make: F) -> oneshot::Receiver<()>
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let (finished_sender, finished) = oneshot::channel();
    let thread_name = name.to_owned();
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap_or_else(|error| panic!("the {thread_name} runtime starts: {error}"));
            runtime.block_on(make());
            // Dropped unsent if the future panics.
            let _ = finished_sender.send(());
        })
        .unwrap_or_else(|error| panic!("the {name} thread starts: {error}"));
    finished
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_future_runs_on_a_thread_of_the_given_name_and_its_end_is_reported() {
        let (name_sender, name) = oneshot::channel();
        let finished = spawn("tally-test", move || async move {
            let _ = name_sender.send(std::thread::current().name().map(str::to_owned));
        });
        assert_eq!(name.await.unwrap().as_deref(), Some("tally-test"));
        assert!(finished.await.is_ok());
    }

    #[tokio::test]
    async fn a_future_that_panics_is_reported_as_not_finished() {
        let finished = spawn("tally-test-panics", || async { panic!("on purpose") });
        assert!(finished.await.is_err());
    }
}
