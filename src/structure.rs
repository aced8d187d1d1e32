//! What a model is made of: its decoder's stack of layers, the multi-token-prediction (MTP)
//! layers that extend it, and the towers beside it (vision, audio) — read from its tensor names
//! ([`crate::names`]) and, where the names alone cannot tell, its config.json: which numbered
//! stack is the decoder, how many layers it has, and whether MTP layers are stored after them
//! under the same prefix (DeepSeek-V3's `model.layers.{num_hidden_layers}`). Slices move the
//! decoder's layers only, layer gradients run over them, and λ's layer and module scopes group
//! tensors by stack (SPEC §3).

use crate::names::{self, Module, Stack};
use std::collections::{BTreeMap, BTreeSet};

/// The keys of a config.json that count layers (the first one present is the model's count).
pub const LAYER_COUNT_KEYS: [&str; 3] = ["num_hidden_layers", "n_layer", "num_layers"];

/// The keys of a config.json that count MTP layers.
pub const MTP_COUNT_KEYS: [&str; 3] = [
    "num_nextn_predict_layers",
    "mtp_num_hidden_layers",
    "num_mtp_layers",
];

/// The config that describes the decoder: a multimodal model's `text_config` when the top level
/// has no layer count, else the top level.
pub fn decoder_config(config: &serde_json::Value) -> &serde_json::Value {
    match config.get("text_config") {
        Some(text) if top_layer_count(config).is_none() && top_layer_count(text).is_some() => text,
        _ => config,
    }
}

/// [`decoder_config`], to edit (a sliced output's layer count and per-layer lists).
pub fn decoder_config_mut(config: &mut serde_json::Value) -> &mut serde_json::Value {
    let top = std::ptr::eq(decoder_config(config), config);
    match top {
        false => config.get_mut("text_config").expect("the decoder's config"),
        true => config,
    }
}

/// The layer count at a config's top level (not in `text_config`).
pub fn top_layer_count(config: &serde_json::Value) -> Option<usize> {
    count_of(config, &LAYER_COUNT_KEYS)
}

fn count_of(config: &serde_json::Value, keys: &[&str]) -> Option<usize> {
    keys.iter()
        .find_map(|k| config.get(k).and_then(whole_number))
        .map(|n| n as usize)
}

/// A count in a config: `2`, or `2.0` as some tools write it.
pub fn whole_number(v: &serde_json::Value) -> Option<u64> {
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

/// A model's MTP layer count from its config.json (0 where it names none).
pub fn mtp_count(config: &serde_json::Value) -> usize {
    count_of(decoder_config(config), &MTP_COUNT_KEYS).unwrap_or(0)
}

/// The decoder's layer stack in a model's tensor names: the prefix (`model.layers`,
/// `model.language_model.layers`, `transformer.h`) under which the layers its config counts are
/// numbered `0..layers`, and the MTP layers numbered after them under the same prefix (`tail`:
/// DeepSeek-V3 and GLM-4.5 store theirs so). Other numbered stacks — a vision tower's layers, an
/// audio encoder's, `mtp.layers` — are not the decoder's, and slices leave them whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerStack {
    pub prefix: String,
    pub layers: usize,
    pub tail: usize,
}

