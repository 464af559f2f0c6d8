//! Shared test support for the node's integration tests: locating built plugins and writing plugin trees.
#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};

use gantry_engine_abi::EngineConfig;
use gantry_node::engine_host::{EngineRegistry, Plugin};

/// `target/<profile>`: the test binary lives in `target/<profile>/deps/`.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>")
        .to_path_buf()
}

/// A cdylib built in this workspace, e.g. `gantry_fault_faulty`.
pub fn built_lib(name: &str) -> PathBuf {
    let p = profile_dir().join(format!("lib{name}.so"));
    assert!(
        p.is_file(),
        "{} is missing: build the workspace first (`cargo build --release --workspace`, which scripts/test.sh does)",
        p.display()
    );
    p
}

/// Write `<root>/<dir_id>/<backend>/manifest.json` and link the library beside it.
pub fn install_plugin(
    root: &Path,
    dir_id: &str,
    backend: &str,
    manifest: serde_json::Value,
    lib: Option<&Path>,
) -> PathBuf {
    let dir = root.join(dir_id).join(backend);
    std::fs::create_dir_all(&dir).expect("plugin dir");
    if let Some(lib) = lib {
        let binary = manifest["binary"].as_str().expect("binary field");
        std::os::unix::fs::symlink(lib, dir.join(binary)).expect("symlink library");
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_vec_pretty(&manifest).expect("json"),
    )
    .expect("manifest");
    dir
}

pub fn faulty_manifest(id: &str) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "version": "0.1.0",
        "abi_version": "1",
        "gpu_backend": "cpu",
        "binary": "libgantry_fault_faulty.so",
        "architectures": ["toy"],
        "formats": ["gguf"],
        "modalities": ["completion"],
        "license": "Apache-2.0"
    })
}

/// The `faulty` plugin under `<root>/faulty/cpu/`, as most host tests need it.
pub fn install_faulty(root: &Path) -> PathBuf {
    install_plugin(
        root,
        "faulty",
        "cpu",
        faulty_manifest("faulty"),
        Some(&built_lib("gantry_fault_faulty")),
    )
}

pub fn cpu_config() -> EngineConfig {
    EngineConfig {
        n_threads: 2,
        max_batch_size: 8,
        context_length: 512,
        ..EngineConfig::default()
    }
}

/// The llama.cpp plugin, opened straight from the build output.
pub fn llama_plugin(max_batch_size: u32, context_length: u32) -> Plugin {
    let dir = profile_dir().join("engines");
    let cfg = EngineConfig {
        n_threads: 2,
        max_batch_size,
        context_length,
        ..EngineConfig::default()
    };
    let reg = EngineRegistry::discover(&dir, &cfg);
    let rec = reg
        .get("llama_cpp")
        .unwrap_or_else(|| panic!("no llama_cpp plugin under {}", dir.display()));
    rec.plugin()
        .cloned()
        .unwrap_or_else(|| panic!("llama_cpp refused: {:?}", rec.summary().reason))
}
