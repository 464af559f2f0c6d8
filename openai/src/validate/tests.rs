//! Tests of request validation: every refusal names its field and limit; messages are typed as sent.

use super::*;
use crate::request::parse;

fn chat_err(body: serde_json::Value) -> ApiError {
    match parse::<ChatRequest>(body.to_string().as_bytes()) {
        Err(e) => e,
        Ok(req) => chat(&req).expect_err("should be refused"),
    }
}

fn msg() -> serde_json::Value {
    serde_json::json!([{"role": "user", "content": "hi"}])
}

#[test]
fn each_range_check_names_its_field_and_limit() {
    let cases = [
        (
            "temperature",
            serde_json::json!(3),
            "`temperature` must be within [0, 2], got 3",
        ),
        (
            "top_p",
            serde_json::json!(1.5),
            "`top_p` must be within [0, 1], got 1.5",
        ),
        (
            "top_k",
            serde_json::json!(-1),
            "`top_k` must be >= 0, got -1",
        ),
        (
            "min_p",
            serde_json::json!(2),
            "`min_p` must be within [0, 1], got 2",
        ),
        (
            "presence_penalty",
            serde_json::json!(-3),
            "`presence_penalty` must be within [-2, 2], got -3",
        ),
        (
            "frequency_penalty",
            serde_json::json!(2.5),
            "`frequency_penalty` must be within [-2, 2], got 2.5",
        ),
        (
            "repetition_penalty",
            serde_json::json!(11),
            "`repetition_penalty` must be within [0, 10], got 11",
        ),
        (
            "max_tokens",
            serde_json::json!(0),
            "`max_tokens` must be >= 1, got 0",
        ),
        (
            "n",
            serde_json::json!(129),
            "`n` must be within [1, 128], got 129",
        ),
        (
            "top_logprobs",
            serde_json::json!(21),
            "`top_logprobs` must be within [0, 20], got 21",
        ),
    ];
    for (field, value, message) in cases {
        let mut body = serde_json::json!({"model": "m", "messages": msg()});
        body[field] = value;
        if field == "top_logprobs" {
            body["logprobs"] = true.into();
        }
        let e = chat_err(body);
        assert_eq!(
            (e.status, e.param.as_deref(), e.message.as_str()),
            (400, Some(field), message)
        );
    }
}

#[test]
fn parameters_the_model_cannot_honour_are_refused() {
    let image = serde_json::json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]);
    let e = chat_err(serde_json::json!({"model": "m", "messages": image}));
    assert!(e.message.contains("text-only"), "{}", e.message);
    let e = chat_err(
        serde_json::json!({"model": "m", "messages": msg(), "response_format": {"type": "xml"}}),
    );
    assert_eq!(e.param.as_deref(), Some("response_format.type"));
    let e = chat_err(serde_json::json!({"model": "m", "messages": msg(), "frobnicate": 1}));
    assert_eq!(
        (e.param.as_deref(), e.code.as_deref()),
        (Some("frobnicate"), Some("unsupported_parameter"))
    );
    let e =
        chat_err(serde_json::json!({"model": "m", "messages": msg(), "tool_choice": "required"}));
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    assert!(e.message.contains("no `tools`"), "{}", e.message);
    let ok = parse::<ChatRequest>(serde_json::json!({"model": "m", "messages": msg(), "response_format": {"type": "text"}, "user": "u", "seed": 3}).to_string().as_bytes()).expect("parse");
    let p = chat(&ok).expect("valid").params;
    assert_eq!(p.sampling.seed, 3);
}

#[test]
fn an_empty_or_whitespace_prompt_is_a_400() {
    let e = chat_err(
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "  \n "}]}),
    );
    assert!(e.message.contains("empty"));
    let e = chat_err(serde_json::json!({"model": "m", "messages": []}));
    assert_eq!(e.param.as_deref(), Some("messages"));
}

#[test]
fn type_errors_name_the_field() {
    let e = chat_err(serde_json::json!({"model": "m", "messages": msg(), "temperature": "hot"}));
    assert_eq!(e.param.as_deref(), Some("temperature"));
    assert!(
        e.message.starts_with("`temperature`: invalid type"),
        "{}",
        e.message
    );
}

#[test]
fn typed_messages_serialize_as_sent_and_tool_arguments_become_objects() {
    let sent = serde_json::json!([
        {"content": "first the content", "role": "user", "name": "u"},
        {"role": "user", "content": [{"text": "a", "type": "text", "cache": 1}]},
        {"role": "assistant", "content": null, "reasoning_content": "r", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "tool_calls": "odd"}
    ]);
    let typed = messages(sent.as_array().expect("array")).expect("valid");
    assert_eq!(
        serde_json::to_string(&typed).expect("json"),
        sent.to_string()
    );
    let body = serde_json::json!({"model": "m", "messages": sent});
    let req = parse::<ChatRequest>(body.to_string().as_bytes()).expect("parse");
    let valid = chat(&req).expect("valid");
    let rendered = serde_json::to_value(&valid.messages).expect("json");
    assert_eq!(
        rendered[2]["tool_calls"][0]["function"]["arguments"],
        serde_json::json!({"x": 1})
    );
    assert_eq!(
        rendered[2]["tool_calls"][1]["function"]["arguments"],
        "not json"
    );
}
