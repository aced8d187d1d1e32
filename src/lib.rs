//! rlmerge: merge reinforcement-learning-trained LLM agents that share a base model into one
//! checkpoint with Reinforced Agent Merging (RAM / RAM+), streaming tensors tile by tile.
//!
//! Data flows `checkpoint` (open and validate folders) → `engine` (tiles, probe and merge passes)
//! → `backend` (the math over one tile) → `checkpoint::writer` (shards, atomic output).

pub mod backend;
pub mod cancel;
pub mod checkpoint;
pub mod demo;
pub mod engine;
pub mod error;
pub mod escape;
pub mod figures;
pub mod hash;
pub mod hub;
pub mod inputs;
pub mod job;
pub mod method;
pub mod names;
pub mod record;
pub mod report;
pub mod scans;
pub mod select;
mod simd;
pub mod slices;
pub mod verify;
pub mod vocabulary;
