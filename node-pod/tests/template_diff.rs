//! HTTP → validation → chat template (tested here) → tokenization: holds
//! `gantry_node::template` to Jinja2, the engine Hugging Face `transformers`
//! renders chat templates with, over llama.cpp's corpus of real templates.
//!
//! Every template × conversation × `add_generation_prompt` is rendered by
//! minijinja here and by `tests/python/template_diff/render_jinja2.py` (one
//! batch, JSON in and out) in transformers' Jinja2 environment; a case passes
//! when both outputs are identical, or when both engines refuse it (the
//! template raised, e.g. "system role not supported"). `strftime_now` sees the
//! same fixed instant on both sides.
//!
//! Needs `GANTRY_TEMPLATES_DIR` (printed by
//! `tests/python/template_diff/fetch_templates.sh`, which `scripts/setup.sh`
//! runs) and `GANTRY_VENV` (a virtualenv with jinja2). Writes the report to
//! `$CARGO_TARGET_DIR/template-diff.json` (default `target/`) and prints a table;
//! docs/chat-templates.md records the result.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, bail};
use gantry_node::http::validate;
use gantry_node::template::{ChatTemplate, TemplateSource};
use serde_json::{Value, json};

/// Templates that must match Jinja2 on every case: the families people serve
/// most. The corpus has no Gemma 3 template; Gemma 2 and Gemma 4 stand in.
const MUST_MATCH: &[&str] = &[
    "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja",
    "Qwen-Qwen2.5-7B-Instruct.jinja",
    "Qwen-QwQ-32B.jinja",
    "Qwen-Qwen3-0.6B.jinja",
    "Qwen3-Coder.jinja",
    "google-gemma-2-2b-it.jinja",
    "google-gemma-4-31B-it.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "unsloth-mistral-Devstral-Small-2507.jinja",
    "microsoft-Phi-3.5-mini-instruct.jinja",
];

/// Floors measured on llama-cpp-python 0.3.36's corpus (see
/// docs/chat-templates.md): a template passes when all its cases do. Raise
/// them when the pass rate improves; a drop below is a regression.
const MIN_TEMPLATE_PASS_RATE: f64 = 65.0 / 70.0;
const MIN_CASE_PASS_RATE: f64 = 1618.0 / 1680.0;

/// What `strftime_now()` returns on both sides.
const FIXED_NOW: &str = "2025-03-14T09:26:53";
const BOS: &str = "<s>";
const EOS: &str = "</s>";

struct Conversation {
    name: &'static str,
    messages: Value,
    tools: Option<Value>,
    extra: Option<Value>,
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "description": "City name, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
            }, "required": ["city"]}
        }},
        {"type": "function", "function": {
            "name": "search_docs",
            "description": "Search the docs — «recherche» 文档 <b>&'\"</b>",
            "parameters": {"type": "object", "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "minimum": 1, "default": 5},
                "threshold": {"type": "number", "default": 0.5}
            }, "required": ["query"]}
        }}
    ])
}

