//! Tool calls (after the scheduler's text, before the OpenAI response): the model's output text becomes `message.tool_calls` / `delta.tool_calls`.
//!
//! With `tool_choice: "auto"` the model writes its family's own syntax, or
//! plain text, and [`AutoParser`] recognises it:
//!
//! - Hermes/Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
//!   possibly several, anywhere in the reply;
//! - Llama 3.x: a reply that *starts* with `{"name": …, "parameters": {…}}`
//!   (optionally after `<|python_tag|>`), several calls joined by `;`;
//! - Mistral: `[TOOL_CALLS]` then a JSON array of calls (v3) or
//!   `name[ARGS]{…}` (v11+).
//!
//! Text that turns out not to be a call is passed on verbatim as content.
//! With `tool_choice: "required"` or a named function the output was
//! constrained to Gantry's own JSON format, and [`ForcedParser`] streams the
//! argument text as it is generated. [`collect`] folds the pieces into the
//! non-streamed message.

use std::collections::BTreeMap;

use serde_json::Value;

mod auto;
mod forced;
mod read;
mod scan;
#[cfg(test)]
mod tests;

pub use auto::AutoParser;
pub use forced::ForcedParser;

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const MISTRAL_OPEN: &str = "[TOOL_CALLS]";
const MISTRAL_ARGS: &str = "[ARGS]";
const MISTRAL_CALL_ID: &str = "[CALL_ID]";
const PYTHON_TAG: &str = "<|python_tag|>";

/// The tool-call syntax a model family writes, chosen from its chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Hermes,
    Llama3,
    Mistral,
}

impl Family {
    /// Hermes/Qwen when the template mentions `<tool_call>`, Mistral when it
    /// mentions `[TOOL_CALLS]`, Llama3 when it mentions `<|python_tag|>` or
    /// (`<|start_header_id|>` and `tools`); otherwise Hermes (Gantry's
    /// fallback prompt for templates without tool support asks for the
    /// Hermes syntax).
    pub fn detect(template_source: &str) -> Family {
        let mentions = |s: &str| template_source.contains(s);
        if mentions(HERMES_OPEN) {
            Family::Hermes
        } else if mentions(MISTRAL_OPEN) {
            Family::Mistral
        } else if mentions(PYTHON_TAG) || (mentions("<|start_header_id|>") && mentions("tools")) {
            Family::Llama3
        } else {
            Family::Hermes
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Family::Hermes => "hermes",
            Family::Llama3 => "llama3",
            Family::Mistral => "mistral",
        }
    }

    /// The marker that opens a call anywhere in the text; Llama 3 has none
    /// (its calls can only open the reply).
    fn call_marker(self) -> Option<&'static str> {
        match self {
            Family::Hermes => Some(HERMES_OPEN),
            Family::Mistral => Some(MISTRAL_OPEN),
            Family::Llama3 => None,
        }
    }
}

/// One piece of a reply, in order. Tool-call indexes count from 0 within the reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Content(String),
    CallStart {
        index: usize,
        name: String,
    },
    /// A fragment of the arguments' JSON text; the fragments of one call
    /// concatenate to a JSON object.
    CallArgs {
        index: usize,
        fragment: String,
    },
}

/// A finished call: (name, arguments as JSON object text).
type Call = (String, String);

/// Append content text, joined to the content piece before it.
fn push_content(out: &mut Vec<Piece>, text: &str) {
    if text.is_empty() {
        return;
    }
    if let Some(Piece::Content(last)) = out.last_mut() {
        last.push_str(text);
    } else {
        out.push(Piece::Content(text.to_owned()));
    }
}

/// Append one character of call `index`'s arguments, joined to that call's fragment before it.
fn push_args_char(out: &mut Vec<Piece>, index: usize, c: char) {
    if let Some(Piece::CallArgs {
        index: last,
        fragment,
    }) = out.last_mut()
        && *last == index
    {
        fragment.push(c);
        return;
    }
    out.push(Piece::CallArgs {
        index,
        fragment: c.to_string(),
    });
}

/// Collect pieces into the non-streamed answer: the content (None when empty,
/// or whitespace-only beside calls) and the calls as (name, arguments JSON
/// text) in index order.
pub fn collect(pieces: impl IntoIterator<Item = Piece>) -> (Option<String>, Vec<(String, String)>) {
    let mut content = String::new();
    let mut calls: BTreeMap<usize, (String, String)> = BTreeMap::new();
    for piece in pieces {
        match piece {
            Piece::Content(text) => content.push_str(&text),
            Piece::CallStart { index, name } => calls.entry(index).or_default().0 = name,
            Piece::CallArgs { index, fragment } => {
                calls.entry(index).or_default().1.push_str(&fragment);
            }
        }
    }
    let calls: Vec<(String, String)> = calls
        .into_values()
        .map(|(name, arguments)| {
            let arguments = if arguments.is_empty() {
                "{}".to_owned()
            } else {
                arguments
            };
            (name, arguments)
        })
        .collect();
    let blank = content.trim().is_empty() && !calls.is_empty();
    let content = (!content.is_empty() && !blank).then_some(content);
    (content, calls)
}
