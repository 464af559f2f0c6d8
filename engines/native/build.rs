//! Build step of the native plugin: lays out `<target>/<profile>/engines/native/<backend>/` so
//! the node's default plugin directory finds the library this build produces (the manifest with
//! this build's backend, and a relative symlink to the cdylib, which resolves once cargo links
//! it), as the llama.cpp plugin's build does. The `cuda` build also gets an `$ORIGIN` run path,
//! so the cuBLAS and NVRTC libraries its image ships beside it are found when it opens them.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=manifest.json");
    println!("cargo:rerun-if-env-changed=CARGO_FEATURE_CUDA");
    let backend = if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-rpath,$ORIGIN,--disable-new-dtags");
        "cuda"
    } else {
        "cpu"
    };
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    // OUT_DIR is <target>/<profile>/build/<pkg>-<hash>/out.
    let Some(profile_dir) = out_dir.ancestors().nth(3) else {
        return;
    };
    let dir = profile_dir.join("engines").join("native").join(backend);
    if let Err(e) = lay_out(&dir, backend) {
        println!(
            "cargo:warning=could not lay out the dev plugin directory {}: {e}",
            dir.display()
        );
    }
}

/// Classes the CPU backend runs and the CUDA backend does not yet (mixture-of-experts layers,
/// state-space layers and partial RoPE, encoders): the CUDA build's manifest leaves them out,
/// so the node and the operator never place such a model on it. The chart's `native-cuda` EnginePlugin lists the same (tests/python/test_chart.py).
const CPU_ONLY: [&str; 9] = [
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "BambaForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "NemotronHForCausalLM",
    "GptOssForCausalLM",
    "BertModel",
    "WhisperForConditionalGeneration",
];

/// Modalities only [`CPU_ONLY`] classes serve (speech recognition): the CUDA build's manifest
/// leaves them out too.
const CPU_ONLY_MODALITIES: [&str; 1] = ["transcription"];

fn lay_out(dir: &Path, backend: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let manifest = std::fs::read_to_string("manifest.json")?;
    let manifest = manifest.replace(
        "\"gpu_backend\": \"cpu\"",
        &format!("\"gpu_backend\": \"{backend}\""),
    );
    let manifest = if backend == "cuda" {
        without_cpu_only(&manifest)
    } else {
        manifest
    };
    std::fs::write(dir.join("manifest.json"), manifest)?;
    let lib = "libgantry_engine_native.so";
    let link = dir.join(lib);
    let _ = std::fs::remove_file(&link);
    #[cfg(unix)]
    std::os::unix::fs::symlink(Path::new("../../..").join(lib), &link)?;
    Ok(())
}

/// `manifest.json` (one array item per line, as committed) without the [`CPU_ONLY`] classes
/// and [`CPU_ONLY_MODALITIES`],
/// the comma of a new last item dropped. A line filter, not a JSON parser: a build script
/// dependency would be compiled again for the host in every profile.
fn without_cpu_only(manifest: &str) -> String {
    let lines: Vec<&str> = manifest
        .lines()
        .filter(|l| {
            let item = l.trim().trim_end_matches(',');
            !CPU_ONLY
                .iter()
                .chain(&CPU_ONLY_MODALITIES)
                .any(|c| item == format!("\"{c}\""))
        })
        .collect();
    let mut out = String::new();
    for (i, line) in lines.iter().enumerate() {
        let closes = lines
            .get(i + 1)
            .is_some_and(|next| next.trim_start().starts_with(']'));
        out.push_str(if closes {
            line.trim_end_matches(',')
        } else {
            line
        });
        out.push('\n');
    }
    out
}
