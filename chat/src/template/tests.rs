//! Tests of the chat template: ChatML, the transformers context, Python behaviour, tokenizer configs.

use super::pycompat::python_float_repr;
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
    let template = ChatTemplate::new(TemplateSource::Model, "{{ messages[0].x.y }}", None, None)
        .expect("compiles");
    let error = template
        .render(&[json!({"role": "user"})], None, true, None)
        .expect_err("fails");
    assert!(matches!(error, TemplateError::Render(_)), "{error:?}");
}

#[test]
fn syntax_errors_name_the_template_source() {
    let error = ChatTemplate::resolve(Some("{% for %}"), None, None, None).expect_err("invalid");
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
    assert_eq!(
        both.render::<serde_json::Value>(&[], None, false, None)
            .expect("ok"),
        "override"
    );

    let model = ChatTemplate::resolve(None, Some("model"), None, None).expect("ok");
    assert_eq!(model.source(), TemplateSource::Model);
    assert_eq!(
        model
            .render::<serde_json::Value>(&[], None, false, None)
            .expect("ok"),
        "model"
    );

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
        .render::<serde_json::Value>(&[], Some(&[tool]), false, None)
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
    let now =
        NaiveDateTime::parse_from_str("2025-03-04 05:06:07", "%Y-%m-%d %H:%M:%S").expect("valid");
    let template = ChatTemplate::new(
        TemplateSource::Model,
        "{{ strftime_now('%d %B %Y|%b %-d|%H:%M:%S.%f|%Z%z|%%') }}",
        None,
        None,
    )
    .expect("compiles")
    .with_fixed_now(now);
    assert_eq!(
        template
            .render::<serde_json::Value>(&[], None, false, None)
            .expect("renders"),
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
    assert!(TokenizerConfig::from_json_str(r#"{"chat_template": [{"name": "default"}]}"#).is_err());
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

    let missing =
        ChatTemplate::from_tokenizer_config(&dir.path().join("nope.json")).expect_err("missing");
    assert_eq!(missing.metric_label(), "config");
}
