//! Model store, step 3 (at node start, after listing): which of a source's files make the model.
//!
//! Pure rules over a file list, so they are the same for Hugging Face, S3,
//! and a local directory:
//! - the registered format is the only one considered (`format: gguf` never
//!   selects a `.safetensors` file, and the reverse);
//! - GGUF quantization is matched exactly — case and separators count, so
//!   `q4-k-m` is not `Q4_K_M` — against the file name's parts;
//! - a sharded GGUF (`name-00001-of-00003.gguf`) is one artifact and must be
//!   complete;
//! - several candidates and no quantization, or a quantization matched by
//!   several, is an error that lists the candidates;
//! - an `mmproj` GGUF beside the model is attached;
//! - safetensors takes `config.json`, the tokenizer files, the top-level
//!   `*.safetensors` and their index.

use std::collections::BTreeMap;

use gantry_engine_abi::Format;

use super::{RemoteFile, StoreError};

/// The files that make one model, and which of them the engine opens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArtifactSelection {
    /// Every file to fetch, in listing order.
    pub files: Vec<RemoteFile>,
    /// Relative path of the file the engine loads (first shard, index, or the file).
    pub primary: String,
    /// Relative path of the attached multimodal projector.
    pub mmproj: Option<String>,
    /// The quantization the choice was made on, when one was asked for.
    pub quantization: Option<String>,
}

/// Files a safetensors model needs beside its weights, when present.
const SAFETENSORS_SIDECARS: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
];

const SAFETENSORS_INDEX: &str = "model.safetensors.index.json";

fn file_name(path: &str) -> &str {
    path.rsplit('/').next().unwrap_or(path)
}

fn is_gguf(path: &str) -> bool {
    path.ends_with(".gguf")
}

fn is_mmproj(path: &str) -> bool {
    file_name(path).to_ascii_lowercase().contains("mmproj")
}

/// `name-00001-of-00003.gguf` → (`name`, 1, 3).
fn shard_of(path: &str) -> Option<(&str, u32, u32)> {
    let stem = path.strip_suffix(".gguf")?;
    let (head, total) = stem.rsplit_once("-of-")?;
    let (base, index) = head.rsplit_once('-')?;
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(total) || !digits(index) {
        return None;
    }
    Some((base, index.parse().ok()?, total.parse().ok()?))
}

/// Whether `quant` appears in `path` as a whole part: bounded by the start,
/// the end, `/`, `-` or `.`, and by `_` only on its left (so `Q4_K` does not
/// match `Q4_K_M`). Case-sensitive on purpose.
fn names_quantization(path: &str, quant: &str) -> bool {
    if quant.is_empty() {
        return false;
    }
    let left_ok = |c: Option<char>| c.is_none_or(|c| matches!(c, '/' | '-' | '.' | '_'));
    let right_ok = |c: Option<char>| c.is_none_or(|c| matches!(c, '/' | '-' | '.'));
    path.match_indices(quant).any(|(i, _)| {
        left_ok(path[..i].chars().next_back()) && right_ok(path[i + quant.len()..].chars().next())
    })
}

/// One GGUF model artifact: a single file or a complete set of shards.
struct GgufArtifact {
    /// What the user sees in candidate lists.
    label: String,
    /// Stem the quantization is read from (shard suffix removed).
    stem: String,
    files: Vec<RemoteFile>,
}

fn gguf_artifacts(listing: &[RemoteFile]) -> Result<Vec<GgufArtifact>, StoreError> {
    let mut singles = Vec::new();
    let mut shards: BTreeMap<(String, u32), Vec<(u32, RemoteFile)>> = BTreeMap::new();
    for f in listing
        .iter()
        .filter(|f| is_gguf(&f.path) && !is_mmproj(&f.path))
    {
        match shard_of(&f.path) {
            Some((base, i, n)) => shards
                .entry((base.to_string(), n))
                .or_default()
                .push((i, f.clone())),
            None => singles.push(GgufArtifact {
                label: f.path.clone(),
                stem: f.path.trim_end_matches(".gguf").to_string(),
                files: vec![f.clone()],
            }),
        }
    }
    for ((base, n), mut parts) in shards {
        parts.sort_by_key(|(i, _)| *i);
        let have: Vec<u32> = parts.iter().map(|(i, _)| *i).collect();
        if have != (1..=n).collect::<Vec<_>>() {
            return Err(StoreError::Selection(format!(
                "sharded GGUF `{base}` is incomplete: has parts {have:?} of {n}"
            )));
        }
        singles.push(GgufArtifact {
            label: format!("{base}-{{00001..{n:05}}}-of-{n:05}.gguf ({n} shards)"),
            stem: base,
            files: parts.into_iter().map(|(_, f)| f).collect(),
        });
    }
    singles.sort_by(|a, b| a.label.cmp(&b.label));
    Ok(singles)
}

