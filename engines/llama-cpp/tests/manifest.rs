//! The plugin's manifest must list exactly the architectures of the llama.cpp it links.
//!
//! The list is copied from the vendored `src/llama-arch.cpp` (`LLM_ARCH_NAMES`,
//! minus the `clip` dummy and `(unknown)`); when llama-cpp-sys-2 is upgraded,
//! this test names what to add or remove.

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
fn manifest_lists_exactly_the_architectures_of_the_vendored_llama_cpp() {
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
    let missing: Vec<_> = vendored.difference(&listed).collect();
    let extra: Vec<_> = listed.difference(&vendored).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "manifest.json is stale: add {missing:?}, remove {extra:?}"
    );
    assert!(listed.contains("gemma3") && listed.contains("llama"));
    assert_eq!(manifest["id"], "llama_cpp");
    assert_eq!(
        manifest["modalities"],
        serde_json::json!(["completion", "embedding"])
    );
    assert!(manifest["license"].as_str().is_some_and(|l| !l.is_empty()));
}
