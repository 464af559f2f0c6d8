//! Chat template, Python compatibility (called while a template renders): Jinja2 and Python
//! behaviour where minijinja's differs in ways a template can print.
//!
//! transformers renders with Jinja2, so a template sees Python: `str()` of
//! what it prints, `json.dumps` behind `tojson`, `datetime.strftime` behind
//! `strftime_now`, `str.strip` behind `trim`. Each shim here imitates one of
//! those exactly; `node-pod/tests/template_diff.rs` holds them to Jinja2.

use std::fmt::Write as _;

use chrono::NaiveDateTime;
use chrono::format::{Item, StrftimeItems};
use minijinja::value::{ArgType, Kwargs, Rest, ValueKind};
use minijinja::{Error, ErrorKind, Value};

/// Formats like Python's `datetime.strftime` on a naive datetime. chrono's
/// directives are Python's (C's) with two exceptions handled here: `%f` is
/// microseconds in Python but nanoseconds in chrono, and `%z`/`%Z` are empty
/// for a naive datetime in Python but an error in chrono.
pub(super) fn python_strftime(now: NaiveDateTime, format: &str) -> Result<String, Error> {
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
pub(super) fn tojson(value: &Value, args: Rest<Value>) -> Result<Value, Error> {
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
pub(super) fn join(value: &Value, args: Rest<Value>) -> Result<String, Error> {
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
pub(super) fn python_strip(text: &str, chars: Option<&str>) -> String {
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
pub(super) fn python_str(value: &Value) -> String {
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
pub(super) fn python_float_repr(value: f64) -> String {
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
