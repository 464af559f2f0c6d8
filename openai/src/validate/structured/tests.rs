//! What shapes the output, validated: `response_format`, tools and `tool_choice`, the vLLM-style extras (validation tests).

use super::*;

fn tool(name: &str, params: Value) -> Value {
    json!({"type": "function", "function": {"name": name, "parameters": params}})
}

#[test]
fn response_formats_map_to_grammars_and_name_their_field() {
    let none = chat_output(
        Some(&json!({"type": "text"})),
        &Extras::default(),
        None,
        None,
        None,
    )
    .expect("present");
    assert_eq!(none.constraint, None);
    let obj = chat_output(
        Some(&json!({"type": "json_object"})),
        &Extras::default(),
        None,
        None,
        None,
    )
    .expect("present");
    assert_eq!(
        obj.constraint.expect("present").spec,
        GrammarSpec::JsonObject
    );
    let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}});
    let s = chat_output(Some(&rf), &Extras::default(), None, None, None).expect("present");
    assert_eq!(
        s.constraint.expect("present").field,
        "response_format.json_schema.schema"
    );
    let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}});
    let e = chat_output(Some(&bad), &Extras::default(), None, None, None).expect_err("refused");
    assert_eq!(
        e.param.as_deref(),
        Some("response_format.json_schema.schema")
    );
    assert!(e.message.contains("`type` at #"), "{}", e.message);
    let nested = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"properties": []}}}}});
    let e = chat_output(Some(&nested), &Extras::default(), None, None, None).expect_err("refused");
    assert!(e.message.contains("#/properties/a"), "{}", e.message);
    let no_name = json!({"type": "json_schema", "json_schema": {"schema": {}}});
    let e = chat_output(Some(&no_name), &Extras::default(), None, None, None).expect_err("refused");
    assert_eq!(e.param.as_deref(), Some("response_format.json_schema.name"));
}

#[test]
fn tool_choice_is_checked_against_the_tools() {
    let tools = [tool("get_weather", json!({"type": "object"}))];
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    let o =
        chat_output(None, &Extras::default(), Some(&tools), Some(&named), None).expect("present");
    assert_eq!(o.tools, ToolMode::Named("get_weather".into()));
    assert_eq!(
        o.constraint.expect("present").field,
        "tools[0].function.parameters"
    );
    let unknown = json!({"type": "function", "function": {"name": "nope"}});
    let e = chat_output(None, &Extras::default(), Some(&tools), Some(&unknown), None)
        .expect_err("refused");
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    assert!(e.message.contains("nope") && e.message.contains("get_weather"));
    let e = chat_output(
        None,
        &Extras::default(),
        None,
        Some(&json!("required")),
        None,
    )
    .expect_err("refused");
    assert_eq!(e.param.as_deref(), Some("tool_choice"));
    let auto = chat_output(None, &Extras::default(), Some(&tools), None, None).expect("present");
    assert_eq!((auto.tools, auto.constraint), (ToolMode::Auto, None));
    let nameless = [json!({"type": "function", "function": {"parameters": {}}})];
    let e =
        chat_output(None, &Extras::default(), Some(&nameless), None, None).expect_err("refused");
    assert_eq!(e.param.as_deref(), Some("tools[0].function.name"));
}

