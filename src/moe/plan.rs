//! Which output tensor of the MoE comes from where: the base's tensors outside the MLPs as they
//! are; each layer's experts from the experts' MLPs (fused — `experts.gate_up_proj`
//! [E, 2I, H] of each expert's gate then up rows, `experts.down_proj` [E, H, I] — or one module
//! each, by the layout); the routers; Qwen2-MoE's shared expert, its router and the q/k/v biases
//! it needs (zeros where the base has none). What the layout has no place for is refused by name,
//! never dropped.

use super::config::{Expert, MoeConfig};
use crate::checkpoint::{DType, ModelFolder, OutputTensor};
use crate::error::usage;
use crate::model_config::moe::MoeLayout;
use anyhow::Result;

/// Where a run of an output tensor's elements comes from.
pub enum Part {
    /// Tensor `name` of input model `model` (an index into the opened models), with expert
    /// `expert`'s noise and, on a `down_proj`, its residual scale.
    Tensor {
        model: usize,
        name: String,
        expert: Option<(usize, bool)>,
    },
    /// That many zeros.
    Zeros(usize),
    /// These values (a router).
    Values(Vec<f32>),
}

/// One output tensor and its parts, in order.
pub struct Planned {
    pub out: OutputTensor,
    pub parts: Vec<Part>,
}

/// The MLP projections of a dense layer, in the order a fused `gate_up_proj` stacks the first two.
pub const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// The dense MLP's shapes the experts must share: layers, intermediate size, hidden size.
#[derive(Clone, Copy)]
pub struct Dims {
    pub layers: usize,
    pub intermediate: usize,
    pub hidden: usize,
}

/// Layer `i`'s projection `p` of a dense model.
pub fn mlp_name(i: usize, p: &str) -> String {
    format!("model.layers.{i}.mlp.{p}.weight")
}

/// The dense MLP's dims, from the base's layer 0 and its layer count; every layer's three
/// projections must be there with those shapes, and no other MLP tensor.
pub fn dims(base: &ModelFolder, layers: usize) -> Result<Dims> {
    let first = base.get(&mlp_name(0, "gate_proj")).ok_or_else(|| {
        usage(format!(
            "the base {} has no {}: a MoE is built from dense Llama-style MLPs",
            base.dir.display(),
            mlp_name(0, "gate_proj")
        ))
    })?;
    let (intermediate, hidden) = match first.entry.shape[..] {
        [i, h] => (i, h),
        _ => {
            return Err(usage(format!(
                "the base's {} is not a matrix",
                first.entry.name
            )))
        }
    };
    let dims = Dims {
        layers,
        intermediate,
        hidden,
    };
    check_mlps(base, dims, "the base")?;
    for t in &base.tensors {
        let n = &*t.entry.name;
        if n.contains(".mlp.")
            && !(0..layers).any(|i| PROJECTIONS.iter().any(|p| *n == mlp_name(i, p)))
        {
            return Err(usage(format!(
                "the base's '{n}' is part of an MLP the MoE layout has no place for (an MLP bias, \
                 or a layer past its {layers}); rlmerge builds MoEs from bias-free Llama-style MLPs"
            )));
        }
    }
    Ok(dims)
}

/// Checks `model` has every layer's three projections with the dense shapes.
pub fn check_mlps(model: &ModelFolder, d: Dims, who: &str) -> Result<()> {
    for i in 0..d.layers {
        for p in PROJECTIONS {
            let name = mlp_name(i, p);
            let want = match p {
                "down_proj" => [d.hidden, d.intermediate],
                _ => [d.intermediate, d.hidden],
            };
            if model
                .lora_for(&name)
                .and_then(|l| l.update(&name))
                .is_some_and(|u| u.is_dora())
            {
                return Err(usage(format!(
                    "{who} ({}) is a DoRA adapter, which rlmerge moe does not apply: convert it \
                     first (rlmerge convert BASE+ADAPTER OUT) and name the converted folder",
                    model.dir.display()
                )));
            }
            match model.get(&name) {
                Some(t) if t.entry.shape[..] == want => {}
                found => {
                    return Err(usage(format!(
                        "{who} ({}) {}: every expert's MLP must have the base's shape {}",
                        model.dir.display(),
                        match found {
                            Some(t) => format!(
                                "has '{name}' as {}",
                                crate::checkpoint::weight_file::shape_text(&t.entry.shape)
                            ),
                            None => format!("has no '{name}'"),
                        },
                        crate::checkpoint::weight_file::shape_text(&want)
                    )))
                }
            }
        }
    }
    Ok(())
}

