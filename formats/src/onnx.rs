//! The files beside an ONNX model (before engine selection, like `hf_config.rs` for
//! safetensors): which model family the graph belongs to, without loading the graph. Two are
//! known: a Hibari voice (the `hibari-tts` package's layout: a `voices.json` registry beside
//! the graph lists it by file name) and a Piper voice (`<name>.onnx.json`, whose phoneme table
//! and espeak-ng voice turn text into the graph's input).

use std::path::{Path, PathBuf};

/// The architecture a Piper voice reports (what the ONNX engine's manifest lists).
pub const PIPER: &str = "PiperVoice";
/// The architecture a Hibari voice reports.
pub const HIBARI: &str = "HibariVoice";
/// A Hibari voice's registry, beside its graph.
pub const HIBARI_REGISTRY: &str = "voices.json";

/// Largest config read (a Piper config is a few KiB; a phoneme table is a few hundred entries).
const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// The config file of an ONNX graph: `<graph>.json` beside it.
pub fn config_path(graph: &Path) -> PathBuf {
    let mut name = graph.as_os_str().to_owned();
    name.push(".json");
    PathBuf::from(name)
}

/// The architecture of the ONNX model whose graph is `graph`, from the files beside it.
pub fn architecture(graph: &Path) -> Result<String, String> {
    let registry = graph.with_file_name(HIBARI_REGISTRY);
    if let Some(name) = graph.file_name().and_then(|n| n.to_str())
        && registry.is_file()
        && lists(&read_bounded(&registry)?, name)
    {
        return Ok(HIBARI.to_string());
    }
    let path = config_path(graph);
    architecture_of(&read_bounded(&path)?).map_err(|e| format!("{}: {e}", path.display()))
}

/// Whether a Hibari registry's bytes list a voice whose `file` is `name`.
pub fn lists(registry: &[u8], name: &str) -> bool {
    serde_json::from_slice::<serde_json::Value>(registry)
        .ok()
        .and_then(|v| {
            v.as_object().map(|o| {
                o.values()
                    .any(|e| e.get("file").and_then(|f| f.as_str()) == Some(name))
            })
        })
        .unwrap_or(false)
}

/// A config's bytes, refused past [`MAX_CONFIG_BYTES`].
fn read_bounded(path: &Path) -> Result<Vec<u8>, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len > MAX_CONFIG_BYTES {
        return Err(format!(
            "{}: {len} bytes, more than the {MAX_CONFIG_BYTES} a model config may have",
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The architecture a config's bytes describe.
pub fn architecture_of(bytes: &[u8]) -> Result<String, String> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
    if v.get("phoneme_id_map")
        .is_some_and(serde_json::Value::is_object)
    {
        return Ok(PIPER.to_string());
    }
    Err(
        "not a config this node knows (a Piper voice's has `phoneme_id_map`; a Hibari voice \
         has no config but a `voices.json` listing it)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piper_config_names_the_piper_architecture() {
        let cfg = br#"{"audio": {"sample_rate": 22050}, "phoneme_id_map": {"_": [0]}}"#;
        assert_eq!(architecture_of(cfg).expect("valid"), PIPER);
        assert!(
            architecture_of(b"{}")
                .expect_err("refused")
                .contains("phoneme_id_map")
        );
        assert!(
            architecture_of(b"\xff")
                .expect_err("refused")
                .contains("not JSON")
        );
        assert_eq!(
            config_path(Path::new("/m/en_US-joe-medium.onnx")),
            Path::new("/m/en_US-joe-medium.onnx.json")
        );
    }

    #[test]
    fn a_graph_its_registry_lists_is_a_hibari_voice() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(
            dir.path().join(HIBARI_REGISTRY),
            r#"{"heart": {"file": "hibari.onnx", "british": false}}"#,
        )
        .expect("write");
        assert_eq!(
            architecture(&dir.path().join("hibari.onnx")).expect("listed"),
            HIBARI
        );
        // Not listed, and no Piper config either.
        let e = architecture(&dir.path().join("other.onnx")).expect_err("unknown");
        assert!(e.contains("other.onnx.json"), "{e}");
        assert!(!lists(b"[1]", "hibari.onnx"));
    }
}
