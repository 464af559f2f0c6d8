//! A model family's chat format, in both directions (between request validation and
//! tokenization on the way in, between the detokenized text and the OpenAI response on the way
//! out): `template` renders a validated conversation into the prompt the model was trained on;
//! `toolcall` reads the tool calls the model wrote back out of its text. The node
//! (`gantry-node`) calls both; nothing here knows about HTTP, engines or the scheduler.

pub mod template;
pub mod toolcall;
