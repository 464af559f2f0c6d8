//! The `/copy` binary as the node pod's plugin sidecar runs it (plugin delivery, before the
//! engine host discovers the plugin): `--serve` copies and stays, SIGTERM ends it cleanly,
//! `--ready` is its startup probe.

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const COPY: &str = env!("CARGO_BIN_EXE_gantry-copy");

fn wait_until(what: &str, limit: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "{what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn probe(dest: &Path) -> bool {
    Command::new(COPY)
        .arg("--ready")
        .arg(dest)
        .status()
        .expect("run --ready")
        .success()
}

#[test]
fn serve_copies_then_stays_until_sigterm_and_exits_zero() {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src");
    let dest = dir.path().join("engines/my_engine/cpu");
    fs::create_dir_all(&src).expect("mkdir");
    fs::write(src.join("manifest.json"), b"{\"id\":\"my_engine\"}").expect("write");
    fs::write(src.join("libmy_engine.so"), vec![1u8; 4096]).expect("write");
    assert!(!probe(&dest), "nothing copied yet");

    let mut child = Command::new(COPY)
        .arg("--serve")
        .arg(&src)
        .arg(&dest)
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn --serve");
    wait_until("a complete copy", Duration::from_secs(10), || probe(&dest));
    assert_eq!(
        fs::read(dest.join("libmy_engine.so")).expect("read").len(),
        4096
    );
    // Still running: a sidecar that exits would be restarted by the kubelet in a loop.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "--serve stays"
    );

    let killed = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status()
        .expect("kill");
    assert!(killed.success());
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "exits on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    // An exit code, not death by the signal: the handler ran (as PID 1 in a container,
    // a process without one would ignore SIGTERM).
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[test]
fn bad_arguments_print_the_usage() {
    let out = Command::new(COPY).arg("--bogus").output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--serve SRC_DIR DEST_DIR"));
}
