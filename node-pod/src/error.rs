//! Node refusals at the HTTP edge (last step of a request that the node itself refuses): how
//! the node's own failures — a model that cannot take a request ([`Unavailable`]), a grammar the
//! compiler refused — become the OpenAI surface's one error type, [`ApiError`].

use gantry_api::ArtifactStatus;
pub use gantry_openai::ApiError;

use crate::constraint::GrammarRefused;
use crate::node::Unavailable;

/// A grammar the constrained-decoding compiler refused: a 400 naming the request's field.
impl From<GrammarRefused> for ApiError {
    fn from(e: GrammarRefused) -> Self {
        ApiError::invalid(e.field, e.message)
    }
}

/// A model that cannot take a request: 404 for an unknown id, 507 when the
/// memory policy refused its load, otherwise 503 with how long to wait.
impl From<Unavailable> for ApiError {
    fn from(u: Unavailable) -> Self {
        match u {
            Unavailable::Draining => ApiError::unavailable("the node is shutting down", 1),
            Unavailable::Unknown(id) => ApiError::not_found_model(&id),
            Unavailable::Downloading { id, progress } => downloading(&id, progress.as_ref()),
            Unavailable::LoadingNow(id) => {
                ApiError::unavailable(format!("model `{id}` is loading"), 5)
            }
            Unavailable::Loading(id) => {
                ApiError::unavailable(format!("model `{id}` is loading; retry shortly"), 5)
            }
            Unavailable::Refused(r) => ApiError::from(r.to_engine_error()),
            Unavailable::LoadFailed { id, message } => {
                ApiError::unavailable(format!("model `{id}` failed to load: {message}"), 30)
            }
            Unavailable::Failed { id, message } => {
                ApiError::unavailable(format!("model `{id}` is not available: {message}"), 30)
            }
            Unavailable::Unsupported { id, why } => ApiError::unavailable(
                format!("no engine on this node supports model `{id}`: {why}"),
                60,
            ),
            Unavailable::LoadTask(e) => ApiError::internal(format!("load task: {e}")),
            Unavailable::Restarting { id, wait, why } => Self {
                code: Some("engine_restarting".into()),
                ..ApiError::unavailable(
                    format!(
                        "model `{id}` is restarting after its engine worker crashed ({why}); it restarts in {} s",
                        wait.as_secs_f64().ceil() as u64
                    ),
                    wait.as_secs_f64().ceil().max(1.0) as u64,
                )
            },
        }
    }
}

/// 503 for a model whose artifacts are still being fetched, with how far it got.
fn downloading(id: &str, progress: Option<&ArtifactStatus>) -> ApiError {
    let Some(s) = progress else {
        return ApiError::unavailable(format!("model `{id}` is downloading; retry shortly"), 5);
    };
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut msg = format!("model `{id}` is still downloading");
    if s.bytes_total > 0 {
        msg.push_str(&format!(
            " ({:.1} of {:.1} MiB)",
            mib(s.bytes_done),
            mib(s.bytes_total)
        ));
    }
    if let Some(m) = &s.message {
        msg.push_str(&format!(": {m}"));
    }
    msg.push_str("; retry later");
    // Retry-After: the time the rest should take at the current rate, within [1, 60] s.
    let remaining = s.bytes_total.saturating_sub(s.bytes_done) as f64;
    let eta = if s.bytes_per_second > 0.0 {
        remaining / s.bytes_per_second
    } else {
        10.0
    };
    ApiError::unavailable(msg, eta.clamp(1.0, 60.0).ceil() as u64)
}
