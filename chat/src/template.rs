//! Chat template (after the model is ready, before tokenization): a validated conversation
//! becomes the prompt text the model was trained on.
//!
//! Renders the model's own Jinja chat template with minijinja. Templates are
//! written and tested against Hugging Face `transformers`, so the environment
//! imitates the one it renders with: Jinja2's `ImmutableSandboxedEnvironment`
//! with `trim_blocks`, `lstrip_blocks` and loop controls, the
//! `raise_exception` and `strftime_now` globals, and Python's behaviour where
//! a template can see it (`pycompat`). `node-pod/tests/template_diff.rs`
//! holds this to Jinja2 over llama.cpp's corpus of real templates;
//! `docs/chat-templates.md` has the result and the known differences.
//!
//! Which template is used: a `chat_template` override from the model config,
//! else the model's own (GGUF `tokenizer.chat_template` or
//! `tokenizer_config.json`, read by `tokenizer_config`), else [`CHATML`], the
//! fallback llama-server uses too. [`ChatTemplate::source`] says which one won.
//! The conversation arrives typed (`conversation`), as validation built it.

mod conversation;
pub mod inline_tools;
mod pycompat;
#[cfg(test)]
mod tests;
mod tokenizer_config;

pub use conversation::{Arguments, ChatMessage, Content, Role, TextPart, ToolCall};
pub use tokenizer_config::TokenizerConfig;

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use chrono::NaiveDateTime;
use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

use pycompat::{join, python_str, python_strftime, python_strip, tojson};

/// The fallback template: ChatML, rendered exactly as llama-server's built-in
/// `chatml` (`<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
/// `<|im_start|>assistant\n` when a generation prompt is asked for). Content
/// given as a list of parts renders its text parts back to back.
pub const CHATML: &str = "\
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' -}}
{%- if message.content is string -%}
{{- message.content -}}
{%- elif message.content is iterable -%}
{%- for part in message.content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/// The name the one template is registered under; it shows up in error
/// locations (`(in chat_template:12)`).
const TEMPLATE_NAME: &str = "chat_template";

/// Where the template being rendered came from, most specific first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TemplateSource {
    /// `chat_template` in the model config.
    Override,
    /// The model's own: GGUF metadata or `tokenizer_config.json`.
    Model,
    /// The model has none: [`CHATML`].
    DefaultChatml,
}

impl TemplateSource {
    pub fn as_str(self) -> &'static str {
        match self {
            TemplateSource::Override => "override",
            TemplateSource::Model => "model",
            TemplateSource::DefaultChatml => "default-chatml",
        }
    }
}

impl fmt::Display for TemplateSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What went wrong compiling or rendering a chat template, or reading one.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The template is not valid Jinja; the model (or its config) is at fault.
    #[error("the {origin} chat template does not compile: {detail}")]
    Syntax {
        origin: TemplateSource,
        detail: String,
    },
    /// The template called `raise_exception(message)`: it rejects this
    /// conversation (say, a system message it does not support). The client's
    /// request is at fault; the message is the template's own.
    #[error("the chat template rejected the conversation: {0}")]
    Raised(String),
    /// Rendering failed otherwise (a type error, an unknown method, ...).
    #[error("the chat template failed to render: {0}")]
    Render(String),
    #[error("cannot read tokenizer config {}", path.display())]
    ReadConfig {
        path: PathBuf,
        #[source]
        error: std::io::Error,
    },
    #[error("tokenizer config {} is invalid: {reason}", path.display())]
    InvalidConfig { path: PathBuf, reason: String },
}

impl TemplateError {
    pub fn metric_label(&self) -> &'static str {
        match self {
            TemplateError::Syntax { .. } => "syntax",
            TemplateError::Raised(_) => "raised",
            TemplateError::Render(_) => "render",
            TemplateError::ReadConfig { .. } | TemplateError::InvalidConfig { .. } => "config",
        }
    }
}

/// What `strftime_now` reads: the wall clock, or a fixed instant for
/// deterministic output in tests.
#[derive(Debug, Clone, Copy)]
enum Clock {
    System,
    Fixed(NaiveDateTime),
}

/// A compiled chat template, ready to render any number of conversations.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: TemplateSource,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// The text the template puts after an assistant turn (`<|im_end|>` for ChatML), found by
    /// rendering a probe conversation; generation stops on it (see [`ChatTemplate::end_of_turn`]).
    end_of_turn: Option<String>,
    /// The template's text, for what is read off it (the model family's tool-call syntax).
    text: String,
}

impl ChatTemplate {
    /// Compiles `template` once. `bos_token`/`eos_token` are the strings the
    /// template sees under those names (transformers passes the tokenizer's
    /// special tokens); `None` leaves the variable undefined.
    pub fn new(
        source: TemplateSource,
        template: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let mut env = environment(Clock::System);
        env.add_template_owned(TEMPLATE_NAME, translate_generation_tags(template))
            .map_err(|error| TemplateError::Syntax {
                origin: source,
                detail: error.to_string(),
            })?;
        let mut t = ChatTemplate {
            env,
            source,
            bos_token,
            eos_token,
            end_of_turn: None,
            text: template.to_string(),
        };
        t.end_of_turn = t.probe_end_of_turn();
        Ok(t)
    }

