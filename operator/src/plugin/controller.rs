//! EnginePlugin reconcile, shared by its steps (the entry and the status step that writes): the
//! controller's name in metrics and logs. Its resync is the Model's (`model::controller`).

/// Controller name in metrics and logs.
pub const CONTROLLER: &str = "engineplugin";
