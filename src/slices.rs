//! mergekit's `slices`: an output model whose layers are taken, slice by slice, from ranges of the
//! input models' layers — a "frankenmerge" with passthrough, or a merge per slice with any method.
//! Output layers are numbered consecutively; each module outside the decoder's layers comes whole
//! from the first slice's models (embeddings, vision and audio towers) or the last one's (final
//! norm, lm_head, MTP layers), as mergekit takes the embeddings and the head
//! ([`crate::structure`] says which stack a tensor is in). Per-layer lists — written, or derived
//! from each layer's index as transformers derives them — follow the layers
//! ([`crate::model_config::layers`]).

use crate::model_config::layers::{derived, index_rule_key, per_layer_list, PER_LAYER_LISTS};
use crate::structure::{decoder_config, decoder_config_mut, whole_number, LAYER_COUNT_KEYS};
use serde::{Deserialize, Serialize};

/// Which input a slice source is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The base model (θ₀ of the slice).
    Base,
    /// Agent t (in the order of the merge's models).
    Agent(usize),
}

/// One slice: `len` output layers; output layer i takes layer `start + i` of each source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slice {
    pub sources: Vec<SliceSource>,
    pub len: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SliceSource {
    pub model: Source,
    pub start: usize,
}

/// The slices of a merge, in output order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Slices(pub Vec<Slice>);

/// Where an output tensor of a sliced merge comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Placement {
    /// The slice whose sources and parameters it takes.
    pub slice: usize,
    /// Its position for parameter gradients: i / (len − 1) within the slice (1 for a slice of
    /// one layer), 0 outside the layers — mergekit's.
    pub t: f64,
}

impl Slices {
    /// Output layers in all.
    pub fn layers(&self) -> usize {
        self.0.iter().map(|s| s.len).sum()
    }

    /// Each output layer's (slice, offset within it), in output order.
    pub fn output_layers(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.0
            .iter()
            .enumerate()
            .flat_map(|(s, slice)| (0..slice.len).map(move |i| (s, i)))
    }

    /// The placement of output layer offset `i` of slice `s`.
    pub fn placement(&self, s: usize, i: usize) -> Placement {
        let len = self.0[s].len;
        Placement {
            slice: s,
            t: if len > 1 {
                i as f64 / (len - 1) as f64
            } else {
                1.0
            },
        }
    }

    /// The placement of a tensor outside the decoder's layers: from the first slice for the
    /// embeddings and the towers (mergekit's "pre" weights), from the last for everything else
    /// (final norm, lm_head, MTP layers: "post" weights).
    pub fn outside_layers(&self, first: bool) -> Placement {
        Placement {
            slice: if first { 0 } else { self.0.len() - 1 },
            t: 0.0,
        }
    }

    /// The source whose tensors name and shape slice `s`'s output: its base source when it has
    /// one, else its first.
    pub fn lead(&self, s: usize) -> SliceSource {
        let sources = &self.0[s].sources;
        *sources
            .iter()
            .find(|x| x.model == Source::Base)
            .unwrap_or(&sources[0])
    }
}

/// Config lists of decoder layer numbers (the layers with a property: Qwen-MoE's dense
/// `mlp_only_layers`, LFM2's `full_attn_idxs`), rebuilt for a sliced output: output layer j is
/// listed when the layer it comes from is listed in its model's config.
pub const LAYER_INDEX_LISTS: [&str; 2] = ["mlp_only_layers", "full_attn_idxs"];

