//! rlmerge: merge reinforcement-learning-trained LLM agents that share a base model into one
//! checkpoint with Reinforced Agent Merging (RAM / RAM+), streaming tensors tile by tile.
//!
//! Data flows `checkpoint` (open and validate folders) → `engine` (tiles, probe and merge passes)
//! → `backend` (the math over one tile) → `checkpoint::writer` (shards, atomic output).
//!
//! The public surface is what the front ends use — the binary (`src/cli`), the Python extension
//! (`python/src/lib.rs`) — and the tests and benches; every public item is documented
//! (`missing_docs`, an error under CI's clippy). Modules only the library itself uses (`names`,
//! `report`, `scans`, `select`, `slices`) are crate-private.
#![warn(missing_docs)]

pub mod backend;
pub mod cancel;
pub mod checkpoint;
#[cfg(feature = "cli")]
pub mod cli;
pub mod demo;
pub mod engine;
pub mod error;
pub mod escape;
pub mod extract_lora;
pub mod figures;
pub mod hash;
pub mod hub;
pub mod inputs;
pub mod job;
pub(crate) mod linalg;
pub mod method;
pub mod model_config;
pub mod moe;
pub(crate) mod names;
pub mod record;
pub(crate) mod report;
pub(crate) mod scans;
pub(crate) mod select;
pub mod service;
mod simd;
pub(crate) mod slices;
pub(crate) mod structure;
pub mod verify;
pub mod vocabulary;
