//! Chat template, its input (built by validation, read while rendering): a conversation as
//! checked types.
//!
//! Validation (`http/validate.rs`) turns each OpenAI message into a
//! [`ChatMessage`] once; nothing after it picks JSON apart again. A template
//! may still print a whole message (`message | tojson`) or read a key the
//! node does not interpret (`reasoning_content`, `name`, `tool_call_id`), so
//! each type keeps the keys it does not type, and the order the client wrote
//! every key in: serialized for the template, a message is the object the
//! client sent, except for what validation decided to change (tool-call
//! arguments parsed into an object).

use serde::Serialize;
use serde_json::{Map, Value};

/// Who wrote a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

impl Role {
    /// The role named exactly `name` (OpenAI's spelling).
    pub fn parse(name: &str) -> Option<Role> {
        Some(match name {
            "system" => Role::System,
            "developer" => Role::Developer,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::Developer => "developer",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A message's `content`.
#[derive(Clone, Debug, PartialEq)]
pub enum Content {
    /// `content: null` (an assistant message that only calls tools).
    Null,
    Text(String),
    /// A list of parts; only text parts pass validation.
    Parts(Vec<TextPart>),
}

impl Content {
    /// Whether any of the text is more than whitespace.
    pub fn has_text(&self) -> bool {
        match self {
            Content::Null => false,
            Content::Text(t) => !t.trim().is_empty(),
            Content::Parts(parts) => parts.iter().any(|p| !p.text.trim().is_empty()),
        }
    }
}

/// One `{"type": "text", "text": ...}` content part.
#[derive(Clone, Debug, PartialEq)]
pub struct TextPart {
    pub text: String,
    /// The part as sent (`type`, `text` and any other key), for the template.
    sent: Map<String, Value>,
}

impl TextPart {
    /// `sent` must be a part whose `type` is `"text"` and whose `text` is `text`.
    pub fn new(text: String, sent: Map<String, Value>) -> Self {
        Self { text, sent }
    }
}

/// A tool call's `function.arguments`.
#[derive(Clone, Debug, PartialEq)]
pub enum Arguments {
    /// A JSON object: what templates expect (they `tojson` it).
    Object(Map<String, Value>),
    /// A string that is not a JSON object, kept as sent.
    Text(String),
    /// Anything else, kept as sent.
    Other(Value),
}

impl Arguments {
    fn to_json(&self) -> Value {
        match self {
            Arguments::Object(o) => Value::Object(o.clone()),
            Arguments::Text(t) => Value::String(t.clone()),
            Arguments::Other(v) => v.clone(),
        }
    }
}

/// One entry of an assistant message's `tool_calls`.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// `function.arguments`, when the call has them.
    pub arguments: Option<Arguments>,
    /// The call as sent; `arguments` replaces its `function.arguments`.
    sent: Value,
}

impl ToolCall {
    pub fn new(sent: Value) -> Self {
        let arguments = sent
            .get("function")
            .and_then(|f| f.get("arguments"))
            .map(|a| match a {
                Value::Object(o) => Arguments::Object(o.clone()),
                Value::String(s) => Arguments::Text(s.clone()),
                other => Arguments::Other(other.clone()),
            });
        Self { arguments, sent }
    }

    fn to_json(&self) -> Value {
        let mut v = self.sent.clone();
        if let (Some(a), Some(slot)) = (
            &self.arguments,
            v.get_mut("function").and_then(|f| f.get_mut("arguments")),
        ) {
            *slot = a.to_json();
        }
        v
    }
}

/// One checked message of a conversation.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatMessage {
    pub role: Role,
    /// `None` when the message has no `content` key.
    pub content: Option<Content>,
    /// `tool_calls` when it is a list; any other value stays in `rest`.
    pub tool_calls: Option<Vec<ToolCall>>,
    /// Every other key as sent (`name`, `tool_call_id`, `reasoning_content`, ...).
    pub rest: Map<String, Value>,
    /// Every key in the order the client wrote them.
    order: Vec<String>,
}

impl ChatMessage {
    /// `order` lists every key of the sent message: `role`, `content` when
    /// `content` is `Some`, `tool_calls` when it is `Some`, and those of `rest`.
    pub fn new(
        role: Role,
        content: Option<Content>,
        tool_calls: Option<Vec<ToolCall>>,
        rest: Map<String, Value>,
        order: Vec<String>,
    ) -> Self {
        Self {
            role,
            content,
            tool_calls,
            rest,
            order,
        }
    }

    /// The message as the template sees it.
    fn to_json(&self) -> Map<String, Value> {
        let mut out = Map::new();
        for key in &self.order {
            let value = match key.as_str() {
                "role" => Value::from(self.role.as_str()),
                "content" => match &self.content {
                    Some(Content::Null) => Value::Null,
                    Some(Content::Text(t)) => Value::String(t.clone()),
                    Some(Content::Parts(parts)) => Value::Array(
                        parts
                            .iter()
                            .map(|p| Value::Object(p.sent.clone()))
                            .collect(),
                    ),
                    None => continue,
                },
                "tool_calls" if self.tool_calls.is_some() => Value::Array(
                    self.tool_calls
                        .iter()
                        .flatten()
                        .map(ToolCall::to_json)
                        .collect(),
                ),
                other => match self.rest.get(other) {
                    Some(v) => v.clone(),
                    None => continue,
                },
            };
            out.insert(key.clone(), value);
        }
        out
    }
}

impl Serialize for ChatMessage {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(serializer)
    }
}

impl Content {
    /// The text of the content (parts joined), empty for `null`.
    pub fn text(&self) -> String {
        match self {
            Content::Null => String::new(),
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => parts.iter().map(|p| p.text.as_str()).collect(),
        }
    }
}

impl ToolCall {
    /// `function.name` as sent.
    pub fn name(&self) -> &str {
        self.sent
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str)
            .unwrap_or_default()
    }

    /// `function.arguments` as a JSON value: an object when it is one or a string holding one.
    pub fn arguments_json(&self) -> Value {
        match &self.arguments {
            None => Value::Object(Map::new()),
            Some(Arguments::Text(t)) => serde_json::from_str::<Map<String, Value>>(t)
                .map_or_else(|_| Value::String(t.clone()), Value::Object),
            Some(a) => a.to_json(),
        }
    }
}

impl ChatMessage {
    /// A message with only a role and text content.
    pub fn text(role: Role, text: String) -> Self {
        Self::new(
            role,
            Some(Content::Text(text)),
            None,
            Map::new(),
            vec!["role".into(), "content".into()],
        )
    }
}
