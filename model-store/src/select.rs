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
/// a Piper voice's), or, without one, a Hibari voice's `voices.json` and `vocab.json` beside
/// it. The graph may sit in a folder (a voice collection such as `rhasspy/piper-voices` holds
/// hundreds, one per folder): a listing with several is refused with the first few named, and
/// `files` picks one.
/// A Hibari voice's files beside its graph: its registry and its phoneme vocabulary.
const HIBARI_FILES: [&str; 2] = ["voices.json", "vocab.json"];

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
    let has = |p: &str| listing.iter().any(|f| f.path == p);
    let config = format!("{primary}.json");
    let folder = primary.rfind('/').map_or("", |i| &primary[..=i]);
    let hibari = [
        format!("{folder}{}", HIBARI_FILES[0]),
        format!("{folder}{}", HIBARI_FILES[1]),
    ];
    let companions: Vec<&str> = if has(&config) {
        vec![&config]
    } else if hibari.iter().all(|p| has(p)) {
        hibari.iter().map(String::as_str).collect()
    } else {
        return Err(StoreError::Selection(format!(
            "an onnx model needs its config {config} beside {primary} (a Piper voice), or {} and \
             {} (a Hibari voice)",
            hibari[0], hibari[1]
        )));
    };
    let files = listing
        .iter()
        .filter(|f| f.path == primary || companions.contains(&f.path.as_str()))
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
mod tests;