/// Whether a file named directly (a model path that is a file) can be what
/// an engine of `format` opens; every other choice goes through [`select`].
pub fn is_model_file(path: &str, format: Format) -> bool {
    match format {
        Format::Gguf => is_gguf(path),
        Format::Safetensors => path.ends_with(".safetensors") || path.ends_with(".json"),
        Format::Onnx => path.ends_with(".onnx") || path.ends_with(".json"),
    }
}

/// Choose the files of a model from a source's listing: the one rule for
/// downloads and local directories alike.
///
/// `wanted` restricts the listing to the model's `files` (each must exist).
pub fn select(
    listing: &[RemoteFile],
    format: Format,
    quantization: Option<&str>,
    wanted: &[String],
) -> Result<ArtifactSelection, StoreError> {
    let restricted: Vec<RemoteFile>;
    let listing = if wanted.is_empty() {
        listing
    } else {
        let mut out = Vec::new();
        for w in wanted {
            let w = w.trim_start_matches('/');
            match listing.iter().find(|f| f.path == w) {
                Some(f) => out.push(f.clone()),
                None => {
                    return Err(StoreError::Selection(format!(
                        "`files` names {w:?}, which the source does not have"
                    )));
                }
            }
        }
        restricted = out;
        &restricted
    };
    match format {
        Format::Gguf => select_gguf(listing, quantization),
        Format::Safetensors => {
            if let Some(q) = quantization {
                return Err(StoreError::Selection(format!(
                    "`quantization` ({q}) picks a GGUF file; this model's format is safetensors"
                )));
            }
            select_safetensors(listing)
        }
        Format::Onnx => {
            if let Some(q) = quantization {
                return Err(StoreError::Selection(format!(
                    "`quantization` ({q}) picks a GGUF file; this model's format is onnx"
                )));
            }
            select_onnx(listing)
        }
    }
}

