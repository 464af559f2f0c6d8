//! Model reconcile, validate step (pure): one reason a Model (or a ModelPool's template, or a
//! pool member) cannot be served as written, and the condition message the reasons make
//! together (`InvalidSpec`).

use std::borrow::Cow;

/// One reason a Model cannot be served as written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct Invalid {
    /// The offending field, as a path (`spec.source.uri`, `spec.adapters[pirate].scale`).
    pub field: Cow<'static, str>,
    pub message: String,
}

impl Invalid {
    pub(crate) fn new(field: &'static str, message: impl Into<String>) -> Self {
        Invalid {
            field: Cow::Borrowed(field),
            message: message.into(),
        }
    }

    /// A problem with a field whose path names a list entry (`spec.adapters[pirate].scale`).
    pub(crate) fn at(field: String, message: impl Into<String>) -> Self {
        Invalid {
            field: Cow::Owned(field),
            message: message.into(),
        }
    }

    /// Stable label for the `reconcile_errors_total` metric.
    pub fn metric_label(&self) -> &'static str {
        "invalid_spec"
    }
}

/// Every reason, joined for a condition message.
pub fn message(problems: &[Invalid]) -> String {
    problems
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}