impl Slices {
    /// The output's config.json from the base's (`config`): the decoder's layer count set to the
    /// output's (at the top level, or in `text_config` for a multimodal model), every
    /// [`PER_LAYER_LISTS`] and [`LAYER_INDEX_LISTS`] list rebuilt from the model and layer each
    /// output layer comes from (`config_of`: each source's config.json), and the keys that say
    /// which layers are dense and which MoE (`first_k_dense_replace`) set for the output's
    /// order. An order those keys cannot say — a dense layer after a MoE one where the config
    /// only counts the first k dense layers — is refused naming the key: the loader would build
    /// the layer with the wrong MLP. Other keys are kept as they are.
    pub fn rewrite_config(
        &self,
        config: &mut serde_json::Value,
        config_of: &dyn Fn(Source) -> serde_json::Value,
    ) -> anyhow::Result<()> {
        let leads: Vec<(serde_json::Value, usize)> = (0..self.0.len())
            .map(|s| {
                let lead = self.lead(s);
                let c = config_of(lead.model);
                (decoder_config(&c).clone(), lead.start)
            })
            .collect();
        let Some(obj) = decoder_config_mut(config).as_object_mut() else {
            return Ok(());
        };
        if let Some(key) = LAYER_COUNT_KEYS.iter().find(|k| obj.contains_key(**k)) {
            obj.insert(key.to_string(), self.layers().into());
        }
        for key in PER_LAYER_LISTS {
            // Every lead's list, written or derived from its layers' index (issue #50 item 2).
            let lists: Option<Vec<Vec<serde_json::Value>>> =
                leads.iter().map(|(c, _)| per_layer_list(c, key)).collect();
            let Some(lists) = lists else { continue };
            let rebuilt: Vec<serde_json::Value> = self
                .output_layers()
                .map(|(s, i)| lists[s][leads[s].1 + i].clone())
                .collect();
            // A list the output's config does not write is written where its model type's rule
            // would give the output's layers other values (where it has none, its loader does
            // not read the list).
            let written = obj.get(key).is_some_and(|v| v.is_array());
            let own = derived(&serde_json::Value::Object(obj.clone()), key, self.layers());
            if written || own.is_some_and(|own| own != rebuilt) {
                obj.insert(key.to_string(), rebuilt.into());
            }
        }
        self.refuse_unknown_index_rule(obj, &leads)?;
        for key in LAYER_INDEX_LISTS {
            if !obj.get(key).is_some_and(|v| v.is_array()) {
                continue;
            }
            let listed = |s: usize, layer: usize| {
                leads[s]
                    .0
                    .get(key)
                    .and_then(|v| v.as_array())
                    .is_some_and(|l| l.iter().any(|x| whole_number(x) == Some(layer as u64)))
            };
            let rebuilt: Vec<serde_json::Value> = self
                .output_layers()
                .enumerate()
                .filter(|(_, (s, i))| listed(*s, leads[*s].1 + i))
                .map(|(j, _)| j.into())
                .collect();
            obj.insert(key.to_string(), rebuilt.into());
        }
        self.set_moe_order(obj, &leads)
    }

    /// Refuses to move layers of a config whose layers' kind is a rule over their index that
    /// rlmerge does not know (`model_config::layers::index_rule_key`): the output's layers would
    /// change kind silently.
    fn refuse_unknown_index_rule(
        &self,
        obj: &serde_json::Map<String, serde_json::Value>,
        leads: &[(serde_json::Value, usize)],
    ) -> anyhow::Result<()> {
        let Some(key) = index_rule_key(&serde_json::Value::Object(obj.clone())) else {
            return Ok(());
        };
        let moved = self
            .output_layers()
            .enumerate()
            .find(|(j, (s, i))| leads[*s].1 + i != *j);
        if let Some((j, (s, i))) = moved {
            anyhow::bail!(
                "slice {} puts layer {} of its model at output layer {j}, and the config derives \
                 each layer's kind from its index ('{key}') by a rule rlmerge does not know for \
                 this model type: the layer would change kind silently. Give the models' \
                 config.json an explicit layer_types list, or keep every layer at its index",
                s + 1,
                leads[s].1 + i
            );
        }
        Ok(())
    }

