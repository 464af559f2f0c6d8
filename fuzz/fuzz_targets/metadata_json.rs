//! Fuzz target (model metadata and plugin discovery, before anything is loaded): the Hugging Face
//! `config.json` parser and the plugin `manifest.json` parser on the same bytes. Both must return,
//! never panic or hang; what they accept must survive a round trip.
#![no_main]

use gantry_formats::hf_config;
use gantry_formats::manifest::PluginManifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = hf_config::parse(data) {
        assert!(!c.model_type.is_empty());
        if let Some(ctx) = &c.context_length {
            assert!(ctx.tokens >= 1 && ctx.tokens <= hf_config::MAX_CONTEXT_LENGTH);
        }
    }
    if let Ok(m) = PluginManifest::parse(data) {
        // An accepted manifest serialises and parses back to itself.
        let again = serde_json::to_vec(&m).expect("a parsed manifest serialises");
        let back = PluginManifest::parse(&again).expect("a serialised manifest parses");
        assert_eq!(back, m);
        let _ = m.backend();
        let _ = m.supports_architecture("llama");
    }
});
