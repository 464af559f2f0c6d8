//! HTTP → validation → chat template (this) → tokenization → scheduler → engine.
//!
//! Turns a validated OpenAI-shaped conversation into the prompt text the model
//! was trained on, by rendering the model's own Jinja chat template with
//! minijinja. Templates are written and tested against Hugging Face
//! `transformers`, so the environment imitates the one it renders with: Jinja2's
//! `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks` and loop
//! controls, the `raise_exception` and `strftime_now` globals, a
//! `json.dumps`-backed `tojson`, Python string and dict methods, and Python's
//! `str()` for everything a template prints. `node-pod/tests/template_diff.rs`
//! holds this to Jinja2 over llama.cpp's corpus of real templates;
//! `docs/chat-templates.md` has the result and the known differences.
//!
//! Which template is used: a `chat_template` override from the model config,
//! else the model's own (GGUF `tokenizer.chat_template` or `tokenizer_config.json`),
//! else [`CHATML`], the fallback llama-server uses too. [`ChatTemplate::source`]
//! says which one won.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};

use chrono::NaiveDateTime;
use chrono::format::{Item, StrftimeItems};
use minijinja::value::{ArgType, Kwargs, Rest, ValueKind};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, State, UndefinedBehavior, Value};

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
        Ok(ChatTemplate {
            env,
            source,
            bos_token,
            eos_token,
        })
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
    /// `messages` and `tools` are passed through as they are: OpenAI-shaped
    /// messages with string or `[{type: "text", text}]` content, assistant
    /// `tool_calls`, `tool` messages with `tool_call_id`; `tools` are function
    /// specs with JSON-schema parameters. Key order is kept, so `tojson` prints
    /// objects in the order the client sent them.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
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

/// Formats like Python's `datetime.strftime` on a naive datetime. chrono's
/// directives are Python's (C's) with two exceptions handled here: `%f` is
/// microseconds in Python but nanoseconds in chrono, and `%z`/`%Z` are empty
/// for a naive datetime in Python but an error in chrono.
fn python_strftime(now: NaiveDateTime, format: &str) -> Result<String, Error> {
    let mut translated = String::with_capacity(format.len());
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            translated.push(c);
            continue;
        }
        match chars.next() {
            Some('f') => translated.push_str("%6f"),
            Some('z' | 'Z') => {}
            Some(other) => {
                translated.push('%');
                translated.push(other);
            }
            None => translated.push('%'),
        }
    }
    let items: Vec<Item<'_>> = StrftimeItems::new(&translated).collect();
    let invalid = || {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now: invalid format string {format:?}"),
        )
    };
    if items.iter().any(|item| matches!(item, Item::Error)) {
        return Err(invalid());
    }
    let mut out = String::new();
    write!(out, "{}", now.format_with_items(items.iter())).map_err(|_| invalid())?;
    Ok(out)
}

/// transformers' `tojson` filter: `json.dumps(x, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)` with those four options
/// open to the template, positionally or by keyword. Jinja2's own `tojson`
/// (and minijinja's) HTML-escape `<>&'`, which no chat template wants.
fn tojson(value: &Value, args: Rest<Value>) -> Result<Value, Error> {
    let [ensure_ascii, indent, separators, sort_keys] = python_args(
        "tojson",
        args,
        ["ensure_ascii", "indent", "separators", "sort_keys"],
    )?;
    let none = || Value::from(());
    let ensure_ascii = ensure_ascii.unwrap_or_else(none);
    let indent = indent.unwrap_or_else(none);
    let separators = separators.unwrap_or_else(none);
    let sort_keys = sort_keys.unwrap_or_else(none);

    let indent = if indent.is_none() || indent.is_undefined() {
        None
    } else if let Some(text) = indent.as_str() {
        Some(text.to_owned())
    } else if let Some(width) = indent.as_i64() {
        // Python: `' ' * indent`, so a negative width means no indentation.
        Some(" ".repeat(usize::try_from(width).unwrap_or(0)))
    } else if indent.kind() == ValueKind::Bool {
        Some(if indent.is_true() { " " } else { "" }.to_owned())
    } else {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: indent must be an integer or a string, not {}",
                indent.kind()
            ),
        ));
    };
    let (item_separator, key_separator) = if separators.is_none() || separators.is_undefined() {
        let item = if indent.is_some() { "," } else { ", " };
        (item.to_owned(), ": ".to_owned())
    } else {
        let parts: Vec<Value> = separators.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => (
                item.as_str().unwrap_or_default().to_owned(),
                key.as_str().unwrap_or_default().to_owned(),
            ),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings",
                ));
            }
        }
    };
    let dumper = JsonDumps {
        ensure_ascii: ensure_ascii.is_true(),
        indent,
        item_separator,
        key_separator,
        sort_keys: sort_keys.is_true(),
    };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(Value::from(out))
}