impl LayerStack {
    /// The stack of the model whose tensor names are `names` and whose config.json is `config`
    /// (`what` names it in errors): the one numbered exactly `0..N` (or `0..N + MTP layers`)
    /// with N the config's layer count; where several are, the one that is not a vision, audio
    /// or encoder stack. A config whose count no stack in the files has is refused: the output's
    /// config would claim layers the output lacks.
    pub fn find<'a>(
        names: impl Iterator<Item = &'a str>,
        config: &serde_json::Value,
        what: &str,
    ) -> anyhow::Result<LayerStack> {
        let Some(count) = layer_count(config) else {
            anyhow::bail!("{what}: config.json gives no layer count (num_hidden_layers)");
        };
        let mtp = mtp_count(config);
        let mut stacks: BTreeMap<String, BTreeSet<usize>> = Default::default();
        for name in names {
            if let Some((prefix, i)) = names::numbered(name) {
                stacks.entry(prefix.to_string()).or_default().insert(i);
            }
        }
        // The layers the stack holds after the decoder's: none, or the config's MTP layers.
        let tail = |set: &BTreeSet<usize>| {
            let numbered = |n: usize| set.len() == n && set.iter().next_back() == Some(&(n - 1));
            if count > 0 && numbered(count) {
                Some(0)
            } else if count > 0 && mtp > 0 && numbered(count + mtp) {
                Some(mtp)
            } else {
                None
            }
        };
        let candidates: Vec<(&String, usize)> = stacks
            .iter()
            .filter_map(|(p, set)| tail(set).map(|t| (p, t)))
            .collect();
        let other = |p: &str| {
            names::tower_of(p).is_some() || ["encoder", "mm_"].iter().any(|w| p.contains(w))
        };
        // Not a vision, audio, MTP or encoder stack — unless the model has no other numbered
        // stack.
        let decoder: Vec<&(&String, usize)> =
            candidates.iter().filter(|(p, _)| !other(p)).collect();
        let chosen = match (decoder.as_slice(), candidates.as_slice()) {
            ([one], _) => Some(**one),
            ([], [one]) if stacks.keys().all(|p| other(p)) => Some(*one),
            _ => None,
        };
        if let Some((prefix, tail)) = chosen {
            return Ok(LayerStack {
                prefix: prefix.clone(),
                layers: count,
                tail,
            });
        }
        let found: Vec<String> = stacks
            .iter()
            .map(|(p, set)| format!("{} ({} layers)", crate::escape::terminal(p), set.len()))
            .collect();
        anyhow::bail!(
            "{what}: config.json counts {count} decoder layers{}, but {} (found: {})",
            if mtp > 0 {
                format!(" and {mtp} MTP layers")
            } else {
                String::new()
            },
            if candidates.is_empty() {
                "no stack of layers in its weights is numbered 0 to that".to_string()
            } else {
                format!(
                    "no single decoder stack is numbered so ({} are, a vision, audio or encoder \
                     stack, or several)",
                    candidates
                        .iter()
                        .map(|(p, _)| crate::escape::terminal(p).into_owned())
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

    /// The number under this stack's prefix of tensor `name`, decoder or MTP layer.
    fn number_of(&self, name: &str) -> Option<usize> {
        names::numbered(name)
            .filter(|(p, _)| *p == self.prefix)
            .map(|(_, i)| i)
    }

    /// The decoder layer tensor `name` belongs to; `None` outside this stack's decoder layers.
    pub fn layer_of(&self, name: &str) -> Option<usize> {
        self.number_of(name).filter(|i| *i < self.layers)
    }

    /// The MTP layer (0, 1, …) tensor `name` belongs to when the MTP layers are stored after the
    /// decoder's under its prefix.
    pub fn mtp_of(&self, name: &str) -> Option<usize> {
        self.number_of(name)
            .filter(|i| *i >= self.layers && *i < self.layers + self.tail)
            .map(|i| i - self.layers)
    }

    /// This stack with `layers` decoder layers (a sliced output's), its MTP layers after them.
    pub fn with_layers(&self, layers: usize) -> LayerStack {
        LayerStack {
            layers,
            ..self.clone()
        }
    }

    /// Where tensor `name` of a model with this decoder stack is (see [`Structure::part`]).
    pub fn part(&self, name: &str) -> Part {
        if let Some(stack) = names::tower_of(name) {
            return Part {
                stack,
                layer: names::layer_index(name),
            };
        }
        match (self.layer_of(name), self.mtp_of(name)) {
            (Some(i), _) => Part {
                stack: Stack::Decoder,
                layer: Some(i),
            },
            (_, Some(j)) => Part {
                stack: Stack::Mtp,
                layer: Some(j),
            },
            _ => Part {
                stack: Stack::Decoder,
                layer: None,
            },
        }
    }

    /// `name` (a tensor of this stack) moved to number `layer` under its prefix.
    pub fn rename(&self, name: &str, layer: usize) -> Option<String> {
        self.number_of(name)?;
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

/// Where a tensor is in its model: its stack, and its layer in that stack where it is in one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Part {
    pub stack: Stack,
    pub layer: Option<usize>,
}

impl Part {
    /// The decoder layer this is, `None` for every tensor outside the decoder's layers.
    pub fn decoder_layer(self) -> Option<usize> {
        (self.stack == Stack::Decoder)
            .then_some(self.layer)
            .flatten()
    }
}

/// A model's stacks (see the module's documentation): the decoder's, where its config.json and
/// tensor names find it, else the names' rule (a tensor of `….layers.N.…` outside the towers is
/// in decoder layer N).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Structure {
    pub decoder: Option<LayerStack>,
}

impl Structure {
    /// The structure of a model with tensors `names` and (where it has one) `config`.
    pub fn of<'a>(
        names: impl Iterator<Item = &'a str>,
        config: Option<&serde_json::Value>,
    ) -> Structure {
        Structure {
            decoder: config.and_then(|c| LayerStack::find(names, c, "").ok()),
        }
    }

    /// This structure with `layers` decoder layers: a sliced output's.
    pub fn with_layers(&self, layers: usize) -> Structure {
        Structure {
            decoder: self.decoder.as_ref().map(|d| d.with_layers(layers)),
        }
    }

    /// Where tensor `name` is.
    pub fn part(&self, name: &str) -> Part {
        match &self.decoder {
            Some(d) => d.part(name),
            None => Part {
                stack: names::tower_of(name).unwrap_or(Stack::Decoder),
                layer: names::layer_index(name),
            },
        }
    }

    /// The decoder's layer count: the config's, else one past the highest decoder layer among
    /// `names`.
    pub fn decoder_layers<'a>(&self, names: impl Iterator<Item = &'a str>) -> usize {
        match &self.decoder {
            Some(d) => d.layers,
            None => names
                .filter_map(|n| self.part(n).decoder_layer())
                .max()
                .map_or(0, |m| m + 1),
        }
    }

    /// The group of tensor `name` whose counts give its λ in layer scope (SPEC §3): `layer N`
    /// for a tensor of decoder layer N; the stack's name (`vision`, `audio`, `mtp`) for a tower's
    /// or the MTP layers'; else the tensor's module kind (embed, norm, lm_head, other).
    pub fn layer_group(part: Part, module: Module) -> String {
        match (part.stack, part.layer) {
            (Stack::Decoder, Some(i)) => format!("layer {i}"),
            (Stack::Decoder, None) => module.name().to_string(),
            (stack, _) => stack.name().to_string(),
        }
    }

    /// The group of a tensor in module scope: its module kind (attn, mlp, …) in the decoder,
    /// prefixed by its stack elsewhere (`vision attn`, `mtp mlp`).
    pub fn module_group(part: Part, module: Module) -> String {
        match part.stack {
            Stack::Decoder => module.name().to_string(),
            stack => format!("{} {}", stack.name(), module.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn mtp_layers_after_the_decoder_and_towers_are_their_own_stacks() {
        let names = [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.layers.1.mlp.experts.0.w1.weight",
            "model.layers.2.eh_proj.weight",
            "model.layers.2.shared_head.head.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.blocks.1.attn.qkv.weight",
            "model.visual.merger.mlp.0.weight",
            "model.norm.weight",
        ];
        let config = serde_json::json!({"num_hidden_layers": 2, "num_nextn_predict_layers": 1});
        let s = Structure::of(names.into_iter(), Some(&config));
        let d = s.decoder.as_ref().expect("a decoder");
        assert_eq!(
            (d.prefix.as_str(), d.layers, d.tail),
            ("model.layers", 2, 1)
        );
        let part = |n: &str| s.part(n);
        assert_eq!(part(names[2]).decoder_layer(), Some(1));
        assert_eq!(
            part(names[3]),
            Part {
                stack: Stack::Mtp,
                layer: Some(0)
            }
        );
        assert_eq!(
            part(names[6]),
            Part {
                stack: Stack::Vision,
                layer: Some(1)
            }
        );
        assert_eq!(part(names[7]).stack, Stack::Vision);
        assert_eq!(
            part(names[0]),
            Part {
                stack: Stack::Decoder,
                layer: None
            }
        );
        assert_eq!(s.decoder_layers(names.into_iter()), 2);
        assert_eq!(Module::of(names[4]), Module::LmHead);
        let group = |n: &str| Structure::layer_group(s.part(n), Module::of(n));
        assert_eq!(group(names[1]), "layer 0");
        assert_eq!(group(names[3]), "mtp");
        assert_eq!(group(names[6]), "vision");
        assert_eq!(group(names[8]), "norm");
        assert_eq!(
            Structure::module_group(s.part(names[5]), Module::of(names[5])),
            "vision attn"
        );
        // Without a config: the names' rule, the towers still apart.
        let bare = Structure::of(names.into_iter(), None);
        assert_eq!(bare.part(names[6]).decoder_layer(), None);
        assert_eq!(bare.decoder_layers(names.into_iter()), 3);
        // A sliced output of 5 layers: the MTP layer is number 5.
        let out = s.with_layers(5);
        assert_eq!(
            out.part("model.layers.5.eh_proj.weight"),
            Part {
                stack: Stack::Mtp,
                layer: Some(0)
            }
        );
    }
}
