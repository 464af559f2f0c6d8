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

// ---------------------------------------------------------------------------
// Incremental JSON scanning
// ---------------------------------------------------------------------------

/// Follows JSON text one character at a time, far enough to tell where a
/// bracketed value ends: strings (with escapes) are skipped, brackets counted.
#[derive(Clone, Copy, Debug, Default)]
struct JsonScan {
    depth: usize,
    in_string: bool,
    escaped: bool,
}

impl JsonScan {
    /// Take one character; true when it closes the outermost bracket.
    fn step(&mut self, c: char) -> bool {
        if self.in_string {
            self.step_in_string(c);
            return false;
        }
        match c {
            '"' => self.in_string = true,
            '{' | '[' => self.depth += 1,
            '}' | ']' => {
                self.depth = self.depth.saturating_sub(1);
                return self.depth == 0;
            }
            _ => {}
        }
        false
    }

    fn step_in_string(&mut self, c: char) {
        if self.escaped {
            self.escaped = false;
        } else if c == '\\' {
            self.escaped = true;
        } else if c == '"' {
            self.in_string = false;
        }
    }

    /// Outside every string and bracket.
    fn at_top(&self) -> bool {
        !self.in_string && self.depth == 0
    }
}

/// Feed `text[from..]` to `scan`; the offset just past the closing bracket,
/// if it came.
fn scan_until_closed(text: &str, from: usize, scan: &mut JsonScan) -> Option<usize> {
    text[from..]
        .char_indices()
        .find(|&(_, c)| scan.step(c))
        .map(|(i, c)| from + i + c.len_utf8())
}

/// Waits, in held text, for a bracketed JSON value that starts (after
/// whitespace) at `from`, remembering how far it has read.
#[derive(Clone, Copy, Debug)]
struct JsonWatch {
    from: usize,
    start: Option<usize>,
    pos: usize,
    scan: JsonScan,
}

/// What a [`JsonWatch`] has seen so far.
enum Watch {
    /// More text is needed.
    Wait,
    /// Something other than the expected bracket came first.
    NotJson,
    /// The value is `text[start..end]`.
    Closed { start: usize, end: usize },
}

impl JsonWatch {
    fn new(from: usize) -> Self {
        JsonWatch {
            from,
            start: None,
            pos: from,
            scan: JsonScan::default(),
        }
    }

    fn advance(&mut self, text: &str, open: char) -> Watch {
        let start = match self.start {
            Some(start) => start,
            None => match first_non_space(text, self.from) {
                None => return Watch::Wait,
                Some((at, c)) if c == open => {
                    self.start = Some(at);
                    self.pos = at;
                    at
                }
                Some(_) => return Watch::NotJson,
            },
        };
        match scan_until_closed(text, self.pos, &mut self.scan) {
            Some(end) => Watch::Closed { start, end },
            None => {
                self.pos = text.len();
                Watch::Wait
            }
        }
    }
}

fn first_non_space(text: &str, from: usize) -> Option<(usize, char)> {
    text[from..]
        .char_indices()
        .find(|(_, c)| !c.is_whitespace())
        .map(|(i, c)| (from + i, c))
}

/// Where `marker` starts in `text[from..]`, outside JSON strings.
enum Search {
    Found(usize),
    /// Not yet; resume from this offset when more text comes.
    Wait(usize),
}

fn find_outside_strings(text: &str, from: usize, scan: &mut JsonScan, marker: &str) -> Search {
    for (i, c) in text[from..].char_indices() {
        let at = from + i;
        if !scan.in_string && marker.starts_with(c) {
            let rest = &text[at..];
            if rest.starts_with(marker) {
                return Search::Found(at);
            }
            if marker.starts_with(rest) {
                return Search::Wait(at);
            }
        }
        scan.step(c);
    }
    Search::Wait(text.len())
}

/// Length of the longest end of `text` that could still grow into `marker`.
fn partial_marker_len(text: &str, marker: &str) -> usize {
    (1..marker.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            let at = text.len() - n;
            text.is_char_boundary(at) && marker.starts_with(&text[at..])
        })
        .unwrap_or(0)
}

fn leading_whitespace_len(text: &str) -> usize {
    text.len() - text.trim_start().len()
}

// ---------------------------------------------------------------------------
// Reading calls out of JSON values
// ---------------------------------------------------------------------------

/// `{"name": …, "arguments"|"parameters": …}` written as text.
fn call_from_text(text: &str) -> Option<Call> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    call_from_value(&value)
}

fn call_from_value(value: &Value) -> Option<Call> {
    let object = value.as_object()?;
    let name = object.get("name")?.as_str()?;
    if name.is_empty() {
        return None;
    }
    let arguments = object.get("arguments").or_else(|| object.get("parameters"));
    Some((name.to_owned(), arguments_text(arguments)?))
}

/// Arguments as compact JSON object text: an object as it is, a string that
/// holds an object decoded, none at all as `{}`.
fn arguments_text(arguments: Option<&Value>) -> Option<String> {
    match arguments {
        None | Some(Value::Null) => Some("{}".to_owned()),
        Some(object @ Value::Object(_)) => Some(object.to_string()),
        Some(Value::String(text)) => object_text(text),
        Some(_) => None,
    }
}

/// `text` re-serialised compactly when it is a JSON object.
fn object_text(text: &str) -> Option<String> {
    match serde_json::from_str(text.trim()).ok()? {
        object @ Value::Object(_) => Some(object.to_string()),
        _ => None,
    }
}