/// Binds a filter's arguments the way Python binds `def f(value, a=None,
/// b=None, ...)`: positionally in order, or by keyword, each at most once,
/// no unknown keywords.
fn python_args<const N: usize>(
    filter: &str,
    args: Rest<Value>,
    names: [&str; N],
) -> Result<[Option<Value>; N], Error> {
    let mut args = args.0;
    let kwargs = match args.last() {
        Some(last) if last.is_kwargs() => {
            let kwargs = Kwargs::from_value(Some(last))?;
            args.pop();
            kwargs
        }
        _ => Kwargs::from_value(None)?,
    };
    if args.len() > N {
        return Err(Error::new(
            ErrorKind::TooManyArguments,
            format!("{filter} takes at most {N} arguments, got {}", args.len()),
        ));
    }
    let positional = args.len();
    let mut bound: [Option<Value>; N] = std::array::from_fn(|_| None);
    for (slot, arg) in bound.iter_mut().zip(args) {
        *slot = Some(arg);
    }
    for (index, name) in names.iter().enumerate() {
        if let Some(arg) = kwargs.get::<Option<Value>>(name)? {
            if index < positional {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{filter} got multiple values for argument {name:?}"),
                ));
            }
            bound[index] = Some(arg);
        }
    }
    kwargs.assert_all_used()?;
    Ok(bound)
}

/// Jinja2's `join(value, d='', attribute=None)`: `str()` of every item (of
/// `item[attribute]` when given, a dotted path), joined by `d`.
fn join(value: &Value, args: Rest<Value>) -> Result<String, Error> {
    let [separator, attribute] = python_args("join", args, ["d", "attribute"])?;
    let separator = separator.map(|d| python_str(&d)).unwrap_or_default();
    let attribute = attribute.map(|a| python_str(&a));
    if matches!(
        value.kind(),
        ValueKind::None | ValueKind::Number | ValueKind::Bool
    ) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("join: {} is not iterable", value.kind()),
        ));
    }
    let mut out = String::new();
    for (index, item) in value.try_iter()?.enumerate() {
        if index > 0 {
            out.push_str(&separator);
        }
        let item = match &attribute {
            Some(path) => {
                path.split('.')
                    .try_fold(item, |item, part| match part.parse::<i64>() {
                        Ok(index) => item.get_item(&Value::from(index)),
                        Err(_) => item.get_item(&Value::from(part)),
                    })?
            }
            None => item,
        };
        out.push_str(&python_str(&item));
    }
    Ok(out)
}

/// Python's `str.strip(chars)`: whitespace by Python's definition (which
/// adds U+001C..U+001F to Unicode's) when `chars` is `None`.
fn python_strip(text: &str, chars: Option<&str>) -> String {
    match chars {
        Some(chars) => text.trim_matches(|c| chars.contains(c)).to_owned(),
        None => text
            .trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
            .to_owned(),
    }
}

/// Python's `json.dumps` over template values, byte for byte: its
/// separators and indentation, `float.__repr__` numbers, `NaN`/`Infinity`,
/// and its string escaping (with or without `ensure_ascii`). serde_json
/// differs on all of those, hence our own writer.
struct JsonDumps {
    ensure_ascii: bool,
    indent: Option<String>,
    item_separator: String,
    key_separator: String,
    sort_keys: bool,
}

