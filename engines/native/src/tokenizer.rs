//! Native engine, load step 3: the model's own tokenizer (`tokenizer.json` through the Hugging
//! Face `tokenizers` crate) and its special tokens (`tokenizer_config.json`).
//!
//! The engine host asks plugins to tokenize and to turn each sampled token back into bytes
//! (`detokenize`, reassembled into UTF-8 by the host). Bytes per token come from a table built
//! at load: SentencePiece-style vocabularies map `▁` to a space and `<0xNN>` to byte NN;
//! byte-level ones (GPT-2's byte-to-unicode alphabet) map each character back to its byte.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use gantry_engine_abi::{EngineError, Status};
use serde_json::Value;

fn corrupt(msg: impl Into<String>) -> EngineError {
    EngineError::new(Status::ModelCorrupt, msg.into())
}

pub struct Tokenizer {
    /// Special-token text in the input becomes the special token.
    full: tokenizers::Tokenizer,
    /// The same without the special added tokens (`parse_special = false`), built on first use.
    plain: OnceLock<Result<tokenizers::Tokenizer, String>>,
    json: Value,
    /// Bytes of each token id; `special[i]` marks control tokens (rendered only on request).
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    pub bos: Option<i32>,
    pub eos: Option<i32>,
    pub bos_text: Option<String>,
    pub eos_text: Option<String>,
    pub add_bos: bool,
    pub chat_template: Option<String>,
    /// Every id the tokenizer knows (model vocabulary and added tokens).
    pub n_tokens: usize,
}

/// `"<s>"` or `{"content": "<s>", ...}` (both appear in tokenizer_config.json).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// GPT-2's reversible byte <-> printable-unicode table (byte-level BPE).
fn byte_level_decoder() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter()
        .zip(cs)
        .filter_map(|(b, c)| char::from_u32(c).map(|c| (c, b as u8)))
        .collect()
}

fn contains_type(v: &Value, ty: &str) -> bool {
    match v {
        Value::Object(o) => {
            o.get("type").and_then(Value::as_str) == Some(ty)
                || o.values().any(|x| contains_type(x, ty))
        }
        Value::Array(a) => a.iter().any(|x| contains_type(x, ty)),
        _ => false,
    }
}

