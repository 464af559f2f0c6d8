//! Plugin image helper, the first step of plugin delivery: it puts a plugin's files where the
//! node's engine host discovers them (`/opt/gantry/engines/{engineId}/{gpuBackend}` in the node
//! pod's engines volume). `/copy SRC DEST` copies the plugin directory `SRC` of a scratch-based
//! plugin image into `DEST`. It runs as the node pod's init container before the node starts,
//! and again as an ephemeral container of the running pod when the operator delivers a new
//! version in place (the node then shadow-loads it).
//!
//! Each file is written to a temporary name in its destination directory, synced, and renamed
//! into place, so the node never sees a half-written library or manifest even if the copy is
//! interrupted. A copy in progress is marked by [`IN_PROGRESS`] in `DEST`, created before the
//! first file and removed after the last: the node leaves a marked directory alone until the
//! copy is complete, so it never checks a new library against an old manifest. Files of an
//! older version that the new one no longer has are removed. Symlinks are refused (a plugin
//! image holds plain files). std only, hand-written on purpose: the image has no shell and no
//! libc, and a dependency would grow a binary whose whole job is a directory walk.

use std::fs;
use std::io;
use std::path::Path;

/// Marks a copy in progress in the destination directory. The node's engine host
/// (engine-host/src/registry.rs) reads the same name.
pub const IN_PROGRESS: &str = ".gantry-copy-in-progress";

/// Copy the tree `src` into `dest` (created if missing). Returns how many files were copied.
fn copy_tree(src: &Path, dest: &Path) -> io::Result<u64> {
    fs::create_dir_all(dest)?;
    let mut copied = 0;
    let mut entries: Vec<_> = fs::read_dir(src)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let kind = entry.file_type()?;
        let to = dest.join(entry.file_name());
        if kind.is_dir() {
            copied += copy_tree(&entry.path(), &to)?;
        } else if kind.is_file() {
            copy_file(&entry.path(), &to)?;
            copied += 1;
        } else {
            return Err(io::Error::other(format!(
                "{} is neither a file nor a directory",
                entry.path().display()
            )));
        }
    }
    Ok(copied)
}

/// Copy one file atomically: temporary name beside the target, fsync, rename.
fn copy_file(from: &Path, to: &Path) -> io::Result<()> {
    let name = to
        .file_name()
        .ok_or_else(|| io::Error::other(format!("{} has no file name", to.display())))?;
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(".gantry-copy.tmp");
    let tmp = to.with_file_name(tmp_name);
    fs::copy(from, &tmp)?;
    fs::File::open(&tmp)?.sync_all()?;
    fs::rename(&tmp, to)
}

/// Remove what `dest` holds and `src` does not (an older version's files), except the
/// in-progress marker at the top. Returns how many entries were removed. A library still
/// mapped by a running worker stays readable to it: unlinking never touches an open file.
fn prune(src: &Path, dest: &Path, top: bool) -> io::Result<u64> {
    let mut removed = 0;
    for entry in fs::read_dir(dest)? {
        let entry = entry?;
        let name = entry.file_name();
        if top && name == IN_PROGRESS {
            continue;
        }
        let there = src.join(&name);
        let kind = entry.file_type()?;
        if kind.is_dir() {
            if there.is_dir() {
                removed += prune(&there, &entry.path(), false)?;
            } else {
                fs::remove_dir_all(entry.path())?;
                removed += 1;
            }
        } else if !there.is_file() {
            fs::remove_file(entry.path())?;
            removed += 1;
        }
    }
    Ok(removed)
}