    /// The end-of-turn marker: what the template writes right after an assistant message's
    /// content (first line, trimmed), e.g. `<|im_end|>` (ChatML), `<end_of_turn>` (Gemma),
    /// `<|eot_id|>` (Llama 3). Chat requests stop on it like llama-server does, so a model
    /// that writes the marker as plain text (a model without a template of its own, served
    /// with [`CHATML`]) still ends its reply. `None` when the template writes nothing there or
    /// cannot render the probe.
    pub fn end_of_turn(&self) -> Option<&str> {
        self.end_of_turn.as_deref()
    }

    /// The template as given (before Gantry's translations).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Whether the template renders `tools` and tool-call history itself; a template that does
    /// not gets them written into the conversation by Gantry (see `template::conversation`).
    pub fn handles_tools(&self) -> bool {
        self.text.contains("tools") && self.text.contains("tool_calls")
    }

    fn probe_end_of_turn(&self) -> Option<String> {
        const PROBE: &str = "\u{1}gantry-end-of-turn-probe\u{1}";
        let messages = serde_json::json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": PROBE},
        ]);
        let text = self.render(messages.as_array()?, None, false, None).ok()?;
        let after = &text[text.find(PROBE)? + PROBE.len()..];
        let marker = after.trim_start().lines().next()?.trim();
        (!marker.is_empty() && marker.len() <= 64).then(|| marker.to_string())
    }

    /// Picks the template by precedence — `override_template`, else
    /// `model_template`, else [`CHATML`] — and compiles it.
    pub fn resolve(
        override_template: Option<&str>,
        model_template: Option<&str>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, TemplateError> {
        let (source, template) = match (override_template, model_template) {
            (Some(template), _) => (TemplateSource::Override, template),
            (None, Some(template)) => (TemplateSource::Model, template),
            (None, None) => (TemplateSource::DefaultChatml, CHATML),
        };
        Self::new(source, template, bos_token, eos_token)
    }

    /// The default template of an HF-style model directory's
    /// `tokenizer_config.json` with the config's `bos_token`/`eos_token`
    /// (source [`TemplateSource::Model`]), or [`CHATML`] when the config has
    /// no template. An override goes through [`ChatTemplate::resolve`] instead.
    pub fn from_tokenizer_config(path: &Path) -> Result<Self, TemplateError> {
        let config = TokenizerConfig::from_file(path)?;
        Self::resolve(
            None,
            config.chat_template.as_deref(),
            config.bos_token,
            config.eos_token,
        )
    }

    /// Makes `strftime_now` report `now` instead of the wall clock, so output
    /// is reproducible (tests, and comparing against another renderer).
    pub fn with_fixed_now(mut self, now: NaiveDateTime) -> Self {
        add_strftime_now(&mut self.env, Clock::Fixed(now));
        self
    }

    pub fn source(&self) -> TemplateSource {
        self.source
    }

    /// Renders a conversation the way transformers' `apply_chat_template`
    /// does: the template sees `messages`, `tools` (`none` when absent),
    /// `documents` (`none`), `add_generation_prompt`, `bos_token`,
    /// `eos_token`, and every key of `extra` (`chat_template_kwargs`, e.g.
    /// `enable_thinking`). `extra` may replace `bos_token`/`eos_token` but
    /// not the other four.
    ///
    /// `messages` are the checked conversation ([`ChatMessage`]: string or
    /// `[{type: "text", text}]` content, assistant `tool_calls`, `tool`
    /// messages with `tool_call_id`); `tools` are function specs with
    /// JSON-schema parameters, passed through. Key order is kept, so `tojson`
    /// prints objects in the order the client sent them.
    ///
    /// Any serializable message renders (the template engine's own tests
    /// pass JSON); the request path passes the [`ChatMessage`]s validation
    /// built, which serialize to the objects the client sent.
    pub fn render<M: serde::Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String, TemplateError> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|error| TemplateError::Render(error.to_string()))?;

        let mut context: BTreeMap<&str, Value> = BTreeMap::new();
        if let Some(bos) = &self.bos_token {
            context.insert("bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            context.insert("eos_token", Value::from(eos.as_str()));
        }
        for (key, value) in extra.into_iter().flatten() {
            context.insert(key, Value::from_serialize(value));
        }
        context.insert("messages", Value::from_serialize(messages));
        context.insert(
            "tools",
            tools.map_or(Value::from(()), Value::from_serialize),
        );
        context.insert("documents", Value::from(()));
        context.insert("add_generation_prompt", Value::from(add_generation_prompt));

        template.render(context).map_err(render_error)
    }
}

