#![forbid(unsafe_code)]

use clap::Parser;

/// jemalloc rather than glibc's malloc: a hook event allocates and frees
/// dozens of small blocks across the runtime's worker threads (events,
/// frames, span data), and glibc's arenas spent ~15.6k instructions per
/// event on it against ~6.4k here, with about the same memory per
/// in-flight run (BENCHMARKS.md, "The allocator").
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    let cli = hookwire::cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(hookwire::cli::main(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // `hookwire run --json | head`: the reader is gone, nothing to report.
        Err(e) if is_broken_pipe(&e) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
