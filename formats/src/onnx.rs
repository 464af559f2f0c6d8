//! The config beside an ONNX model (before engine selection, like `hf_config.rs` for
//! safetensors): which model family the graph belongs to, read from `<name>.onnx.json`
//! without loading the graph. Only Piper voices are known today; their config carries the
//! phoneme table and the espeak-ng voice that turn text into the graph's input.

use std::path::{Path, PathBuf};

/// The architecture a Piper voice reports (what the ONNX engine's manifest lists).
pub const PIPER: &str = "PiperVoice";

/// Largest config read (a Piper config is a few KiB; a phoneme table is a few hundred entries).
const MAX_CONFIG_BYTES: u64 = 4 << 20;

/// The config file of an ONNX graph: `<graph>.json` beside it.
pub fn config_path(graph: &Path) -> PathBuf {
    let mut name = graph.as_os_str().to_owned();
    name.push(".json");
    PathBuf::from(name)
}

/// The architecture of the ONNX model whose graph is `graph`, from its config.
pub fn architecture(graph: &Path) -> Result<String, String> {
    let path = config_path(graph);
    let len = std::fs::metadata(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len > MAX_CONFIG_BYTES {
        return Err(format!(
            "{}: {len} bytes, more than the {MAX_CONFIG_BYTES} a model config may have",
            path.display()
        ));
    }
    let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    architecture_of(&bytes).map_err(|e| format!("{}: {e}", path.display()))
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
    Err("not a config this node knows (a Piper voice's has `phoneme_id_map`)".into())
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
}
