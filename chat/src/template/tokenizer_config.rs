//! Chat template, tokenizer config (at model load, before any request): the template and
//! special tokens of a Hugging Face `tokenizer_config.json`.

use std::collections::BTreeMap;
use std::path::Path;

use super::TemplateError;

/// The chat-template parts of a Hugging Face `tokenizer_config.json`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The template transformers uses when none is named: `chat_template`
    /// when it is a string, its `"default"` entry when it is a list of
    /// `{name, template}`.
    pub chat_template: Option<String>,
    /// Every entry of the list form by name (`"default"`, `"tool_use"`,
    /// `"rag"`, ...); empty for the string form.
    pub named_templates: BTreeMap<String, String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

impl TokenizerConfig {
    pub fn from_file(path: &Path) -> Result<Self, TemplateError> {
        let text = std::fs::read_to_string(path).map_err(|error| TemplateError::ReadConfig {
            path: path.to_owned(),
            error,
        })?;
        Self::from_json_str(&text).map_err(|reason| TemplateError::InvalidConfig {
            path: path.to_owned(),
            reason,
        })
    }

    /// Parses the config text; the error says which field is malformed.
    pub fn from_json_str(text: &str) -> Result<Self, String> {
        let config: serde_json::Value =
            serde_json::from_str(text).map_err(|error| format!("not JSON: {error}"))?;
        let Some(config) = config.as_object() else {
            return Err("not a JSON object".to_owned());
        };

        let mut named_templates = BTreeMap::new();
        let chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(template)) => Some(template.clone()),
            Some(serde_json::Value::Array(entries)) => {
                for entry in entries {
                    let name = entry.get("name").and_then(serde_json::Value::as_str);
                    let template = entry.get("template").and_then(serde_json::Value::as_str);
                    let (Some(name), Some(template)) = (name, template) else {
                        return Err(
                            "`chat_template` entries must be {\"name\": string, \"template\": string}"
                                .to_owned(),
                        );
                    };
                    named_templates.insert(name.to_owned(), template.to_owned());
                }
                named_templates.get("default").cloned()
            }
            Some(_) => {
                return Err(
                    "`chat_template` must be a string or a list of {name, template}".to_owned(),
                );
            }
        };

        Ok(TokenizerConfig {
            chat_template,
            named_templates,
            bos_token: special_token(config, "bos_token")?,
            eos_token: special_token(config, "eos_token")?,
        })
    }

    /// A named template of the list form, e.g. `"tool_use"`.
    pub fn named(&self, name: &str) -> Option<&str> {
        self.named_templates.get(name).map(String::as_str)
    }
}

/// A special token is a string or an `AddedToken` object (`{"content": ...}`).
fn special_token(
    config: &serde_json::Map<String, serde_json::Value>,
    field: &str,
) -> Result<Option<String>, String> {
    match config.get(field) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(token)) => Ok(Some(token.clone())),
        Some(token) => match token.get("content").and_then(serde_json::Value::as_str) {
            Some(content) => Ok(Some(content.to_owned())),
            None => Err(format!(
                "`{field}` must be a string or an AddedToken object with a string `content`"
            )),
        },
    }
}