/// Copy `src` over `dest` as one delivery: mark, copy, prune, unmark. Returns the files copied
/// and the old entries removed. On failure the marker stays, so the node keeps the version it
/// runs until a later copy completes.
pub fn deliver(src: &Path, dest: &Path) -> io::Result<(u64, u64)> {
    fs::create_dir_all(dest)?;
    let marker = dest.join(IN_PROGRESS);
    fs::write(&marker, b"")?;
    let copied = copy_tree(src, dest)?;
    if copied == 0 {
        // Nothing to deliver: pruning now would empty the plugin directory.
        return Err(io::Error::other(format!(
            "{} holds no files",
            src.display()
        )));
    }
    let removed = prune(src, dest, true)?;
    fs::remove_file(&marker)?;
    Ok((copied, removed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_the_plugin_tree_and_replaces_files_whole() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let src = dir.path().join("engines/llama_cpp/cpu");
        fs::create_dir_all(src.join("sub"))?;
        fs::write(src.join("manifest.json"), b"{\"id\":\"llama_cpp\"}")?;
        fs::write(
            src.join("libgantry_engine_llama_cpp.so"),
            vec![7u8; 100_000],
        )?;
        fs::write(src.join("sub/extra.txt"), b"x")?;
        let dest = dir.path().join("opt/gantry/engines/llama_cpp/cpu");
        // An older copy is replaced, not appended to.
        fs::create_dir_all(&dest)?;
        fs::write(dest.join("manifest.json"), b"old old old old old old")?;

        assert_eq!(copy_tree(&src, &dest)?, 3);
        assert_eq!(
            fs::read(dest.join("manifest.json"))?,
            b"{\"id\":\"llama_cpp\"}"
        );
        assert_eq!(
            fs::read(dest.join("libgantry_engine_llama_cpp.so"))?,
            vec![7u8; 100_000]
        );
        assert_eq!(fs::read(dest.join("sub/extra.txt"))?, b"x");
        // No temporary file is left behind.
        let leftovers: Vec<_> = fs::read_dir(&dest)?
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        Ok(())
    }

    #[test]
    fn a_delivery_replaces_the_old_version_and_removes_its_leftovers() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let (v1, v2, dest) = (
            dir.path().join("v1"),
            dir.path().join("v2"),
            dir.path().join("d"),
        );
        for (src, lib) in [(&v1, "libengine-0.1.so"), (&v2, "libengine-0.2.so")] {
            fs::create_dir_all(src.join("kernels"))?;
            fs::write(src.join("manifest.json"), lib)?;
            fs::write(src.join(lib), lib)?;
        }
        fs::write(v1.join("kernels/old.ptx"), b"old")?;
        fs::create_dir_all(v1.join("extra"))?;
        fs::write(v1.join("extra/x"), b"x")?;
        fs::write(v2.join("kernels/new.ptx"), b"new")?;

        assert_eq!(deliver(&v1, &dest)?, (4, 0));
        assert!(!dest.join(IN_PROGRESS).exists());
        assert_eq!(deliver(&v2, &dest)?, (3, 3));
        let mut left: Vec<String> = Vec::new();
        for e in fs::read_dir(&dest)? {
            left.push(e?.file_name().to_string_lossy().into_owned());
        }
        left.sort();
        assert_eq!(left, ["kernels", "libengine-0.2.so", "manifest.json"]);
        assert_eq!(fs::read(dest.join("kernels/new.ptx"))?, b"new");
        assert!(!dest.join("kernels/old.ptx").exists());
        assert_eq!(fs::read(dest.join("manifest.json"))?, b"libengine-0.2.so");
        assert!(
            !dest.join(IN_PROGRESS).exists(),
            "the marker is gone after a complete copy"
        );
        Ok(())
    }

    #[test]
    fn a_failed_delivery_leaves_the_marker_and_the_old_files() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let (good, empty, dest) = (
            dir.path().join("good"),
            dir.path().join("empty"),
            dir.path().join("d"),
        );
        fs::create_dir_all(&good)?;
        fs::create_dir_all(&empty)?;
        fs::write(good.join("manifest.json"), b"{}")?;
        deliver(&good, &dest)?;
        let err = deliver(&empty, &dest).expect_err("an empty source");
        assert!(err.to_string().contains("holds no files"), "{err}");
        // The node must not take this directory for a complete copy, and nothing was pruned.
        assert!(dest.join(IN_PROGRESS).exists());
        assert_eq!(fs::read(dest.join("manifest.json"))?, b"{}");
        Ok(())
    }

    #[test]
    fn a_missing_source_is_an_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = copy_tree(&dir.path().join("absent"), &dir.path().join("out"))
            .expect_err("missing source");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[cfg(unix)]
    #[test]
    fn symlinks_are_refused() -> io::Result<()> {
        let dir = tempfile::tempdir()?;
        let src = dir.path().join("src");
        fs::create_dir_all(&src)?;
        std::os::unix::fs::symlink("/etc/passwd", src.join("link"))?;
        let err = copy_tree(&src, &dir.path().join("out")).expect_err("symlink");
        assert!(err.to_string().contains("neither a file"), "{err}");
        Ok(())
    }
}
