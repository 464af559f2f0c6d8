//! Build step of the llama.cpp plugin: lays out `<target>/<profile>/engines/llama_cpp/<backend>/`
//! so the node's default plugin directory finds the library this build produces.
//!
//! The manifest is copied (with the backend of this build) and the library is
//! linked by a relative symlink, which resolves once cargo links the cdylib.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=manifest.json");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    // How ggml is built for the CPU, for the plugin's build report (src/cpu.rs): the same
    // test llama-cpp-sys-2's build script makes to choose GGML_NATIVE.
    let rustflags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let cpu_build = if std::env::var_os("CARGO_FEATURE_CPU_VARIANTS").is_some() {
        "variants"
    } else if rustflags
        .split('\x1f')
        .any(|f| f.contains("target-cpu=native"))
    {
        "native"
    } else {
        "portable"
    };
    println!("cargo:rustc-env=GANTRY_LLAMA_CPU_BUILD={cpu_build}");
    // The manifest test compares against this exact llama.cpp version's sources.
    println!(
        "cargo:rustc-env=LLAMA_CPP_SYS_VERSION={}",
        llama_sys_version()
    );
    let backend = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        "cuda"
    } else {
        "cpu"
    };
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        return;
    };
    let dir = profile_dir.join("engines").join("llama_cpp").join(backend);
    if let Err(e) = lay_out(&dir, backend) {
        println!(
            "cargo:warning=could not lay out the dev plugin directory {}: {e}",
            dir.display()
        );
    }
}

fn lay_out(dir: &Path, backend: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let manifest = std::fs::read_to_string("manifest.json")?;
    let manifest = manifest.replace(
        "\"gpu_backend\": \"cpu\"",
        &format!("\"gpu_backend\": \"{backend}\""),
    );
    std::fs::write(dir.join("manifest.json"), manifest)?;
    let lib = "libgantry_engine_llama_cpp.so";
    let link = dir.join(lib);
    let _ = std::fs::remove_file(&link);
    #[cfg(unix)]
    std::os::unix::fs::symlink(Path::new("../../..").join(lib), &link)?;
    Ok(())
}

/// The resolved llama-cpp-sys-2 version, read from Cargo.lock beside the workspace.
fn llama_sys_version() -> String {
    let lock = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    let text = std::fs::read_to_string(lock).unwrap_or_default();
    let mut lines = text.lines();
    while let Some(l) = lines.next() {
        if l == "name = \"llama-cpp-sys-2\""
            && let Some(v) = lines.next().and_then(|v| v.strip_prefix("version = \""))
        {
            return v.trim_end_matches('"').to_string();
        }
    }
    "unknown".to_string()
}
