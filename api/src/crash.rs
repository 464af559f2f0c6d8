//! A worker crash, as the engine host reports it and the scheduler, the crash path and the
//! HTTP edge pass it on (node side of `process` isolation): a typed value, so a client's
//! 503 `engine_crashed` comes from its type, never from matching a message.

use gantry_engine_abi::EngineError;

/// A model's engine worker process that ended without the node asking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerCrash {
    pub plugin: String,
    pub model: String,
    pub pid: u32,
    /// `SIGSEGV`, `SIGABRT`, `SIGKILL` (also the kernel's OOM killer), ...
    pub signal: Option<String>,
    pub exit_code: Option<i32>,
    /// The watchdog killed it because a step overran.
    pub hung: bool,
}

impl WorkerCrash {
    /// `crashed` or `hung` (the `reason` label of `gantry_engine_crashes_total`).
    pub fn reason(&self) -> &'static str {
        if self.hung { "hung" } else { "crashed" }
    }

    /// What ended the worker, in words.
    pub fn how(&self) -> String {
        match (&self.signal, self.exit_code, self.hung) {
            (_, _, true) => "killed by the watchdog after a step overran".into(),
            (Some(s), _, _) if s == "SIGKILL" => {
                "killed by SIGKILL (the kernel's OOM killer sends it too)".into()
            }
            (Some(s), _, _) => format!("killed by {s}"),
            (None, Some(c), _) => format!("exited with code {c}"),
            (None, None, _) => "ended".into(),
        }
    }

    pub fn message(&self) -> String {
        format!(
            "the engine worker of plugin `{}` for model `{}` (pid {}) {}",
            self.plugin,
            self.model,
            self.pid,
            self.how()
        )
    }

    /// The error every engine call on the dead worker returns (its type is this crash where
    /// the caller can tell: the scheduler's `GenError::Crashed`).
    pub fn error(&self) -> EngineError {
        EngineError::internal(self.message())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn crash(signal: Option<&str>, exit_code: Option<i32>, hung: bool) -> WorkerCrash {
        WorkerCrash {
            plugin: "faulty".into(),
            model: "m".into(),
            pid: 42,
            signal: signal.map(str::to_string),
            exit_code,
            hung,
        }
    }

    #[test]
    fn the_message_names_plugin_model_pid_and_cause() {
        assert_eq!(
            crash(Some("SIGSEGV"), None, false).message(),
            "the engine worker of plugin `faulty` for model `m` (pid 42) killed by SIGSEGV"
        );
        assert!(
            crash(Some("SIGKILL"), None, false)
                .how()
                .contains("OOM killer")
        );
        assert_eq!(crash(None, Some(3), false).how(), "exited with code 3");
        assert_eq!(crash(Some("SIGKILL"), None, true).reason(), "hung");
        assert_eq!(crash(None, None, false).reason(), "crashed");
    }
}