/// The output's tensors: the base's non-MLP ones, then each layer's experts (and shared
/// expert), then the routers; `models[m]` is input model m (0: the base), `of_expert[k]` the model
/// of expert k (routed experts first, then shared). Also says which q/k/v biases are zeros.
pub fn plan(
    (config, layout, dims): (&MoeConfig, MoeLayout, Dims),
    (base, of_expert): (&ModelFolder, &[usize]),
    routers: &super::router::Routers,
    dtype: DType,
) -> Result<(Vec<Planned>, Vec<String>)> {
    let mut planned = Vec::new();
    let mut zeros = Vec::new();
    let tensor = |name: &str, shape: Vec<usize>, parts: Vec<Part>| Planned {
        out: OutputTensor {
            name: name.into(),
            dtype,
            shape: shape.into(),
        },
        parts,
    };
    for t in &base.tensors {
        let name = &*t.entry.name;
        if name.contains(".mlp.") || name.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        refuse_attention_bias(layout, name)?;
        let part = Part::Tensor {
            model: 0,
            name: name.to_string(),
            expert: None,
        };
        planned.push(tensor(name, t.entry.shape.to_vec(), vec![part]));
    }
    let e = config.experts.len();
    let (i_, h) = (dims.intermediate, dims.hidden);
    let from = |k: usize, layer: usize, p: &str| Part::Tensor {
        model: of_expert[k],
        name: mlp_name(layer, p),
        expert: Some((k, p == "down_proj")),
    };
    for layer in 0..dims.layers {
        let prefix = format!("model.layers.{layer}.mlp");
        if layout.fused_experts() {
            let gate_up = (0..e)
                .flat_map(|k| [from(k, layer, "gate_proj"), from(k, layer, "up_proj")])
                .collect();
            let down = (0..e).map(|k| from(k, layer, "down_proj")).collect();
            planned.push(tensor(
                &format!("{prefix}.experts.gate_up_proj"),
                vec![e, 2 * i_, h],
                gate_up,
            ));
            planned.push(tensor(
                &format!("{prefix}.experts.down_proj"),
                vec![e, h, i_],
                down,
            ));
        } else {
            for k in 0..e + config.shared_experts.len() {
                let module = match k < e {
                    true => format!("{prefix}.experts.{k}"),
                    false => format!("{prefix}.shared_expert"),
                };
                for p in PROJECTIONS {
                    let shape = match p {
                        "down_proj" => vec![h, i_],
                        _ => vec![i_, h],
                    };
                    planned.push(tensor(
                        &format!("{module}.{p}.weight"),
                        shape,
                        vec![from(k, layer, p)],
                    ));
                }
            }
        }
    }
    for layer in 0..dims.layers {
        let prefix = format!("model.layers.{layer}.mlp");
        let rows = routers.experts[layer].clone();
        planned.push(tensor(
            &format!("{prefix}.gate.weight"),
            vec![e, h],
            vec![Part::Values(rows)],
        ));
        if layout == MoeLayout::Qwen2Moe {
            let rows = routers.shared[layer].clone();
            let n = rows.len() / h;
            planned.push(tensor(
                &format!("{prefix}.shared_expert_gate.weight"),
                vec![n, h],
                vec![Part::Values(rows)],
            ));
        }
    }
    if layout == MoeLayout::Qwen2Moe {
        add_zero_biases(base, dims, (&mut planned, &mut zeros), dtype)?;
    }
    Ok((planned, zeros))
}

/// Refuses a base attention bias the layout has no place for: Mixtral has none, Qwen2-MoE none
/// on `o_proj` (Qwen3-MoE takes them all where the config says `attention_bias`).
fn refuse_attention_bias(layout: MoeLayout, name: &str) -> Result<()> {
    let attention_bias = name.contains(".self_attn.") && name.ends_with("_proj.bias");
    let refused = match layout {
        MoeLayout::Mixtral => attention_bias,
        MoeLayout::Qwen2Moe => attention_bias && name.ends_with("o_proj.bias"),
        MoeLayout::Qwen3Moe => false,
    };
    match refused {
        true => Err(usage(format!(
            "the base has the attention bias '{name}', which {} has no place for: it would be \
             dropped, and the model would compute something else{}",
            layout.name(),
            match layout {
                MoeLayout::Mixtral =>
                    " (architecture: qwen, with one shared expert, keeps q/k/v biases)",
                _ => "",
            }
        ))),
        false => Ok(()),
    }
}

/// Qwen2-MoE's q/k/v projections have biases: zeros for each the base lacks (as mergekit-moe
/// writes them), named in `zeros`.
fn add_zero_biases(
    base: &ModelFolder,
    dims: Dims,
    (planned, zeros): (&mut Vec<Planned>, &mut Vec<String>),
    dtype: DType,
) -> Result<()> {
    for layer in 0..dims.layers {
        for p in ["q_proj", "k_proj", "v_proj"] {
            let name = format!("model.layers.{layer}.self_attn.{p}.bias");
            if base.get(&name).is_some() {
                continue;
            }
            let weight = format!("model.layers.{layer}.self_attn.{p}.weight");
            let rows = base.get(&weight).map(|t| t.entry.shape[0]).ok_or_else(|| {
                usage(format!(
                    "the base has no '{weight}': Qwen2-MoE's attention is Llama-style q/k/v/o"
                ))
            })?;
            planned.push(Planned {
                out: OutputTensor {
                    name: name.as_str().into(),
                    dtype,
                    shape: vec![rows].into(),
                },
                parts: vec![Part::Zeros(rows)],
            });
            zeros.push(name);
        }
    }
    Ok(())
}

/// The expert of `k` (routed experts first, then shared).
pub fn expert_of(config: &MoeConfig, k: usize) -> &Expert {
    let e = config.experts.len();
    match k < e {
        true => &config.experts[k],
        false => &config.shared_experts[k - e],
    }
}
