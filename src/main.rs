//! The `tally` binary: parse the command line, set up telemetry, run the subcommand.

use std::process::ExitCode;

use clap::Parser;

/// mimalloc rather than glibc's malloc: the service allocates and frees small buffers for
/// every request and row on several threads at once, where glibc's arenas spent a tenth
/// of the process's CPU in `tally-bench`'s single-event phase (malloc, free, consolidation
/// and arena locks).
///
/// Built with `no_thp`: by default mimalloc asks for transparent huge pages on the memory
/// it maps, and then gives back parts of them, so the kernel faulted in and zeroed whole
/// 2 MiB pages again and again for hyper's 8 KiB read buffers. Under admission checks that
/// zeroing took a tenth of the machine's CPU (`clear_page_erms`, from huge-page faults).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = tally::cli::Cli::parse();
    tally::telemetry::init_logs();
    match tally::cli::run(cli).await {
        Ok(code) => code,
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "tally failed");
            eprintln!("tally: {error:#}");
            ExitCode::from(2)
        }
    }
}
