//! Plugin image helper (before the node pod starts, in the InitContainer mount strategy):
//! `/copy SRC DEST` copies the plugin directory `SRC` of a scratch-based plugin image into the
//! node pod's engines volume at `DEST`.
//!
//! Each file is written to a temporary name in its destination directory, synced, and renamed
//! into place, so the node never sees a half-written library or manifest even if the copy is
//! interrupted and the InitContainer restarts. Symlinks are refused (a plugin image holds plain
//! files). std only, hand-written on purpose: the image has no shell and no libc, and a
//! dependency would grow a binary whose whole job is a directory walk.

use std::fs;
use std::io;
use std::path::Path;
use std::process::ExitCode;

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

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [src, dest] = args.as_slice() else {
        eprintln!(
            "usage: copy SRC_DIR DEST_DIR   (copies the plugin directory SRC_DIR into DEST_DIR)"
        );
        return ExitCode::from(2);
    };
    match copy_tree(Path::new(src), Path::new(dest)) {
        Ok(0) => {
            eprintln!("copy: {src} holds no files");
            ExitCode::FAILURE
        }
        Ok(n) => {
            eprintln!("copy: {n} files from {src} to {dest}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("copy: {src} -> {dest}: {e}");
            ExitCode::FAILURE
        }
    }
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
