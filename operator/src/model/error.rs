//! Model reconcile, after any step fails: the error of a Model (or ModelPool) reconcile, by
//! pipeline step, with the metric label and retry class the error policies (`model::reconcile`,
//! `pool`) act on.

use super::apply::ApplyError;
use super::build::BuildError;
use super::deliver::DeliverError;
use super::node_config::RenderError;
use super::status::StatusError;
use crate::write::Retry;

/// A failed Model reconcile, by pipeline step.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Render(#[from] RenderError),
    #[error(transparent)]
    Build(#[from] BuildError),
    #[error(transparent)]
    Apply(#[from] ApplyError),
    #[error(transparent)]
    Deliver(#[from] DeliverError),
    #[error(transparent)]
    Status(#[from] StatusError),
}

impl Error {
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Render(e) => e.metric_label(),
            Error::Build(e) => e.metric_label(),
            Error::Apply(e) => e.metric_label(),
            Error::Deliver(e) => e.metric_label(),
            Error::Status(e) => e.metric_label(),
        }
    }

    pub fn retry(&self) -> Retry {
        match self {
            // A render or build failure is a bug in this operator; retrying slowly keeps the log
            // readable.
            Error::Render(_) | Error::Build(_) => Retry::Permanent,
            Error::Apply(e) => e.retry(),
            Error::Deliver(e) => e.retry(),
            Error::Status(e) => e.retry(),
        }
    }
}