impl Tokenizer {
    /// Read `tokenizer.json`, `tokenizer_config.json` (and `chat_template.jinja` when present).
    pub fn load(dir: &Path, config_bos: Option<i32>) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer.json");
        let text = std::fs::read(&path).map_err(|e| {
            EngineError::new(
                Status::LoadFailed,
                format!(
                    "{}: {e} (the native engine needs the model's tokenizer.json)",
                    path.display()
                ),
            )
        })?;
        let mut json: Value = serde_json::from_slice(&text)
            .map_err(|e| corrupt(format!("{} is not valid JSON: {e}", path.display())))?;
        // A tokenizer.json may carry the padding and truncation of its training batches
        // (sentence-transformers models pad every input to 128): the engine takes each input
        // whole and unpadded, and says so when one is too long.
        if let Value::Object(o) = &mut json {
            o.insert("padding".into(), Value::Null);
            o.insert("truncation".into(), Value::Null);
        }
        let text = serde_json::to_vec(&json).map_err(|e| corrupt(e.to_string()))?;
        let full = tokenizers::Tokenizer::from_bytes(&text)
            .map_err(|e| corrupt(format!("{}: {e}", path.display())))?;
        let vocab = full.get_vocab(true);
        let n_tokens = vocab.values().map(|&i| i as usize + 1).max().unwrap_or(0);
        let byte_level = json
            .get("decoder")
            .is_some_and(|d| contains_type(d, "ByteLevel"))
            || json
                .get("pre_tokenizer")
                .is_some_and(|d| contains_type(d, "ByteLevel"));
        let byte_map = byte_level.then(byte_level_decoder);
        let mut bytes = vec![Vec::new(); n_tokens];
        let mut special = vec![false; n_tokens];
        let added: HashMap<u32, (String, bool)> = full
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, (t.content.clone(), t.special)))
            .collect();
        for (piece, &id) in &vocab {
            let id = id as usize;
            if let Some((content, is_special)) = added.get(&(id as u32)) {
                bytes[id] = content.as_bytes().to_vec();
                special[id] = *is_special;
                continue;
            }
            bytes[id] = match &byte_map {
                Some(map) => piece
                    .chars()
                    .map(|c| map.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| piece.as_bytes().to_vec()),
                None => {
                    if piece.len() == 6
                        && piece.starts_with("<0x")
                        && piece.ends_with('>')
                        && let Ok(b) = u8::from_str_radix(&piece[3..5], 16)
                    {
                        vec![b]
                    } else {
                        piece.replace('\u{2581}', " ").into_bytes()
                    }
                }
            };
        }

        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read(&cfg_path) {
            Ok(b) => serde_json::from_slice(&b)
                .map_err(|e| corrupt(format!("{} is not valid JSON: {e}", cfg_path.display())))?,
            Err(_) => Value::Null,
        };
        let id_of = |t: &Option<String>| {
            t.as_deref()
                .and_then(|t| full.token_to_id(t))
                .map(|i| i as i32)
        };
        let bos_text = token_text(cfg.get("bos_token"));
        let eos_text = token_text(cfg.get("eos_token"));
        let bos = id_of(&bos_text).or(config_bos);
        let eos = id_of(&eos_text);
        let add_bos = cfg
            .get("add_bos_token")
            .and_then(Value::as_bool)
            .unwrap_or_else(|| {
                // No explicit flag: the post-processor says whether BOS is prepended.
                bos.is_some_and(|b| {
                    full.encode("a", true)
                        .map(|e| e.get_ids().first() == Some(&(b as u32)))
                        .unwrap_or(false)
                })
            });
        let chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the default one.
            Some(Value::Array(items)) => items
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or(items.first())
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        }
        .or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
        Ok(Self {
            full,
            plain: OnceLock::new(),
            json,
            bytes,
            special,
            bos,
            eos,
            bos_text: bos.and(bos_text),
            eos_text: eos.and(eos_text),
            add_bos,
            chat_template,
            n_tokens,
        })
    }

    /// `tokenizer.json` with its special added tokens removed: their text stays text.
    fn plain(&self) -> Result<&tokenizers::Tokenizer, EngineError> {
        self.plain
            .get_or_init(|| {
                let mut json = self.json.clone();
                if let Some(Value::Array(added)) = json.get_mut("added_tokens") {
                    added.retain(|t| t.get("special").and_then(Value::as_bool) != Some(true));
                }
                let bytes = serde_json::to_vec(&json).map_err(|e| e.to_string())?;
                tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| EngineError::internal(format!("tokenizer without special tokens: {e}")))
    }

    /// Refuse a tokenizer whose ids reach past the model's embedding table (it belongs to
    /// another model).
    pub fn check_vocab(&self, vocab: usize) -> Result<(), EngineError> {
        if self.n_tokens > vocab {
            return Err(corrupt(format!(
                "tokenizer.json has {} tokens, config.json `vocab_size` is {vocab}",
                self.n_tokens
            )));
        }
        Ok(())
    }

    /// [`Tokenizer::encode`] of the ABI's bytes, which must be UTF-8.
    pub fn encode_bytes(
        &self,
        text: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let text = std::str::from_utf8(text)
            .map_err(|e| EngineError::unsupported(format!("text is not UTF-8: {e}")))?;
        self.encode(text, add_special, parse_special)
    }

    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<i32>, EngineError> {
        let t = if parse_special {
            &self.full
        } else {
            self.plain()?
        };
        let enc = t
            .encode(text, add_special)
            .map_err(|e| EngineError::internal(format!("tokenizer: {e}")))?;
        let mut ids: Vec<i32> = enc.get_ids().iter().map(|&i| i as i32).collect();
        if add_special
            && self.add_bos
            && let Some(b) = self.bos
            && ids.first() != Some(&b)
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// The bytes of `tokens`, concatenated; control tokens only when `render_special`.
    pub fn bytes_of(&self, tokens: &[i32], render_special: bool) -> Result<Vec<u8>, EngineError> {
        let mut out = Vec::with_capacity(tokens.len() * 4);
        for &t in tokens {
            let i = usize::try_from(t)
                .ok()
                .filter(|&i| i < self.bytes.len())
                .ok_or_else(|| {
                    EngineError::unsupported(format!("token id {t} is outside the vocabulary"))
                })?;
            if self.special[i] && !render_special {
                continue;
            }
            out.extend_from_slice(&self.bytes[i]);
        }
        Ok(out)
    }

    /// Every special token: its id and text.
    pub fn specials(&self) -> impl Iterator<Item = (i32, &[u8])> {
        self.special
            .iter()
            .enumerate()
            .filter(|(_, s)| **s)
            .map(|(i, _)| (i as i32, self.bytes[i].as_slice()))
    }

    /// Ids of the control tokens whose text is in `names` (end-of-turn markers and the like).
    pub fn id(&self, text: &str) -> Option<i32> {
        self.full.token_to_id(text).map(|i| i as i32)
    }
}