/// A Mistral v3 array `[{"name": …, "arguments": {…}}, …]`; every element must be a call.
fn calls_from_array(text: &str) -> Option<Vec<Call>> {
    match serde_json::from_str(text).ok()? {
        Value::Array(items) if !items.is_empty() => items.iter().map(call_from_value).collect(),
        _ => None,
    }
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

fn leading_len(text: &str, keep: impl Fn(char) -> bool) -> usize {
    text.find(|c| !keep(c)).unwrap_or(text.len())
}

/// How far a Mistral v11 call head (`name[ARGS]`, `name[CALL_ID]id[ARGS]`,
/// or `name` directly followed by `{`) has come.
enum Head {
    Partial,
    Invalid,
    Complete { name_end: usize, args_at: usize },
}

fn v11_head(text: &str) -> Head {
    let name_end = leading_len(text, is_name_char);
    if name_end == 0 {
        return if text.is_empty() {
            Head::Partial
        } else {
            Head::Invalid
        };
    }
    let rest = &text[name_end..];
    if let Some(id_and_rest) = rest.strip_prefix(MISTRAL_CALL_ID) {
        let id_len = leading_len(id_and_rest, |c| c.is_ascii_alphanumeric());
        return mistral_args_marker(text, name_end, name_end + MISTRAL_CALL_ID.len() + id_len);
    }
    if !rest.is_empty() && MISTRAL_CALL_ID.starts_with(rest) {
        return Head::Partial;
    }
    mistral_args_marker(text, name_end, name_end)
}

/// The `[ARGS]` (or a bare `{`) expected at `text[at..]`.
fn mistral_args_marker(text: &str, name_end: usize, at: usize) -> Head {
    let rest = &text[at..];
    if rest.starts_with(MISTRAL_ARGS) {
        Head::Complete {
            name_end,
            args_at: at + MISTRAL_ARGS.len(),
        }
    } else if rest.starts_with('{') {
        Head::Complete {
            name_end,
            args_at: at,
        }
    } else if MISTRAL_ARGS.starts_with(rest) {
        Head::Partial
    } else {
        Head::Invalid
    }
}

// ---------------------------------------------------------------------------
// tool_choice "auto"
// ---------------------------------------------------------------------------

/// What came just before plain text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum After {
    Text,
    Call,
    /// A Mistral v11 call, which the next may follow without a marker.
    NamedCall,
}

/// Where an [`AutoParser`] is; positions are offsets into its held text.
#[derive(Debug)]
enum State {
    /// Plain text, watching for the family's marker.
    Text(After),
    /// Hermes: after `<tool_call>`, until `</tool_call>` outside a string.
    HermesBody { scan: JsonScan, pos: usize },
    /// Mistral: just after `[TOOL_CALLS]`.
    MistralHead,
    /// Mistral v3: the JSON array of calls.
    MistralArray(JsonWatch),
    /// Mistral v11: the function name; `marked` when `[TOOL_CALLS]` came before.
    MistralName { marked: bool, start: usize },
    /// Mistral v11: the arguments object after the name.
    MistralArgs {
        marked: bool,
        name: String,
        watch: JsonWatch,
    },
    /// Llama 3: the start of the reply, before it is known to be a call.
    ReplyStart,
    /// Llama 3: a call object.
    LlamaCall(JsonWatch),
    /// Llama 3: after a call, a `;` and another call or the closing text.
    BetweenCalls,
}

/// `tool_choice: "auto"`: the model writes its family's syntax, or plain text.
#[derive(Debug)]
pub struct AutoParser {
    family: Family,
    /// Text received but not yet told: a possible marker prefix, or a call in progress.
    held: String,
    state: State,
    next_index: usize,
}

impl AutoParser {
    pub fn new(family: Family) -> Self {
        let state = match family {
            Family::Llama3 => State::ReplyStart,
            Family::Hermes | Family::Mistral => State::Text(After::Text),
        };
        AutoParser {
            family,
            held: String::new(),
            state,
            next_index: 0,
        }
    }

