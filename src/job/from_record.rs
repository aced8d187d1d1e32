//! A job from a merged folder's record: the merge it describes, made again by
//! `verify --against` through the same service as any merge (`crate::service`).

use super::{saved_recipe::Recipe, Job};
use crate::checkpoint::DType;
use crate::record::{resolved_path, MergeRecord};
use anyhow::{Context, Result};
use std::path::{Path, PathBuf};

impl Job {
    /// The merge `record` (read from the merged folder `out`) describes: its inputs where the
    /// record names them from `out`, its method and SVC, ε, dtype, shard size, switches, slices,
    /// tokenizer, names and config choice. A record's values are not trusted: the dtype must be
    /// one rlmerge writes, the shard size at least a byte, the config choice one of its agents.
    pub fn from_record(record: &MergeRecord, out: &Path) -> Result<Job> {
        let base = record
            .inputs
            .first()
            .context("the record lists no inputs")?;
        let agents: Vec<PathBuf> = record.inputs[1..]
            .iter()
            .map(|i| resolved_path(out, &i.path))
            .collect();
        let out_dtype = record
            .out_dtype
            .as_deref()
            .map(|d| {
                DType::parse_user(d).with_context(|| format!("record: unknown out_dtype '{d}'"))
            })
            .transpose()?;
        anyhow::ensure!(record.shard_size >= 1, "record: shard_size 0");
        let config_from = match record.config_from.as_deref() {
            None => None,
            Some("base") => Some("base".to_string()),
            Some(named) => {
                let t = record
                    .agents
                    .iter()
                    .position(|a| a.path == named)
                    .context("the record's config_from names none of its agents")?;
                Some(agents[t].to_string_lossy().into_owned())
            }
        };
        Ok(Job {
            base: resolved_path(out, &base.path),
            names: record.agents.iter().map(|a| a.name.clone()).collect(),
            agents,
            merging: record.merging.clone(),
            epsilon: Some(record.epsilon),
            out_dtype,
            shard_size: Some(record.shard_size),
            allow_nonfinite: record.allow_nonfinite,
            allow_missing_tensors: record.allow_missing_tensors,
            raw_f32_agents: record.raw_f32_agents,
            recipe: Recipe::default(),
            recipe_path: None,
            slices: record.slices.clone(),
            tokenizer: record
                .tokenizer
                .as_ref()
                .map(|t| t.with_folders(|p| resolved_path(out, p))),
            config_from,
            stages: Vec::new(),
            chat_template: None,
        })
    }
}
