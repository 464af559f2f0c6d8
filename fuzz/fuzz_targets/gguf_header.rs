//! Fuzz target (model metadata, before engine selection): the GGUF header parser and everything
//! the node derives from a parsed header must return, never panic, hang or allocate without bound.
#![no_main]

use gantry_formats::gguf::{GgufValue, ParseOptions, parse_header, parse_header_with};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The whole header as the test kit reads it: tensor infos too, every array item kept.
    let full = ParseOptions {
        keep_array_items: u64::MAX,
        tensor_infos: true,
    };
    if let Ok(h) = parse_header_with(data, full) {
        assert!(h.tensors.len() <= data.len());
        assert!(h.data_offset % h.alignment == 0);
    }
    let Ok(h) = parse_header(data) else {
        return;
    };
    // The accessors the node calls after a successful parse.
    let _ = h.architecture();
    let _ = h.context_length();
    let _ = h.chat_template();
    let _ = h.file_type();
    let _ = h.kv_bytes_per_token();
    // A parsed header never holds more entries than the input has bytes.
    assert!(h.metadata.len() <= data.len());
    for v in h.metadata.values() {
        if let GgufValue::Array { len, items } = v {
            // Long arrays are summarised, never kept whole.
            assert!(items.len() as u64 <= (*len).min(64));
        }
    }
});