    /// The dense/MoE order of the output's layers, said by the output's config (see
    /// [`Self::rewrite_config`]).
    fn set_moe_order(
        &self,
        obj: &mut serde_json::Map<String, serde_json::Value>,
        leads: &[(serde_json::Value, usize)],
    ) -> anyhow::Result<()> {
        let wanted: Vec<Option<bool>> = self
            .output_layers()
            .map(|(s, i)| moe_layer(&leads[s].0, leads[s].1 + i))
            .collect();
        if wanted.iter().all(Option::is_none) {
            return Ok(());
        }
        let config = serde_json::Value::Object(obj.clone());
        if config.get("mlp_layer_types").is_none()
            && config.get("first_k_dense_replace").is_none()
            && config.get("mlp_only_layers").is_some_and(|v| v.is_array())
        {
            // Qwen-MoE: every layer that is dense listed (the rest follow decoder_sparse_step).
            let dense: Vec<serde_json::Value> = (0..wanted.len())
                .filter(|j| wanted[*j] == Some(false))
                .map(|j| j.into())
                .collect();
            obj.insert("mlp_only_layers".into(), dense.into());
        }
        if config.get("mlp_layer_types").is_none() && config.get("first_k_dense_replace").is_some()
        {
            // The first k layers dense, for the k that gives the output's order.
            let fits = |k: usize| {
                let mut c = config.clone();
                c["first_k_dense_replace"] = k.into();
                (0..wanted.len()).all(|j| moe_layer(&c, j) == wanted[j])
            };
            if let Some(k) = (0..=wanted.len()).find(|k| fits(*k)) {
                obj.insert("first_k_dense_replace".into(), k.into());
            }
        }
        let config = serde_json::Value::Object(obj.clone());
        let Some(mut j) = (0..wanted.len()).find(|j| moe_layer(&config, *j) != wanted[*j]) else {
            return Ok(());
        };
        if moe_key(&config) == "first_k_dense_replace" {
            // The layer to blame: the first dense one after a MoE one.
            j = (0..wanted.len())
                .find(|i| wanted[*i] == Some(false) && wanted[..*i].contains(&Some(true)))
                .unwrap_or(j);
        }
        let (s, i) = self.output_layers().nth(j).expect("an output layer");
        let kind = |moe: Option<bool>| match moe {
            Some(true) => "a MoE layer",
            Some(false) => "a dense layer",
            None => "a layer",
        };
        anyhow::bail!(
            "slice {} puts {} (layer {} of its model) at output layer {j}, where the output's \
             config.json key '{}' can only make {}: no value of it gives the slices' order of \
             dense and MoE layers — reorder the slices so that the dense layers come first",
            s + 1,
            kind(wanted[j]),
            leads[s].1 + i,
            moe_key(&config),
            kind(moe_layer(&config, j))
        )
    }
}

/// Whether decoder layer `i` of a model with (decoder) config `config` is a MoE layer, as its
/// loader decides: `mlp_layer_types[i]` (GLM-4.7-Flash), `first_k_dense_replace` and
/// `moe_layer_freq` (DeepSeek, GLM-4.5), `mlp_only_layers` and `decoder_sparse_step` (Qwen-MoE);
/// `None` where the config says nothing of it (every layer alike).
fn moe_layer(config: &serde_json::Value, i: usize) -> Option<bool> {
    if let Some(list) = config.get("mlp_layer_types").and_then(|v| v.as_array()) {
        return list.get(i).and_then(|v| v.as_str()).map(|v| v == "sparse");
    }
    let number = |key: &str| config.get(key).and_then(whole_number);
    if let Some(k) = number("first_k_dense_replace") {
        let every = number("moe_layer_freq").unwrap_or(1).max(1);
        return Some(i as u64 >= k && (i as u64).is_multiple_of(every));
    }
    if config.get("mlp_only_layers").is_some() || config.get("decoder_sparse_step").is_some() {
        let dense = config
            .get("mlp_only_layers")
            .and_then(|v| v.as_array())
            .is_some_and(|l| l.iter().any(|x| whole_number(x) == Some(i as u64)));
        let step = number("decoder_sparse_step").unwrap_or(1).max(1);
        return Some(!dense && (i as u64 + 1).is_multiple_of(step));
    }
    None
}