    /// Feed the next text; returns what can be told now.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        self.advance(false)
    }

    /// The end of the reply: flush everything held.
    pub fn finish(&mut self) -> Vec<Piece> {
        self.advance(true)
    }

    fn advance(&mut self, at_end: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        while self.step(at_end, &mut out) {}
        out
    }

    /// Make one move; false when nothing more can be done with the text held.
    /// Every handler sets the next state.
    fn step(&mut self, at_end: bool, out: &mut Vec<Piece>) -> bool {
        match std::mem::replace(&mut self.state, State::Text(After::Text)) {
            State::Text(after) => self.text(after, at_end, out),
            State::HermesBody { scan, pos } => self.hermes_body(scan, pos, at_end, out),
            State::MistralHead => self.mistral_opened(at_end, out),
            State::MistralArray(watch) => self.mistral_array(watch, at_end, out),
            State::MistralName { marked, start } => self.mistral_name(marked, start, at_end, out),
            State::MistralArgs {
                marked,
                name,
                watch,
            } => self.mistral_args(marked, name, watch, at_end, out),
            State::ReplyStart => self.reply_start(at_end),
            State::LlamaCall(watch) => self.llama_call(watch, at_end, out),
            State::BetweenCalls => self.between_calls(at_end),
        }
    }

    fn wait(&mut self, state: State) -> bool {
        self.state = state;
        false
    }

    fn go(&mut self, state: State) -> bool {
        self.state = state;
        true
    }

    /// Tell the first `len` bytes of the held text as content.
    fn release(&mut self, len: usize, out: &mut Vec<Piece>) {
        let text: String = self.held.drain(..len).collect();
        push_content(out, &text);
    }

    /// A call is complete: drop its `consumed` text and tell it.
    fn accept(&mut self, call: Call, consumed: usize, next: State, out: &mut Vec<Piece>) -> bool {
        self.held.drain(..consumed);
        let index = self.next_index;
        self.next_index += 1;
        let (name, arguments) = call;
        out.push(Piece::CallStart { index, name });
        out.push(Piece::CallArgs {
            index,
            fragment: arguments,
        });
        self.go(next)
    }

    /// What looked like a call is not one: its `marker` (already taken from
    /// the held text) becomes content and the held text is read again as text.
    fn give_up(&mut self, marker: &str, out: &mut Vec<Piece>) -> bool {
        push_content(out, marker);
        self.go(State::Text(After::Text))
    }

    fn text(&mut self, after: After, at_end: bool, out: &mut Vec<Piece>) -> bool {
        if after != After::Text {
            // Whitespace right after a call only separates it from what follows.
            self.held.drain(..leading_whitespace_len(&self.held));
            if self.held.is_empty() {
                return self.wait(State::Text(after));
            }
            if after == After::NamedCall && self.held.starts_with(is_name_char) {
                let next = State::MistralName {
                    marked: false,
                    start: 0,
                };
                return self.go(next);
            }
        }
        let Some(marker) = self.family.call_marker() else {
            self.release(self.held.len(), out);
            return self.wait(State::Text(After::Text));
        };
        if let Some(at) = self.held.find(marker) {
            self.release(at, out);
            self.held.drain(..marker.len());
            return self.go(self.opened_state());
        }
        let keep = if at_end {
            0
        } else {
            partial_marker_len(&self.held, marker)
        };
        self.release(self.held.len() - keep, out);
        self.wait(State::Text(After::Text))
    }

    /// The state just after the family's marker (Llama 3 has none).
    fn opened_state(&self) -> State {
        match self.family {
            Family::Mistral => State::MistralHead,
            Family::Hermes | Family::Llama3 => State::HermesBody {
                scan: JsonScan::default(),
                pos: 0,
            },
        }
    }

    fn hermes_body(
        &mut self,
        mut scan: JsonScan,
        pos: usize,
        at_end: bool,
        out: &mut Vec<Piece>,
    ) -> bool {
        let (body_end, consumed) =
            match find_outside_strings(&self.held, pos, &mut scan, HERMES_CLOSE) {
                Search::Found(at) => (at, at + HERMES_CLOSE.len()),
                Search::Wait(pos) if !at_end => return self.wait(State::HermesBody { scan, pos }),
                // The reply ended without `</tool_call>`: a complete object still counts.
                Search::Wait(_) => (self.held.len(), self.held.len()),
            };
        match call_from_text(&self.held[..body_end]) {
            Some(call) => self.accept(call, consumed, State::Text(After::Call), out),
            None => self.give_up(HERMES_OPEN, out),
        }
    }

    fn mistral_opened(&mut self, at_end: bool, out: &mut Vec<Piece>) -> bool {
        match first_non_space(&self.held, 0) {
            None if at_end => self.give_up(MISTRAL_OPEN, out),
            None => self.wait(State::MistralHead),
            Some((at, '[')) => self.go(State::MistralArray(JsonWatch::new(at))),
            Some((at, _)) => self.go(State::MistralName {
                marked: true,
                start: at,
            }),
        }
    }

    fn mistral_array(&mut self, mut watch: JsonWatch, at_end: bool, out: &mut Vec<Piece>) -> bool {
        let (start, end) = match watch.advance(&self.held, '[') {
            Watch::Closed { start, end } => (start, end),
            Watch::Wait if !at_end => return self.wait(State::MistralArray(watch)),
            Watch::Wait | Watch::NotJson => return self.give_up(MISTRAL_OPEN, out),
        };
        let Some(calls) = calls_from_array(&self.held[start..end]) else {
            return self.give_up(MISTRAL_OPEN, out);
        };
        self.held.drain(..end);
        for call in calls {
            self.accept(call, 0, State::Text(After::Call), out);
        }
        true
    }

    fn mistral_name(
        &mut self,
        marked: bool,
        start: usize,
        at_end: bool,
        out: &mut Vec<Piece>,
    ) -> bool {
        match v11_head(&self.held[start..]) {
            Head::Complete { name_end, args_at } => {
                let next = State::MistralArgs {
                    marked,
                    name: self.held[start..start + name_end].to_owned(),
                    watch: JsonWatch::new(start + args_at),
                };
                self.go(next)
            }
            Head::Partial if !at_end => self.wait(State::MistralName { marked, start }),
            Head::Partial | Head::Invalid => self.give_up(mistral_marker(marked), out),
        }
    }

    fn mistral_args(
        &mut self,
        marked: bool,
        name: String,
        mut watch: JsonWatch,
        at_end: bool,
        out: &mut Vec<Piece>,
    ) -> bool {
        let (start, end) = match watch.advance(&self.held, '{') {
            Watch::Closed { start, end } => (start, end),
            Watch::Wait if !at_end => {
                let state = State::MistralArgs {
                    marked,
                    name,
                    watch,
                };
                return self.wait(state);
            }
            Watch::Wait | Watch::NotJson => return self.give_up(mistral_marker(marked), out),
        };
        match object_text(&self.held[start..end]) {
            Some(arguments) => {
                self.accept((name, arguments), end, State::Text(After::NamedCall), out)
            }
            None => self.give_up(mistral_marker(marked), out),
        }
    }

    fn reply_start(&mut self, at_end: bool) -> bool {
        let lead = leading_whitespace_len(&self.held);
        let body = &self.held[lead..];
        if body.starts_with(PYTHON_TAG) {
            self.go(State::LlamaCall(JsonWatch::new(lead + PYTHON_TAG.len())))
        } else if body.starts_with('{') {
            self.go(State::LlamaCall(JsonWatch::new(lead)))
        } else if !at_end && PYTHON_TAG.starts_with(body) {
            self.wait(State::ReplyStart)
        } else {
            self.go(State::Text(After::Text))
        }
    }

    fn llama_call(&mut self, mut watch: JsonWatch, at_end: bool, out: &mut Vec<Piece>) -> bool {
        // Giving up leaves everything from the reply's start (or the `;`) to be told as text.
        let (start, end) = match watch.advance(&self.held, '{') {
            Watch::Closed { start, end } => (start, end),
            Watch::Wait if !at_end => return self.wait(State::LlamaCall(watch)),
            Watch::Wait | Watch::NotJson => return self.give_up("", out),
        };
        match call_from_text(&self.held[start..end]) {
            Some(call) => self.accept(call, end, State::BetweenCalls, out),
            None => self.give_up("", out),
        }
    }

    fn between_calls(&mut self, at_end: bool) -> bool {
        self.held.drain(..leading_whitespace_len(&self.held));
        let next_at = match self.held.strip_prefix(';') {
            Some(rest) => 1 + leading_whitespace_len(rest),
            None => 0,
        };
        if next_at == self.held.len() {
            // Only separators so far; at the end they are dropped.
            if at_end {
                self.held.clear();
            }
            return self.wait(State::BetweenCalls);
        }
        if self.held[next_at..].starts_with('{') {
            self.go(State::LlamaCall(JsonWatch::new(next_at)))
        } else {
            self.go(State::Text(After::Text))
        }
    }
}

