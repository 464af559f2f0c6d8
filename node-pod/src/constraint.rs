//! Constrained decoding (between the model limits and the scheduler): a request's grammar
//! becomes an llguidance matcher, which the scheduler asks for each step's allowed-token mask.
//!
//! Structured outputs (`response_format`), forced tool calls (`tool_choice: "required"` or a
//! named function) and the vLLM-style extras (regex, choice, Lark grammar) all end here as one
//! [`GrammarSpec`]. The grammar work is `llguidance`'s (the library behind several engines'
//! structured outputs); this module only gives it the model's vocabulary and hands its masks
//! to the scheduler, which passes them to the plugin through ABI 1.2's
//! `gantry_sampling_t.allowed_tokens`.
//!
//! The vocabulary (every token's bytes, read once through the plugin's `detokenize`, and
//! llguidance's token trie over it) is built per model on first use and kept while the model
//! is loaded; the node starts building it in the background when the model becomes ready.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};

mod digits;
mod matcher;
use digits::{DigitTokens, FractionBound};
pub use matcher::Constraint;

use crate::engine_host::ModelShared;
pub use gantry_openai::grammar::{ConstraintRequest, GrammarSpec};

/// The JSON layout Gantry asks for: compact, with the usual separators, and no free
/// whitespace (a small model can otherwise spend its whole budget on newlines). A schema
/// that carries its own `x-guidance` options keeps them.
fn json_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// The llguidance grammar of a request's spec.
fn to_grammar(spec: &GrammarSpec) -> Result<TopLevelGrammar, String> {
    Ok(match spec {
        GrammarSpec::JsonSchema(schema) => {
            let mut schema = schema.clone();
            match schema.as_object() {
                Some(obj) if !obj.contains_key("x-guidance") => {
                    json_options().apply_to(&mut schema)
                }
                Some(_) => {}
                None if schema.is_boolean() => {}
                None => return Err("a JSON Schema must be an object (or a boolean)".into()),
            }
            TopLevelGrammar::from_json_schema(schema)
        }
        GrammarSpec::JsonObject => {
            let mut schema = serde_json::json!({"type": "object"});
            json_options().apply_to(&mut schema);
            TopLevelGrammar::from_json_schema(schema)
        }
        GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
        GrammarSpec::Choice(options) => {
            let alts: Vec<String> = options
                .iter()
                .map(|o| serde_json::to_string(o).unwrap_or_default())
                .collect();
            TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | ")))
        }
        GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
    })
}

/// A model's compiled vocabulary: compiles grammars into matchers.
pub struct Compiler {
    factory: ParserFactory,
    digits: Arc<DigitTokens>,
}

impl Compiler {
    /// Read every token's bytes through the plugin and build llguidance's trie. Control tokens
    /// (empty as text) get llguidance's special-token marker, so grammars can name them but
    /// plain text never matches them; every end-of-generation token counts as EOS.
    pub fn build(shared: &ModelShared) -> Result<Self, String> {
        let info = shared.info();
        let vocab = info.vocab_size;
        let mut words = Vec::with_capacity(vocab as usize);
        // Every token's piece at once: one round trip to a worker (`process` isolation).
        let ids: Vec<i32> = (0..vocab as i32).collect();
        let pieces = shared
            .detokenize_each(&ids, false)
            .map_err(|e| e.to_string())?;
        for (t, plain) in ids.into_iter().zip(pieces) {
            if plain.is_empty() {
                let special = shared.detokenize(&[t], true).map_err(|e| e.to_string())?;
                if special.is_empty() {
                    words.push(Vec::new());
                } else {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(&special);
                    words.push(w);
                }
            } else {
                words.push(plain);
            }
        }
        let eos = info
            .eos_token
            .or_else(|| info.eog_tokens.first().copied())
            .ok_or("the model declares no end-of-generation token")?;
        let eog: Vec<u32> = info
            .eog_tokens
            .iter()
            .chain(std::iter::once(&eos))
            .map(|&t| t as u32)
            .collect();
        let digits = Arc::new(DigitTokens::new(&words));
        let trie = TokTrie::from(&TokRxInfo::new(vocab, eos as u32), &words).with_eos_tokens(&eog);
        // Gantry only asks for masks and feeds sampled tokens, so llguidance never needs the
        // model's real tokenizer; its greedy trie tokenizer covers what it tokenizes itself,
        // and the environment holds no reference that would keep the model loaded.
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Self { factory, digits })
    }

    /// Compile one request's grammar; a grammar llguidance refuses (a malformed schema, an
    /// unsupported keyword, a bad regex) is a 400 naming the request's field.
    pub fn compile(&self, req: &ConstraintRequest) -> Result<Constraint, GrammarRefused> {
        let refuse = |msg: String| GrammarRefused {
            field: req.field.clone(),
            message: format!(
                "`{}` cannot be used for constrained decoding: {msg}",
                req.field
            ),
        };
        let grammar = to_grammar(&req.spec).map_err(refuse)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| refuse(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(refuse(e));
        }
        // The fraction bound reads the output as JSON: only a schema's output is.
        let bound = match (&req.spec, req.fraction_digits) {
            (GrammarSpec::JsonSchema(_), Some(limit)) => Some(FractionBound::new(
                limit,
                self.digits.clone(),
                self.factory.tok_env().clone(),
            )),
            _ => None,
        };
        Ok(Constraint::new(matcher, bound))
    }
}

/// A grammar the compiler refused: the request's field that gave it, and why (the HTTP
/// edge answers 400 naming the field).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct GrammarRefused {
    pub field: String,
    pub message: String,
}

/// A model's vocabulary for constrained decoding, built on first use (or by the warm-up the
/// node starts when the model becomes ready) and kept while the model is loaded.
pub struct Vocabulary {
    shared: Arc<ModelShared>,
    compiler: OnceLock<Result<Arc<Compiler>, String>>,
}

impl Vocabulary {
    pub fn new(shared: Arc<ModelShared>) -> Self {
        Self {
            shared,
            compiler: OnceLock::new(),
        }
    }

    /// The compiler, building it on first use (blocking: call from a blocking context).
    pub fn compiler(&self) -> Result<Arc<Compiler>, String> {
        self.compiler
            .get_or_init(|| {
                let t = Instant::now();
                let built = Compiler::build(&self.shared).map(Arc::new);
                match &built {
                    Ok(_) => tracing::info!(vocab = self.shared.info().vocab_size, build_s = t.elapsed().as_secs_f64(), "constrained-decoding vocabulary ready"),
                    Err(e) => tracing::warn!(error = %e, "constrained decoding unavailable for this model"),
                }
                built
            })
            .clone()
    }
}
