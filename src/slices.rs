//! mergekit's `slices`: an output model whose layers are taken, slice by slice, from ranges of the
//! input models' layers — a "frankenmerge" with passthrough, or a merge per slice with any method.
//! Output layers are numbered consecutively; the tensors outside the layers come from the first
//! slice's models (embeddings) or the last one's (final norm, lm_head), as mergekit takes them.

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

    /// The placement of a tensor outside the layers: from the first slice for embeddings
    /// (mergekit's "pre" weights), from the last for everything else (final norm, lm_head: "post"
    /// weights; see [`crate::names::is_embedding`]).
    pub fn outside_layers(&self, embedding: bool) -> Placement {
        Placement {
            slice: if embedding { 0 } else { self.0.len() - 1 },
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

/// The keys of a config.json that count layers (the first one present is the model's count).
pub const LAYER_COUNT_KEYS: [&str; 3] = ["num_hidden_layers", "n_layer", "num_layers"];

/// Config lists with one entry per decoder layer, rebuilt for a sliced output. Only these: a
/// list that merely has as many entries as there are layers (`eos_token_id`, `architectures`)
/// is no per-layer list.
pub const PER_LAYER_LISTS: [&str; 3] = ["layer_types", "no_rope_layers", "block_types"];

/// The config that describes the decoder: a multimodal model's `text_config` when the top level
/// has no layer count, else the top level.
fn decoder_config(config: &serde_json::Value) -> &serde_json::Value {
    match config.get("text_config") {
        Some(text) if top_layer_count(config).is_none() && top_layer_count(text).is_some() => text,
        _ => config,
    }
}

fn top_layer_count(config: &serde_json::Value) -> Option<usize> {
    LAYER_COUNT_KEYS
        .iter()
        .find_map(|k| config.get(k).and_then(whole_number))
        .map(|n| n as usize)
}

/// A count in a config: `2`, or `2.0` as some tools write it.
fn whole_number(v: &serde_json::Value) -> Option<u64> {
    v.as_u64().or_else(|| {
        v.as_f64()
            .filter(|x| x.fract() == 0.0 && *x >= 0.0 && *x <= u32::MAX as f64)
            .map(|x| x as u64)
    })
}

/// A model's decoder layer count from its config.json (a multimodal model's `text_config`'s).
pub fn layer_count(config: &serde_json::Value) -> Option<usize> {
    top_layer_count(decoder_config(config))
}

/// The decoder's layer stack in a model's tensor names: the prefix (`model.layers`,
/// `model.language_model.layers`, `transformer.h`) under which the layers its config counts are
/// numbered `0..layers`. Other numbered stacks — a vision tower's layers, an audio encoder's — are
/// not the decoder's, and slices leave them whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerStack {
    pub prefix: String,
    pub layers: usize,
}

impl LayerStack {
    /// The stack of the model whose tensor names are `names` and whose config.json is `config`
    /// (`what` names it in errors): the one numbered exactly `0..N` with N the config's layer
    /// count; where several are, the one that is not a vision, audio or encoder stack. A config
    /// whose count no stack in the files has is refused: the output's config would claim layers
    /// the output lacks.
    pub fn find<'a>(
        names: impl Iterator<Item = &'a str>,
        config: &serde_json::Value,
        what: &str,
    ) -> anyhow::Result<LayerStack> {
        let Some(count) = layer_count(config) else {
            anyhow::bail!("{what}: config.json gives no layer count (num_hidden_layers)");
        };
        let mut stacks: std::collections::BTreeMap<String, std::collections::BTreeSet<usize>> =
            Default::default();
        for name in names {
            if let Some((prefix, i)) = crate::names::numbered(name) {
                stacks.entry(prefix.to_string()).or_default().insert(i);
            }
        }
        let whole = |set: &std::collections::BTreeSet<usize>| {
            set.len() == count && set.iter().next_back() == Some(&(count - 1))
        };
        let candidates: Vec<&String> = stacks
            .iter()
            .filter(|(_, set)| count > 0 && whole(set))
            .map(|(p, _)| p)
            .collect();
        let other = |p: &str| {
            ["vision", "visual", "audio", "encoder", "image", "mm_"]
                .iter()
                .any(|w| p.contains(w))
        };
        // Not a vision, audio or encoder stack — unless the model has no other numbered stack.
        let decoder: Vec<&&String> = candidates.iter().filter(|p| !other(p)).collect();
        let chosen = match (decoder.as_slice(), candidates.as_slice()) {
            ([one], _) => Some(**one),
            ([], [one]) if stacks.keys().all(|p| other(p)) => Some(*one),
            _ => None,
        };
        match chosen {
            Some(prefix) => Ok(LayerStack {
                prefix: prefix.clone(),
                layers: count,
            }),
            None => {
                let found: Vec<String> = stacks
                    .iter()
                    .map(|(p, set)| {
                        format!("{} ({} layers)", crate::escape::terminal(p), set.len())
                    })
                    .collect();
                anyhow::bail!(
                    "{what}: config.json counts {count} decoder layers, but {} (found: {})",
                    if candidates.is_empty() {
                        "no stack of layers in its weights is numbered 0 to that".to_string()
                    } else {
                        format!(
                            "no single decoder stack is numbered so ({} are, a vision, audio or \
                             encoder stack, or several)",
                            candidates
                                .iter()
                                .map(|p| crate::escape::terminal(p).into_owned())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )
                    },
                    if found.is_empty() {
                        "no numbered layers".to_string()
                    } else {
                        found.join(", ")
                    }
                )
            }
        }
    }

    /// The decoder layer tensor `name` belongs to; `None` outside this stack.
    pub fn layer_of(&self, name: &str) -> Option<usize> {
        crate::names::numbered(name)
            .filter(|(p, _)| *p == self.prefix)
            .map(|(_, i)| i)
    }

    /// `name` (a tensor of this stack) moved to decoder layer `layer`.
    pub fn rename(&self, name: &str, layer: usize) -> Option<String> {
        self.layer_of(name)?;
        let rest = name[self.prefix.len() + 1..]
            .split_once('.')
            .map_or("", |(_, r)| r);
        Some(if rest.is_empty() {
            format!("{}.{layer}", self.prefix)
        } else {
            format!("{}.{layer}.{rest}", self.prefix)
        })
    }
}