fn mistral_marker(marked: bool) -> &'static str {
    if marked { MISTRAL_OPEN } else { "" }
}

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

// ---------------------------------------------------------------------------
// tool_choice "required" / a named function
// ---------------------------------------------------------------------------

/// `tool_choice: "required"` or a named function: the output was constrained
/// by a grammar to Gantry's own format, parsed incrementally so argument
/// fragments stream as they are generated.
#[derive(Debug)]
pub struct ForcedParser {
    shape: Forced,
}

#[derive(Debug)]
enum Forced {
    Named(NamedArgs),
    List(CallList),
}

impl ForcedParser {
    /// A named function: the whole output is the arguments object, e.g. `{"city": "Paris"}`.
    pub fn named(name: &str) -> Self {
        ForcedParser {
            shape: Forced::Named(NamedArgs::new(name)),
        }
    }

    /// `required`: the output is a JSON array of calls,
    /// `[{"name": "get_weather", "arguments": {"city": "Paris"}}, …]`, each
    /// `arguments` an object; any JSON whitespace is tolerated.
    pub fn list() -> Self {
        ForcedParser {
            shape: Forced::List(CallList::default()),
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        match &mut self.shape {
            Forced::Named(named) => named.push(text, &mut out),
            Forced::List(list) => text.chars().for_each(|c| list.feed(c, &mut out)),
        }
        out
    }

    /// Everything was told as it came; output cut short (e.g. by
    /// `max_tokens`) adds nothing, and the caller reports `length`.
    pub fn finish(&mut self) -> Vec<Piece> {
        Vec::new()
    }
}

/// The arguments object of one named call, passed on as it arrives.
#[derive(Debug)]
struct NamedArgs {
    name: String,
    announced: bool,
    begun: bool,
    done: bool,
    scan: JsonScan,
}

impl NamedArgs {
    fn new(name: &str) -> Self {
        NamedArgs {
            name: name.to_owned(),
            announced: false,
            begun: false,
            done: false,
            scan: JsonScan::default(),
        }
    }

    fn push(&mut self, text: &str, out: &mut Vec<Piece>) {
        if !self.announced {
            self.announced = true;
            out.push(Piece::CallStart {
                index: 0,
                name: self.name.clone(),
            });
        }
        for c in text.chars() {
            if self.done {
                break;
            }
            if !self.begun && c.is_whitespace() {
                continue;
            }
            self.begun = true;
            push_args_char(out, 0, c);
            self.done = self.scan.step(c);
        }
    }
}

/// The text of a JSON string being read, up to its closing quote.
#[derive(Debug, Default)]
struct JsonString {
    raw: String,
    escaped: bool,
}

impl JsonString {
    /// Take one character after the opening quote; the decoded string once
    /// the closing quote comes.
    fn step(&mut self, c: char) -> Option<String> {
        if c == '"' && !self.escaped {
            return Some(decode_json_string(&self.raw));
        }
        self.escaped = c == '\\' && !self.escaped;
        self.raw.push(c);
        None
    }
}

fn decode_json_string(raw: &str) -> String {
    serde_json::from_str(&format!("\"{raw}\"")).unwrap_or_else(|_| raw.to_owned())
}

fn is_arguments_key(key: &str) -> bool {
    key == "arguments" || key == "parameters"
}

/// Where a [`CallList`] is in `[{"name": …, "arguments": {…}}, …]`.
#[derive(Debug, Default)]
enum ListState {
    #[default]
    BeforeArray,
    BeforeItem,
    AfterItem,
    BeforeKey,
    Key(JsonString),
    Colon(String),
    BeforeValue(String),
    Name(JsonString),
    /// The arguments object, streamed.
    Args(JsonScan),
    /// Any other value (or arguments that cannot be streamed), kept whole.
    Other {
        key: String,
        raw: String,
        scan: JsonScan,
    },
    AfterValue,
    Closed,
}

impl ListState {
    /// Whitespace here is only layout.
    fn skips_whitespace(&self) -> bool {
        !matches!(
            self,
            ListState::Key(_) | ListState::Name(_) | ListState::Args(_) | ListState::Other { .. }
        )
    }
}

/// The call object being read.
#[derive(Debug, Default)]
struct Item {
    named: bool,
    args_told: bool,
    /// Arguments that came before the name, told once it comes.
    early_args: Option<String>,
}

/// The `required` array of calls, read one character at a time.
#[derive(Debug, Default)]
struct CallList {
    state: ListState,
    index: usize,
    item: Item,
}

impl CallList {
    fn feed(&mut self, c: char, out: &mut Vec<Piece>) {
        let state = std::mem::take(&mut self.state);
        self.state = self.next(state, c, out);
    }

    fn next(&mut self, state: ListState, c: char, out: &mut Vec<Piece>) -> ListState {
        if c.is_whitespace() && state.skips_whitespace() {
            return state;
        }
        match state {
            ListState::BeforeArray if c == '[' => ListState::BeforeItem,
            ListState::BeforeItem if c == '{' => {
                self.item = Item::default();
                ListState::BeforeKey
            }
            ListState::BeforeItem | ListState::AfterItem if c == ']' => ListState::Closed,
            ListState::AfterItem if c == ',' => ListState::BeforeItem,
            ListState::BeforeKey if c == '"' => ListState::Key(JsonString::default()),
            ListState::BeforeKey if c == '}' => self.end_item(out),
            ListState::Key(mut key) => match key.step(c) {
                Some(key) => ListState::Colon(key),
                None => ListState::Key(key),
            },
            ListState::Colon(key) if c == ':' => ListState::BeforeValue(key),
            ListState::BeforeValue(key) => self.start_value(key, c, out),
            ListState::Name(mut name) => match name.step(c) {
                Some(name) => self.name_done(name, out),
                None => ListState::Name(name),
            },
            ListState::Args(mut scan) => {
                push_args_char(out, self.index, c);
                if scan.step(c) {
                    ListState::AfterValue
                } else {
                    ListState::Args(scan)
                }
            }
            ListState::Other { key, raw, scan } => self.other_value(key, raw, scan, c, out),
            ListState::AfterValue => self.after_value(c, out),
            // Anything unexpected is ignored: the grammar does not produce it.
            other => other,
        }
    }

