//! The rules the operator and the node both apply (outside the request path: operator validate
//! and resolve steps, node start-up), fed the same table of cases on both sides: the operator's
//! `validate`/`resolve` on a Model and EnginePlugin objects, the node's config validation, model
//! store and engine registry on real plugin libraries. Each case states one expected answer and
//! both sides must give it.

use std::path::{Path, PathBuf};

use gantry_api::RejectionKind;
use gantry_api::config::NodeConfig;
use gantry_crd::{EnginePlugin, Model};
use gantry_engine_abi::{EngineConfig, Format};
use gantry_node::engine_host::EngineRegistry;
use gantry_operator::context::Settings;
use gantry_operator::model::resolve::{Resolution, resolve};
use gantry_operator::model::validate::validate;

/// A Model as the operator reads it, from the CPU fixture, with `uri` as its source.
fn model(uri: &str, format: &str, pin: Option<&str>) -> Model {
    let mut m: serde_json::Value = serde_json::json!({
        "apiVersion": "gantry.dev/v1alpha1",
        "kind": "Model",
        "metadata": {"name": "m", "namespace": "default", "uid": "u-1", "generation": 1},
        "spec": {
            "source": {"uri": uri},
            "format": format,
            "servedName": "m",
            "resources": {"cpu": "2", "memory": "2Gi"}
        }
    });
    if let Some(pin) = pin {
        m["spec"]["engine"] = pin.into();
    }
    serde_json::from_value(m).expect("model")
}

fn operator_accepts_uri(uri: &str) -> Result<(), String> {
    match validate(&model(uri, "gguf", None), &Settings::default()) {
        Ok(_) => Ok(()),
        Err(problems) => {
            let on_uri: Vec<_> = problems
                .iter()
                .filter(|p| p.field == "spec.source.uri")
                .collect();
            assert_eq!(
                on_uri.len(),
                problems.len(),
                "{uri}: only the URI may be wrong, got {problems:?}"
            );
            Err(on_uri[0].message.clone())
        }
    }
}

/// The node's answer for a URI it is given: its config validation, which runs the parser its
/// model store runs (`Source::parse_on_node`).
fn node_accepts_uri(uri: &str) -> Result<(), String> {
    let yaml = format!("models:\n  - id: m\n    source: {uri:?}\n    format: gguf\n");
    let cfg: NodeConfig = serde_yaml::from_str(&yaml).expect("yaml");
    cfg.validate().map_err(|e| e.to_string())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Uri {
    /// Both sides accept it.
    Ok,
    /// Both sides refuse it.
    Refused,
    /// The operator accepts it and hands the node a different URI (`pvc://` is mounted).
    Rewritten,
    /// A URI the grammar allows but a Model in a cluster may not use (plain http).
    LocalOnly,
}

const URIS: &[(&str, Uri)] = &[
    ("hf://google/gemma-3-270m", Uri::Ok),
    ("hf://org/repo@v1.0", Uri::Ok),
    ("hf://org/repo@refs/pr/1", Uri::Ok),
    ("hf://org/repo:Q4_K_M", Uri::Ok),
    ("hf://Qwen/Qwen2.5-7B-Instruct-GGUF@main", Uri::Ok),
    // The node always refused these characters; the operator used to accept them.
    ("hf://org/re po", Uri::Refused),
    ("hf://org/repo!", Uri::Refused),
    ("hf://org/.hidden", Uri::Refused),
    ("hf://only-org", Uri::Refused),
    ("hf://a/b/c", Uri::Refused),
    ("hf://org/repo@", Uri::Refused),
    ("hf://org/repo:", Uri::Refused),
    ("hf://org/repo@../x", Uri::Refused),
    ("https://models.example.com/x.gguf", Uri::Ok),
    ("https://h.example:8443/m/", Uri::Ok),
    ("https:///x.gguf", Uri::Refused),
    ("https://h.example/a/../b.gguf", Uri::Refused),
    ("http://127.0.0.1:8000/x.gguf", Uri::LocalOnly),
    ("s3://models/llama-3.2-1b", Uri::Ok),
    ("s3://models", Uri::Ok),
    ("s3://ab/x", Uri::Refused),
    ("s3://Bucket/x", Uri::Refused),
    ("s3:///x", Uri::Refused),
    ("s3://bucket/a/../b", Uri::Refused),
    ("file:///models/x.gguf", Uri::Ok),
    ("file://relative", Uri::Refused),
    ("file:///models/../etc/passwd", Uri::Refused),
    ("pvc://model-store/qwen/q.gguf", Uri::Rewritten),
    ("pvc://claim/../etc/passwd", Uri::Refused),
    ("pvc://Claim/x", Uri::Refused),
    ("ftp://host/x.gguf", Uri::Refused),
];

#[test]
fn operator_and_node_accept_and_refuse_the_same_source_uris() {
    for &(uri, want) in URIS {
        let (op, node) = (operator_accepts_uri(uri), node_accepts_uri(uri));
        match want {
            Uri::Ok => {
                assert_eq!(op, Ok(()), "operator on {uri}");
                assert_eq!(node, Ok(()), "node on {uri}");
            }
            Uri::Refused => {
                assert!(op.is_err(), "operator accepted {uri}");
                assert!(node.is_err(), "node accepted {uri}");
            }
            Uri::Rewritten => {
                assert_eq!(op, Ok(()), "operator on {uri}");
                let v = validate(&model(uri, "gguf", None), &Settings::default()).expect("valid");
                assert_eq!(
                    node_accepts_uri(&v.source.node_uri),
                    Ok(()),
                    "node on the rewritten {}",
                    v.source.node_uri
                );
                assert!(node.is_err(), "a node is never handed a pvc:// URI: {uri}");
            }
            Uri::LocalOnly => {
                assert!(
                    op.as_ref().is_err_and(|m| m.contains("https://")),
                    "operator on {uri}: {op:?}"
                );
                assert_eq!(node, Ok(()), "node on {uri}");
            }
        }
    }
}

/// One plugin in a selection case: engine id (also its EnginePlugin name and directory),
/// backend, formats, architectures, ABI major, modalities.
type PluginCase = (
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    u32,
    &'static [&'static str],
);

