//! `gantry-node` binary: parse arguments, start logging, hand over to the command.
#![forbid(unsafe_code)]

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = gantry_node::cli::Cli::parse();
    gantry_node::cli::init_logging();
    match gantry_node::cli::run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gantry-node: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