/// The key of `config` that [`moe_layer`] reads.
fn moe_key(config: &serde_json::Value) -> &'static str {
    [
        "mlp_layer_types",
        "first_k_dense_replace",
        "decoder_sparse_step",
    ]
    .into_iter()
    .find(|k| config.get(*k).is_some())
    .unwrap_or("mlp_only_layers")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_renamed_and_placed() {
        let s = Slices(vec![
            Slice {
                sources: vec![SliceSource {
                    model: Source::Agent(0),
                    start: 0,
                }],
                len: 3,
            },
            Slice {
                sources: vec![SliceSource {
                    model: Source::Agent(1),
                    start: 5,
                }],
                len: 1,
            },
        ]);
        assert_eq!(s.layers(), 4);
        assert_eq!(
            s.output_layers().collect::<Vec<_>>(),
            [(0, 0), (0, 1), (0, 2), (1, 0)]
        );
        assert_eq!(s.placement(0, 1).t, 0.5);
        assert_eq!(s.placement(1, 0).t, 1.0);
        assert_eq!(s.outside_layers(true).slice, 0);
        assert_eq!(s.outside_layers(false).slice, 1);
    }

    #[test]
    fn only_per_layer_lists_are_rebuilt() {
        let s = Slices(vec![Slice {
            sources: vec![SliceSource {
                model: Source::Agent(0),
                start: 1,
            }],
            len: 1,
        }]);
        let base = serde_json::json!({
            "num_hidden_layers": 2, "layer_types": ["a", "b"], "eos_token_id": [1, 2],
            "architectures": ["X", "Y"]
        });
        let mut out = base.clone();
        s.rewrite_config(&mut out, &|_| base.clone()).unwrap();
        assert_eq!(out["num_hidden_layers"], 1);
        assert_eq!(out["layer_types"], serde_json::json!(["b"]));
        assert_eq!(out["eos_token_id"], serde_json::json!([1, 2]));
        assert_eq!(out["architectures"], serde_json::json!(["X", "Y"]));
        let nested = serde_json::json!({"text_config": {"num_hidden_layers": 2, "layer_types": ["a", "b"]}, "vision_config": {"num_hidden_layers": 5}});
        let mut out = nested.clone();
        s.rewrite_config(&mut out, &|_| nested.clone()).unwrap();
        assert_eq!(out["text_config"]["num_hidden_layers"], 1);
        assert_eq!(out["text_config"]["layer_types"], serde_json::json!(["b"]));
        assert_eq!(out["vision_config"]["num_hidden_layers"], 5);
    }

    fn ranges(ranges: &[(usize, usize)]) -> Slices {
        Slices(
            ranges
                .iter()
                .map(|&(start, len)| Slice {
                    sources: vec![SliceSource {
                        model: Source::Agent(0),
                        start,
                    }],
                    len,
                })
                .collect(),
        )
    }

    #[test]
    fn dense_and_moe_layers_keep_their_order_or_are_refused() {
        // DeepSeek-V3: layer 0 dense, 1-3 MoE.
        let ds = serde_json::json!({"num_hidden_layers": 4, "first_k_dense_replace": 1});
        let mut out = ds.clone();
        ranges(&[(0, 2), (0, 1), (1, 3)])
            .rewrite_config(&mut out, &|_| ds.clone())
            .map(|_| ())
            .unwrap_err();
        let mut out = ds.clone();
        ranges(&[(0, 1), (0, 1), (2, 2)])
            .rewrite_config(&mut out, &|_| ds.clone())
            .unwrap();
        assert_eq!(out["first_k_dense_replace"], 2);
        assert_eq!(out["num_hidden_layers"], 4);
        let mut out = ds.clone();
        let e = ranges(&[(1, 2), (0, 1)])
            .rewrite_config(&mut out, &|_| ds.clone())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'first_k_dense_replace'") && e.contains("output layer 2"),
            "{e}"
        );
        // GLM-4.7-Flash: a per-layer list follows the layers.
        let glm =
            serde_json::json!({"num_hidden_layers": 2, "mlp_layer_types": ["dense", "sparse"]});
        let mut out = glm.clone();
        ranges(&[(1, 1), (0, 2)])
            .rewrite_config(&mut out, &|_| glm.clone())
            .unwrap();
        assert_eq!(
            out["mlp_layer_types"],
            serde_json::json!(["sparse", "dense", "sparse"])
        );
        // Qwen-MoE: the dense layers' numbers follow them.
        let qwen = serde_json::json!({"num_hidden_layers": 3, "mlp_only_layers": [0], "decoder_sparse_step": 1});
        let mut out = qwen.clone();
        ranges(&[(1, 2), (0, 1)])
            .rewrite_config(&mut out, &|_| qwen.clone())
            .unwrap();
        assert_eq!(out["mlp_only_layers"], serde_json::json!([2]));
        // Every second layer MoE: a slice that breaks the rhythm is refused.
        let step = serde_json::json!({"num_hidden_layers": 4, "decoder_sparse_step": 2});
        let mut out = step.clone();
        let e = ranges(&[(1, 1), (3, 1)])
            .rewrite_config(&mut out, &|_| step.clone())
            .unwrap_err()
            .to_string();
        assert!(e.contains("'decoder_sparse_step'"), "{e}");
    }

    #[test]
    fn hostile_layer_keys_neither_panic_nor_pass_silently() {
        // Keys of the wrong type, absurd sizes, zero steps: each config is either rewritten or
        // refused with an error; nothing panics or overflows.
        let configs = [
            serde_json::json!({"num_hidden_layers": 4, "first_k_dense_replace": 1e300}),
            serde_json::json!({"num_hidden_layers": 4, "first_k_dense_replace": -1}),
            serde_json::json!({"num_hidden_layers": 4, "first_k_dense_replace": 1, "moe_layer_freq": 0}),
            serde_json::json!({"num_hidden_layers": 4, "decoder_sparse_step": 0}),
            serde_json::json!({"num_hidden_layers": 4, "mlp_only_layers": ["x", null, 1e300, -3]}),
            serde_json::json!({"num_hidden_layers": 4, "mlp_layer_types": ["dense", 7, null]}),
            serde_json::json!({"num_hidden_layers": 4, "mlp_layer_types": "sparse"}),
            serde_json::json!({"num_hidden_layers": 4, "layer_types": [[], {}, "a", 1]}),
            serde_json::json!({"num_hidden_layers": 4, "full_attn_idxs": {"0": 1}}),
            serde_json::json!({"num_hidden_layers": 4, "num_nextn_predict_layers": u32::MAX}),
        ];
        for config in configs {
            for slices in [
                ranges(&[(0, 4)]),
                ranges(&[(2, 2), (0, 2)]),
                ranges(&[(3, 1); 3]),
            ] {
                let mut out = config.clone();
                if slices.rewrite_config(&mut out, &|_| config.clone()).is_ok() {
                    assert_eq!(out["num_hidden_layers"], slices.layers(), "{config}");
                }
            }
        }
        // A huge MTP count is no stack the files hold.
        let names = ["m.layers.0.w", "m.layers.1.w", "m.layers.2.w"];
        let config = serde_json::json!({"num_hidden_layers": 2, "num_nextn_predict_layers": u64::from(u32::MAX)});
        assert!(crate::structure::LayerStack::find(names.into_iter(), &config, "m").is_err());
    }
}