/// What engine selection must answer.
#[derive(Debug)]
enum Want {
    Chosen(&'static str),
    Rejected(&'static [(&'static str, RejectionKind)]),
}

struct SelectionCase {
    name: &'static str,
    plugins: &'static [PluginCase],
    format: &'static str,
    architecture: &'static str,
    pin: Option<&'static str>,
    /// What the Model is for (`spec.modalities`).
    modalities: &'static [&'static str],
    want: Want,
}

// A plugin that loads reports its own engine id, so the loadable candidates are the two real
// libraries built here: the fault-injection plugin (`faulty`) and llama.cpp (`llama_cpp`). Their
// manifests, which selection reads, say what each case needs. Refused candidates may have any id.
const CPU_TOY: PluginCase = ("faulty", "cpu", &["gguf"], &["toy"], 1, &["completion"]);
const CPU_LLAMA: PluginCase = (
    "llama_cpp",
    "cpu",
    &["gguf"],
    &["llama", "toy"],
    1,
    &["completion"],
);

const SELECTION: &[SelectionCase] = &[
    SelectionCase {
        name: "the first candidate in engine-id order wins",
        plugins: &[CPU_LLAMA, CPU_TOY],
        format: "gguf",
        architecture: "toy",
        pin: None,
        modalities: &[],
        want: Want::Chosen("faulty"),
    },
    SelectionCase {
        name: "the architecture decides",
        plugins: &[CPU_TOY, CPU_LLAMA],
        format: "gguf",
        architecture: "llama",
        pin: None,
        modalities: &[],
        want: Want::Chosen("llama_cpp"),
    },
    SelectionCase {
        name: "a pin is honoured over engine-id order",
        plugins: &[CPU_TOY, CPU_LLAMA],
        format: "gguf",
        architecture: "toy",
        pin: Some("llama_cpp"),
        modalities: &[],
        want: Want::Chosen("llama_cpp"),
    },
    SelectionCase {
        name: "a pin to a missing engine is never overridden",
        plugins: &[CPU_TOY, CPU_LLAMA],
        format: "gguf",
        architecture: "toy",
        pin: Some("vllm"),
        modalities: &[],
        want: Want::Rejected(&[
            ("faulty", RejectionKind::Pin),
            ("llama_cpp", RejectionKind::Pin),
            ("vllm", RejectionKind::Pin),
        ]),
    },
    SelectionCase {
        name: "no fallback to another format",
        plugins: &[CPU_TOY, CPU_LLAMA],
        format: "safetensors",
        architecture: "toy",
        pin: None,
        modalities: &[],
        want: Want::Rejected(&[
            ("faulty", RejectionKind::Format),
            ("llama_cpp", RejectionKind::Format),
        ]),
    },
    SelectionCase {
        // A safetensors model's architecture is its config.json class (node-pod's
        // read_architecture); the safetensors engine lists classes.
        name: "a safetensors model goes to the engine that lists its model class",
        plugins: &[
            CPU_LLAMA,
            (
                "native",
                "cpu",
                &["safetensors"],
                &["LlamaForCausalLM"],
                1,
                &["completion"],
            ),
        ],
        format: "safetensors",
        architecture: "LlamaForCausalLM",
        pin: None,
        modalities: &[],
        want: Want::Chosen("native"),
    },
    SelectionCase {
        name: "an unknown architecture lists every candidate",
        plugins: &[CPU_TOY, CPU_LLAMA],
        format: "gguf",
        architecture: "mamba",
        pin: None,
        modalities: &[],
        want: Want::Rejected(&[
            ("faulty", RejectionKind::Architecture),
            ("llama_cpp", RejectionKind::Architecture),
        ]),
    },
    SelectionCase {
        name: "a plugin for another backend is passed over",
        plugins: &[
            ("a_gpu", "cuda", &["gguf"], &["toy"], 1, &["completion"]),
            CPU_TOY,
        ],
        format: "gguf",
        architecture: "toy",
        pin: None,
        modalities: &[],
        want: Want::Chosen("faulty"),
    },
    SelectionCase {
        name: "only other backends",
        plugins: &[("a_gpu", "cuda", &["gguf"], &["toy"], 1, &["completion"])],
        format: "gguf",
        architecture: "toy",
        pin: None,
        modalities: &[],
        want: Want::Rejected(&[("a_gpu", RejectionKind::Backend)]),
    },
    SelectionCase {
        name: "an ABI mismatch is refused before its formats are looked at",
        plugins: &[
            ("abi2", "cpu", &["gguf"], &["toy"], 2, &["completion"]),
            CPU_TOY,
        ],
        format: "safetensors",
        architecture: "toy",
        pin: None,
        modalities: &[],
        want: Want::Rejected(&[
            ("abi2", RejectionKind::Abi),
            ("faulty", RejectionKind::Format),
        ]),
    },
    SelectionCase {
        name: "the pin check comes first",
        plugins: &[("abi2", "cpu", &["gguf"], &["toy"], 2, &["completion"])],
        format: "gguf",
        architecture: "toy",
        pin: Some("faulty"),
        modalities: &[],
        want: Want::Rejected(&[("abi2", RejectionKind::Pin), ("faulty", RejectionKind::Pin)]),
    },
    SelectionCase {
        name: "a Model for speech recognition is refused by engines that serve only text",
        plugins: &[CPU_TOY, CPU_LLAMA],
        format: "gguf",
        architecture: "toy",
        pin: None,
        modalities: &["transcription"],
        want: Want::Rejected(&[
            ("faulty", RejectionKind::Modality),
            ("llama_cpp", RejectionKind::Modality),
        ]),
    },
    SelectionCase {
        name: "a Model for speech recognition goes to the engine that declares it",
        plugins: &[
            CPU_LLAMA,
            (
                "native",
                "cpu",
                &["safetensors"],
                &["WhisperForConditionalGeneration"],
                1,
                &["completion", "embedding", "transcription"],
            ),
        ],
        format: "safetensors",
        architecture: "WhisperForConditionalGeneration",
        pin: None,
        modalities: &["transcription"],
        want: Want::Chosen("native"),
    },
    SelectionCase {
        name: "a Piper voice goes to the ONNX engine, and text engines refuse its format",
        plugins: &[
            CPU_LLAMA,
            ("onnx", "cpu", &["onnx"], &["PiperVoice"], 1, &["speech"]),
        ],
        format: "onnx",
        architecture: "PiperVoice",
        pin: None,
        modalities: &["speech"],
        want: Want::Chosen("onnx"),
    },
    SelectionCase {
        name: "a Hibari voice goes to the ONNX engine that lists its architecture",
        plugins: &[
            CPU_LLAMA,
            (
                "onnx",
                "cpu",
                &["onnx"],
                &["PiperVoice", "HibariVoice"],
                1,
                &["speech"],
            ),
        ],
        format: "onnx",
        architecture: "HibariVoice",
        pin: None,
        modalities: &["speech"],
        want: Want::Chosen("onnx"),
    },
    SelectionCase {
        name: "a speech Model is refused by an engine that takes its format but not speech",
        plugins: &[(
            "onnx",
            "cpu",
            &["onnx"],
            &["PiperVoice"],
            1,
            &["completion"],
        )],
        format: "onnx",
        architecture: "PiperVoice",
        pin: None,
        modalities: &["speech"],
        want: Want::Rejected(&[("onnx", RejectionKind::Modality)]),
    },
];

fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps")
        .to_path_buf()
}

/// The node's registry over the case's plugins, each a real library under
/// `<root>/<id>/<backend>/`: llama.cpp for `llama_cpp`, the native engine for `native`, the
/// ONNX engine for `onnx`, the fault-injection plugin otherwise.
fn node_registry(root: &Path, plugins: &[PluginCase]) -> EngineRegistry {
    for &(id, backend, formats, architectures, abi, modalities) in plugins {
        let name = if id == "llama_cpp" {
            "libgantry_engine_llama_cpp.so"
        } else if id == "native" {
            "libgantry_engine_native.so"
        } else if id == "onnx" {
            "libgantry_engine_onnx.so"
        } else {
            "libgantry_fault_faulty.so"
        };
        let lib = profile_dir().join(name);
        assert!(
            lib.is_file(),
            "{} is missing: build the workspace first (scripts/test.sh does)",
            lib.display()
        );
        let dir = root.join(id).join(backend);
        std::fs::create_dir_all(&dir).expect("plugin dir");
        std::os::unix::fs::symlink(&lib, dir.join(name)).expect("link");
        let manifest = serde_json::json!({
            "id": id,
            "version": "0.1.0",
            "abi_version": abi.to_string(),
            "gpu_backend": backend,
            "binary": name,
            "architectures": architectures,
            "formats": formats,
            "modalities": modalities,
        });
        std::fs::write(
            dir.join("manifest.json"),
            serde_json::to_vec(&manifest).expect("json"),
        )
        .expect("manifest");
    }
    let config = EngineConfig {
        n_threads: 1,
        max_batch_size: 1,
        context_length: 64,
        ..EngineConfig::default()
    };
    EngineRegistry::discover(root, &config)
}