/// An ONNX model: one `.onnx` graph (the primary) and its config beside it (`<name>.onnx.json`,
/// a Piper voice's). The graph may sit in a folder (a voice collection such as
/// `rhasspy/piper-voices` holds hundreds, one per folder): a listing with several is refused
/// with the first few named, and `files` picks one.
fn select_onnx(listing: &[RemoteFile]) -> Result<ArtifactSelection, StoreError> {
    let graphs: Vec<&RemoteFile> = listing
        .iter()
        .filter(|f| f.path.ends_with(".onnx"))
        .collect();
    let primary = match graphs.as_slice() {
        [one] => one.path.clone(),
        [] => {
            return Err(StoreError::Selection(
                "no .onnx file in the source (format is onnx; other formats are never used)".into(),
            ));
        }
        many => {
            let shown: Vec<&str> = many.iter().take(5).map(|f| f.path.as_str()).collect();
            let more = match many.len() - shown.len() {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            return Err(StoreError::Selection(format!(
                "several .onnx files: {}{more}; name the graph and its .onnx.json in `files`",
                shown.join(", ")
            )));
        }
    };
    let config = format!("{primary}.json");
    if !listing.iter().any(|f| f.path == config) {
        return Err(StoreError::Selection(format!(
            "an onnx model needs its config {config} beside {primary}"
        )));
    }
    let files = listing
        .iter()
        .filter(|f| f.path == primary || f.path == config)
        .cloned()
        .collect();
    Ok(ArtifactSelection {
        files,
        primary,
        mmproj: None,
        quantization: None,
    })
}

fn select_gguf(
    listing: &[RemoteFile],
    quantization: Option<&str>,
) -> Result<ArtifactSelection, StoreError> {
    let artifacts = gguf_artifacts(listing)?;
    let labels = |a: &[&GgufArtifact]| -> String {
        a.iter()
            .map(|a| a.label.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let all: Vec<&GgufArtifact> = artifacts.iter().collect();
    if all.is_empty() {
        return Err(StoreError::Selection(
            "no .gguf model file in the source (format is gguf; other formats are never used)"
                .into(),
        ));
    }
    let chosen = match quantization {
        Some(q) => {
            let hits: Vec<&GgufArtifact> = all
                .iter()
                .copied()
                .filter(|a| names_quantization(&a.stem, q))
                .collect();
            match hits.len() {
                1 => hits[0],
                0 => {
                    return Err(StoreError::Selection(format!(
                        "no GGUF with quantization `{q}` (matched exactly: case and separators count); candidates: {}",
                        labels(&all)
                    )));
                }
                _ => {
                    return Err(StoreError::Selection(format!(
                        "quantization `{q}` matches several GGUF files; name one with `files`: {}",
                        labels(&hits)
                    )));
                }
            }
        }
        None if all.len() == 1 => all[0],
        None => {
            return Err(StoreError::Selection(format!(
                "several GGUF candidates; set `quantization` (or `name:QUANT`) or `files` to choose one: {}",
                labels(&all)
            )));
        }
    };
    let mut files = chosen.files.clone();
    let primary = files[0].path.clone();
    // The projector: the only one, or the one naming the chosen quantization.
    let projectors: Vec<&RemoteFile> = listing
        .iter()
        .filter(|f| is_gguf(&f.path) && is_mmproj(&f.path))
        .collect();
    let mmproj = match projectors.as_slice() {
        [] => None,
        [one] => Some(*one),
        many => quantization
            .and_then(|q| many.iter().find(|f| names_quantization(&f.path, q)))
            .or_else(|| {
                many.iter()
                    .find(|f| f.path.contains("f16") || f.path.contains("F16"))
            })
            .or(many.first())
            .copied(),
    };
    if let Some(p) = mmproj {
        files.push(p.clone());
    }
    Ok(ArtifactSelection {
        files,
        primary,
        mmproj: mmproj.map(|p| p.path.clone()),
        quantization: quantization.map(str::to_string),
    })
}

/// The files at the top of the listing (not in a folder) whose names end with `ext`.
fn top_level<'a>(listing: &'a [RemoteFile], ext: &str) -> Vec<&'a RemoteFile> {
    listing
        .iter()
        .filter(|f| !f.path.contains('/') && f.path.ends_with(ext))
        .collect()
}

fn select_safetensors(listing: &[RemoteFile]) -> Result<ArtifactSelection, StoreError> {
    let weights = top_level(listing, ".safetensors");
    if weights.is_empty() {
        return Err(StoreError::Selection(
            "no top-level .safetensors file in the source (format is safetensors; other formats are never used)"
                .into(),
        ));
    }
    if !listing.iter().any(|f| f.path == "config.json") {
        return Err(StoreError::Selection(
            "a safetensors model needs config.json beside its weights".into(),
        ));
    }
    let index = listing.iter().find(|f| f.path == SAFETENSORS_INDEX);
    let primary = match (index, weights.as_slice()) {
        (Some(i), _) => i.path.clone(),
        (None, [one]) => one.path.clone(),
        (None, many) => {
            return Err(StoreError::Selection(format!(
                "several .safetensors files and no {SAFETENSORS_INDEX}: {}",
                many.iter()
                    .map(|f| f.path.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
    };
    let files = listing
        .iter()
        .filter(|f| {
            SAFETENSORS_SIDECARS.contains(&f.path.as_str())
                || f.path == SAFETENSORS_INDEX
                || (!f.path.contains('/') && f.path.ends_with(".safetensors"))
        })
        .cloned()
        .collect();
    Ok(ArtifactSelection {
        files,
        primary,
        mmproj: None,
        quantization: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_onnx_model_is_its_graph_and_its_config() {
        let l = ls(&[
            "en_US-joe-medium.onnx",
            "en_US-joe-medium.onnx.json",
            "MODEL_CARD",
            "samples/x.wav",
        ]);
        let s = select(&l, Format::Onnx, None, &[]).expect("onnx");
        assert_eq!(s.primary, "en_US-joe-medium.onnx");
        let mut names: Vec<_> = s.files.iter().map(|f| f.path.as_str()).collect();
        names.sort();
        assert_eq!(
            names,
            ["en_US-joe-medium.onnx", "en_US-joe-medium.onnx.json"]
        );
        let e = select(&ls(&["a.onnx"]), Format::Onnx, None, &[]).expect_err("refused");
        assert!(e.to_string().contains("a.onnx.json"), "{e}");
        let e = select(&ls(&["a.onnx", "b.onnx"]), Format::Onnx, None, &[]).expect_err("refused");
        assert!(e.to_string().contains("a.onnx, b.onnx;"), "{e}");
        let e = select(&ls(&["a.safetensors"]), Format::Onnx, None, &[]).expect_err("refused");
        assert!(e.to_string().contains("no .onnx"), "{e}");
        // A voice collection: one voice per folder, picked with `files`.
        let voices: Vec<String> = (0..8)
            .flat_map(|i| {
                let v = format!("en/v{i}/medium/v{i}.onnx");
                [
                    v.clone(),
                    format!("{v}.json"),
                    format!("en/v{i}/MODEL_CARD"),
                ]
            })
            .collect();
        let listing = ls(&voices.iter().map(String::as_str).collect::<Vec<_>>());
        let e = select(&listing, Format::Onnx, None, &[]).expect_err("several");
        assert!(e.to_string().contains("and 3 more"), "{e}");
        let want = vec![
            "en/v2/medium/v2.onnx".to_string(),
            "en/v2/medium/v2.onnx.json".into(),
        ];
        let s = select(&listing, Format::Onnx, None, &want).expect("picked");
        assert_eq!(s.primary, "en/v2/medium/v2.onnx");
        assert_eq!(s.files.len(), 2);
    }

    fn ls(names: &[&str]) -> Vec<RemoteFile> {
        names
            .iter()
            .map(|n| RemoteFile {
                path: n.to_string(),
                size: 1,
                sha256: None,
            })
            .collect()
    }

    fn paths(s: &ArtifactSelection) -> Vec<&str> {
        s.files.iter().map(|f| f.path.as_str()).collect()
    }

    #[test]
    fn quantization_is_matched_exactly() {
        let l = ls(&[
            "m-Q4_K_M.gguf",
            "m-Q4_K.gguf",
            "m-Q4_K_S.gguf",
            "m-q4-k-m.gguf",
            "m-Q8_0.gguf",
            "README.md",
        ]);
        let s = select(&l, Format::Gguf, Some("Q4_K_M"), &[]).expect("Q4_K_M");
        assert_eq!(s.primary, "m-Q4_K_M.gguf");
        let s = select(&l, Format::Gguf, Some("Q4_K"), &[]).expect("Q4_K");
        assert_eq!(s.primary, "m-Q4_K.gguf");
        let s = select(&l, Format::Gguf, Some("q4-k-m"), &[]).expect("lowercase is its own name");
        assert_eq!(s.primary, "m-q4-k-m.gguf");
        let e = select(&l, Format::Gguf, Some("q4_k_m"), &[]).expect_err("case counts");
        let msg = e.to_string();
        assert!(msg.contains("no GGUF with quantization `q4_k_m`"), "{msg}");
        assert!(
            msg.contains("m-Q4_K_M.gguf") && msg.contains("m-Q8_0.gguf"),
            "{msg}"
        );
    }

    #[test]
    fn several_candidates_without_a_quantization_are_listed() {
        let l = ls(&["a-Q4_K_M.gguf", "a-Q8_0.gguf"]);
        let msg = select(&l, Format::Gguf, None, &[])
            .expect_err("ambiguous")
            .to_string();
        assert!(
            msg.contains("several GGUF candidates") && msg.contains("a-Q4_K_M.gguf, a-Q8_0.gguf"),
            "{msg}"
        );
        let s = select(&l, Format::Gguf, None, &["a-Q8_0.gguf".into()]).expect("files pick one");
        assert_eq!(s.primary, "a-Q8_0.gguf");
        let e = select(&l, Format::Gguf, None, &["nope.gguf".into()]).expect_err("missing");
        assert!(e.to_string().contains("nope.gguf"));
    }

    #[test]
    fn shards_are_one_artifact_and_must_be_complete() {
        let l = ls(&[
            "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf",
            "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
            "m-Q8_0.gguf",
        ]);
        let s = select(&l, Format::Gguf, Some("Q4_K_M"), &[]).expect("sharded");
        assert_eq!(s.primary, "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf");
        assert_eq!(s.files.len(), 2);
        let e = select(&l, Format::Gguf, None, &[]).expect_err("two artifacts");
        assert!(e.to_string().contains("(2 shards)"), "{e}");
        let broken = ls(&["m-00001-of-00003.gguf", "m-00003-of-00003.gguf"]);
        let e = select(&broken, Format::Gguf, None, &[]).expect_err("missing shard");
        assert!(e.to_string().contains("incomplete"), "{e}");
    }

    #[test]
    fn mmproj_is_attached_and_never_taken_as_the_model() {
        let l = ls(&["m-Q4_K_M.gguf", "mmproj-m-F16.gguf"]);
        let s = select(&l, Format::Gguf, None, &[]).expect("one model");
        assert_eq!(s.primary, "m-Q4_K_M.gguf");
        assert_eq!(s.mmproj.as_deref(), Some("mmproj-m-F16.gguf"));
        assert_eq!(paths(&s), ["m-Q4_K_M.gguf", "mmproj-m-F16.gguf"]);
    }

    #[test]
    fn only_the_registered_format_is_selected() {
        let l = ls(&[
            "config.json",
            "tokenizer.json",
            "model.safetensors",
            "m-Q4_K_M.gguf",
            "onnx/model.safetensors",
            "README.md",
        ]);
        let g = select(&l, Format::Gguf, None, &[]).expect("gguf");
        assert_eq!(paths(&g), ["m-Q4_K_M.gguf"]);
        let s = select(&l, Format::Safetensors, None, &[]).expect("safetensors");
        assert_eq!(
            paths(&s),
            ["config.json", "tokenizer.json", "model.safetensors"]
        );
        assert_eq!(s.primary, "model.safetensors");
        let e = select(&l, Format::Safetensors, Some("Q4_K_M"), &[]).expect_err("quant");
        assert!(e.to_string().contains("safetensors"), "{e}");
        let e = select(&ls(&["config.json"]), Format::Gguf, None, &[]).expect_err("none");
        assert!(e.to_string().contains("no .gguf"), "{e}");
    }

    /// The file the engine opens, for each kind of listing: the one choice
    /// local directories and downloads share.
    #[test]
    fn the_primary_file_of_each_listing() {
        /// A listing, its format and quantization, and the primary file or a part of the error.
        type Case<'a> = (
            &'a [&'a str],
            Format,
            Option<&'a str>,
            Result<&'a str, &'a str>,
        );
        let cases: &[Case<'_>] = &[
            (&["m.gguf"], Format::Gguf, None, Ok("m.gguf")),
            (
                &["m.gguf", "mmproj-m.gguf"],
                Format::Gguf,
                None,
                Ok("m.gguf"),
            ),
            (
                &["README.md", "m.gguf", "m.safetensors"],
                Format::Gguf,
                None,
                Ok("m.gguf"),
            ),
            (
                &["a.gguf", "b.gguf"],
                Format::Gguf,
                None,
                Err("several GGUF candidates"),
            ),
            (
                &["a-Q8_0.gguf", "a-Q4_0.gguf"],
                Format::Gguf,
                Some("Q4_0"),
                Ok("a-Q4_0.gguf"),
            ),
            (
                &["mmproj-m.gguf"],
                Format::Gguf,
                None,
                Err("no .gguf model file"),
            ),
            (
                &["config.json", "model.safetensors"],
                Format::Safetensors,
                None,
                Ok("model.safetensors"),
            ),
            (
                &[
                    "config.json",
                    "a.safetensors",
                    "b.safetensors",
                    "model.safetensors.index.json",
                ],
                Format::Safetensors,
                None,
                Ok("model.safetensors.index.json"),
            ),
            (
                &["config.json", "a.safetensors", "b.safetensors"],
                Format::Safetensors,
                None,
                Err("several .safetensors files"),
            ),
            (
                &["model.safetensors"],
                Format::Safetensors,
                None,
                Err("needs config.json"),
            ),
            (
                &["config.json", "m.gguf"],
                Format::Safetensors,
                None,
                Err("no top-level .safetensors"),
            ),
        ];
        for (names, format, quant, want) in cases {
            let got = select(&ls(names), *format, *quant, &[]);
            match (got, want) {
                (Ok(s), Ok(p)) => assert_eq!(s.primary, *p, "{names:?}"),
                (Err(e), Err(msg)) => assert!(e.to_string().contains(msg), "{names:?}: {e}"),
                (got, want) => panic!("{names:?}: got {got:?}, want {want:?}"),
            }
        }
        let files = [
            ("m.gguf", Format::Gguf, true),
            ("m.safetensors", Format::Gguf, false),
            ("model.safetensors", Format::Safetensors, true),
            ("model.safetensors.index.json", Format::Safetensors, true),
            ("m.gguf", Format::Safetensors, false),
        ];
        for (name, format, ok) in files {
            assert_eq!(is_model_file(name, format), ok, "{name}");
        }
    }

    #[test]
    fn sharded_safetensors_use_their_index() {
        let l = ls(&[
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "model.safetensors.index.json",
        ]);
        let s = select(&l, Format::Safetensors, None, &[]).expect("sharded");
        assert_eq!(s.primary, SAFETENSORS_INDEX);
        assert_eq!(s.files.len(), 4);
    }
}