/// The name `{% generation %}` blocks call; see [`translate_generation_tags`].
const GENERATION_MACRO: &str = "__gantry_generation";

/// transformers' `{% generation %}...{% endgeneration %}` (it marks assistant
/// text for training masks and renders its body unchanged) becomes
/// `{% call __gantry_generation() %}...{% endcall %}`, a call block whose
/// macro returns the body: the same output and, as in Jinja2, its own
/// scope. Whitespace control marks (`{%-`, `-%}`) are kept.
fn translate_generation_tags(source: &str) -> String {
    if !source.contains("generation") {
        return source.to_owned();
    }
    let mut out = String::with_capacity(source.len() + 64);
    let mut rest = source;
    while let Some(open) = rest.find("{%") {
        out.push_str(&rest[..open + 2]);
        rest = &rest[open + 2..];
        let marker = usize::from(rest.starts_with('-') || rest.starts_with('+'));
        let after_marker = &rest[marker..];
        let name_start = after_marker.trim_start();
        let leading = rest.len() - name_start.len();
        let name_len = name_start
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(name_start.len());
        let tail = name_start[name_len..].trim_start();
        let closes = tail.starts_with("%}") || tail.starts_with("-%}") || tail.starts_with("+%}");
        let replacement = match &name_start[..name_len] {
            "generation" if closes => Some(format!("call {GENERATION_MACRO}()")),
            "endgeneration" if closes => Some("endcall".to_owned()),
            _ => None,
        };
        if let Some(replacement) = replacement {
            out.push_str(&rest[..leading]);
            out.push_str(&replacement);
            rest = &name_start[name_len..];
        }
    }
    out.push_str(rest);
    out
}

/// Marks an error as coming from the template's own `raise_exception`, so
/// [`render_error`] can tell it from an engine failure.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

fn render_error(error: Error) -> TemplateError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&error);
    while let Some(current) = cause {
        if let Some(raised) = current.downcast_ref::<RaisedByTemplate>() {
            return TemplateError::Raised(raised.0.clone());
        }
        cause = current.source();
    }
    TemplateError::Render(error.to_string())
}

/// The rendering environment: transformers' Jinja2 settings and globals, and
/// Python's behaviour where minijinja's differs in ways templates can see.
fn environment(clock: Clock) -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    // transformers renders without autoescaping; so must we, whatever the name.
    env.set_auto_escape_callback(|_| AutoEscape::None);
    // Jinja2's default `Undefined`: printing and iterating are fine, looking
    // into it is an error.
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_debug(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        match value.as_str() {
            Some(text) => out.write_str(text)?,
            None => out.write_str(&python_str(value))?,
        }
        Ok(())
    });
    env.add_filter("string", |value: Value| -> Value {
        if value.kind() == ValueKind::String {
            value
        } else {
            Value::from(python_str(&value))
        }
    });
    // Jinja2's string filters take `str(value)` of whatever they get.
    env.add_filter("trim", |value: Value, chars: Option<String>| {
        python_strip(&python_str(&value), chars.as_deref())
    });
    env.add_filter("upper", |value: Value| python_str(&value).to_uppercase());
    env.add_filter("lower", |value: Value| python_str(&value).to_lowercase());
    env.add_filter("join", join);
    env.add_filter("tojson", tojson);
    // Jinja2's type tests follow Python: `none` is not iterable, strings are
    // sequences, booleans are numbers. minijinja's differ on exactly those.
    env.add_test("iterable", |value: Value| {
        matches!(
            value.kind(),
            ValueKind::Undefined
                | ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
                | ValueKind::Iterable
        )
    });
    env.add_test("sequence", |value: Value| {
        matches!(
            value.kind(),
            ValueKind::Undefined
                | ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
        )
    });
    env.add_test("number", |value: Value| {
        matches!(value.kind(), ValueKind::Number | ValueKind::Bool)
    });
    env.add_function(
        "raise_exception",
        |message: Value| -> Result<Value, Error> {
            let message = python_str(&message);
            Err(Error::new(ErrorKind::InvalidOperation, message.clone())
                .with_source(RaisedByTemplate(message)))
        },
    );
    env.add_function(GENERATION_MACRO, |state: &State, kwargs: Kwargs| {
        let caller: Value = kwargs.get("caller")?;
        kwargs.assert_all_used()?;
        caller.call(state, &[])
    });
    add_strftime_now(&mut env, clock);
    env
}

/// `strftime_now(format)`: transformers' `datetime.now().strftime(format)`,
/// a naive local time.
fn add_strftime_now(env: &mut Environment<'static>, clock: Clock) {
    env.add_function(
        "strftime_now",
        move |format: &str| -> Result<String, Error> {
            let now = match clock {
                Clock::System => chrono::Local::now().naive_local(),
                Clock::Fixed(now) => now,
            };
            python_strftime(now, format)
        },
    );
}
