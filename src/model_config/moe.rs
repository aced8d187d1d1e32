//! The config.json of a mixture of experts built from a dense model (`rlmerge moe`): which MoE
//! layout fits the models (mergekit-moe's rules), and the base's config turned into it — every
//! key of the base kept, the model type, the expert counts and the MoE sizes set.

use crate::checkpoint::DType;
use crate::error::usage;
use anyhow::Result;
use serde_json::{json, Value};

/// The MoE architectures `rlmerge moe` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeLayout {
    /// `MixtralForCausalLM`, from Llama or Mistral models; no shared expert.
    Mixtral,
    /// `Qwen2MoeForCausalLM`, from Qwen2, Llama or Mistral models, with one shared expert.
    Qwen2Moe,
    /// `Qwen3MoeForCausalLM`, from Qwen3 models; no shared expert.
    Qwen3Moe,
}

/// Every layout, in the order one is chosen where several fit (Mixtral first, as mergekit).
const LAYOUTS: [MoeLayout; 3] = [MoeLayout::Mixtral, MoeLayout::Qwen2Moe, MoeLayout::Qwen3Moe];

impl MoeLayout {
    /// mergekit-moe's name (what `architecture:` is matched against, by its start).
    pub fn name(self) -> &'static str {
        match self {
            MoeLayout::Mixtral => "Mixtral",
            MoeLayout::Qwen2Moe => "Qwen MoE",
            MoeLayout::Qwen3Moe => "Qwen3 MoE",
        }
    }

    /// The output's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            MoeLayout::Mixtral => "mixtral",
            MoeLayout::Qwen2Moe => "qwen2_moe",
            MoeLayout::Qwen3Moe => "qwen3_moe",
        }
    }

    /// The output's class, its `architectures` entry.
    pub fn class(self) -> &'static str {
        match self {
            MoeLayout::Mixtral => "MixtralForCausalLM",
            MoeLayout::Qwen2Moe => "Qwen2MoeForCausalLM",
            MoeLayout::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// Whether a layer's experts are stored fused, as transformers holds them
    /// (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]), else one module each.
    pub fn fused_experts(self) -> bool {
        self != MoeLayout::Qwen2Moe
    }

    /// Why this layout cannot hold the models, or `None` where it can: their model types (the
    /// base's first) and the shared experts' count.
    fn refusal(self, types: &[&str], shared: usize) -> Option<String> {
        let (inputs, shared_rule): (&[&str], bool) = match self {
            MoeLayout::Mixtral => (&["llama", "mistral"], shared == 0),
            MoeLayout::Qwen2Moe => (&["llama", "mistral", "qwen2"], shared == 1),
            MoeLayout::Qwen3Moe => (&["qwen3"], shared == 0),
        };
        if !shared_rule {
            return Some(match self {
                MoeLayout::Qwen2Moe => format!("needs exactly one shared expert, not {shared}"),
                _ => format!("has no shared expert (the config names {shared})"),
            });
        }
        if let Some(t) = types.iter().find(|t| !inputs.contains(t)) {
            return Some(format!(
                "is built from {} models, not {t}",
                inputs.join(" or ")
            ));
        }
        if types.iter().any(|t| *t != types[0]) {
            return Some(format!(
                "needs every model of one type, not {}",
                types.join(", ")
            ));
        }
        None
    }

    /// The layout for models of `types` (the base's first, then each expert's and shared
    /// expert's) with `shared` shared experts, among those whose name starts with
    /// `architecture` (mergekit's rule; any case); an error says why none fits.
    pub fn choose(architecture: Option<&str>, types: &[&str], shared: usize) -> Result<MoeLayout> {
        let wanted = architecture.map(str::to_ascii_lowercase);
        let named: Vec<MoeLayout> = LAYOUTS
            .into_iter()
            .filter(|l| {
                wanted
                    .as_deref()
                    .is_none_or(|w| l.name().to_ascii_lowercase().starts_with(w))
            })
            .collect();
        if named.is_empty() {
            let w = architecture.unwrap_or_default();
            let deepseek = w.to_ascii_lowercase().starts_with("deepseek");
            return Err(usage(format!(
                "architecture '{w}' {}: rlmerge writes {}",
                if deepseek {
                    "(mergekit's DeepSeek MoE) is not written by rlmerge yet"
                } else {
                    "names no MoE architecture"
                },
                LAYOUTS.map(|l| format!("'{}'", l.name())).join(", ")
            )));
        }
        let mut reasons = Vec::new();
        for layout in named {
            match layout.refusal(types, shared) {
                None => return Ok(layout),
                Some(why) => reasons.push(format!("{} {why}", layout.name())),
            }
        }
        Err(usage(format!(
            "no MoE architecture fits these models: {}",
            reasons.join("; ")
        )))
    }
}

