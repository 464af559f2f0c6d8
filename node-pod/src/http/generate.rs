//! HTTP layer, generation handlers (entered once per request, from the router): chat and
//! legacy completions, step by step.
//!
//! Each handler reads as the request path (docs/architecture.md walks it):
//! parse (`openai.rs`) → validate (`validate.rs`) → the ready model
//! (`Node::ready_model`) and the adapter the model id names (`Node::adapter_lease`) → chat template (`template`) → tokenize
//! (`tokenizer.rs`) → model limits and the grammar (`limits.rs`) → cache, scheduler and the
//! response or SSE stream (`response.rs`). Every step's failure is an
//! `ApiError`, answered by `response::respond`.

use axum::body::Bytes;
use axum::response::Response;

use super::AppState;
use super::limits::{self, PromptTokens, ReplyTools};
use super::openai::{self, ChatRequest, CompletionRequest};
use super::response;
use super::validate::{self, ToolMode, ValidPrompt};
use crate::template::inline_tools;
use crate::toolcall::Family;
use gantry_openai::reply::Flavor;

pub async fn chat(state: AppState, body: Bytes) -> Response {
    let generation = async {
        let req: ChatRequest = openai::parse(&body)?;
        let mut valid = validate::chat(&req)?;
        let (m, ready) = state.node.ready_model(&valid.model).await?;
        let adapter = state.node.adapter_lease(&m, &ready, &valid.model).await?;
        // A template without tool support gets the tools and the tool history as plain text.
        let inlined = (!ready.template.handles_tools()
            && inline_tools::uses_tools(&valid.messages, valid.tools.as_deref()))
        .then(|| inline_tools::inline(&valid.messages, valid.tools.as_deref()));
        let text = match &inlined {
            Some(messages) => {
                ready
                    .template
                    .render(messages, None, true, Some(&valid.template_kwargs))?
            }
            None => ready.template.render(
                &valid.messages,
                valid.tools.as_deref(),
                true,
                Some(&valid.template_kwargs),
            )?,
        };
        let prompt = ready.tokenizer.encode_chat(&text, ready.shared.info())?;
        // The template's end-of-turn marker ends the reply even when the model writes it as
        // text rather than as its end-of-generation token (hidden, like any stop sequence).
        // Not under a grammar: there the marker is text inside the output (a JSON string, say),
        // cutting it there would break the output, and the grammar's end is the reply's end.
        if let Some(marker) = ready.template.end_of_turn()
            && valid.params.constraint.is_none()
            && !valid.params.stop.iter().any(|s| s == marker)
        {
            valid.params.stop.push(marker.to_string());
        }
        let tools = match &valid.tool_mode {
            ToolMode::Off => ReplyTools::Off,
            ToolMode::Auto => ReplyTools::Auto(Family::detect(ready.template.text())),
            ToolMode::Named(n) => ReplyTools::Named(n.clone()),
            ToolMode::Required => ReplyTools::Required,
        };
        let sched = &state.node.config.scheduler;
        let mut g = limits::generation(
            sched,
            &m,
            ready,
            adapter,
            PromptTokens::Encoded(prompt),
            "messages",
            valid.params,
        )?;
        g.tools = tools;
        limits::constrain(g).await
    }
    .await;
    response::respond(state, Flavor::Chat, generation).await
}

pub async fn completion(state: AppState, body: Bytes) -> Response {
    let generation = async {
        let req: CompletionRequest = openai::parse(&body)?;
        let valid = validate::completion(&req)?;
        let (m, ready) = state.node.ready_model(&valid.model).await?;
        let adapter = state.node.adapter_lease(&m, &ready, &valid.model).await?;
        let prompt = match &valid.prompt {
            ValidPrompt::Text(t) => {
                PromptTokens::Encoded(ready.tokenizer.encode_prompt(t, ready.shared.info())?)
            }
            ValidPrompt::Tokens(ids) => PromptTokens::Sent(ids),
        };
        let sched = &state.node.config.scheduler;
        let g = limits::generation(sched, &m, ready, adapter, prompt, "prompt", valid.params)?;
        limits::constrain(g).await
    }
    .await;
    response::respond(state, Flavor::Completion, generation).await
}
