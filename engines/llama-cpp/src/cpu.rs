//! llama.cpp engine, CPU build (read once, when the host first reads the engine's info, before
//! any engine is created): which CPU code this library runs and the SIMD extensions in use.
//!
//! Two builds exist. A build made on the machine that runs it (the workspace builds with
//! `-C target-cpu=native`, so llama-cpp-sys-2 configures ggml with `GGML_NATIVE=ON`) uses
//! everything that CPU has. The image's build (feature `cpu-variants`) carries ggml's CPU
//! backend once per x86-64 level (x64 … haswell, skylakex, icelake, zen4, sapphirerapids)
//! as loadable modules beside the plugin library; ggml scores each against the running CPU
//! and loads the best, as llama.cpp's own release builds do. Either way the report names
//! the build and the features of the CPU code actually loaded.

use std::ffi::CStr;

/// How this library was built for the CPU (from build.rs).
const BUILD: &str = env!("GANTRY_LLAMA_CPU_BUILD");

/// ggml's x86-64 CPU variants (ggml/src/CMakeLists.txt, `GGML_CPU_ALL_VARIANTS`), most
/// capable first, with the features each is compiled with.
const X86_VARIANTS: &[(&str, &[&str])] = &[
    (
        "sapphirerapids",
        &[
            "AVX512",
            "AVX512_VBMI",
            "AVX512_VNNI",
            "AVX512_BF16",
            "AMX_INT8",
        ],
    ),
    (
        "zen4",
        &["AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16"],
    ),
    ("cooperlake", &["AVX512", "AVX512_VNNI", "AVX512_BF16"]),
    ("icelake", &["AVX512", "AVX512_VBMI", "AVX512_VNNI"]),
    ("cascadelake", &["AVX512", "AVX512_VNNI"]),
    ("cannonlake", &["AVX512", "AVX512_VBMI"]),
    ("skylakex", &["AVX512"]),
    ("alderlake", &["AVX2", "AVX_VNNI"]),
    ("haswell", &["AVX2", "FMA", "F16C"]),
    ("sandybridge", &["AVX"]),
    ("sse42", &["SSE3"]),
];

/// One line for `engines info` and `/v1/status`: the build, the variant and its features,
/// and for a GPU build its backend's own settings (e.g. `CUDA: ARCHS=900 USE_GRAPHS`).
pub fn describe() -> String {
    load_variants();
    let sections = backend_sections(&system_info());
    let features: Vec<String> = sections
        .iter()
        .find(|(name, _)| name == "CPU")
        .map(|(_, kv)| {
            kv.iter()
                .filter(|(_, v)| v == "1")
                .map(|(k, _)| k.clone())
                .collect()
        })
        .unwrap_or_default();
    let variant = variant_of(&features);
    let mode = match BUILD {
        "native" => "built for the build machine's CPU (GGML_NATIVE=ON)",
        "variants" => "runtime-dispatched ggml CPU variants (GGML_CPU_ALL_VARIANTS)",
        _ => "portable x86-64 build (GGML_NATIVE=OFF)",
    };
    let mut line = format!(
        "cpu: {mode}; running the {variant} code path; ggml CPU features: {}",
        features.join(" ")
    );
    for (name, kv) in sections.iter().filter(|(name, _)| name != "CPU") {
        let settings: Vec<String> = kv
            .iter()
            .map(|(k, v)| {
                if v == "1" {
                    k.clone()
                } else {
                    format!("{k}={v}")
                }
            })
            .collect();
        line.push_str(&format!("; {name}: {}", settings.join(" ")));
    }
    line
}