impl JsonDumps {
    fn dump(&self, value: &Value, level: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => out.push_str(&json_number(value)),
            ValueKind::String => self.dump_str(value.as_str().unwrap_or_default(), out),
            // Python's generators (`map`, `select`, `dict.items()`, ...) are
            // not serializable; minijinja's lazy iterables stand for them.
            ValueKind::Seq => {
                let items: Vec<Value> = value.try_iter()?.collect();
                self.dump_container(out, level, '[', ']', &items, |item, level, out| {
                    self.dump(item, level, out)
                })?;
            }
            ValueKind::Map => {
                let mut entries: Vec<(String, Value)> = Vec::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    entries.push((json_key(&key)?, item));
                }
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(&b.0));
                }
                self.dump_container(out, level, '{', '}', &entries, |(key, item), level, out| {
                    self.dump_str(key, out);
                    out.push_str(&self.key_separator);
                    self.dump(item, level, out)
                })?;
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: object of type {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }

    fn dump_container<T>(
        &self,
        out: &mut String,
        level: usize,
        open: char,
        close: char,
        items: &[T],
        mut dump_item: impl FnMut(&T, usize, &mut String) -> Result<(), Error>,
    ) -> Result<(), Error> {
        out.push(open);
        if items.is_empty() {
            out.push(close);
            return Ok(());
        }
        for (index, item) in items.iter().enumerate() {
            if index > 0 {
                out.push_str(&self.item_separator);
            }
            if let Some(indent) = &self.indent {
                out.push('\n');
                out.push_str(&indent.repeat(level + 1));
            }
            dump_item(item, level + 1, out)?;
        }
        if let Some(indent) = &self.indent {
            out.push('\n');
            out.push_str(&indent.repeat(level));
        }
        out.push(close);
        Ok(())
    }

    fn dump_str(&self, text: &str, out: &mut String) {
        out.push('"');
        for c in text.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if c < ' ' => push_u_escape(out, c as u32),
                // ensure_ascii escapes everything outside ' '..='~', as
                // UTF-16 code units.
                c if self.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        push_u_escape(out, u32::from(*unit));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

fn push_u_escape(out: &mut String, unit: u32) {
    let _ = write!(out, "\\u{unit:04x}");
}

/// A mapping key as `json.dumps` writes it: strings as they are; numbers,
/// booleans and None converted; anything else is a TypeError in Python.
fn json_key(key: &Value) -> Result<String, Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_owned()),
        ValueKind::Number => Ok(json_number(key)),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_owned()),
        ValueKind::None => Ok("null".to_owned()),
        kind => Err(Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

fn json_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(float) if float.is_nan() => "NaN".to_owned(),
        Ok(float) if float.is_infinite() => {
            if float > 0.0 { "Infinity" } else { "-Infinity" }.to_owned()
        }
        Ok(float) => python_float_repr(float),
        Err(_) => value.to_string(),
    }
}

/// Python's `str(value)`, which is what Jinja2 prints for `{{ value }}` and
/// what `|string` returns: `None`, `True`, `1.0`, `1e-05`, and containers as
/// their `repr` (`['a', 1]`, `{'k': 'v'}`). minijinja would print containers
/// with double quotes and floats with Rust's formatting.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => python_repr(value),
    }
}

/// Python's `repr(value)`, for values inside printed containers.
fn python_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::Undefined => "Undefined".to_owned(),
        ValueKind::None => "None".to_owned(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_owned(),
        ValueKind::Number => {
            if value.is_integer() {
                value.to_string()
            } else {
                f64::try_from(value.clone())
                    .map(python_float_repr)
                    .unwrap_or_else(|_| value.to_string())
            }
        }
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq => match value.try_iter() {
            Ok(items) => {
                let items: Vec<String> = items.map(|item| python_repr(&item)).collect();
                format!("[{}]", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let entries: Vec<String> = keys
                    .map(|key| {
                        let item = value.get_item(&key).unwrap_or_default();
                        format!("{}: {}", python_repr(&key), python_repr(&item))
                    })
                    .collect();
                format!("{{{}}}", entries.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Python's `float.__repr__`: the shortest digits that round-trip (Rust's
/// `{:e}` finds the same ones), in positional notation for exponents -4..16
/// and scientific (`1e-05`, `1.5e+16`) outside.
fn python_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".to_owned();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.to_owned();
    }
    let sign = if value.is_sign_negative() { "-" } else { "" };
    if value == 0.0 {
        return format!("{sign}0.0");
    }
    let scientific = format!("{:e}", value.abs());
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    // The decimal point sits `point` digits into `digits`.
    let point = exponent + 1;
    let body = if !(-3..=16).contains(&point) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        format!("{first}{fraction}e{exponent_sign}{:02}", exponent.abs())
    } else if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else {
        let point = point as usize;
        if point >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point - digits.len()))
        } else {
            format!("{}.{}", &digits[..point], &digits[point..])
        }
    };
    format!("{sign}{body}")
}

