//! Operator binary entry point (before any reconcile): parse the command line, start logging,
//! hand over to `cli::dispatch`.
#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use gantry_operator::cli::{Cli, error_chain, init_logging, run_blocking};

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
