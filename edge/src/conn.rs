//! The accept loop and one task per connection (the edge, before any request is parsed): the
//! connection cap with idle eviction, and the header-read and idle timers.
//!
//! Each connection has a [`ConnState`]: how many requests are in flight on it (a guard held
//! until the response body is finished or dropped), since when it has been idle, and when the
//! first byte of the next request arrived. Its task sleeps until the one deadline that applies
//! (none while a request is in flight) and drops the connection when it passes; any change of
//! state wakes it to recompute.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use http::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tower::ServiceExt;

use crate::{EdgeArgs, EdgeMetrics};

pub(crate) const CLOSE_REASONS: [&str; 3] = ["header_timeout", "idle_timeout", "evicted"];

/// One open connection, as the accept loop and its own task see it.
struct ConnState {
    inflight: AtomicUsize,
    /// Milliseconds since the registry's epoch when the connection last became idle.
    idle_since: AtomicU64,
    /// Milliseconds since the epoch (+1) when the first byte arrived while idle; 0 = none.
    first_byte: AtomicU64,
    evicted: AtomicBool,
    changed: Notify,
}

/// Every open connection, for the cap and for eviction.
struct Registry {
    epoch: Instant,
    next_id: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<ConnState>>>,
}

impl Registry {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn len(&self) -> usize {
        self.conns.lock().map_or(0, |c| c.len())
    }

    fn insert(&self) -> (u64, Arc<ConnState>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let st = Arc::new(ConnState {
            inflight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.now_ms()),
            first_byte: AtomicU64::new(0),
            evicted: AtomicBool::new(false),
            changed: Notify::new(),
        });
        if let Ok(mut c) = self.conns.lock() {
            c.insert(id, st.clone());
        }
        (id, st)
    }

    fn remove(&self, id: u64) {
        if let Ok(mut c) = self.conns.lock() {
            c.remove(&id);
        }
    }

    /// Ask the longest-idle connection (no request in flight, not already asked) to close.
    /// False when every connection is busy.
    fn evict_idle(&self) -> bool {
        let Ok(c) = self.conns.lock() else {
            return false;
        };
        let victim = c
            .values()
            .filter(|s| s.inflight.load(Ordering::SeqCst) == 0 && !s.evicted.load(Ordering::SeqCst))
            .min_by_key(|s| s.idle_since.load(Ordering::Relaxed));
        match victim {
            Some(s) => {
                s.evicted.store(true, Ordering::SeqCst);
                s.changed.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Held from the moment a request reaches the service until its response body is done.
struct InflightGuard {
    conn: Arc<ConnState>,
    registry: Arc<Registry>,
}

impl InflightGuard {
    fn new(conn: Arc<ConnState>, registry: Arc<Registry>) -> Self {
        conn.inflight.fetch_add(1, Ordering::SeqCst);
        conn.first_byte.store(0, Ordering::SeqCst);
        InflightGuard { conn, registry }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.conn.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.conn
                .idle_since
                .store(self.registry.now_ms(), Ordering::Relaxed);
            self.conn.first_byte.store(0, Ordering::SeqCst);
            self.conn.changed.notify_one();
        }
    }
}

/// A response body that keeps its connection counted as busy until it is finished or dropped
/// (a stream that lasts minutes is a request in flight, never "idle").
struct GuardedBody {
    inner: Body,
    _guard: InflightGuard,
}

impl http_body::Body for GuardedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body that must arrive by a deadline (read errors after it; reading a body is
/// what makes a request "in flight", so without this a slow body would hold a connection).
struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    limit: Duration,
}

impl http_body::Body for TimedBody {
    type Data = bytes::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|r| r.map_err(axum::Error::new)));
        }
        if self.deadline.as_mut().poll(cx).is_ready() {
            let secs = self.limit.as_secs();
            return Poll::Ready(Some(Err(axum::Error::new(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the request body did not arrive within {secs} s of its headers"),
            )))));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The socket, noting the first byte of each request that arrives while the connection is idle
/// (the start of the header-read timer).
struct WatchedIo {
    inner: TcpStream,
    conn: Arc<ConnState>,
    registry: Arc<Registry>,
}

impl AsyncRead for WatchedIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            let c = &self.conn;
            if c.inflight.load(Ordering::SeqCst) == 0 && c.first_byte.load(Ordering::SeqCst) == 0 {
                c.first_byte
                    .store(self.registry.now_ms() + 1, Ordering::SeqCst);
                c.changed.notify_one();
            }
        }
        r
    }
}

impl AsyncWrite for WatchedIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// What the connection's timer is waiting for, when nothing is in flight.
fn deadline(
    conn: &ConnState,
    registry: &Registry,
    args: &EdgeArgs,
) -> Option<(Instant, &'static str)> {
    if conn.inflight.load(Ordering::SeqCst) > 0 {
        return None;
    }
    let at = |ms: u64, d: Duration| registry.epoch + Duration::from_millis(ms) + d;
    match conn.first_byte.load(Ordering::SeqCst) {
        0 => Some((
            at(conn.idle_since.load(Ordering::Relaxed), args.idle_timeout()),
            "idle_timeout",
        )),
        t => Some((at(t - 1, args.header_read_timeout()), "header_timeout")),
    }
}

