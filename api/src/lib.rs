//! The rules and types both sides of Gantry apply (operator ⇄ node ⇄ gateway), each in one place
//! so they give the same answer by construction:
//!
//! - [`source`]: the source-URI grammar (operator validate step, node model store);
//! - [`selection`]: engine selection and its rejection kinds (operator resolve step, node engine
//!   registry);
//! - [`config`]: the node config the operator renders and the node reads;
//! - [`status`]: the node status document (`/v1/status`) the operator reads;
//! - [`crash`]: a worker crash as engine host, scheduler and HTTP edge pass it on (node);
//! - [`openai`]: the OpenAI error body the node and the gateway answer with;
//! - [`node_token`]: the token a node pod requires, derived per Model from the install token
//!   (operator writes it, gateway and operator send it, node checks it).
#![forbid(unsafe_code)]

pub mod config;
pub mod crash;
pub mod node_token;
pub mod openai;
pub mod selection;
pub mod source;
pub mod status;

pub use config::{LoadPolicy, ModelConfig, NODE_CONFIG_PATH, NodeConfig, SchedulerConfig};
pub use crash::WorkerCrash;
pub use openai::{openai_error_json, openai_error_response};
pub use status::*;