fn operator_plugins(plugins: &[PluginCase]) -> Vec<EnginePlugin> {
    plugins
        .iter()
        .map(|&(id, backend, formats, architectures, abi, modalities)| {
            serde_json::from_value(serde_json::json!({
                "apiVersion": "gantry.dev/v1alpha1",
                "kind": "EnginePlugin",
                "metadata": {"name": id, "uid": format!("uid-{id}"), "generation": 1},
                "spec": {
                    "image": format!("registry.example/{id}:0.1.0"),
                    "engineId": id,
                    "version": "0.1.0",
                    "abiVersion": abi,
                    "gpuBackend": backend,
                    "formats": formats,
                    "architectures": architectures,
                    "modalities": modalities,
                }
            }))
            .expect("EnginePlugin")
        })
        .collect()
}

#[test]
fn operator_and_node_select_the_same_engine_with_the_same_rejections() {
    for case in SELECTION {
        let root = tempfile::tempdir().expect("tempdir");
        let registry = node_registry(root.path(), case.plugins);
        let format = Format::parse(case.format).expect("format");
        let wanted: Vec<String> = case.modalities.iter().map(|m| m.to_string()).collect();
        let node = registry.resolve(format, case.architecture, case.pin, &wanted);

        let mut m = model("hf://org/repo", case.format, case.pin);
        m.spec.modalities =
            serde_json::from_value(serde_json::json!(case.modalities)).expect("modalities");
        let model = validate(&m, &Settings::default()).expect("valid model");
        let operator = resolve(
            &model,
            Some(case.architecture),
            &operator_plugins(case.plugins),
            Settings::default().abi_major,
        );

        match &case.want {
            Want::Chosen(id) => {
                assert!(
                    matches!(&node, gantry_api::EngineVerdict::Supported { plugin, .. } if plugin == id),
                    "{}: node said {node:?}",
                    case.name
                );
                match &operator {
                    Resolution::Resolved(p) => {
                        assert_eq!(p.spec.engine_id, *id, "{}: operator", case.name);
                    }
                    // Several pass and none is pinned: the operator mounts them all and the node
                    // measures exactly that set at load (its verdict names the first until then).
                    Resolution::Measured(ps) => {
                        let ids: Vec<&str> = ps.iter().map(|p| p.spec.engine_id.as_str()).collect();
                        assert_eq!(ids.first(), Some(id), "{}: operator", case.name);
                        assert!(case.pin.is_none(), "{}: a pin is never measured", case.name);
                        assert_eq!(
                            registry.alternatives(format, case.architecture, &wanted),
                            ids,
                            "{}: the node measures what the operator mounts",
                            case.name
                        );
                    }
                    other => panic!("{}: operator said {other:?}", case.name),
                }
            }
            Want::Rejected(want) => {
                let gantry_api::EngineVerdict::Unsupported { rejections } = &node else {
                    panic!("{}: node said {node:?}", case.name)
                };
                let node_kinds: Vec<(&str, RejectionKind)> = rejections
                    .iter()
                    .map(|r| (r.plugin.as_str(), r.kind))
                    .collect();
                assert_eq!(&node_kinds, want, "{}: node", case.name);
                let Resolution::Unresolved(rejections) = &operator else {
                    panic!("{}: operator said {operator:?}", case.name)
                };
                let operator_kinds: Vec<(&str, RejectionKind)> = rejections
                    .iter()
                    .map(|r| (r.plugin.as_str(), r.kind))
                    .collect();
                assert_eq!(&operator_kinds, want, "{}: operator", case.name);
            }
        }
    }
}
