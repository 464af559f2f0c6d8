//! Build step of the ONNX plugin: lays out `<target>/<profile>/engines/onnx/cpu/` (its manifest
//! and a relative symlink to the cdylib) so the node's default plugin directory finds the
//! library this build produces, as the other engine crates' builds do.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=manifest.json");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        return;
    };
    let dir = profile_dir.join("engines").join("onnx").join("cpu");
    if let Err(e) = lay_out(&dir) {
        println!(
            "cargo:warning=could not lay out the dev plugin directory {}: {e}",
            dir.display()
        );
    }
}

fn lay_out(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::copy("manifest.json", dir.join("manifest.json"))?;
    let lib = "libgantry_engine_onnx.so";
    let link = dir.join(lib);
    let _ = std::fs::remove_file(&link);
    #[cfg(unix)]
    std::os::unix::fs::symlink(Path::new("../../..").join(lib), &link)?;
    Ok(())
}
