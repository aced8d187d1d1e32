"""Tiny random checkpoints of real architectures, built with transformers, for the architecture
suite (test_architectures.py): a config per model type, small enough that building, merging and
loading all of them takes seconds, with every structural feature the real models have (experts,
dense-then-MoE layers, hybrid attention, vision towers, MTP layers)."""

# Sizes shared by every text config: 4 decoder layers so that slices can reorder them, and vision
# towers deeper than the decoder so that counting their blocks as layers shows.
LAYERS = 4
TEXT = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
VISION = dict(depth=LAYERS + 2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def _text(**extra):
    config = dict(TEXT)
    config.update(extra)
    if "qk_rope_head_dim" in extra:
        # MLA: the rotary part of a head sets head_dim, and keys have every head.
        config["head_dim"] = extra["qk_rope_head_dim"]
        config["num_key_value_heads"] = config["num_attention_heads"]
    return config


def configs():
    """model_type -> (config class kwargs, extra tensors the real checkpoints carry beside what
    transformers builds: MTP layers, as (name suffix kind))."""
    return {
        "llama": _text(),
        "qwen2": _text(),
        "qwen3": _text(),
        "mistral": _text(sliding_window=64),
        "phi3": _text(pad_token_id=0),
        "olmo2": _text(),
        "mixtral": _text(num_local_experts=4, num_experts_per_tok=2),
        "qwen3_moe": _text(num_experts=4, mlp_only_layers=[0], **MOE),
        "qwen3_next": _text(num_experts=4, linear_num_value_heads=4, linear_num_key_heads=2,
                            linear_key_head_dim=8, linear_value_head_dim=8, full_attention_interval=2,
                            shared_expert_intermediate_size=16, **MOE),
        "deepseek_v3": _text(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                             kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                             v_head_dim=8, n_group=1, topk_group=1, num_nextn_predict_layers=1, **MOE),
        "glm4_moe": _text(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                          n_group=1, topk_group=1, num_nextn_predict_layers=1, **MOE),
        "glm4_moe_lite": _text(n_routed_experts=4, n_shared_experts=1, kv_lora_rank=16,
                               q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                               n_group=1, topk_group=1, mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
                               num_nextn_predict_layers=1, **MOE),
        "gemma3_text": _text(sliding_window=64, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]),
        "lfm2": _text(layer_types=["conv", "full_attention", "conv", "full_attention"], block_ff_dim=48,
                      block_auto_adjust_ff_dim=False),
        "falcon_h1": _text(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
                           mamba_n_groups=1, mamba_chunk_size=16),
        "qwen3_5_text": _text(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                              linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"] * 2,
                              mtp_num_hidden_layers=1),
        "qwen3_5_moe_text": _text(num_experts=4, linear_num_value_heads=4, linear_num_key_heads=2,
                                  linear_key_head_dim=8, linear_value_head_dim=8,
                                  shared_expert_intermediate_size=16,
                                  layer_types=["linear_attention", "full_attention"] * 2,
                                  mtp_num_hidden_layers=1, **MOE),
        "gemma3": dict(text_config=_text(sliding_window=64), vision_config=dict(
            hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS + 2, num_attention_heads=4,
            image_size=28, patch_size=14), mm_tokens_per_image=4, image_token_index=90,
            boi_token_index=91, eoi_token_index=92),
        "qwen2_5_vl": dict(text_config=_text(rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], rope_theta=10000.0)),
                           vision_config=dict(VISION, fullatt_block_indexes=[1], window_size=28),
                           image_token_id=90, video_token_id=91, vision_start_token_id=92),
        "qwen3_vl_moe": dict(text_config=_text(num_experts=4, rope_parameters=dict(rope_type="default", mrope_section=[1, 1, 2], mrope_interleaved=True, rope_theta=10000.0), **MOE),
                             vision_config=dict(VISION, num_position_embeddings=16, deepstack_visual_indexes=[1]),
                             image_token_id=90, video_token_id=91, vision_start_token_id=92),
    }