/// Python's `repr(str)`: single quotes unless the text has a single quote
/// and no double one; backslash escapes for the quote, `\\`, `\t`, `\n`,
/// `\r` and unprintable characters. "Unprintable" follows Python for
/// control, separator and common format characters; unassigned code points
/// (which Python also escapes) print as they are.
fn python_str_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for c in text.chars() {
        match c {
            c if c == quote || c == '\\' => {
                out.push('\\');
                out.push(c);
            }
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if python_printable(c) => out.push(c),
            c if (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if (c as u32) < 0x10000 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
        }
    }
    out.push(quote);
    out
}

fn python_printable(c: char) -> bool {
    let code = c as u32;
    if c == ' ' {
        return true;
    }
    !(c.is_control()
        || c.is_whitespace()
        || matches!(code,
            0xad | 0x600..=0x605 | 0x61c | 0x6dd | 0x70f | 0x180e
            | 0x200b..=0x200f | 0x202a..=0x202e | 0x2060..=0x2064 | 0x2066..=0x206f
            | 0xd800..=0xf8ff | 0xfeff | 0xfff9..=0xfffb
            | 0xe0001 | 0xe0020..=0xe007f | 0xf0000..=0x10ffff))
}

/// The chat-template parts of a Hugging Face `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The template transformers uses when none is named: `chat_template`
    /// when it is a string, its `"default"` entry when it is a list of
    /// `{name, template}`.
    pub chat_template: Option<String>,
    /// Every entry of the list form by name (`"default"`, `"tool_use"`,
    /// `"rag"`, ...); empty for the string form.
    pub named_templates: BTreeMap<String, String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl TokenizerConfig {
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        let text = std::fs::read_to_string(path).map_err(|error| TemplateError::ReadConfig {
            path: path.to_owned(),
            error,
        })?;
        Self::from_json_str(&text).map_err(|reason| TemplateError::InvalidConfig {
            path: path.to_owned(),
            reason,
        })
    }

    /// Parses the config text; the error says which field is malformed.
    pub fn from_json_str(text: &str) -> Result<Self, String> {
        let config: serde_json::Value =
            serde_json::from_str(text).map_err(|error| format!("not JSON: {error}"))?;
        let Some(config) = config.as_object() else {
            return Err("not a JSON object".to_owned());
        };

        let mut named_templates = BTreeMap::new();
        let chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(template)) => Some(template.clone()),
            Some(serde_json::Value::Array(entries)) => {
                for entry in entries {
                    let name = entry.get("name").and_then(serde_json::Value::as_str);
                    let template = entry.get("template").and_then(serde_json::Value::as_str);
                    let (Some(name), Some(template)) = (name, template) else {
                        return Err(
                            "`chat_template` entries must be {\"name\": string, \"template\": string}"
                                .to_owned(),
                        );
                    };
                    named_templates.insert(name.to_owned(), template.to_owned());
                }
                named_templates.get("default").cloned()
            }
            Some(_) => {
                return Err(
                    "`chat_template` must be a string or a list of {name, template}".to_owned(),
                );
            }
        };

        Ok(TokenizerConfig {
            chat_template,
            named_templates,
            bos_token: special_token(config, "bos_token")?,
            eos_token: special_token(config, "eos_token")?,
        })
    }

    /// A named template of the list form, e.g. `"tool_use"`.
    pub fn named(&self, name: &str) -> Option<&str> {
        self.named_templates.get(name).map(String::as_str)
    }
}