    fn start_value(&mut self, key: String, c: char, out: &mut Vec<Piece>) -> ListState {
        if key == "name" && c == '"' && !self.item.named {
            return ListState::Name(JsonString::default());
        }
        let mut scan = JsonScan::default();
        scan.step(c);
        if is_arguments_key(&key) && c == '{' && self.item.named && !self.item.args_told {
            self.item.args_told = true;
            push_args_char(out, self.index, c);
            return ListState::Args(scan);
        }
        ListState::Other {
            key,
            raw: c.to_string(),
            scan,
        }
    }

    fn name_done(&mut self, name: String, out: &mut Vec<Piece>) -> ListState {
        self.item.named = true;
        out.push(Piece::CallStart {
            index: self.index,
            name,
        });
        if let Some(arguments) = self.item.early_args.take() {
            self.tell_args(arguments, out);
        }
        ListState::AfterValue
    }

    fn other_value(
        &mut self,
        key: String,
        mut raw: String,
        mut scan: JsonScan,
        c: char,
        out: &mut Vec<Piece>,
    ) -> ListState {
        if scan.at_top() && matches!(c, ',' | '}') {
            self.other_value_done(&key, &raw, out);
            return self.after_value(c, out);
        }
        raw.push(c);
        scan.step(c);
        ListState::Other { key, raw, scan }
    }

    /// Arguments that were not streamed (a string holding an object, or an
    /// object before the name) are told whole.
    fn other_value_done(&mut self, key: &str, raw: &str, out: &mut Vec<Piece>) {
        if !is_arguments_key(key) || self.item.args_told {
            return;
        }
        let value: Option<Value> = serde_json::from_str(raw.trim()).ok();
        let Some(arguments) = arguments_text(value.as_ref()) else {
            return;
        };
        if self.item.named {
            self.tell_args(arguments, out);
        } else {
            self.item.early_args = Some(arguments);
        }
    }

    fn tell_args(&mut self, arguments: String, out: &mut Vec<Piece>) {
        self.item.args_told = true;
        out.push(Piece::CallArgs {
            index: self.index,
            fragment: arguments,
        });
    }

    fn after_value(&mut self, c: char, out: &mut Vec<Piece>) -> ListState {
        match c {
            ',' => ListState::BeforeKey,
            '}' => self.end_item(out),
            _ => ListState::AfterValue,
        }
    }

    fn end_item(&mut self, out: &mut Vec<Piece>) -> ListState {
        if self.item.named {
            if !self.item.args_told {
                self.tell_args("{}".to_owned(), out);
            }
            self.index += 1;
        }
        ListState::AfterItem
    }
}

// ---------------------------------------------------------------------------
// The non-streamed answer
// ---------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;