/// The conversations every template renders: what OpenAI clients send.
fn conversations() -> Vec<Conversation> {
    let system = json!({"role": "system", "content": "You are a helpful assistant."});
    let user = json!({"role": "user", "content": "What is the capital of France?"});
    let assistant = json!({"role": "assistant", "content": "The capital of France is Paris."});
    let user2 = json!({"role": "user", "content": "And of Germany?"});
    let ask_weather = json!({"role": "user", "content": "What's the weather in Paris?"});
    let tool_result = json!({"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
                             "content": "{\"temperature\": 21, \"unit\": \"celsius\"}"});
    vec![
        Conversation {
            name: "user",
            messages: json!([{"role": "user", "content": "Hello! How are you?"}]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "system",
            messages: json!([system, user]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "multi_turn",
            messages: json!([system, user, assistant, user2]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "multi_turn_no_system",
            messages: json!([user, assistant, user2]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "content_parts",
            messages: json!([system, {"role": "user", "content": [
                {"type": "text", "text": "Describe this:"},
                {"type": "text", "text": " a red apple."}
            ]}]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "unicode",
            messages: json!([{"role": "user",
                "content": "Ünïcödé — 日本語 \"quoted\" 'single' <b>&amp;</b> \\ back\ttab\nnew line 😀"}]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "tools",
            messages: json!([system, ask_weather]),
            tools: Some(tools()),
            extra: None,
        },
        // As OpenAI clients send it: `content: null`, arguments a JSON
        // string, two calls in parallel.
        Conversation {
            name: "tool_calls",
            messages: json!([system, ask_weather,
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                    {"id": "call_2", "type": "function",
                     "function": {"name": "search_docs", "arguments": "{\"query\": \"météo\", \"limit\": 2}"}}
                ]},
                tool_result,
                {"role": "tool", "tool_call_id": "call_2", "name": "search_docs", "content": "[]"}]),
            tools: Some(tools()),
            extra: None,
        },
        // As transformers documents it (and llama-server/vLLM pass it after
        // parsing): arguments an object, empty content.
        Conversation {
            name: "tool_calls_object_args",
            messages: json!([ask_weather,
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
                ]},
                tool_result,
                {"role": "assistant", "content": "It is 21 °C in Paris."},
                user2]),
            tools: Some(tools()),
            extra: None,
        },
        Conversation {
            name: "reasoning_content",
            messages: json!([user,
                {"role": "assistant", "content": "The capital of France is Paris.",
                 "reasoning_content": "The user asks for a capital; it is Paris."},
                user2]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "assistant_last",
            messages: json!([user, {"role": "assistant", "content": "The capital of France is"}]),
            tools: None,
            extra: None,
        },
        Conversation {
            name: "template_kwargs",
            messages: json!([system, user]),
            tools: None,
            // Model-specific kwargs: Qwen 3's thinking switch, gpt-oss's
            // effort, firefunction's `functions` and `datetime`.
            extra: Some(json!({
                "enable_thinking": false,
                "reasoning_effort": "low",
                "functions": "[{\"name\": \"get_weather\", \"parameters\": {\"type\": \"object\"}}]",
                "datetime": "2025-03-14 09:26",
            })),
        },
    ]
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    Rendered(String),
    Refused(String),
}

struct Case {
    id: String,
    template: String,
    conversation: &'static str,
    add_generation_prompt: bool,
    ours: Outcome,
}

#[test]
fn minijinja_renders_the_template_corpus_like_jinja2() -> anyhow::Result<()> {
    let dir = templates_dir()?;
    let python = venv_python()?;
    let templates = load_templates(&dir)?;
    let now = chrono::NaiveDateTime::parse_from_str(FIXED_NOW, "%Y-%m-%dT%H:%M:%S")?;

    let conversations = conversations();
    let mut cases = Vec::new();
    let mut requests = Vec::new();
    for (name, source) in &templates {
        let compiled = ChatTemplate::new(
            TemplateSource::Model,
            source,
            Some(BOS.to_owned()),
            Some(EOS.to_owned()),
        )
        .map(|t| t.with_fixed_now(now));
        for conversation in &conversations {
            for add_generation_prompt in [true, false] {
                let id = format!("{name}/{}/agp={add_generation_prompt}", conversation.name);
                let messages = conversation.messages.as_array().context("messages")?;
                // Typed by validation, as the node renders a request.
                let typed = validate::messages(messages).map_err(|e| anyhow::anyhow!("{e}"))?;
                let tools = conversation.tools.as_ref().and_then(Value::as_array);
                let extra = conversation.extra.as_ref().and_then(Value::as_object);
                let ours = match &compiled {
                    Err(error) => Outcome::Refused(error.to_string()),
                    Ok(template) => {
                        match template.render(
                            &typed,
                            tools.map(Vec::as_slice),
                            add_generation_prompt,
                            extra,
                        ) {
                            Ok(text) => Outcome::Rendered(text),
                            Err(error) => Outcome::Refused(error.to_string()),
                        }
                    }
                };
                requests.push(json!({
                    "id": id, "template": name, "messages": messages, "tools": tools,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": BOS, "eos_token": EOS, "extra": extra,
                }));
                cases.push(Case {
                    id,
                    template: name.clone(),
                    conversation: conversation.name,
                    add_generation_prompt,
                    ours,
                });
            }
        }
    }

    let (jinja2_version, theirs) = render_with_jinja2(&python, &templates, &requests)?;

    let mut per_template: BTreeMap<&str, TemplateResult> = BTreeMap::new();
    for case in &cases {
        let result = per_template.entry(&case.template).or_default();
        result.total += 1;
        let reference = theirs
            .get(&case.id)
            .with_context(|| format!("Jinja2 returned no result for {}", case.id))?;
        match compare(&case.ours, reference) {
            Verdict::Same => result.passed += 1,
            Verdict::BothRefuse => {
                result.passed += 1;
                result.both_refuse += 1;
            }
            Verdict::Differ(mut failure) => {
                failure["conversation"] = json!(case.conversation);
                failure["add_generation_prompt"] = json!(case.add_generation_prompt);
                result.failures.push(failure);
            }
        }
    }

    let total_cases = cases.len();
    let passed_cases: usize = per_template.values().map(|r| r.passed).sum();
    let passed_templates = per_template
        .values()
        .filter(|r| r.passed == r.total)
        .count();
    let template_rate = passed_templates as f64 / per_template.len() as f64;
    let case_rate = passed_cases as f64 / total_cases as f64;

    println!(
        "\n{:<58} {:>7} {:>7}  failures",
        "template", "pass", "refused"
    );
    for (name, result) in &per_template {
        let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
        for failure in &result.failures {
            *kinds
                .entry(failure["kind"].as_str().unwrap_or_default())
                .or_default() += 1;
        }
        let kinds: Vec<String> = kinds
            .iter()
            .map(|(kind, n)| format!("{n}× {kind}"))
            .collect();
        println!(
            "{name:<58} {:>7} {:>7}  {}",
            format!("{}/{}", result.passed, result.total),
            result.both_refuse,
            kinds.join(", ")
        );
    }
    println!(
        "\ntemplates passing: {passed_templates}/{} ({:.1} %); cases passing: {passed_cases}/{total_cases} ({:.1} %); Jinja2 {jinja2_version}",
        per_template.len(),
        template_rate * 100.0,
        case_rate * 100.0
    );

    let report = json!({
        "corpus": dir,
        "jinja2": jinja2_version,
        "fixed_now": FIXED_NOW,
        "templates_passing": passed_templates,
        "templates_total": per_template.len(),
        "cases_passing": passed_cases,
        "cases_total": total_cases,
        "templates": per_template.iter().map(|(name, r)| json!({
            "template": name, "passed": r.passed, "total": r.total,
            "both_refuse": r.both_refuse, "failures": r.failures,
        })).collect::<Vec<_>>(),
    });
    let report_path = report_path();
    if let Some(parent) = report_path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&report_path, serde_json::to_string_pretty(&report)?)?;
    println!("report: {}", report_path.display());

    let mut problems = Vec::new();
    for name in MUST_MATCH {
        match per_template.get(name) {
            None => problems.push(format!("{name} is not in the corpus")),
            Some(r) if r.passed != r.total => problems.push(format!(
                "{name} must match Jinja2 on every case; {}/{} do; first failure: {}",
                r.passed,
                r.total,
                serde_json::to_string_pretty(&r.failures[0])?
            )),
            Some(_) => {}
        }
    }
    if template_rate < MIN_TEMPLATE_PASS_RATE {
        problems.push(format!(
            "template pass rate {template_rate:.3} fell below the floor {MIN_TEMPLATE_PASS_RATE}"
        ));
    }
    if case_rate < MIN_CASE_PASS_RATE {
        problems.push(format!(
            "case pass rate {case_rate:.3} fell below the floor {MIN_CASE_PASS_RATE}"
        ));
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("\n"));
    }
    Ok(())
}

#[derive(Default)]
struct TemplateResult {
    passed: usize,
    total: usize,
    /// Passing cases where both engines refused the conversation.
    both_refuse: usize,
    failures: Vec<Value>,
}

enum Verdict {
    Same,
    BothRefuse,
    Differ(Value),
}

fn compare(ours: &Outcome, reference: &Value) -> Verdict {
    let their_ok = reference["ok"].as_bool().unwrap_or(false);
    match ours {
        Outcome::Rendered(text) if their_ok => {
            let expected = reference["output"].as_str().unwrap_or_default();
            if text == expected {
                return Verdict::Same;
            }
            Verdict::Differ({
                let at = text
                    .char_indices()
                    .zip(expected.chars())
                    .find(|((_, a), b)| a != b)
                    .map_or(text.len().min(expected.len()), |((i, _), _)| i);
                let at = floor_char_boundary(text, at).min(floor_char_boundary(expected, at));
                json!({
                    "kind": "output differs",
                    "at_byte": at,
                    "minijinja": excerpt(text, at),
                    "jinja2": excerpt(expected, at),
                })
            })
        }
        Outcome::Refused(_) if !their_ok => Verdict::BothRefuse,
        Outcome::Rendered(_) => Verdict::Differ(json!({
            "kind": "only Jinja2 refuses",
            "jinja2": reference["error"],
        })),
        Outcome::Refused(error) => Verdict::Differ(json!({
            "kind": "only minijinja refuses",
            "minijinja": error,
        })),
    }
}

fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

fn excerpt(text: &str, at: usize) -> String {
    let start = floor_char_boundary(text, at.saturating_sub(60));
    let end = floor_char_boundary(text, at + 80);
    text[start..end].to_owned()
}

fn templates_dir() -> anyhow::Result<PathBuf> {
    let Some(dir) = std::env::var_os("GANTRY_TEMPLATES_DIR") else {
        bail!(
            "GANTRY_TEMPLATES_DIR is not set: run `eval \"$(scripts/setup.sh)\"`, or set it to the \
             directory `tests/python/template_diff/fetch_templates.sh` prints"
        );
    };
    let dir = PathBuf::from(dir);
    if !dir.is_dir() {
        bail!(
            "GANTRY_TEMPLATES_DIR={} is not a directory: run tests/python/template_diff/fetch_templates.sh",
            dir.display()
        );
    }
    Ok(dir)
}

fn venv_python() -> anyhow::Result<PathBuf> {
    let Some(venv) = std::env::var_os("GANTRY_VENV") else {
        bail!(
            "GANTRY_VENV is not set: run `eval \"$(scripts/setup.sh)\"` (a virtualenv with jinja2)"
        );
    };
    let python = Path::new(&venv).join("bin").join("python");
    if !python.is_file() {
        bail!("{} does not exist: run scripts/setup.sh", python.display());
    }
    Ok(python)
}

fn load_templates(dir: &Path) -> anyhow::Result<BTreeMap<String, String>> {
    let mut templates = BTreeMap::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "jinja") {
            let name = path
                .file_name()
                .context("file name")?
                .to_string_lossy()
                .into_owned();
            let source = std::fs::read_to_string(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            templates.insert(name, source);
        }
    }
    if templates.is_empty() {
        bail!(
            "{} holds no *.jinja templates: run tests/python/template_diff/fetch_templates.sh",
            dir.display()
        );
    }
    Ok(templates)
}

fn render_with_jinja2(
    python: &Path,
    templates: &BTreeMap<String, String>,
    cases: &[Value],
) -> anyhow::Result<(String, serde_json::Map<String, Value>)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/python/template_diff/render_jinja2.py");
    let request = json!({"now": FIXED_NOW, "templates": templates, "cases": cases});
    let mut child = Command::new(python)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("starting {} {}", python.display(), script.display()))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let body = serde_json::to_vec(&request)?;
    // Write from a thread: the script may answer before it has read it all.
    let writer = std::thread::spawn(move || stdin.write_all(&body));
    let output = child.wait_with_output()?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("writer thread panicked"))??;
    if !output.status.success() {
        bail!("{} failed with {}", script.display(), output.status);
    }
    let mut response: Value =
        serde_json::from_slice(&output.stdout).context("the Jinja2 side's JSON")?;
    let version = response["jinja2"].as_str().unwrap_or("?").to_owned();
    let Value::Object(results) = response["results"].take() else {
        bail!("the Jinja2 side returned no results");
    };
    Ok((version, results))
}

fn report_path() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("template-diff.json")
}