/// A special token is a string or an `AddedToken` object (`{"content": ...}`).
fn special_token(
    config: &serde_json::Map<String, serde_json::Value>,
    field: &str,
) -> Result<Option<String>, String> {
    match config.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(token)) => Ok(Some(token.clone())),
        Some(token) => match token.get("content").and_then(serde_json::Value::as_str) {
            Some(content) => Ok(Some(content.to_owned())),
            None => Err(format!(
                "`{field}` must be a string or an AddedToken object with a string `content`"
            )),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chatml() -> ChatTemplate {
        ChatTemplate::resolve(None, None, None, None).expect("ChatML compiles")
    }

    fn render(template: &ChatTemplate, messages: serde_json::Value, agp: bool) -> String {
        let messages = messages.as_array().expect("an array").clone();
        template
            .render(&messages, None, agp, None)
            .expect("renders")
    }

    #[test]
    fn chatml_default_renders_like_llama_server() {
        let template = chatml();
        assert_eq!(template.source(), TemplateSource::DefaultChatml);
        let messages = json!([
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]);
        assert_eq!(
            render(&template, messages.clone(), true),
            "<|im_start|>system\nYou are terse.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n\
             <|im_start|>user\nBye<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        assert_eq!(
            render(&template, messages, false),
            "<|im_start|>system\nYou are terse.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n\
             <|im_start|>user\nBye<|im_end|>\n"
        );
    }

    #[test]
    fn chatml_default_renders_text_parts_and_keeps_whitespace() {
        let messages = json!([
            {"role": "user", "content": [
                {"type": "text", "text": "  two\n"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "parts "},
            ]},
        ]);
        assert_eq!(
            render(&chatml(), messages, true),
            "<|im_start|>user\n  two\nparts <|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_surfaces_the_templates_message() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}",
            None,
            None,
        )
        .expect("compiles");
        let error = template
            .render(
                &[json!({"role": "system", "content": "x"})],
                None,
                true,
                None,
            )
            .expect_err("raises");
        assert!(
            matches!(&error, TemplateError::Raised(message) if message == "System role not supported"),
            "{error:?}"
        );
        assert_eq!(error.metric_label(), "raised");
        assert_eq!(
            error.to_string(),
            "the chat template rejected the conversation: System role not supported"
        );
    }

    #[test]
    fn engine_errors_are_render_errors_not_raised() {
        let template =
            ChatTemplate::new(TemplateSource::Model, "{{ messages[0].x.y }}", None, None)
                .expect("compiles");
        let error = template
            .render(&[json!({"role": "user"})], None, true, None)
            .expect_err("fails");
        assert!(matches!(error, TemplateError::Render(_)), "{error:?}");
    }

    #[test]
    fn syntax_errors_name_the_template_source() {
        let error =
            ChatTemplate::resolve(Some("{% for %}"), None, None, None).expect_err("invalid");
        assert!(
            matches!(
                error,
                TemplateError::Syntax {
                    origin: TemplateSource::Override,
                    ..
                }
            ),
            "{error:?}"
        );
        assert!(
            error
                .to_string()
                .starts_with("the override chat template does not compile")
        );
    }

    #[test]
    fn override_wins_over_model_template_which_wins_over_chatml() {
        let both = ChatTemplate::resolve(Some("override"), Some("model"), None, None).expect("ok");
        assert_eq!(both.source(), TemplateSource::Override);
        assert_eq!(both.render(&[], None, false, None).expect("ok"), "override");

        let model = ChatTemplate::resolve(None, Some("model"), None, None).expect("ok");
        assert_eq!(model.source(), TemplateSource::Model);
        assert_eq!(model.render(&[], None, false, None).expect("ok"), "model");

        assert_eq!(chatml().source(), TemplateSource::DefaultChatml);
        assert_eq!(TemplateSource::Override.as_str(), "override");
        assert_eq!(TemplateSource::Model.as_str(), "model");
        assert_eq!(TemplateSource::DefaultChatml.as_str(), "default-chatml");
    }

    #[test]
    fn context_has_transformers_variables_and_extra_kwargs() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ documents }}|{{ add_generation_prompt }}|{{ enable_thinking }}|{{ messages | length }}",
            Some("<s>".into()),
            Some("</s>".into()),
        )
        .expect("compiles");
        let extra = json!({"enable_thinking": false, "messages": "ignored"});
        let out = template
            .render(
                &[json!({"role": "user", "content": "x"})],
                None,
                true,
                extra.as_object(),
            )
            .expect("renders");
        assert_eq!(out, "<s>|</s>|None|None|True|False|1");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{{ tools[0] | tojson }}\n{{ tools[0] | tojson(indent=2) }}\n{{ tools[0] | tojson(sort_keys=true, separators=[',', ':']) }}\n{{ tools[0].name | tojson(ensure_ascii=true) }}",
            None,
            None,
        )
        .expect("compiles");
        let tool = json!({"name": "é<&>'\"\u{1F600}", "b": [1, 2.5, 1e-7, 1e16, true, null], "a": {}, "c": []});
        let out = template
            .render(&[], Some(&[tool]), false, None)
            .expect("renders");
        assert_eq!(
            out,
            "{\"name\": \"é<&>'\\\"\u{1F600}\", \"b\": [1, 2.5, 1e-07, 1e+16, true, null], \"a\": {}, \"c\": []}\n\
             {\n  \"name\": \"é<&>'\\\"\u{1F600}\",\n  \"b\": [\n    1,\n    2.5,\n    1e-07,\n    1e+16,\n    true,\n    null\n  ],\n  \"a\": {},\n  \"c\": []\n}\n\
             {\"a\":{},\"b\":[1,2.5,1e-07,1e+16,true,null],\"c\":[],\"name\":\"é<&>'\\\"\u{1F600}\"}\n\
             \"\\u00e9<&>'\\\"\\ud83d\\ude00\""
        );
    }

    #[test]
    fn printing_follows_python_str() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{{ messages[0] }}|{{ messages[0].content }}|{{ 1.0 }}|{{ 0.1 + 0.2 }}|{{ none }}|{{ true }}|{{ [1, 'it\\'s'] | string }}",
            None,
            None,
        )
        .expect("compiles");
        let out = template
            .render(
                &[json!({"role": "assistant", "content": null, "n": [1.5, "a\nb"]})],
                None,
                false,
                None,
            )
            .expect("renders");
        assert_eq!(
            out,
            "{'role': 'assistant', 'content': None, 'n': [1.5, 'a\\nb']}|None|1.0|0.30000000000000004|None|True|[1, \"it's\"]"
        );
    }

    #[test]
    fn python_float_repr_matches_python() {
        for (value, repr) in [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (123456.789, "123456.789"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (5e-324, "5e-324"),
            (-2.5, "-2.5"),
        ] {
            assert_eq!(python_float_repr(value), repr, "{value}");
        }
    }

    #[test]
    fn strftime_now_uses_python_directives_and_the_fixed_clock() {
        let now = NaiveDateTime::parse_from_str("2025-03-04 05:06:07", "%Y-%m-%d %H:%M:%S")
            .expect("valid");
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{{ strftime_now('%d %B %Y|%b %-d|%H:%M:%S.%f|%Z%z|%%') }}",
            None,
            None,
        )
        .expect("compiles")
        .with_fixed_now(now);
        assert_eq!(
            template.render(&[], None, false, None).expect("renders"),
            "04 March 2025|Mar 4|05:06:07.000000||%"
        );
    }

    #[test]
    fn python_string_and_dict_methods_work() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{{ messages[0].content.strip().split(' ') | join(',') }}|{{ 'x'.startswith('x') }}|\
             {% for k, v in messages[0].items() %}{{ k }}={{ v | trim }};{% endfor %}|{{ messages[0].get('missing', 'd') }}",
            None,
            None,
        )
        .expect("compiles");
        let out = template
            .render(
                &[json!({"role": "user", "content": "  a b  "})],
                None,
                false,
                None,
            )
            .expect("renders");
        assert_eq!(out, "a,b|True|role=user;content=a b;|d");
    }

    #[test]
    fn tool_calls_and_tool_messages_pass_through() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{% for m in messages %}{{ m.role }}:\
             {% for call in m.tool_calls or [] %}{{ call.function.name }}({{ call.function.arguments }}){% endfor %}\
             {% if m.role == 'tool' %}{{ m.tool_call_id }}={{ m.content }}{% endif %};{% endfor %}\
             {% for tool in tools %}{{ tool.function.name }}{{ tool.function.parameters | tojson }}{% endfor %}",
            None,
            None,
        )
        .expect("compiles");
        let messages = [
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}
            ]}),
            json!({"role": "tool", "tool_call_id": "c1", "content": "ok"}),
        ];
        let tools = [json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}})];
        assert_eq!(
            template
                .render(&messages, Some(&tools), false, None)
                .expect("renders"),
            "assistant:f({\"x\": 1});tool:c1=ok;\
             f{\"type\": \"object\", \"properties\": {\"x\": {\"type\": \"integer\"}}}"
        );
    }

    #[test]
    fn type_tests_and_string_filters_follow_jinja2() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{{ tools is iterable }} {{ 'ab' is sequence }} {{ true is number }} {{ undefined_var is iterable }}|\
             {{ messages | trim }}|{{ messages | join(', ', attribute='role') }}|{{ [1, none, 'a'] | join('-') }}",
            None,
            None,
        )
        .expect("compiles");
        let out = template
            .render(
                &[json!({"role": "user"}), json!({"role": "assistant"})],
                None,
                false,
                None,
            )
            .expect("renders");
        assert_eq!(
            out,
            "False True True True|[{'role': 'user'}, {'role': 'assistant'}]|user, assistant|1-None-a"
        );
    }

    #[test]
    fn generation_blocks_render_their_body() {
        let template = ChatTemplate::new(
            TemplateSource::Model,
            "{% for m in messages %}{%- generation -%}\n  [{{ m.content }}]{% set local = 1 %}\n{%- endgeneration %}{% endfor %}{{ local is defined }}",
            None,
            None,
        )
        .expect("compiles");
        let messages = [json!({"content": "a"}), json!({"content": "b"})];
        assert_eq!(
            template
                .render(&messages, None, false, None)
                .expect("renders"),
            "[a][b]False"
        );
        // Only the tags are rewritten, not the word elsewhere.
        assert_eq!(
            translate_generation_tags(
                "{{ add_generation_prompt }}{%+ generation %}x{% endgeneration -%}"
            ),
            "{{ add_generation_prompt }}{%+ call __gantry_generation() %}x{% endcall -%}"
        );
    }

    #[test]
    fn tokenizer_config_string_form_with_added_tokens() {
        let config = TokenizerConfig::from_json_str(
            r#"{"chat_template": "{{ bos_token }}", "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
                "eos_token": "</s>", "pad_token": null}"#,
        )
        .expect("valid");
        assert_eq!(config.chat_template.as_deref(), Some("{{ bos_token }}"));
        assert!(config.named_templates.is_empty());
        assert_eq!(config.bos_token.as_deref(), Some("<s>"));
        assert_eq!(config.eos_token.as_deref(), Some("</s>"));
    }

    #[test]
    fn tokenizer_config_list_form_picks_default_and_keeps_named() {
        let config = TokenizerConfig::from_json_str(
            r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
                "bos_token": null}"#,
        )
        .expect("valid");
        assert_eq!(config.chat_template.as_deref(), Some("D"));
        assert_eq!(config.named("tool_use"), Some("T"));
        assert_eq!(config.named("rag"), None);
        assert_eq!(config.bos_token, None);
        assert_eq!(config.eos_token, None);
    }

    #[test]
    fn tokenizer_config_rejects_malformed_fields() {
        assert!(TokenizerConfig::from_json_str(r#"{"chat_template": 3}"#).is_err());
        assert!(
            TokenizerConfig::from_json_str(r#"{"chat_template": [{"name": "default"}]}"#).is_err()
        );
        assert!(TokenizerConfig::from_json_str(r#"{"eos_token": {"id": 2}}"#).is_err());
        assert!(TokenizerConfig::from_json_str("[]").is_err());
    }

    #[test]
    fn from_tokenizer_config_reads_template_and_special_tokens() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokenizer_config.json");
        std::fs::write(
            &path,
            r#"{"chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}", "bos_token": {"content": "<s>"}, "eos_token": "</s>"}"#,
        )
        .expect("write");
        let model = ChatTemplate::from_tokenizer_config(&path).expect("loads");
        assert_eq!(model.source(), TemplateSource::Model);
        assert_eq!(
            model
                .render(
                    &[json!({"role": "user", "content": "hi"})],
                    None,
                    true,
                    None
                )
                .expect("renders"),
            "<s>hi</s>"
        );

        std::fs::write(&path, r#"{"eos_token": "</s>"}"#).expect("write");
        let fallback = ChatTemplate::from_tokenizer_config(&path).expect("loads");
        assert_eq!(fallback.source(), TemplateSource::DefaultChatml);

        let missing = ChatTemplate::from_tokenizer_config(&dir.path().join("nope.json"))
            .expect_err("missing");
        assert_eq!(missing.metric_label(), "config");
    }
}
