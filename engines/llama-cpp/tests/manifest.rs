//! The plugin's manifest may list only architectures of the llama.cpp it links.
//!
//! The manifest lists the architectures checked against transformers
//! (`engines/native/tests/reference_llama_cpp.rs` keeps it equal to the families it runs); each must
//! still exist in the vendored `src/llama-arch.cpp` (`LLM_ARCH_NAMES`), so that an upgrade of
//! llama-cpp-sys-2 that renames or drops one is caught here.

use std::collections::BTreeSet;
use std::path::PathBuf;

fn vendored_arch_source() -> PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .expect("CARGO_HOME or HOME");
    let version = env!("LLAMA_CPP_SYS_VERSION");
    let src = home.join("registry").join("src");
    std::fs::read_dir(&src)
        .expect("cargo registry sources")
        .filter_map(Result::ok)
        .map(|d| {
            d.path().join(format!(
                "llama-cpp-sys-2-{version}/llama.cpp/src/llama-arch.cpp"
            ))
        })
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "llama-cpp-sys-2 {version} sources not found under {}",
                src.display()
            )
        })
}

#[test]
fn manifest_lists_only_architectures_of_the_vendored_llama_cpp() {
    let cpp = std::fs::read_to_string(vendored_arch_source()).expect("read llama-arch.cpp");
    let start = cpp.find("LLM_ARCH_NAMES = {").expect("LLM_ARCH_NAMES");
    let block = &cpp[start..start + cpp[start..].find("};").expect("end of map")];
    let vendored: BTreeSet<String> = block
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("{ LLM_ARCH_")?;
            let name = rest.split('"').nth(1)?;
            (name != "clip" && name != "(unknown)").then(|| name.to_string())
        })
        .collect();
    let manifest: serde_json::Value =
        serde_json::from_str(include_str!("../manifest.json")).expect("manifest.json parses");
    let listed: BTreeSet<String> = manifest["architectures"]
        .as_array()
        .expect("architectures")
        .iter()
        .map(|v| v.as_str().expect("string").to_string())
        .collect();
    let unknown: Vec<_> = listed.difference(&vendored).collect();
    assert!(
        unknown.is_empty(),
        "the vendored llama.cpp has no {unknown:?}: remove them from manifest.json"
    );
    assert!(listed.contains("gemma3") && listed.contains("llama"));
    assert_eq!(manifest["id"], "llama_cpp");
    assert_eq!(
        manifest["modalities"],
        serde_json::json!(["completion", "embedding"])
    );
    assert!(manifest["license"].as_str().is_some_and(|l| !l.is_empty()));
}