/// llama.cpp's system info line (`CUDA : ARCHS = 900 | … | CPU : SSE3 = 1 | …`).
fn system_info() -> String {
    // SAFETY: returns a pointer to a static string inside llama.cpp, valid until the next
    // call; this runs once, under the SDK's info cell, and copies the text at once.
    unsafe {
        let p = llama_cpp_sys_2::llama_print_system_info();
        if p.is_null() {
            return String::new();
        }
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

/// The line split per backend: `(name, [(key, value)])` in order.
fn backend_sections(info: &str) -> Vec<(String, Vec<(String, String)>)> {
    let mut out: Vec<(String, Vec<(String, String)>)> = Vec::new();
    for part in info.split('|') {
        let kv = match part.split_once(" : ") {
            Some((name, rest)) => {
                out.push((name.trim().to_string(), Vec::new()));
                rest
            }
            None => part,
        };
        if let (Some((k, v)), Some(last)) = (kv.split_once('='), out.last_mut()) {
            last.1.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    out
}

/// The ggml variant whose feature set the running code has (the same rule ggml's loader
/// scores by), or `x64` (the baseline).
fn variant_of(features: &[String]) -> &'static str {
    X86_VARIANTS
        .iter()
        .find(|(_, needs)| needs.iter().all(|n| features.iter().any(|f| f == n)))
        .map_or("x64", |(name, _)| name)
}

/// With `cpu-variants`: load ggml's CPU modules from the directory of this library (the
/// image puts them there), or from `GANTRY_GGML_BACKENDS_DIR`.
#[cfg(feature = "cpu-variants")]
pub(crate) fn load_variants() {
    use std::sync::Once;
    static LOADED: Once = Once::new();
    LOADED.call_once(|| {
        let dir = std::env::var_os("GANTRY_GGML_BACKENDS_DIR")
            .map(std::path::PathBuf::from)
            .or_else(own_dir);
        if let Some(dir) = dir {
            llama_cpp_2::llama_backend::load_backends_from_path(&dir);
        }
    });
}

#[cfg(not(feature = "cpu-variants"))]
pub(crate) fn load_variants() {}

/// The directory this shared library was loaded from.
#[cfg(feature = "cpu-variants")]
fn own_dir() -> Option<std::path::PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr fills `info` for an address inside this library (this function);
    // `dli_fname` then points to a NUL-terminated path owned by the loader.
    let path = unsafe {
        if libc::dladdr(own_dir as *const libc::c_void, info.as_mut_ptr()) == 0 {
            return None;
        }
        let info = info.assume_init();
        if info.dli_fname.is_null() {
            return None;
        }
        CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned()
    };
    std::path::Path::new(&path)
        .parent()
        .map(|p| p.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_read_from_the_system_info_line() {
        let line = "CUDA : ARCHS = 900 | USE_GRAPHS = 1 | PEER_MAX_BATCH_SIZE = 128 | CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | ";
        let sections = backend_sections(line);
        assert_eq!(sections.len(), 2);
        assert_eq!(sections[0].0, "CUDA");
        assert_eq!(sections[0].1[0], ("ARCHS".to_string(), "900".to_string()));
        let f: Vec<String> = sections[1]
            .1
            .iter()
            .filter(|(_, v)| v == "1")
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(f[0], "SSE3");
        assert!(f.contains(&"AVX512_VNNI".to_string()));
        assert_eq!(variant_of(&f), "icelake");
        let avx2: Vec<String> = ["SSE3", "AVX", "AVX2", "FMA", "F16C"]
            .map(String::from)
            .to_vec();
        assert_eq!(variant_of(&avx2), "haswell");
        assert_eq!(variant_of(&[]), "x64");
    }

    #[test]
    fn the_report_names_the_build_and_the_running_code_path() {
        let d = describe();
        assert!(d.starts_with("cpu: "), "{d}");
        assert!(d.contains("code path"), "{d}");
        // This machine's build must include at least the SSE3 baseline of x86-64.
        if cfg!(target_arch = "x86_64") {
            assert!(d.contains("SSE3"), "{d}");
        }
        if BUILD == "native" && cfg!(target_feature = "avx2") {
            assert!(d.contains("AVX2"), "a native build on an AVX2 machine: {d}");
        }
    }
}