    const HERMES_ONE: &str = concat!(
        "<tool_call>\n",
        r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}"#,
        "\n</tool_call>"
    );
    const HERMES_TWO_WITH_TEXT: &str = concat!(
        "Let me check both.\n<tool_call>\n",
        r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#,
        "\n</tool_call>\n\n<tool_call>\n",
        r#"{"name": "get_time", "arguments": {"zone": "CET"}}"#,
        "\n</tool_call>\nBoth requested."
    );
    const LLAMA_TWO: &str = concat!(
        r#"<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; "#,
        r#"{"name": "get_time", "parameters": {"zone": "CET"}}"#
    );
    const MISTRAL_V3: &str = concat!(
        r#"[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, "#,
        r#"{"name": "get_time", "arguments": {"zone": "CET"}}]"#
    );
    const MISTRAL_V11: &str = concat!(
        r#"Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}"#,
        r#"[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}"#
    );
    const TRICKY_ARGS: &str = r#"{"q": "a } b ] c \" d \u00e9 \\", "nested": {"list": [1, {"x": "}"}], "e": {}}, "n": null}"#;

    fn content(text: &str) -> Piece {
        Piece::Content(text.to_owned())
    }

    fn call(index: usize, name: &str, arguments: &str) -> [Piece; 2] {
        [
            Piece::CallStart {
                index,
                name: name.to_owned(),
            },
            Piece::CallArgs {
                index,
                fragment: arguments.to_owned(),
            },
        ]
    }

    /// Adjacent content, and adjacent fragments of one call, merged.
    fn merged(pieces: Vec<Piece>) -> Vec<Piece> {
        let mut out: Vec<Piece> = Vec::new();
        for piece in pieces {
            match (out.last_mut(), piece) {
                (Some(Piece::Content(last)), Piece::Content(text)) => last.push_str(&text),
                (
                    Some(Piece::CallArgs {
                        index: a,
                        fragment: last,
                    }),
                    Piece::CallArgs { index: b, fragment },
                ) if *a == b => last.push_str(&fragment),
                (_, piece) => out.push(piece),
            }
        }
        out
    }

    fn auto_chunks(family: Family, chunks: &[&str]) -> Vec<Piece> {
        let mut parser = AutoParser::new(family);
        let mut pieces: Vec<Piece> = chunks.iter().flat_map(|c| parser.push(c)).collect();
        pieces.extend(parser.finish());
        merged(pieces)
    }

    fn auto(family: Family, text: &str) -> Vec<Piece> {
        auto_chunks(family, &[text])
    }

    fn forced_chunks(mut parser: ForcedParser, chunks: &[&str]) -> Vec<Piece> {
        let mut pieces: Vec<Piece> = chunks.iter().flat_map(|c| parser.push(c)).collect();
        pieces.extend(parser.finish());
        merged(pieces)
    }

    /// Every way of cutting `text` once or twice, and one character at a time.
    fn splits(text: &str) -> Vec<Vec<&str>> {
        let cuts: Vec<usize> = text
            .char_indices()
            .map(|(i, _)| i)
            .chain([text.len()])
            .collect();
        let mut all = Vec::new();
        for (n, &a) in cuts.iter().enumerate() {
            for &b in &cuts[n..] {
                all.push(vec![&text[..a], &text[a..b], &text[b..]]);
            }
        }
        all.push(
            text.char_indices()
                .map(|(i, c)| &text[i..i + c.len_utf8()])
                .collect(),
        );
        all
    }

    fn assert_split_invariant(family: Family, text: &str) {
        let whole = auto(family, text);
        for chunks in splits(text) {
            assert_eq!(auto_chunks(family, &chunks), whole, "{family:?} {chunks:?}");
        }
    }

    fn assert_verbatim_content(family: Family, text: &str) {
        assert_eq!(auto(family, text), vec![content(text)], "{family:?}");
    }

    // --- Family -----------------------------------------------------------

    #[test]
    fn detect_picks_the_family_from_template_markers() {
        let qwen = "{%- if tools %}<tools>{{ tool | tojson }}</tools>\nFor each function call, return \
                    <tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
        let mistral = "{%- if message.tool_calls %}[TOOL_CALLS]{{ message.tool_calls | tojson }}";
        let llama31 = "<|start_header_id|>ipython<|end_header_id|>{%- if tools is not none %}";
        let llama_tag = "{{- '<|python_tag|>' + tool_call.name }}";
        assert_eq!(Family::detect(qwen), Family::Hermes);
        assert_eq!(Family::detect(mistral), Family::Mistral);
        assert_eq!(Family::detect(llama31), Family::Llama3);
        assert_eq!(Family::detect(llama_tag), Family::Llama3);
    }

    #[test]
    fn detect_falls_back_to_hermes() {
        assert_eq!(
            Family::detect("<|im_start|>{{ m.content }}<|im_end|>"),
            Family::Hermes
        );
        // A Llama 3 template without tool support.
        assert_eq!(
            Family::detect("<|start_header_id|>{{ m.role }}"),
            Family::Hermes
        );
        assert_eq!(Family::detect(""), Family::Hermes);
        let names: Vec<&str> = [Family::Hermes, Family::Llama3, Family::Mistral]
            .into_iter()
            .map(Family::name)
            .collect();
        assert_eq!(names, ["hermes", "llama3", "mistral"]);
    }

    // --- Hermes / Qwen ----------------------------------------------------

    #[test]
    fn hermes_one_call() {
        let expected = call(0, "get_weather", r#"{"city":"Paris","unit":"celsius"}"#);
        assert_eq!(auto(Family::Hermes, HERMES_ONE), expected);
        assert_eq!(auto(Family::Hermes, &format!("{HERMES_ONE}\n")), expected);
    }

    #[test]
    fn hermes_two_calls_with_text_before_and_after() {
        let mut expected = vec![content("Let me check both.\n")];
        expected.extend(call(0, "get_weather", r#"{"city":"Paris"}"#));
        expected.extend(call(1, "get_time", r#"{"zone":"CET"}"#));
        expected.push(content("Both requested."));
        assert_eq!(auto(Family::Hermes, HERMES_TWO_WITH_TEXT), expected);
    }

    #[test]
    fn hermes_arguments_as_a_string_or_under_parameters() {
        let as_string = r#"<tool_call>{"name": "f", "arguments": "{\"a\": [1, 2]}"}</tool_call>"#;
        assert_eq!(
            auto(Family::Hermes, as_string),
            call(0, "f", r#"{"a":[1,2]}"#)
        );
        let as_parameters = r#"<tool_call>{"name": "f", "parameters": {"b": true}}</tool_call>"#;
        assert_eq!(
            auto(Family::Hermes, as_parameters),
            call(0, "f", r#"{"b":true}"#)
        );
        let without = r#"<tool_call>{"name": "now"}</tool_call>"#;
        assert_eq!(auto(Family::Hermes, without), call(0, "now", "{}"));
    }

    #[test]
    fn hermes_key_order_and_tricky_strings_survive() {
        let text =
            format!(r#"<tool_call>{{"name": "search", "arguments": {TRICKY_ARGS}}}</tool_call>"#);
        let pieces = auto(Family::Hermes, &text);
        let (_, calls) = collect(pieces);
        let expected: Value = serde_json::from_str(TRICKY_ARGS).expect("valid test JSON");
        assert_eq!(calls[0].1, expected.to_string());
        assert!(
            calls[0]
                .1
                .starts_with(r#"{"q":"a } b ] c \" d é \\","nested""#)
        );
    }

    #[test]
    fn hermes_closing_tag_inside_a_string_does_not_end_the_call() {
        let text = r#"<tool_call>{"name": "echo", "arguments": {"s": "</tool_call>"}}</tool_call>"#;
        assert_eq!(
            auto(Family::Hermes, text),
            call(0, "echo", r#"{"s":"</tool_call>"}"#)
        );
    }

    #[test]
    fn hermes_not_a_call_is_content_verbatim() {
        assert_verbatim_content(
            Family::Hermes,
            r#"Use <tool_call>{"name": "f", "arguments": {"a": }}</tool_call> like this."#,
        );
        assert_verbatim_content(
            Family::Hermes,
            r#"<tool_call>{"arguments": {}}</tool_call>"#,
        );
        assert_verbatim_content(Family::Hermes, "a < b and <tool_ca is not a tag");
    }

    #[test]
    fn hermes_cut_off_mid_call_is_content() {
        let text = r#"Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Pa"#;
        assert_verbatim_content(Family::Hermes, text);
    }

    #[test]
    fn hermes_complete_call_without_closing_tag_at_the_end_counts() {
        let text = r#"<tool_call>{"name": "f", "arguments": {"a": 1}}"#;
        assert_eq!(auto(Family::Hermes, text), call(0, "f", r#"{"a":1}"#));
    }

    #[test]
    fn hermes_streams_text_holding_back_only_a_possible_marker() {
        let mut parser = AutoParser::new(Family::Hermes);
        assert_eq!(parser.push("Hello <"), vec![content("Hello ")]);
        assert_eq!(parser.push("b> <tool_"), vec![content("<b> ")]);
        assert_eq!(parser.push(r#"call>{"name": "f", "#), vec![]);
        assert_eq!(
            parser.push(r#""arguments": {}}</tool_call>"#),
            call(0, "f", "{}")
        );
        assert_eq!(parser.finish(), vec![]);
    }

    #[test]
    fn hermes_split_invariance() {
        for text in [
            HERMES_ONE,
            HERMES_TWO_WITH_TEXT,
            r#"x <tool_call>{"name": "f", "arguments": "{\"a\": \"</tool_call>\"}"}</tool_call> y"#,
            r#"<tool_call>{"name": "f", "arguments": {"a": }}</tool_call><tool_call>{"name": "g"}</tool_call>"#,
            r#"<tool_call>{"name": "f", "arguments": {"é": "Pa"#,
        ] {
            assert_split_invariant(Family::Hermes, text);
        }
    }

    // --- Llama 3 ----------------------------------------------------------

    #[test]
    fn llama_one_call_with_or_without_python_tag() {
        let bare = r#" {"name": "get_weather", "parameters": {"city": "Paris"}}"#;
        let expected = call(0, "get_weather", r#"{"city":"Paris"}"#);
        assert_eq!(auto(Family::Llama3, bare), expected);
        assert_eq!(
            auto(Family::Llama3, &format!("<|python_tag|>{bare}\n")),
            expected
        );
    }

    #[test]
    fn llama_two_calls_separated_by_semicolon() {
        let mut expected = call(0, "get_weather", r#"{"city":"Paris"}"#).to_vec();
        expected.extend(call(1, "get_time", r#"{"zone":"CET"}"#));
        assert_eq!(auto(Family::Llama3, LLAMA_TWO), expected);
    }

    #[test]
    fn llama_text_after_the_last_call_is_content() {
        let text = r#"{"name": "f", "arguments": {}}; {"oops": 1} and more"#;
        let mut expected = call(0, "f", "{}").to_vec();
        expected.push(content(r#"; {"oops": 1} and more"#));
        assert_eq!(auto(Family::Llama3, text), expected);
        let text = r#"{"name": "f", "arguments": {}}

The weather is fine."#;
        let mut expected = call(0, "f", "{}").to_vec();
        expected.push(content("The weather is fine."));
        assert_eq!(auto(Family::Llama3, text), expected);
    }

    #[test]
    fn llama_plain_reply_streams_immediately() {
        let mut parser = AutoParser::new(Family::Llama3);
        assert_eq!(parser.push("  "), vec![]);
        assert_eq!(parser.push("The"), vec![content("  The")]);
        assert_eq!(
            parser.push(r#" {"name": "f"} is JSON"#),
            vec![content(r#" {"name": "f"} is JSON"#)]
        );
        assert_eq!(parser.finish(), vec![]);
    }

    #[test]
    fn llama_json_that_is_not_a_call_is_content_once_closed() {
        let mut parser = AutoParser::new(Family::Llama3);
        assert_eq!(parser.push(r#"{"answer": "#), vec![]);
        assert_eq!(parser.push("42} ok"), vec![content(r#"{"answer": 42} ok"#)]);
        assert_verbatim_content(
            Family::Llama3,
            r#"<|python_tag|>brave_search.call(query="x")"#,
        );
    }

    #[test]
    fn llama_cut_off_mid_call_is_content() {
        assert_verbatim_content(
            Family::Llama3,
            r#"{"name": "get_weather", "parameters": {"city": "Pa"#,
        );
        assert_verbatim_content(Family::Llama3, "<|python_ta");
    }

    #[test]
    fn llama_split_invariance() {
        for text in [
            LLAMA_TWO,
            r#"{"name": "f", "parameters": {"s": "}; {"}} ;"#,
            r#"{"name": "f", "arguments": {}}; {"oops": 1} and more"#,
            r#"  {"answer": 42} ok"#,
            "Just text, {with braces}.",
        ] {
            assert_split_invariant(Family::Llama3, text);
        }
    }

    // --- Mistral ----------------------------------------------------------

    #[test]
    fn mistral_v3_array_of_calls() {
        let mut expected = call(0, "get_weather", r#"{"city":"Paris"}"#).to_vec();
        expected.extend(call(1, "get_time", r#"{"zone":"CET"}"#));
        assert_eq!(auto(Family::Mistral, MISTRAL_V3), expected);
    }

    #[test]
    fn mistral_v11_calls_with_text_before() {
        let mut expected = vec![content("Checking. ")];
        expected.extend(call(0, "get_weather", r#"{"city":"Paris"}"#));
        expected.extend(call(1, "get_time", r#"{"zone":"CET"}"#));
        assert_eq!(auto(Family::Mistral, MISTRAL_V11), expected);
    }

    #[test]
    fn mistral_v11_calls_following_directly_or_with_call_ids() {
        let direct = r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}get_time[ARGS]{} Done."#;
        let mut expected = call(0, "get_weather", r#"{"city":"Paris"}"#).to_vec();
        expected.extend(call(1, "get_time", "{}"));
        expected.push(content("Done."));
        assert_eq!(auto(Family::Mistral, direct), expected);
        let with_id = r#"[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}"#;
        assert_eq!(
            auto(Family::Mistral, with_id),
            call(0, "get_weather", r#"{"city":"Paris"}"#)
        );
    }

    #[test]
    fn mistral_not_a_call_or_cut_off_is_content_verbatim() {
        assert_verbatim_content(
            Family::Mistral,
            r#"[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}] then"#,
        );
        assert_verbatim_content(Family::Mistral, r#"[TOOL_CALLS] [{"arguments": {}}]"#);
        assert_verbatim_content(Family::Mistral, "[TOOL_CALLS] not a call [ARGS]");
        assert_verbatim_content(
            Family::Mistral,
            r#"[TOOL_CALLS]get_weather[ARGS]{"city": "Pa"#,
        );
        assert_verbatim_content(Family::Mistral, "[TOOL_CALLS]");
    }

    #[test]
    fn mistral_split_invariance() {
        for text in [
            MISTRAL_V3,
            MISTRAL_V11,
            r#"[TOOL_CALLS]a[ARGS]{"s": "]}"}b[CALL_ID]x1[ARGS]{} fin"#,
            r#"[TOOL_CALLS] [{"name": "f", "arguments": {"a": }}] [TOOL_CALLS]g{}"#,
            "[TOOL] [TOOL_CALLS]get_weather[ARGS]{\"city\": \"Pa",
        ] {
            assert_split_invariant(Family::Mistral, text);
        }
    }

    // --- Forced -----------------------------------------------------------

    #[test]
    fn forced_named_streams_fragments_as_they_arrive() {
        let fragment = |f: &str| Piece::CallArgs {
            index: 0,
            fragment: f.to_owned(),
        };
        let mut parser = ForcedParser::named("get_weather");
        assert_eq!(parser.push(" {\"ci"), call(0, "get_weather", "{\"ci"));
        assert_eq!(parser.push("ty\": \"Pa"), vec![fragment("ty\": \"Pa")]);
        assert_eq!(parser.push("ris\"}\n\n"), vec![fragment("ris\"}")]);
        assert_eq!(parser.push("trailing"), vec![]);
        assert_eq!(parser.finish(), vec![]);
    }

    #[test]
    fn forced_named_keeps_tricky_arguments_verbatim() {
        let text = format!("{TRICKY_ARGS}\n");
        let expected = call(0, "search", TRICKY_ARGS);
        for chunks in splits(&text) {
            assert_eq!(
                forced_chunks(ForcedParser::named("search"), &chunks),
                expected
            );
        }
    }

    #[test]
    fn forced_list_tells_each_name_as_soon_as_it_is_complete() {
        let mut parser = ForcedParser::list();
        assert_eq!(parser.push(r#"[{"name": "get_wea"#), vec![]);
        let start = Piece::CallStart {
            index: 0,
            name: "get_weather".to_owned(),
        };
        assert_eq!(parser.push(r#"ther", "#), vec![start]);
        let args = Piece::CallArgs {
            index: 0,
            fragment: r#"{"city": "#.to_owned(),
        };
        assert_eq!(parser.push(r#""arguments": {"city": "#), vec![args]);
        let mut rest = vec![Piece::CallArgs {
            index: 0,
            fragment: r#""Paris"}"#.to_owned(),
        }];
        rest.extend(call(1, "get_time", r#"{"zone": "CET"}"#));
        let tail = r#""Paris"}}, {"name": "get_time", "arguments": {"zone": "CET"}}]"#;
        assert_eq!(parser.push(tail), rest);
        assert_eq!(parser.finish(), vec![]);
    }

    #[test]
    fn forced_list_with_layout_escapes_and_nesting() {
        let text = format!(
            "[\n  {{\n    \"name\" : \"get_\\u0077eather\",\n    \"arguments\" : {TRICKY_ARGS}\n  }} ,\n  {{\"name\": \"now\", \"arguments\": {{}}}}\n]\n"
        );
        let mut expected = call(0, "get_weather", TRICKY_ARGS).to_vec();
        expected.extend(call(1, "now", "{}"));
        for chunks in splits(&text) {
            assert_eq!(
                forced_chunks(ForcedParser::list(), &chunks),
                expected,
                "{chunks:?}"
            );
        }
    }

    #[test]
    fn forced_list_odd_arguments_are_told_whole() {
        let text = r#"[{"arguments": {"a": 1}, "name": "f"}, {"name": "g", "arguments": "{\"b\": 2}"}, {"name": "h"}]"#;
        let mut expected = call(0, "f", r#"{"a":1}"#).to_vec();
        expected.extend(call(1, "g", r#"{"b":2}"#));
        expected.extend(call(2, "h", "{}"));
        for chunks in splits(text) {
            assert_eq!(
                forced_chunks(ForcedParser::list(), &chunks),
                expected,
                "{chunks:?}"
            );
        }
    }

    #[test]
    fn forced_output_cut_short_adds_nothing_at_finish() {
        let mut parser = ForcedParser::list();
        let mut told = parser.push(r#"[{"name": "f", "arguments": {"a": "x}"#);
        assert!(parser.finish().is_empty());
        told = merged(told);
        assert_eq!(told, call(0, "f", r#"{"a": "x}"#));
        let mut named = ForcedParser::named("g");
        named.push(r#"{"a": [1, "#);
        assert!(named.finish().is_empty());
    }

    // --- collect ----------------------------------------------------------

    #[test]
    fn collect_merges_content_and_orders_calls() {
        let pieces = vec![
            content(" \n"),
            Piece::CallStart {
                index: 0,
                name: "f".to_owned(),
            },
            Piece::CallArgs {
                index: 0,
                fragment: "{\"a\":".to_owned(),
            },
            Piece::CallStart {
                index: 1,
                name: "g".to_owned(),
            },
            Piece::CallArgs {
                index: 0,
                fragment: " 1}".to_owned(),
            },
            content("\n"),
        ];
        let expected = vec![
            ("f".to_owned(), "{\"a\": 1}".to_owned()),
            ("g".to_owned(), "{}".to_owned()),
        ];
        assert_eq!(collect(pieces), (None, expected));
    }

    #[test]
    fn collect_keeps_content_beside_calls_and_alone() {
        let mut pieces = vec![content("Let me "), content("check.")];
        pieces.extend(call(0, "f", "{}"));
        let (text, calls) = collect(pieces);
        assert_eq!(text.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 1);
        assert_eq!(
            collect(vec![content("  ")]),
            (Some("  ".to_owned()), vec![])
        );
        assert_eq!(collect(Vec::new()), (None, vec![]));
    }
}
