//! Operator binary entry point (before any reconcile): parse the command line, start logging,
//! hand over to `cli::dispatch`.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use gantry_operator::cli::{Cli, error_chain, init_logging, run_blocking};

/// jemalloc, with the options `.cargo/config.toml` builds it with (`JEMALLOC_SYS_WITH_MALLOC_CONF`):
/// a burst of reconciles or node answers leaves glibc's malloc holding its peak, where jemalloc
/// hands the pages back a second later (docs/operator.md, "Memory").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match run_blocking(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gantry-operator: {}", error_chain(&e));
            ExitCode::FAILURE
        }
    }
}
