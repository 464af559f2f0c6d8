//! Tests of the tool-call readers: every family's syntax, streamed in pieces of every size, and the
//! forced formats.

use super::auto::*;
use super::forced::*;
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
const TRICKY_ARGS: &str =
    r#"{"q": "a } b ] c \" d \u00e9 \\", "nested": {"list": [1, {"x": "}"}], "e": {}}, "n": null}"#;

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
