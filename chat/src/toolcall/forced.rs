//! Tool calls with `tool_choice: "required"` or a named function: [`ForcedParser`] streams the
//! argument text of output a grammar constrained to Gantry's own JSON format.

use super::read::*;
use super::scan::*;
use super::*;

/// `tool_choice: "required"` or a named function: the output was constrained
/// by a grammar to Gantry's own format, parsed incrementally so argument
/// fragments stream as they are generated.
#[derive(Debug)]
pub struct ForcedParser {
    shape: Forced,
}

#[derive(Debug)]
pub(super) enum Forced {
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
pub(super) struct NamedArgs {
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
pub(super) struct JsonString {
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

pub(super) fn decode_json_string(raw: &str) -> String {
    serde_json::from_str(&format!("\"{raw}\"")).unwrap_or_else(|_| raw.to_owned())
}

pub(super) fn is_arguments_key(key: &str) -> bool {
    key == "arguments" || key == "parameters"
}

/// Where a [`CallList`] is in `[{"name": …, "arguments": {…}}, …]`.
#[derive(Debug, Default)]
pub(super) enum ListState {
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
pub(super) struct Item {
    named: bool,
    args_told: bool,
    /// Arguments that came before the name, told once it comes.
    early_args: Option<String>,
}

/// The `required` array of calls, read one character at a time.
#[derive(Debug, Default)]
pub(super) struct CallList {
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
