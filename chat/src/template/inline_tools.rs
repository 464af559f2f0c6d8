//! Chat template, tools for templates without tool support (before rendering): the tools and
//! the tool-call history written into plain messages.
//!
//! A template that renders neither `tools` nor `tool_calls` (Gemma 3's, for one) would drop
//! them, or refuse a `tool` message outright. Gantry then writes the function list into the
//! system message with instructions to answer in the Hermes `<tool_call>` syntax (which the
//! reply's `auto` parser reads), turns earlier calls into that syntax in the assistant's text,
//! and tool results into `<tool_response>` blocks in a user turn, merged with a neighbouring
//! user turn so that templates requiring alternating roles still render.

use serde_json::{Value, json};

use super::{ChatMessage, Role};

/// Whether a conversation needs tool support from the template.
pub fn uses_tools(messages: &[ChatMessage], tools: Option<&[Value]>) -> bool {
    tools.is_some_and(|t| !t.is_empty())
        || messages
            .iter()
            .any(|m| m.role == Role::Tool || m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()))
}

fn instructions(tools: &[Value]) -> String {
    let mut s = String::from(
        "You can call functions. Each available function, as JSON with its parameters' JSON Schema:\n",
    );
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        s.push_str(&json!({"name": f.get("name"), "description": f.get("description"), "parameters": f.get("parameters")}).to_string());
        s.push('\n');
    }
    s.push_str(
        "To call a function, reply with one block per call and nothing else:\n<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments>}}\n</tool_call>",
    );
    s
}

/// The conversation with tools and tool history as plain text messages.
pub fn inline(messages: &[ChatMessage], tools: Option<&[Value]>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len() + 1);
    let tools = tools.unwrap_or_default();
    if !tools.is_empty() {
        let text = instructions(tools);
        match messages.first() {
            Some(m) if matches!(m.role, Role::System | Role::Developer) => {
                let own = m.content.as_ref().map(|c| c.text()).unwrap_or_default();
                out.push(ChatMessage::text(m.role, format!("{own}\n\n{text}")));
            }
            _ => out.push(ChatMessage::text(Role::System, text)),
        }
    }
    let skip_first = !tools.is_empty()
        && messages
            .first()
            .is_some_and(|m| matches!(m.role, Role::System | Role::Developer));
    for m in messages.iter().skip(usize::from(skip_first)) {
        let own = m.content.as_ref().map(|c| c.text()).unwrap_or_default();
        let (role, text) = match m.role {
            Role::Tool => (
                Role::User,
                format!("<tool_response>\n{own}\n</tool_response>"),
            ),
            Role::Assistant if m.tool_calls.as_ref().is_some_and(|c| !c.is_empty()) => {
                let mut text = own;
                for c in m.tool_calls.iter().flatten() {
                    let call = json!({"name": c.name(), "arguments": c.arguments_json()});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                (Role::Assistant, text)
            }
            _ => {
                out.push(m.clone());
                continue;
            }
        };
        match out.last_mut() {
            // Consecutive user turns (a tool result after a user message, or several results)
            // become one, for templates that require alternating roles.
            Some(prev) if role == Role::User && prev.role == Role::User => {
                let joined = format!(
                    "{}\n{text}",
                    prev.content.as_ref().map(|c| c.text()).unwrap_or_default()
                );
                *prev = ChatMessage::text(Role::User, joined);
            }
            _ => out.push(ChatMessage::text(role, text)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::ToolCall;

    fn call(name: &str, args: &str) -> ToolCall {
        ToolCall::new(
            json!({"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}),
        )
    }

    #[test]
    fn tool_history_becomes_alternating_plain_turns() {
        let mut assistant = ChatMessage::text(Role::Assistant, String::new());
        assistant.tool_calls = Some(vec![call("get_weather", "{\"city\": \"Paris\"}")]);
        assistant.content = None;
        let msgs = vec![
            ChatMessage::text(Role::User, "Weather in Paris?".into()),
            assistant,
            ChatMessage::text(Role::Tool, "18 C".into()),
            ChatMessage::text(Role::Tool, "sunny".into()),
        ];
        let tools = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
        ];
        assert!(uses_tools(&msgs, None));
        let out = inline(&msgs, Some(&tools));
        let roles: Vec<Role> = out.iter().map(|m| m.role).collect();
        assert_eq!(
            roles,
            vec![Role::System, Role::User, Role::Assistant, Role::User]
        );
        let sys = out[0].content.as_ref().expect("present").text();
        assert!(
            sys.contains("\"name\":\"get_weather\"") && sys.contains("<tool_call>"),
            "{sys}"
        );
        let call_text = out[2].content.as_ref().expect("present").text();
        assert_eq!(
            call_text,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        let results = out[3].content.as_ref().expect("present").text();
        assert_eq!(
            results,
            "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
        );
    }

    #[test]
    fn a_system_message_gets_the_instructions_appended() {
        let msgs = vec![
            ChatMessage::text(Role::System, "Be brief.".into()),
            ChatMessage::text(Role::User, "hi".into()),
        ];
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        let out = inline(&msgs, Some(&tools));
        assert_eq!(out.len(), 2);
        let sys = out[0].content.as_ref().expect("present").text();
        assert!(
            sys.starts_with("Be brief.\n\nYou can call functions."),
            "{sys}"
        );
    }
}
