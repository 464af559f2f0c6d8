//! Workspace rules that the compiler does not enforce by itself:
//! `unsafe` only in the ABI crate, engine crates and the engine host; a
//! `// SAFETY:` note on every `unsafe` block and impl; a `//!` header on every module; no
//! `anyhow` in the operator, gateway and CRD libraries; no unit tests in the operator library,
//! whose test target is off.

use std::path::{Path, PathBuf};

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.filter_map(Result::ok) {
        let p = e.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if p.is_dir() {
            if !matches!(name, "target" | ".git" | ".cache" | "fuzz") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

fn sources() -> Vec<(String, String)> {
    let root = workspace_root();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let rel = p
                .strip_prefix(&root)
                .expect("under root")
                .to_string_lossy()
                .into_owned();
            (rel, std::fs::read_to_string(&p).expect("read source"))
        })
        .collect()
}

/// Places allowed to contain `unsafe` code.
fn may_use_unsafe(rel: &str) -> bool {
    rel.starts_with("engines/") || rel.starts_with("engine-host/")
}

fn code_lines(src: &str) -> impl Iterator<Item = (usize, &str)> {
    src.lines().enumerate().filter(|(_, l)| {
        let t = l.trim_start();
        !(t.starts_with("//") || t.starts_with("///") || t.starts_with('*'))
    })
}

#[test]
fn unsafe_code_appears_only_in_the_abi_engine_and_engine_host_crates() {
    let mut offenders = Vec::new();
    for (rel, src) in sources() {
        if may_use_unsafe(&rel) || rel == "tests/tests/house_rules.rs" {
            continue;
        }
        for (i, line) in code_lines(&src) {
            if line.contains("unsafe ")
                || line.contains("unsafe{")
                || line.contains("allow(unsafe_code)")
            {
                offenders.push(format!("{rel}:{}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "unsafe outside the allowed crates:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn every_unsafe_block_and_impl_carries_a_safety_note() {
    let mut missing = Vec::new();
    for (rel, src) in sources() {
        if rel == "tests/tests/house_rules.rs" {
            continue;
        }
        let lines: Vec<&str> = src.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            if t.starts_with("//") {
                continue;
            }
            let is_block = t.contains("unsafe {") && !t.contains("unsafe fn");
            let is_impl = t.starts_with("unsafe impl");
            if !(is_block || is_impl) {
                continue;
            }
            // The note sits on one of the few lines above (a comment may span lines).
            let window = &lines[i.saturating_sub(8)..=i];
            if !window.iter().any(|l| l.contains("SAFETY:")) {
                missing.push(format!("{rel}:{}: {}", i + 1, t));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "unsafe without a `// SAFETY:` note:\n{}",
        missing.join("\n")
    );
}

#[test]
fn every_module_opens_with_a_doc_header() {
    let mut missing = Vec::new();
    for (rel, src) in sources() {
        let first = src.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        if !first.starts_with("//!") {
            missing.push(rel);
        }
    }
    assert!(
        missing.is_empty(),
        "modules without a `//!` header:\n{}",
        missing.join("\n")
    );
}

/// Library crates of the control plane and the gateway report typed errors (one `thiserror`
/// enum per step); `anyhow` is for binaries (`main.rs`) and tests only.
#[test]
fn anyhow_stays_out_of_the_operator_gateway_and_crd_libraries() {
    let mut offenders = Vec::new();
    for (rel, src) in sources() {
        let library = ["operator/src/", "gateway/src/", "crd/src/"]
            .iter()
            .any(|dir| rel.starts_with(dir))
            && !rel.ends_with("/main.rs");
        if library && code_lines(&src).any(|(_, l)| l.contains("anyhow")) {
            offenders.push(rel);
        }
    }
    assert!(
        offenders.is_empty(),
        "anyhow in library modules (use a thiserror enum):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_operator_library_has_no_unit_tests_since_its_test_target_is_off() {
    let manifest = std::fs::read_to_string(workspace_root().join("operator/Cargo.toml"))
        .expect("operator manifest");
    assert!(
        manifest.contains("\ntest = false\n"),
        "operator/Cargo.toml no longer turns the library's test target off: drop this rule"
    );
    let offenders: Vec<String> = sources()
        .into_iter()
        .filter(|(rel, src)| {
            rel.starts_with("operator/src/")
                && code_lines(src).any(|(_, l)| l.contains("cfg(test)"))
        })
        .map(|(rel, _)| rel)
        .collect();
    assert!(
        offenders.is_empty(),
        "unit tests in operator/src would never run (the library's test target is off; put them \
         in operator/tests/operator/):\n{}",
        offenders.join("\n")
    );
}
