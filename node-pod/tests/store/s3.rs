//! A real S3-compatible server (`s3s-fs`, installed by `scripts/setup.sh`) on loopback, and
//! the store fetching from it.

use super::*;

/// The `s3s-fs` server `scripts/setup.sh` installs, on a free loopback port.
pub(crate) struct S3Server {
    pub(crate) child: Child,
    pub(crate) endpoint: String,
    pub(crate) _root: tempfile::TempDir,
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub(crate) const S3_KEY: &str = "gantrytest";
pub(crate) const S3_SECRET: &str = "gantrytestsecret";

pub(crate) fn s3s_binary() -> PathBuf {
    let p = std::env::var_os("GANTRY_S3_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("s3s-fs"));
    assert!(
        p.is_file(),
        "the S3 test needs a real S3-compatible server: run `eval \"$(scripts/setup.sh)\"`, which installs s3s-fs and sets GANTRY_S3_SERVER (now {p:?})"
    );
    p
}

pub(crate) async fn start_s3() -> S3Server {
    let root = tempfile::tempdir().expect("s3 root");
    let port = free_port();
    let child = Command::new(s3s_binary())
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", S3_KEY, "--secret-key", S3_SECRET])
        .arg(root.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn s3s-fs");
    let endpoint = format!("http://127.0.0.1:{port}");
    let t0 = Instant::now();
    while tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_err()
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "s3s-fs did not listen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    S3Server {
        child,
        endpoint,
        _root: root,
    }
}

pub(crate) fn s3_settings(endpoint: &str) -> SourceSettings {
    SourceSettings {
        s3_endpoint: Some(endpoint.to_string()),
        s3_region: Some("us-east-1".into()),
        aws_access_key_id: Some(S3_KEY.into()),
        aws_secret_access_key: Some(S3_SECRET.into()),
        ..SourceSettings::default()
    }
}

/// Create the bucket and upload objects through the S3 API.
pub(crate) async fn s3_upload(endpoint: &str, bucket: &str, objects: &[(&str, Vec<u8>)]) {
    use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
    let b = Bucket::new(
        endpoint.parse().expect("url"),
        UrlStyle::Path,
        bucket.to_string(),
        "us-east-1",
    )
    .expect("bucket");
    let creds = Credentials::new(S3_KEY, S3_SECRET);
    let c = reqwest::Client::new();
    let ttl = Duration::from_secs(600);
    let r = c
        .put(b.create_bucket(&creds).sign(ttl))
        .send()
        .await
        .expect("create bucket");
    assert!(r.status().is_success(), "create bucket: {}", r.status());
    for (key, bytes) in objects {
        let r = c
            .put(b.put_object(Some(&creds), key).sign(ttl))
            .body(bytes.clone())
            .send()
            .await
            .expect("put");
        assert!(r.status().is_success(), "put {key}: {}", r.status());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(crate) async fn s3_sources_select_exactly_and_download_verified_from_a_real_server() {
    let s3 = start_s3().await;
    let gguf = blob("s3-q4", 40_000);
    s3_upload(
        &s3.endpoint,
        "models",
        &[
            ("tiny/t-Q4_K_M.gguf", gguf.clone()),
            ("tiny/t-Q8_0.gguf", blob("s3-q8", 1000)),
            ("tiny/mmproj-t-f16.gguf", blob("s3-mm", 500)),
            ("tiny/model.safetensors", blob("s3-st", 3000)),
            ("tiny/config.json", br#"{"model_type": "llama"}"#.to_vec()),
            ("other/x.gguf", blob("other", 10)),
        ],
    )
    .await;
    let cache = tempfile::tempdir().expect("cache");
    let s = store(s3_settings(&s3.endpoint), cache.path());
    let (r, p) = fetch(&s, "s3://models/tiny", Format::Gguf, Some("Q4_K_M")).await;
    let f = r.expect("s3 fetch");
    assert_eq!(std::fs::read(&f.primary).expect("read"), gguf);
    assert!(f.primary.ends_with("s3/models/tiny/t-Q4_K_M.gguf"));
    assert!(f.mmproj.is_some());
    assert_eq!(p.snapshot().bytes_done, 40_500);
    let on_disk: Vec<String> = std::fs::read_dir(cache.path().join("s3/models/tiny"))
        .expect("dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert!(
        on_disk
            .iter()
            .all(|n| n.ends_with(".gguf") && !n.contains("Q8_0")),
        "only the chosen GGUF and its mmproj: {on_disk:?}"
    );
    // The ambiguity list, the same rules as the Hub.
    let (r, _) = fetch(&s, "s3://models/tiny", Format::Gguf, None).await;
    let msg = r.expect_err("ambiguous").to_string();
    assert!(msg.contains("t-Q4_K_M.gguf, t-Q8_0.gguf"), "{msg}");
    // Wrong credentials are a clear failure.
    let mut bad = s3_settings(&s3.endpoint);
    bad.aws_secret_access_key = Some("wrong".into());
    let (r, _) = fetch(
        &store(bad, cache.path()),
        "s3://models/tiny",
        Format::Gguf,
        Some("Q4_K_M"),
    )
    .await;
    assert!(r.expect_err("bad secret").to_string().contains("HTTP 403"));
}
