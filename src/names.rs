//! Every rule about tensor names, in one leaf module (it uses nothing of the crate): which part
//! of a transformer a tensor is ([`Module`]), which layer ([`layer_index`]), the λ group of the
//! layer scope ([`layer_group`]), embeddings ([`is_embedding`]) and numbered stacks
//! ([`numbered`]). The report, the slices, the vocabulary and the methods read names through it.

use serde::Serialize;

/// Which part of a transformer a tensor belongs to, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Module {
    Embed,
    Attn,
    Mlp,
    Norm,
    LmHead,
    Other,
}

impl Module {
    pub fn of(name: &str) -> Module {
        let n = name.to_ascii_lowercase();
        let has = |parts: &[&str]| parts.iter().any(|p| n.contains(p));
        if has(&["lm_head", "output.weight"]) {
            Module::LmHead
        } else if has(&["embed", "wte", "wpe", "tok_embeddings"]) {
            Module::Embed
        } else if has(&["norm", "ln_", ".ln"]) {
            Module::Norm
        } else if has(&[
            "attn",
            "attention",
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "qkv",
        ]) {
            Module::Attn
        } else if has(&[
            "mlp",
            "gate_proj",
            "up_proj",
            "down_proj",
            "fc1",
            "fc2",
            "feed_forward",
            "experts",
        ]) {
            Module::Mlp
        } else {
            Module::Other
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Module::Embed => "embed",
            Module::Attn => "attn",
            Module::Mlp => "mlp",
            Module::Norm => "norm",
            Module::LmHead => "lm_head",
            Module::Other => "other",
        }
    }
}

/// The layer number of a tensor from names like `model.layers.7.mlp…` (`Some(7)`), `None` for
/// tensors outside the layers (embeddings, the final norm); [`layer_t`] turns it into t.
pub fn layer_index(name: &str) -> Option<usize> {
    layer_part(&name.split('.').collect::<Vec<_>>()).map(|(_, layer)| layer)
}

/// Which of a name's dot-separated parts is its layer number (the first number after `layers`,
/// `h`, `blocks` or `layer`), and the number.
fn layer_part(parts: &[&str]) -> Option<(usize, usize)> {
    (1..parts.len()).find_map(|i| {
        matches!(parts[i - 1], "layers" | "h" | "blocks" | "layer")
            .then(|| parts[i].parse().ok().map(|layer| (i, layer)))
            .flatten()
    })
}

/// The group a tensor's λ comes from in layer scope (SPEC §3): "layer N" for a tensor of layer N,
/// else its module kind (embed, norm, lm_head, other).
pub fn layer_group(name: &str) -> String {
    match layer_index(name) {
        Some(i) => format!("layer {i}"),
        None => Module::of(name).name().to_string(),
    }
}

/// Whether a tensor outside the layers is an embedding (a slice takes it from the first slice).
pub fn is_embedding(name: &str) -> bool {
    Module::of(name) == Module::Embed
}

/// Whether a tensor is indexed by token: the embeddings or the output head.
pub fn is_token_indexed(name: &str) -> bool {
    matches!(Module::of(name), Module::Embed | Module::LmHead)
}

/// A name's first numbered component: the prefix before it and the number
/// (`model.layers.3.mlp.up_proj.weight` → `("model.layers", 3)`).
pub fn numbered(name: &str) -> Option<(&str, usize)> {
    let mut at = 0;
    for part in name.split('.') {
        if at > 0 && !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()) {
            return Some((&name[..at - 1], part.parse().ok()?));
        }
        at += part.len() + 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_layers_and_stacks_from_names() {
        assert_eq!(Module::of("model.embed_tokens.weight"), Module::Embed);
        assert_eq!(
            Module::of("model.layers.0.self_attn.q_proj.weight"),
            Module::Attn
        );
        assert_eq!(Module::of("model.norm.weight"), Module::Norm);
        assert_eq!(Module::of("lm_head.weight"), Module::LmHead);
        assert_eq!(layer_index("model.layers.12.mlp.up_proj.weight"), Some(12));
        assert_eq!(layer_index("transformer.h.3.attn.c_attn.weight"), Some(3));
        assert_eq!(layer_index("model.embed_tokens.weight"), None);
        assert_eq!(layer_group("model.layers.2.mlp.up_proj.weight"), "layer 2");
        assert_eq!(layer_group("model.norm.weight"), "norm");
        assert!(is_embedding("model.embed_tokens.weight"));
        assert!(!is_embedding("lm_head.weight") && !is_embedding("model.norm.weight"));
        assert!(is_token_indexed("lm_head.weight"));
        assert_eq!(
            numbered("model.layers.3.mlp.experts.1.w"),
            Some(("model.layers", 3))
        );
        assert_eq!(numbered("model.norm.weight"), None);
    }
}