#[test]
fn required_calls_hoist_each_tools_definitions() {
    let tools = [
        tool(
            "a",
            json!({"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}),
        ),
        tool(
            "b",
            json!({"type": "object", "properties": {"p": {"$ref": "#/definitions/P"}}, "definitions": {"P": {"type": "string"}}}),
        ),
    ];
    let o = chat_output(
        None,
        &Extras::default(),
        Some(&tools),
        Some(&json!("required")),
        Some(false),
    )
    .expect("present");
    let GrammarSpec::JsonSchema(s) = o.constraint.expect("present").spec else {
        panic!("a schema")
    };
    assert_eq!(s["maxItems"], 1);
    assert_eq!(s["$defs"]["t0_P"]["type"], "integer");
    assert_eq!(s["$defs"]["t1_P"]["type"], "string");
    let alts = s["items"]["anyOf"].as_array().expect("present");
    assert_eq!(
        alts[1]["properties"]["arguments"]["properties"]["p"]["$ref"],
        "#/$defs/t1_P"
    );
    assert_eq!(alts[0]["properties"]["name"]["const"], "a");
}

#[test]
fn extras_are_one_constraint_at_most() {
    let rx = json!("\\d+");
    let ch = json!(["yes", "no"]);
    let x = Extras {
        guided_regex: Some(&rx),
        ..Extras::default()
    };
    assert_eq!(
        completion_output(None, &x)
            .expect("present")
            .expect("present")
            .spec,
        GrammarSpec::Regex("\\d+".into())
    );
    let both = Extras {
        guided_regex: Some(&rx),
        guided_choice: Some(&ch),
        ..Extras::default()
    };
    let e = completion_output(None, &both).expect_err("refused");
    assert!(e.message.contains("one output constraint"));
    let so = json!({"choice": ["a", "b"]});
    let x = Extras {
        structured_outputs: Some(&so),
        ..Extras::default()
    };
    let c = completion_output(None, &x)
        .expect("present")
        .expect("present");
    assert_eq!(
        (c.field.as_str(), c.spec),
        (
            "structured_outputs.choice",
            GrammarSpec::Choice(vec!["a".into(), "b".into()])
        )
    );
    let rf = json!({"type": "json_object"});
    let x = Extras {
        guided_regex: Some(&rx),
        ..Extras::default()
    };
    assert!(completion_output(Some(&rf), &x).is_err());
}

#[test]
fn schemas_are_strict_unless_the_request_says_strict_false() {
    let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
    let schema_of = |o: OutputSpec| match o.constraint.expect("constrained").spec {
        GrammarSpec::JsonSchema(s) => s,
        other => panic!("{other:?}"),
    };
    let rf = |strict: Value| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}});
    for strict in [json!(true), Value::Null] {
        let o = chat_output(Some(&rf(strict)), &Extras::default(), None, None, None).expect("ok");
        assert_eq!(schema_of(o)["additionalProperties"], json!(false));
    }
    let o = chat_output(
        Some(&rf(json!(false))),
        &Extras::default(),
        None,
        None,
        None,
    )
    .expect("ok");
    assert_eq!(
        schema_of(o).get("additionalProperties"),
        None,
        "permissive on request"
    );

    // A forced tool's arguments: closed, unless the tool says strict: false.
    let forced = |strict: Option<Value>| {
        let mut t = tool("f", schema.clone());
        if let Some(s) = strict {
            t["function"]["strict"] = s;
        }
        let choice = json!({"type": "function", "function": {"name": "f"}});
        chat_output(None, &Extras::default(), Some(&[t]), Some(&choice), None)
    };
    let args = |o: OutputSpec| schema_of(o);
    assert_eq!(
        args(forced(None).expect("ok"))["additionalProperties"],
        json!(false)
    );
    assert_eq!(
        args(forced(Some(json!(false))).expect("ok")).get("additionalProperties"),
        None
    );
    let e = forced(Some(json!("yes"))).expect_err("refused");
    assert_eq!(e.param.as_deref(), Some("tools[0].function.strict"));

    // The vLLM-style extras read a schema strictly too; it opens an object by saying so.
    let x = |v: &Value| {
        let extras = Extras {
            guided_json: Some(v),
            ..Extras::default()
        };
        schema_of(chat_output(None, &extras, None, None, None).expect("ok"))
    };
    assert_eq!(x(&schema)["additionalProperties"], json!(false));
    let open = json!({"type": "object", "additionalProperties": true});
    assert_eq!(x(&open)["additionalProperties"], json!(true));
}

#[test]
fn strict_constraints_bound_fraction_digits_and_permissive_ones_do_not() {
    let schema = json!({"type": "object", "properties": {"x": {"type": "number"}}});
    let digits = |o: OutputSpec| o.constraint.expect("constrained").fraction_digits;
    let strict = Some(STRICT_FRACTION_DIGITS);
    let rf = |strict: Value| json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}});
    let x = Extras::default();
    assert_eq!(
        digits(chat_output(Some(&rf(Value::Null)), &x, None, None, None).expect("ok")),
        strict
    );
    assert_eq!(
        digits(chat_output(Some(&rf(json!(false))), &x, None, None, None).expect("ok")),
        None
    );
    let json_object = json!({"type": "json_object"});
    assert_eq!(
        digits(chat_output(Some(&json_object), &x, None, None, None).expect("ok")),
        None,
        "any JSON: no schema to be strict about"
    );
    // A forced call is strict when every tool it may call is.
    let mut open = tool("open", schema.clone());
    open["function"]["strict"] = json!(false);
    let tools = [tool("closed", schema.clone()), open];
    let named = |n: &str| json!({"type": "function", "function": {"name": n}});
    let call = |choice: &Value| chat_output(None, &x, Some(&tools), Some(choice), None);
    assert_eq!(digits(call(&named("closed")).expect("ok")), strict);
    assert_eq!(digits(call(&named("open")).expect("ok")), None);
    assert_eq!(digits(call(&json!("required")).expect("ok")), None);
    let only_closed = [tool("closed", schema.clone())];
    let required = chat_output(None, &x, Some(&only_closed), Some(&json!("required")), None);
    assert_eq!(digits(required.expect("ok")), strict);
    // The JSON extra is strict; a regex says its own digits.
    let extras = Extras {
        guided_json: Some(&schema),
        ..Extras::default()
    };
    assert_eq!(
        digits(chat_output(None, &extras, None, None, None).expect("ok")),
        strict
    );
    let rx = json!("[0-9]+\\.[0-9]+");
    let extras = Extras {
        guided_regex: Some(&rx),
        ..Extras::default()
    };
    assert_eq!(
        digits(chat_output(None, &extras, None, None, None).expect("ok")),
        None
    );
}
