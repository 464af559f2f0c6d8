//! Node status over HTTP: the real client against a loopback server serving the node's document.

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use gantry_api::node_token::{InstallToken, NODE_TOKEN_HEADER};
use gantry_api::{NODE_STATUS_PATH, NodeStatus};
use gantry_operator::node_report::{HttpNodeStatus, ModelRef, NodeStatusSource, ReportError};

const MODEL: ModelRef<'static> = ModelRef {
    namespace: "team-a",
    name: "gemma",
};

async fn serve(app: Router) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("addr").port();
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    port
}

#[tokio::test]
async fn the_status_document_is_read_over_http() {
    let doc = NodeStatus {
        version: "0.1.0".into(),
        backend: "cpu".into(),
        ready: true,
        ..NodeStatus::default()
    };
    let body = serde_json::to_string(&doc).expect("json");
    let port = serve(Router::new().route(
        NODE_STATUS_PATH,
        get(move || async move { ([("content-type", "application/json")], body) }),
    ))
    .await;
    let got = HttpNodeStatus::new(port)
        .expect("client")
        .fetch("127.0.0.1", MODEL)
        .await
        .expect("status");
    assert_eq!(got, doc);
}

#[tokio::test]
async fn errors_and_garbage_are_reported_not_fatal() {
    let port = serve(Router::new().route(
        NODE_STATUS_PATH,
        get(|| async { (StatusCode::SERVICE_UNAVAILABLE, "draining") }),
    ))
    .await;
    let err = HttpNodeStatus::new(port)
        .expect("client")
        .fetch("127.0.0.1", MODEL)
        .await
        .expect_err("503");
    assert!(
        matches!(err, ReportError::BadStatus { status: 503, .. }),
        "{err}"
    );

    let port = serve(Router::new().route(
        NODE_STATUS_PATH,
        get(|| async { "{\"not\": \"a status\"}" }),
    ))
    .await;
    let err = HttpNodeStatus::new(port)
        .expect("client")
        .fetch("127.0.0.1", MODEL)
        .await
        .expect_err("garbage");
    assert_eq!(err.metric_label(), "malformed");

    // Nothing listens on port 9 on loopback.
    let err = HttpNodeStatus::new(9)
        .expect("client")
        .fetch("127.0.0.1", MODEL)
        .await
        .expect_err("closed");
    assert_eq!(err.metric_label(), "unreachable");
}

#[tokio::test]
async fn with_an_install_token_the_models_derived_token_is_sent() {
    let install: InstallToken = "0123456789abcdef0123456789abcdef".parse().expect("token");
    let doc = serde_json::to_string(&NodeStatus::default()).expect("json");
    // The node's side of the contract: only the Model's own token is answered.
    let port = serve(Router::new().route(
        NODE_STATUS_PATH,
        get(move |headers: axum::http::HeaderMap| async move {
            match headers.get(NODE_TOKEN_HEADER).map(|v| v.as_bytes()) {
                Some(b"4dce9168474a782aeebad355ce9572b8e237d58baa22a8c071bdd293110b3ba2") => {
                    (StatusCode::OK, doc)
                }
                _ => (StatusCode::UNAUTHORIZED, String::new()),
            }
        }),
    ))
    .await;
    let client = HttpNodeStatus::new(port)
        .expect("client")
        .with_install_token(Some(install));
    client
        .fetch("127.0.0.1", MODEL)
        .await
        .expect("team-a/gemma's token is accepted");
    let other = ModelRef {
        namespace: "team-b",
        name: "gemma",
    };
    let err = client
        .fetch("127.0.0.1", other)
        .await
        .expect_err("another Model's token is not");
    assert!(
        matches!(err, ReportError::BadStatus { status: 401, .. }),
        "{err}"
    );
    let err = HttpNodeStatus::new(port)
        .expect("client")
        .fetch("127.0.0.1", MODEL)
        .await
        .expect_err("no token");
    assert!(matches!(err, ReportError::BadStatus { status: 401, .. }));
}
