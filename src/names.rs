//! Every rule about tensor names, in one leaf module (it uses nothing of the crate): which part
//! of a transformer a tensor is ([`Module`]), which stack it is in by name ([`Stack`],
//! [`tower_of`]), which layer ([`layer_index`]), token-indexed tensors ([`is_token_indexed`]) and numbered
//! stacks ([`numbered`]). What the names alone cannot tell — which numbered stack is the decoder,
//! and MTP layers stored after the decoder's — [`crate::structure`] adds from config.json.

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
        // A part named for both, as LFM2's final `embedding_norm`, is a norm.
        let embedding_norm = n
            .split('.')
            .any(|part| part.contains("embed") && part.contains("norm"));
        // An MTP layer's output head (DeepSeek-V3's `shared_head.head`) is an lm_head.
        if has(&["lm_head", "output.weight", "shared_head.head"]) {
            Module::LmHead
        } else if embedding_norm {
            Module::Norm
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
            "moe",
            "router",
        ]) || n.split('.').any(|part| part == "gate")
        {
            // A MoE block's router (`block_sparse_moe.gate`, `mlp.gate`) is part of its MLP.
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

/// The stacks of blocks a model is made of: the decoder, the multi-token-prediction layers that
/// extend it (Qwen3.5's `mtp.*`, DeepSeek-V3's layers after its last), and the encoder towers
/// whose output the decoder reads (a vision tower with its merger or projector, an audio tower).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stack {
    Decoder,
    Mtp,
    Vision,
    Audio,
}

impl Stack {
    pub fn name(self) -> &'static str {
        match self {
            Stack::Decoder => "decoder",
            Stack::Mtp => "mtp",
            Stack::Vision => "vision",
            Stack::Audio => "audio",
        }
    }
}

/// The stack a tensor's name puts it in when the name says (`model.visual.…`,
/// `model.vision_tower.…`, `model.multi_modal_projector.…`, `audio_tower.…`, `mtp.…`); `None`
/// for the decoder's and the model's own tensors.
pub fn tower_of(name: &str) -> Option<Stack> {
    let n = name.to_ascii_lowercase();
    let parts: Vec<&str> = n.split('.').collect();
    let any = |words: &[&str]| parts.iter().any(|p| words.iter().any(|w| p.contains(w)));
    if any(&["audio", "speech", "whisper"]) {
        Some(Stack::Audio)
    } else if any(&[
        "vision",
        "visual",
        "image",
        "multi_modal_projector",
        "mm_projector",
        "patch_embed",
    ]) {
        Some(Stack::Vision)
    } else if parts
        .iter()
        .any(|p| *p == "mtp" || p.starts_with("mtp_") || p.contains("nextn"))
    {
        Some(Stack::Mtp)
    } else {
        None
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

/// Whether a tensor is indexed by token: the embeddings or the output head (an MTP layer's too),
/// not a tower's patch or position embeddings.
pub fn is_token_indexed(name: &str) -> bool {
    matches!(Module::of(name), Module::Embed | Module::LmHead)
        && !matches!(tower_of(name), Some(Stack::Vision | Stack::Audio))
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
        assert_eq!(
            Module::of("model.layers.3.mlp.down_proj.weight"),
            Module::Mlp
        );
        assert_eq!(
            Module::of("model.layers.3.input_layernorm.weight"),
            Module::Norm
        );
        assert_eq!(Module::of("rotary.inv_freq"), Module::Other);
        // A final norm named for the embeddings, routers, an MTP layer's head.
        assert_eq!(Module::of("model.embedding_norm.weight"), Module::Norm);
        assert_eq!(
            Module::of("model.layers.0.block_sparse_moe.gate.weight"),
            Module::Mlp
        );
        assert_eq!(
            Module::of("model.layers.4.shared_head.head.weight"),
            Module::LmHead
        );
        assert_eq!(
            Module::of("model.vision_tower.embeddings.patch_embedding.weight"),
            Module::Embed
        );
        assert_eq!(
            tower_of("model.visual.merger.mlp.0.weight"),
            Some(Stack::Vision)
        );
        assert_eq!(
            tower_of("model.multi_modal_projector.mm_input_projection_weight"),
            Some(Stack::Vision)
        );
        assert_eq!(
            tower_of("mtp.layers.0.mlp.up_proj.weight"),
            Some(Stack::Mtp)
        );
        assert_eq!(tower_of("mtp.fc.weight"), Some(Stack::Mtp));
        assert_eq!(
            tower_of("model.audio_tower.layers.0.fc1.weight"),
            Some(Stack::Audio)
        );
        assert_eq!(tower_of("model.layers.0.mlp.gate.weight"), None);
        assert_eq!(tower_of("model.embed_tokens.weight"), None);
        assert!(is_token_indexed("lm_head.weight"));
        assert_eq!(
            numbered("model.layers.3.mlp.experts.1.w"),
            Some(("model.layers", 3))
        );
        assert_eq!(numbered("model.norm.weight"), None);
    }
}
