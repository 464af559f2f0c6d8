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
    // llama.cpp built as shared libraries: with `cpu-variants` (its CPU code in loadable
    // modules, src/cpu.rs), or when LLAMA_BUILD_SHARED_LIBS=1 (scripts/check-cuda-build.sh).
    // The plugin finds the libraries beside itself ($ORIGIN) and the modules in its own
    // directory, so the plugin directory holds all of them.
    println!("cargo:rerun-if-env-changed=LLAMA_BUILD_SHARED_LIBS");
    let shared =
        cpu_build == "variants" || std::env::var("LLAMA_BUILD_SHARED_LIBS").is_ok_and(|v| v == "1");
    if shared {
        // DT_RPATH, not DT_RUNPATH: the loader searches an RPATH for the dependencies of
        // dependencies too (libggml.so.0 needs libggml-cpu.so.0 and, in a CUDA build,
        // libggml-cuda.so.0, and has no search path of its own).
        println!("cargo:rustc-link-arg-cdylib=-Wl,-rpath,$ORIGIN,--disable-new-dtags");
        if let Err(e) = link_shared(&dir, profile_dir) {
            println!(
                "cargo:warning=could not link llama.cpp's shared libraries into {}: {e}",
                dir.display()
            );
        }
    }
}

/// Link llama.cpp's shared libraries (under the names the plugin's `NEEDED` entries use:
/// `libllama.so.0`, `libggml.so.0`, `libggml-base.so.0`, and ggml-cuda's for a CUDA build)
/// and ggml's CPU modules into the plugin directory, each to the real file. Both come from
/// llama-cpp-sys-2's output directory: `DEP_LLAMA_BACKENDS_DIR` is its `backends` (with
/// dynamic backends), the libraries are in the `lib` beside it.
fn link_shared(dir: &Path, profile_dir: &Path) -> std::io::Result<()> {
    let backends = std::env::var_os("DEP_LLAMA_BACKENDS_DIR").map(PathBuf::from);
    // Without dynamic backends the crate reports no directory: its newest output's `lib`.
    let lib = match &backends {
        Some(b) => b.parent().map(|p| p.join("lib")).unwrap_or_default(),
        None => newest_sys_lib(profile_dir)?,
    };
    let wanted = |name: &str| {
        (name.starts_with("libllama.so") || name.starts_with("libggml")) && name.contains(".so")
    };
    for src_dir in std::iter::once(lib).chain(backends) {
        for entry in std::fs::read_dir(&src_dir)? {
            let path = entry?.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string)
            else {
                continue;
            };
            if !wanted(&name) {
                continue;
            }
            let real = std::fs::canonicalize(&path)?;
            let link = dir.join(&name);
            let _ = std::fs::remove_file(&link);
            #[cfg(unix)]
            std::os::unix::fs::symlink(&real, &link)?;
        }
    }
    Ok(())
}

/// `<profile>/build/llama-cpp-sys-2-*/out/lib` holding `libllama.so.0`, the newest one.
fn newest_sys_lib(profile_dir: &Path) -> std::io::Result<PathBuf> {
    let mut found: Vec<(std::time::SystemTime, PathBuf)> =
        std::fs::read_dir(profile_dir.join("build"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("llama-cpp-sys-2-"))
            })
            .map(|p| p.join("out").join("lib"))
            .filter_map(|lib| {
                let t = std::fs::metadata(lib.join("libllama.so.0"))
                    .ok()?
                    .modified()
                    .ok()?;
                Some((t, lib))
            })
            .collect();
    found.sort();
    found
        .pop()
        .map(|(_, lib)| lib)
        .ok_or_else(|| std::io::Error::other("no llama-cpp-sys-2 output with libllama.so.0"))
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