/// The MoE's config.json: the base's `config` with every key kept, as `layout` with `experts`
/// routed experts, `per_token` of them per token, in `dtype`.
pub fn moe_config(
    config: &Value,
    layout: MoeLayout,
    (experts, per_token): (usize, usize),
    dtype: DType,
) -> Value {
    let mut out = config.clone();
    let intermediate = config["intermediate_size"].clone();
    let obj = out.as_object_mut().expect("a model config is an object");
    obj.insert("architectures".into(), json!([layout.class()]));
    obj.insert("model_type".into(), layout.model_type().into());
    obj.insert("num_experts_per_tok".into(), per_token.into());
    match layout {
        MoeLayout::Mixtral => {
            obj.insert("num_local_experts".into(), experts.into());
            obj.insert("sliding_window".into(), Value::Null);
        }
        MoeLayout::Qwen2Moe | MoeLayout::Qwen3Moe => {
            obj.insert("num_experts".into(), experts.into());
            obj.insert("decoder_sparse_step".into(), 1.into());
            obj.insert("mlp_only_layers".into(), json!([]));
            obj.insert("norm_topk_prob".into(), true.into());
            obj.insert("moe_intermediate_size".into(), intermediate.clone());
        }
    }
    if layout == MoeLayout::Qwen2Moe {
        obj.insert("shared_expert_intermediate_size".into(), intermediate);
        obj.insert("sliding_window".into(), Value::Null);
        obj.insert("use_sliding_window".into(), false.into());
        // Qwen2-MoE's q/k/v projections have biases (zeros where the base has none).
        obj.insert("qkv_bias".into(), true.into());
    }
    // transformers 5 reads `dtype` (set_config_dtype adds `torch_dtype`, older ones' key).
    obj.insert("dtype".into(), dtype.torch_name().into());
    crate::checkpoint::folder_files::set_config_dtype(&mut out, dtype);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mergekit_rules_choose_the_layout() {
        let l = MoeLayout::choose;
        assert_eq!(l(None, &["llama", "llama"], 0).unwrap(), MoeLayout::Mixtral);
        assert_eq!(
            l(None, &["llama", "llama"], 1).unwrap(),
            MoeLayout::Qwen2Moe
        );
        assert_eq!(
            l(None, &["qwen2", "qwen2"], 1).unwrap(),
            MoeLayout::Qwen2Moe
        );
        assert_eq!(
            l(None, &["qwen3", "qwen3"], 0).unwrap(),
            MoeLayout::Qwen3Moe
        );
        // "qwen" starts both Qwen names: the shared expert decides.
        assert_eq!(l(Some("qwen"), &["qwen3"], 0).unwrap(), MoeLayout::Qwen3Moe);
        assert_eq!(l(Some("QWEN"), &["llama"], 1).unwrap(), MoeLayout::Qwen2Moe);
        let e = l(Some("mixtral"), &["qwen3", "qwen3"], 0).unwrap_err();
        assert!(e.to_string().contains("not qwen3"), "{e}");
        let e = l(None, &["llama", "mistral"], 0).unwrap_err().to_string();
        assert!(e.contains("every model of one type"), "{e}");
        let e = l(Some("deepseek"), &["llama"], 0).unwrap_err().to_string();
        assert!(e.contains("not written by rlmerge yet"), "{e}");
        assert!(l(Some("gpt"), &["llama"], 0).is_err());
    }

    #[test]
    fn the_config_keeps_the_base_keys_and_sets_the_moe_ones() {
        let base = json!({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "intermediate_size": 40, "hidden_size": 16, "rope_theta": 5e5, "torch_dtype": "bfloat16"});
        let m = moe_config(&base, MoeLayout::Mixtral, (4, 2), DType::F32);
        assert_eq!(m["model_type"], "mixtral");
        assert_eq!(m["num_local_experts"], 4);
        assert_eq!(m["rope_theta"], 5e5);
        assert_eq!(m["torch_dtype"], "float32");
        let q = moe_config(&base, MoeLayout::Qwen2Moe, (2, 1), DType::BF16);
        assert_eq!(q["architectures"], json!(["Qwen2MoeForCausalLM"]));
        assert_eq!(q["shared_expert_intermediate_size"], 40);
        assert_eq!(q["moe_intermediate_size"], 40);
        assert_eq!(q["num_experts"], 2);
    }
}