impl Slices {
    /// The output's config.json from the base's (`config`): the decoder's layer count set to the
    /// output's (at the top level, or in `text_config` for a multimodal model), and every
    /// [`PER_LAYER_LISTS`] list rebuilt with each output layer's entry from the model and layer it
    /// comes from (`config_of`: each source's config.json). Other lists are kept as they are.
    pub fn rewrite_config(
        &self,
        config: &mut serde_json::Value,
        config_of: &dyn Fn(Source) -> serde_json::Value,
    ) {
        let nested = config.get("text_config").is_some()
            && top_layer_count(config).is_none()
            && config
                .get("text_config")
                .and_then(top_layer_count)
                .is_some();
        let leads: Vec<(serde_json::Value, usize)> = (0..self.0.len())
            .map(|s| {
                let lead = self.lead(s);
                let c = config_of(lead.model);
                (decoder_config(&c).clone(), lead.start)
            })
            .collect();
        let target = if nested {
            config.get_mut("text_config")
        } else {
            Some(config)
        };
        let Some(obj) = target.and_then(|c| c.as_object_mut()) else {
            return;
        };
        if let Some(key) = LAYER_COUNT_KEYS.iter().find(|k| obj.contains_key(**k)) {
            obj.insert(key.to_string(), self.layers().into());
        }
        for key in PER_LAYER_LISTS {
            if !obj.get(key).is_some_and(|v| v.is_array()) {
                continue;
            }
            // A per-layer list in every lead's config.
            let lists: Option<Vec<&Vec<serde_json::Value>>> = leads
                .iter()
                .map(|(c, _)| {
                    let list = c.get(key)?.as_array()?;
                    (Some(list.len()) == top_layer_count(c)).then_some(list)
                })
                .collect();
            let Some(lists) = lists else { continue };
            let rebuilt: Vec<serde_json::Value> = self
                .output_layers()
                .map(|(s, i)| lists[s][leads[s].1 + i].clone())
                .collect();
            obj.insert(key.to_string(), rebuilt.into());
        }
    }
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
    fn the_decoder_stack_is_the_one_the_config_counts() {
        let names = [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.experts.3.w1.weight",
            "model.layers.1.mlp.experts.0.w1.weight",
            "model.vision_tower.encoder.layers.0.q.weight",
            "model.vision_tower.encoder.layers.1.q.weight",
            "model.vision_tower.encoder.layers.2.q.weight",
            "lm_head.weight",
        ];
        assert_eq!(
            layer_count(&serde_json::json!({"num_hidden_layers": 2.0})),
            Some(2)
        );
        let config = serde_json::json!({"num_hidden_layers": 2});
        let stack = LayerStack::find(names.into_iter(), &config, "m").unwrap();
        assert_eq!(stack.prefix, "model.layers");
        assert_eq!(
            stack.layer_of("model.layers.1.mlp.experts.0.w1.weight"),
            Some(1)
        );
        assert_eq!(
            stack.layer_of("model.vision_tower.encoder.layers.1.q.weight"),
            None
        );
        assert_eq!(
            stack
                .rename("model.layers.1.mlp.experts.0.w1.weight", 7)
                .as_deref(),
            Some("model.layers.7.mlp.experts.0.w1.weight")
        );
        // Two stacks of 2: the vision one is not the decoder's.
        let names2 = [
            "a.layers.0.w",
            "a.layers.1.w",
            "vision.blocks.0.w",
            "vision.blocks.1.w",
        ];
        assert_eq!(
            LayerStack::find(names2.into_iter(), &config, "m")
                .unwrap()
                .prefix,
            "a.layers"
        );
        // A config that counts 3 layers the files do not hold.
        let three = serde_json::json!({"text_config": {"num_hidden_layers": 3}});
        let e = LayerStack::find(names.into_iter(), &three, "m")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("counts 3 decoder layers") && e.contains("model.layers (2 layers)"),
            "{e}"
        );
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
        s.rewrite_config(&mut out, &|_| base.clone());
        assert_eq!(out["num_hidden_layers"], 1);
        assert_eq!(out["layer_types"], serde_json::json!(["b"]));
        assert_eq!(out["eos_token_id"], serde_json::json!([1, 2]));
        assert_eq!(out["architectures"], serde_json::json!(["X", "Y"]));
        let nested = serde_json::json!({"text_config": {"num_hidden_layers": 2, "layer_types": ["a", "b"]}, "vision_config": {"num_hidden_layers": 5}});
        let mut out = nested.clone();
        s.rewrite_config(&mut out, &|_| nested.clone());
        assert_eq!(out["text_config"]["num_hidden_layers"], 1);
        assert_eq!(out["text_config"]["layer_types"], serde_json::json!(["b"]));
        assert_eq!(out["vision_config"]["num_hidden_layers"], 5);
    }
}