/// Serve `app` (already wrapped by [`crate::layers`]) on `listener` until `shutdown` resolves;
/// then stop accepting, let every connection finish its in-flight response (hyper's graceful
/// shutdown closes idle ones at once) and return.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    args: EdgeArgs,
    metrics: Option<Arc<EdgeMetrics>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let args = Arc::new(args);
    let registry = Arc::new(Registry {
        epoch: Instant::now(),
        next_id: AtomicU64::new(1),
        conns: Mutex::new(HashMap::new()),
    });
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    let mut accept_errors = 0u64;
    loop {
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    // EMFILE/ENFILE and aborted handshakes: back off a little and go on.
                    accept_errors += 1;
                    if accept_errors.is_power_of_two() {
                        tracing::warn!(error = %e, count = accept_errors, "accept failed");
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        while tasks.try_join_next().is_some() {}
        let _ = stream.set_nodelay(true);
        if registry.len() >= args.max_connections && !registry.evict_idle() {
            if let Some(m) = &metrics {
                m.refused.inc();
            }
            tasks.spawn(refuse(stream, args.max_connections));
            continue;
        }
        if let Some(m) = &metrics {
            m.accepted.inc();
            m.open.inc();
        }
        let (id, conn) = registry.insert();
        tasks.spawn(serve_conn(
            stream,
            id,
            conn,
            registry.clone(),
            app.clone(),
            args.clone(),
            metrics.clone(),
            stop_rx.clone(),
        ));
    }
    let _ = stop_tx.send(true);
    while tasks.join_next().await.is_some() {}
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn serve_conn(
    stream: TcpStream,
    id: u64,
    conn: Arc<ConnState>,
    registry: Arc<Registry>,
    app: Router,
    args: Arc<EdgeArgs>,
    metrics: Option<Arc<EdgeMetrics>>,
    mut stop: watch::Receiver<bool>,
) {
    let io = WatchedIo {
        inner: stream,
        conn: conn.clone(),
        registry: registry.clone(),
    };
    let (svc_conn, svc_registry) = (conn.clone(), registry.clone());
    let body_limit = args.body_read_timeout();
    let svc = tower::service_fn(move |req: Request<Incoming>| {
        let guard = InflightGuard::new(svc_conn.clone(), svc_registry.clone());
        let app = app.clone();
        let req = req.map(|inner| {
            Body::new(TimedBody {
                inner,
                deadline: Box::pin(tokio::time::sleep(body_limit)),
                limit: body_limit,
            })
        });
        async move {
            let resp = match app.oneshot(req).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(resp.map(|b| GuardedBody {
                inner: b,
                _guard: guard,
            }))
        }
    });
    let http = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(svc));
    let mut http = std::pin::pin!(http);
    let closed_by: Option<&'static str> = loop {
        let due = deadline(&conn, &registry, &args);
        let sleep = async {
            match due {
                Some((at, _)) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = http.as_mut() => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                break None;
            }
            () = sleep => {
                // Still due after the sleep (nothing arrived meanwhile): close.
                if let Some((at, reason)) = deadline(&conn, &registry, &args)
                    && at <= Instant::now()
                {
                    break Some(reason);
                }
            }
            () = conn.changed.notified() => {
                if conn.evicted.load(Ordering::SeqCst) {
                    if conn.inflight.load(Ordering::SeqCst) == 0 {
                        break Some("evicted");
                    }
                    // Busy after all: it stays, and may be asked again later.
                    conn.evicted.store(false, Ordering::SeqCst);
                }
            }
            _ = stop.changed() => {
                http.as_mut().graceful_shutdown();
                let _ = http.as_mut().await;
                break None;
            }
        }
    };
    registry.remove(id);
    if let Some(m) = &metrics {
        m.open.dec();
        if let Some(reason) = closed_by {
            m.closed.with_label_values(&[reason]).inc();
        }
    }
    if let Some(reason) = closed_by {
        tracing::debug!(reason, "connection closed by the server");
    }
}

/// Answer a connection past the cap with a 503 in OpenAI's shape, then close it. What the client
/// already sent is read and dropped first (bounded), so it sees the answer rather than a reset.
async fn refuse(mut stream: TcpStream, cap: usize) {
    let body = gantry_api::openai_error_json(
        &format!(
            "the server has {cap} connections open, all with requests in flight; retry shortly"
        ),
        "server_error",
        None,
        Some("too_many_connections"),
    );
    let head = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
        body.len()
    );
    let work = async {
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        stream.shutdown().await?;
        let mut sink = [0u8; 4096];
        let mut total = 0usize;
        while total < 64 << 10 {
            match stream.read(&mut sink).await? {
                0 => break,
                n => total += n,
            }
        }
        Ok::<_, io::Error>(())
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), work).await;
}
