//! Tool calls with `tool_choice: "auto"`: [`AutoParser`] follows the model's own syntax (Hermes,
//! Llama 3, Mistral) in plain text as it streams.

use super::read::*;
use super::scan::*;
use super::*;

/// What came just before plain text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum After {
    Text,
    Call,
    /// A Mistral v11 call, which the next may follow without a marker.
    NamedCall,
}

/// Where an [`AutoParser`] is; positions are offsets into its held text.
#[derive(Debug)]
pub(super) enum State {
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

pub(super) fn mistral_marker(marked: bool) -> &'static str {
    if marked { MISTRAL_OPEN } else { "" }
}
