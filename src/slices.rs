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
    /// weights; see [`is_embedding`]).
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

/// Whether a tensor outside the layers is an embedding (taken from the first slice).
pub fn is_embedding(name: &str) -> bool {
    crate::report::Module::of(name) == crate::report::Module::Embed
}

/// The keys of a config.json that count layers (the first one present is the model's count).
pub const LAYER_COUNT_KEYS: [&str; 3] = ["num_hidden_layers", "n_layer", "num_layers"];

/// A model's layer count from its config.json.
pub fn layer_count(config: &serde_json::Value) -> Option<usize> {
    LAYER_COUNT_KEYS
        .iter()
        .find_map(|k| config.get(k).and_then(|v| v.as_u64()))
        .map(|n| n as usize)
}

impl Slices {
    /// The output's config.json from the base's (`config`): the layer count set to the output's,
    /// and every per-layer list (a top-level array as long as its model's layer count, such as
    /// `layer_types`) rebuilt with each output layer's entry from the model and layer it comes
    /// from (`config_of`: each source's config.json).
    pub fn rewrite_config(
        &self,
        config: &mut serde_json::Value,
        config_of: &dyn Fn(Source) -> serde_json::Value,
    ) {
        let Some(obj) = config.as_object_mut() else {
            return;
        };
        if let Some(key) = LAYER_COUNT_KEYS.iter().find(|k| obj.contains_key(**k)) {
            obj.insert(key.to_string(), self.layers().into());
        }
        let leads: Vec<(serde_json::Value, usize)> = (0..self.0.len())
            .map(|s| {
                let lead = self.lead(s);
                (config_of(lead.model), lead.start)
            })
            .collect();
        let keys: Vec<String> = obj
            .iter()
            .filter(|(k, v)| v.is_array() && !LAYER_COUNT_KEYS.contains(&k.as_str()))
            .map(|(k, _)| k.clone())
            .collect();
        for key in keys {
            // A per-layer list in every lead's config.
            let lists: Option<Vec<&Vec<serde_json::Value>>> = leads
                .iter()
                .map(|(c, _)| {
                    let list = c.get(&key)?.as_array()?;
                    (Some(list.len()) == layer_count(c)).then_some(list)
                })
                .collect();
            let Some(lists) = lists else { continue };
            let rebuilt: Vec<serde_json::Value> = self
                .output_layers()
                .map(|(s, i)| lists[s][leads[s].1 + i].clone())
                .collect();
            obj.insert(key, rebuilt.into());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_are_renamed_and_placed() {
        use crate::method::settings::rename_layer;
        assert_eq!(
            rename_layer("model.layers.7.mlp.up_proj.weight", 12).as_deref(),
            Some("model.layers.12.mlp.up_proj.weight")
        );
        assert_eq!(
            rename_layer("transformer.h.0.attn.c_attn.weight", 3).as_deref(),
            Some("transformer.h.3.attn.c_attn.weight")
        );
        assert_eq!(rename_layer("model.norm.weight", 3), None);
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
        assert!(is_embedding("model.embed_tokens.weight"));
        assert!(!is_embedding("lm_head.weight") && !is_embedding("model.norm.weight"));
        assert_eq!(s.outside_layers(true).slice, 0);
        assert_eq!(s.outside_layers(false).slice, 1);
    }
}
