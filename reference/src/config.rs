//! The validated model configuration, shared with the engine through `tinygpt-types`
//! (re-exported here so that the reference's readers find it where they look). Its RoPE
//! frequencies are the reference's own: [`crate::rope::inv_freq`].

pub use tinygpt_types::config::{AttentionType, Config, GemmaOptions, RopeScaling};
