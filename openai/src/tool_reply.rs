//! OpenAI surface, tool calls in the reply (inside `response`, after the scheduler's text): the
//! generated text becomes OpenAI's `message.tool_calls` or `delta.tool_calls` chunks.
//!
//! `toolcall` does the reading (one parser per model family for `tool_choice: "auto"`, and
//! Gantry's own format for forced calls); this module only gives each call its id and writes
//! OpenAI's shapes.

use serde_json::{Value, json};

use gantry_chat::toolcall::{AutoParser, Family, ForcedParser, Piece, collect};

/// How the reply's text becomes tool calls.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyTools {
    /// Plain text.
    Off,
    /// The model's own syntax, read by its family's parser.
    Auto(Family),
    /// Constrained to this function's arguments.
    Named(String),
    /// Constrained to a list of calls.
    Required,
}

/// The reader of one reply's tool calls.
pub enum ToolReader {
    Auto(AutoParser),
    Forced(ForcedParser),
}

impl ToolReader {
    pub fn new(tools: &ReplyTools) -> Option<Self> {
        match tools {
            ReplyTools::Off => None,
            ReplyTools::Auto(f) => Some(ToolReader::Auto(AutoParser::new(*f))),
            ReplyTools::Named(n) => Some(ToolReader::Forced(ForcedParser::named(n))),
            ReplyTools::Required => Some(ToolReader::Forced(ForcedParser::list())),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        match self {
            ToolReader::Auto(p) => p.push(text),
            ToolReader::Forced(p) => p.push(text),
        }
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        match self {
            ToolReader::Auto(p) => p.finish(),
            ToolReader::Forced(p) => p.finish(),
        }
    }
}

/// The id of call `index` of the reply `reply_id` (`chatcmpl-...`): unique per call.
pub fn call_id(reply_id: &str, index: usize) -> String {
    let tail = reply_id.rsplit('-').next().unwrap_or(reply_id);
    format!("call_{tail}{index:02x}")
}

/// The non-streamed `message` for `text` read with `tools`; the bool says whether it holds
/// tool calls (the finish reason is then `tool_calls`).
pub fn message(text: &str, tools: &ReplyTools, reply_id: &str) -> (Value, bool) {
    let Some(mut reader) = ToolReader::new(tools) else {
        return (json!({"role": "assistant", "content": text}), false);
    };
    let mut pieces = reader.push(text);
    pieces.extend(reader.finish());
    let (content, calls) = collect(pieces);
    if calls.is_empty() {
        return (
            json!({"role": "assistant", "content": content.unwrap_or_default()}),
            false,
        );
    }
    let calls: Vec<Value> = calls
        .into_iter()
        .enumerate()
        .map(|(i, (name, arguments))| {
            json!({"id": call_id(reply_id, i), "type": "function", "function": {"name": name, "arguments": arguments}})
        })
        .collect();
    (
        json!({"role": "assistant", "content": content, "tool_calls": calls}),
        true,
    )
}

/// The `delta` objects for streamed pieces: content as `content`, a call's start with its
/// index, id, type and name (and empty arguments), then its argument fragments.
pub fn deltas(pieces: Vec<Piece>, reply_id: &str) -> Vec<Value> {
    pieces
        .into_iter()
        .filter_map(|p| match p {
            Piece::Content(t) if t.is_empty() => None,
            Piece::Content(t) => Some(json!({"content": t})),
            Piece::CallStart { index, name } => Some(json!({"tool_calls": [{
                "index": index, "id": call_id(reply_id, index), "type": "function",
                "function": {"name": name, "arguments": ""},
            }]})),
            Piece::CallArgs { index, fragment } => {
                Some(json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_calls_become_tool_calls_with_unique_ids() {
        let text = r#"[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]"#;
        let (m, calls) = message(text, &ReplyTools::Required, "chatcmpl-1234abcd000001");
        assert!(calls);
        assert_eq!(m["content"], Value::Null);
        let tc = m["tool_calls"].as_array().expect("calls");
        assert_eq!(tc.len(), 2);
        assert_eq!(tc[0]["function"]["name"], "a");
        let args: Value =
            serde_json::from_str(tc[0]["function"]["arguments"].as_str().expect("text"))
                .expect("json");
        assert_eq!(args, json!({"x": 1}));
        assert_ne!(tc[0]["id"], tc[1]["id"]);
        assert!(tc[0]["id"].as_str().expect("id").starts_with("call_"));
    }

    #[test]
    fn plain_text_stays_content() {
        let (m, calls) = message("hello", &ReplyTools::Off, "chatcmpl-1");
        assert!(!calls);
        assert_eq!(m["content"], "hello");
        assert!(m.get("tool_calls").is_none());
    }

    #[test]
    fn streamed_pieces_become_openai_deltas() {
        let d = deltas(
            vec![
                Piece::CallStart {
                    index: 0,
                    name: "f".into(),
                },
                Piece::CallArgs {
                    index: 0,
                    fragment: "{\"a\"".into(),
                },
                Piece::Content(String::new()),
            ],
            "chatcmpl-9",
        );
        assert_eq!(d.len(), 2);
        assert_eq!(d[0]["tool_calls"][0]["function"]["name"], "f");
        assert_eq!(d[0]["tool_calls"][0]["type"], "function");
        assert_eq!(d[1]["tool_calls"][0]["function"]["arguments"], "{\"a\"");
        assert!(d[1]["tool_calls"][0].get("id").is_none());
    }
}
