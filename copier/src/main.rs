//! The `/copy` binary of Gantry plugin images (plugin delivery, before the engine host
//! discovers a plugin): `copy SRC DEST` runs [`gantry_copy::deliver`]. See the library for
//! what a delivery guarantees.

use std::path::Path;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [src, dest] = args.as_slice() else {
        eprintln!(
            "usage: copy SRC_DIR DEST_DIR   (copies the plugin directory SRC_DIR into DEST_DIR)"
        );
        return ExitCode::from(2);
    };
    match gantry_copy::deliver(Path::new(src), Path::new(dest)) {
        Ok((n, removed)) => {
            eprintln!("copy: {n} files from {src} to {dest}, {removed} old entries removed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("copy: {src} -> {dest}: {e}");
            ExitCode::FAILURE
        }
    }
}
