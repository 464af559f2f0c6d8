//! Local models (`file://` and plain paths; model store, at node start): list the file or
//! directory and select by the same rules as a download, without copying anything.

use std::path::Path;

use gantry_engine_abi::Format;

use crate::{Fetched, RemoteFile, StoreError, select};

/// Most entries read from a local model directory.
const MAX_LOCAL_ENTRIES: usize = 10_000;

/// A local file or directory: list it, select by the same rules, no copy.
/// A file is the model itself, when it is of the registered format.
pub fn resolve_local(
    path: &Path,
    format: Format,
    quantization: Option<&str>,
    files: &[String],
) -> Result<Fetched, StoreError> {
    if path.is_file() {
        if !select::is_model_file(&path.to_string_lossy(), format) {
            return Err(StoreError::Selection(format!(
                "{} is not a {format} file (the registered format is fixed)",
                path.display()
            )));
        }
        return Ok(Fetched {
            dir: path.parent().unwrap_or(Path::new("/")).to_path_buf(),
            primary: path.to_path_buf(),
            mmproj: None,
            quantization: quantization.map(str::to_string),
            files: vec![path.to_path_buf()],
        });
    }
    if !path.is_dir() {
        return Err(StoreError::Source {
            uri: path.display().to_string(),
            reason: "does not exist".into(),
        });
    }
    let listing = list_dir(path)?;
    let s = select(&listing, format, quantization, files)?;
    Ok(Fetched {
        dir: path.to_path_buf(),
        primary: path.join(&s.primary),
        mmproj: s.mmproj.as_ref().map(|m| path.join(m)),
        quantization: s.quantization,
        files: s.files.iter().map(|f| path.join(&f.path)).collect(),
    })
}

fn list_dir(root: &Path) -> Result<Vec<RemoteFile>, StoreError> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).map_err(|source| StoreError::Io {
            path: dir.clone(),
            source,
        })?;
        for e in entries.filter_map(Result::ok) {
            if out.len() + stack.len() >= MAX_LOCAL_ENTRIES {
                return Err(StoreError::Listing(format!(
                    "{} holds more than {MAX_LOCAL_ENTRIES} entries",
                    root.display()
                )));
            }
            let p = e.path();
            let Ok(ft) = e.file_type() else { continue };
            let Ok(rel) = p.strip_prefix(root) else {
                continue;
            };
            let rel = rel.to_string_lossy().replace('\\', "/");
            if rel.starts_with('.') || rel.ends_with(".partial") {
                continue;
            }
            if ft.is_dir() {
                stack.push(p);
            } else {
                let size = e.metadata().map_or(0, |m| m.len());
                out.push(RemoteFile {
                    path: rel,
                    size,
                    sha256: None,
                });
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
