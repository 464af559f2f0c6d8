"""The tiny families `hf_reference.py` writes: their configs at toy size, and the prompts'
shape. Each entry says what its family adds; hf_reference.py's docstring says what is done with
them.
"""

VOCAB = 256
NEW_TOKENS = 32
PROMPT_LENGTHS = (4, 11, 23)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=0,
    tie_word_embeddings=False,
)

OMIT = object()  # a COMMON key the family's config must not be given

# Mamba-2 mixers at toy size (Bamba, Granite 4.0-H, Falcon-H1).
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4,
              mamba_expand=2, mamba_chunk_size=16)

# name: (model_type, extra config). Each exercises what its family adds: Llama 3 rope scaling,
# Mistral's sliding window (shorter than the longest prompt), Qwen2's q/k/v bias, Qwen3's q/k
# norms, Gemma 3's sliding and global layers, soft norms and tied embeddings, and the two
# mixture-of-experts families (Qwen3-MoE with one dense layer and renormalised top-k, Mixtral,
# Qwen2-MoE with its gated shared expert and raw top-k weights).
ARCHS = {
    "llama": ("llama", dict(
        rope_theta=10000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    )),
    "mistral": ("mistral", dict(sliding_window=8, rope_theta=10000.0)),
    "qwen2": ("qwen2", dict(rope_theta=10000.0)),
    "qwen3": ("qwen3", dict(rope_theta=10000.0)),
    "gemma3": ("gemma3_text", dict(
        # Six layers, five sliding and one global: the pattern of every Gemma 3 release (and
        # the one llama.cpp's gemma3 assumes).
        num_hidden_layers=6, sliding_window=8,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_theta=10000.0, rope_local_base_freq=1000.0, query_pre_attn_scalar=16,
        tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    )),
    "qwen3-moe": ("qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        mlp_only_layers=[1], rope_theta=10000.0,
    )),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0)),
    "qwen2-moe": ("qwen2_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, norm_topk_prob=False, rope_theta=10000.0,
    )),
    # Bamba: Mamba-2 layers around one attention layer with RoPE on half of each head (its
    # released shape), a scan chunk shorter than the longest prompt.
    "bamba": ("bamba", dict(MAMBA2, attn_layer_indices=[1], rope_theta=10000.0)),
    # Granite 4.0-H: Mamba-2 and attention layers without position encoding, µP multipliers, a
    # shared MLP in every layer, with a mixture of experts beside it (Tiny/Small) or alone
    # (Micro, whose shared MLP is `intermediate_size` wide as released: llama.cpp sizes it so).
    "granite-hybrid": ("granitemoehybrid", dict(
        MAMBA2, num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention", "mamba"], rope_theta=10000.0,
        position_embedding_type="nope", embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=2.0, shared_intermediate_size=128,
    )),
    "granite-hybrid-dense": ("granitemoehybrid", dict(
        MAMBA2, num_local_experts=0, num_experts_per_tok=0, layer_types=["mamba", "attention", "mamba"],
        position_embedding_type="nope", embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=2.0, shared_intermediate_size=128,
    )),
    # gpt-oss as released: sliding and full layers alternating (window shorter than the longest
    # prompt), YaRN without rounding its ramp (`truncate: false`), a sink per head, biased
    # router and experts; hf_reference.py draws the fused experts' gate/up projections large
    # enough that the SwiGLU clamp (7) is reached. `gpt-oss-mxfp4` is its twin with the experts
    # in MXFP4, the released files' layout.
    "gpt-oss": ("gpt_oss", dict(
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rope_theta=10000.0,
        rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=64),
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )),
}

# Families only transformers 5 has, written by `hf_reference.py v5` (same seeds and prompts).
# Nemotron-H in its two released shapes: dense (Nemotron-H 8B, Nemotron Nano 2: Mamba-2,
# attention without position encoding, relu² MLPs) and with experts (Nemotron 3 Nano: Mamba-2,
# attention, relu² experts with DeepSeek-V3 routing, here in two groups with one kept, a learned
# choice bias, a scale and a shared expert). Mamba-2 with two groups of B/C and two norm
# groups, a scan chunk shorter than the longest prompt. llama.cpp runs both (its nemotron_h and
# nemotron_h_moe; the latter takes no dense MLP layers, as released).
NEMOTRON_H = dict(
    num_hidden_layers=OMIT, rms_norm_eps=OMIT, layer_norm_epsilon=1e-6,
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4,
    expand=2, chunk_size=8, intermediate_size=96,
)
ARCHS_V5 = {
    "nemotron-h": ("nemotron_h", dict(
        NEMOTRON_H,
        layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention", "mlp"],
    )),
    "nemotron-h-moe": ("nemotron_h", dict(
        NEMOTRON_H,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "moe"],
        n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, norm_topk_prob=True,
    )),
}


# Families only the llama.cpp plugin runs (float32 only; the native engine refuses them):
# converted to GGUF by llama.cpp's own converter in setup, checked by
# engines/native/tests/reference_llama_cpp.rs like the others. Each config is the family's own shape at
# toy size: its rotary fraction, biases, sliding-window pattern (the one llama.cpp assumes where
# it assumes one), experts, multipliers, and for the recurrent families their state sizes.
DEEPSEEK = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                first_k_dense_replace=1, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=8,
                qk_nope_head_dim=16, v_head_dim=16, head_dim=8, rope_theta=10000.0, n_group=1, topk_group=1)
LLAMA_CPP_ONLY = {
    "gemma2": ("gemma2", dict(
        sliding_window=8, rope_theta=10000.0, query_pre_attn_scalar=16, tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh", num_hidden_layers=4,
    )),
    "olmo2": ("olmo2", dict(rope_theta=10000.0)),
    "starcoder2": ("starcoder2", dict(rope_theta=10000.0, sliding_window=None, use_bias=True, norm_epsilon=1e-5)),
    "granite": ("granite", dict(
        rope_theta=10000.0, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.25, logits_scaling=2.0,
    )),
    "stablelm": ("stablelm", dict(rope_theta=10000.0, partial_rotary_factor=0.5, layer_norm_eps=1e-5)),
    "gpt2": ("gpt2", dict(n_ctx=256, layer_norm_epsilon=1e-5)),
    "gpt-bigcode": ("gpt_bigcode", dict(multi_query=True, layer_norm_epsilon=1e-5)),
    "gpt-neox": ("gpt_neox", dict(rotary_pct=0.5, use_parallel_residual=True, layer_norm_eps=1e-5)),
    "falcon": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False,
                              parallel_attn=True, bias=False, head_dim=OMIT)),
    "bloom": ("bloom", dict(n_head=4, layer_norm_epsilon=1e-5)),
    "phi2": ("phi", dict(partial_rotary_factor=0.5, layer_norm_eps=1e-5, num_key_value_heads=4, intermediate_size=256)),
    "phi3": ("phi3", dict(rope_theta=10000.0)),
    "gemma": ("gemma", dict(rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
    "olmo": ("olmo", dict(rope_theta=10000.0)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2, rope_theta=10000.0, num_key_value_heads=4)),
    "cohere": ("cohere", dict(rope_theta=10000.0, logit_scale=0.5, layer_norm_eps=1e-5, tie_word_embeddings=True)),
    "cohere2": ("cohere2", dict(
        rotary_pct=1.0, rope_theta=10000.0, logit_scale=0.5, layer_norm_eps=1e-5, sliding_window=8,
        tie_word_embeddings=True, num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )),
    "granitemoe": ("granitemoe", dict(
        num_local_experts=4, num_experts_per_tok=2, rope_theta=10000.0, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.25, logits_scaling=2.0,
    )),
    "nemotron": ("nemotron", dict(rope_theta=10000.0, partial_rotary_factor=0.5, norm_eps=1e-5)),
    # DeepSeek-V2-Lite's shape: no query compression, which llama.cpp recognises by its 27 layers.
    "deepseek2-lite": ("deepseek_v2", dict(DEEPSEEK, q_lora_rank=None, topk_method="greedy", num_hidden_layers=27)),
    # scoring_func as in DeepSeek-V3's and dots.llm1's config.json (transformers' routers take
    # sigmoid whatever it says; llama.cpp's converter reads it, and defaults to softmax).
    "deepseek3": ("deepseek_v3", dict(DEEPSEEK, q_lora_rank=32, scoring_func="sigmoid")),
    # EXAONE 4.0 1.2B's shape: global attention with RoPE in every layer (llama.cpp turns on the
    # 32B's sliding/global pattern, whose global layers take no RoPE, only at 64 layers).
    "exaone4": ("exaone4", dict(
        rope_theta=10000.0, sliding_window=None, num_hidden_layers=4, layer_types=["full_attention"] * 4,
    )),
    "smollm3": ("smollm3", dict(rope_theta=10000.0, no_rope_layer_interval=4, num_hidden_layers=4)),
    # gpt-oss with YaRN's ramp rounded out (`truncate: true`): llama.cpp always rounds it
    # (ggml_rope_yarn_corr_dims), so on the released `truncate: false` ("gpt-oss" above) it
    # computes other rotary frequencies (measured: max |Δ logprob| 11.1, greedy 78 of 96).
    "gpt-oss-truncated-yarn": ("gpt_oss", dict(
        ARCHS["gpt-oss"][1], rope_scaling=dict(ARCHS["gpt-oss"][1]["rope_scaling"], truncate=True),
    )),
    "ernie4.5": ("ernie4_5", dict(rope_theta=10000.0)),
    "ernie4.5-moe": ("ernie4_5_moe", dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1,
        moe_num_shared_experts=0, rope_theta=10000.0,
    )),
    "seed-oss": ("seed_oss", dict(rope_theta=10000.0)),
    "apertus": ("apertus", dict(rope_theta=10000.0)),
    "arcee": ("arcee", dict(rope_theta=10000.0)),
    "dots1": ("dots1", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, rope_theta=10000.0, num_key_value_heads=4, scoring_func="sigmoid",
    )),
    "glm4": ("glm4", dict(rope_theta=10000.0, partial_rotary_factor=0.5)),
    "glm4-moe": ("glm4_moe", dict(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, rope_theta=10000.0, partial_rotary_factor=0.5,
    )),
    "dbrx": ("dbrx", dict(
        d_model=64, n_heads=4, n_layers=3,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(moe_num_experts=4, moe_top_k=2, ffn_hidden_size=32),
    )),
    "hunyuan-dense": ("hunyuan_v1_dense", dict(rope_theta=10000.0)),
    # Qwen3-MoE with every layer sparse (llama.cpp's qwen3moe takes no dense layer).
    "qwen3-moe-sparse": ("qwen3_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, rope_theta=10000.0,
    )),
    # Recurrent and hybrid families: Mamba, Mamba-2, Jamba (Mamba + attention + experts), Bamba
    # and Granite 4 (Mamba-2 + attention), Falcon-H1 (Mamba-2 and attention side by side in every
    # layer), LFM2 (short convolutions + attention).
    "mamba": ("mamba", dict(state_size=8, expand=2, conv_kernel=4, layer_norm_epsilon=1e-5)),
    "mamba2": ("mamba2", dict(num_heads=8, head_dim=16, state_size=16, n_groups=1, expand=2, conv_kernel=4,
                              chunk_size=16, layer_norm_epsilon=1e-5)),
    "jamba": ("jamba", dict(
        num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        use_mamba_kernels=False,
    )),
    # Bamba with RoPE on the whole head: with Bamba-9B's partial RoPE (attn_rotary_emb half the
    # head) llama.cpp's conversion disagrees with transformers (measured: max |Δ logprob| 3.2,
    # greedy 78 of 96), since it reorders every query/key dimension for llama.cpp's rotation.
    "bamba-full-rope": ("bamba", dict(MAMBA2, attn_layer_indices=[1], rope_theta=10000.0, attn_rotary_emb=16,
                                      partial_rotary_factor=1.0)),
    "falcon-h1": ("falcon_h1", dict(MAMBA2, mamba_d_ssm=128, rope_theta=10000.0)),
    "lfm2": ("lfm2", dict(
        layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, norm_eps=1e-5, rope_theta=10000.0,
        block_auto_adjust_ff_dim=False,
    )),
}

# The ARCHS checkpoints llama.cpp runs too (converted from their float32 twin). Left out:
# Qwen3-MoE (a dense layer among the sparse ones: "qwen3-moe-sparse" above instead) and Mistral
# (llama.cpp converts MistralForCausalLM without its sliding window).
LLAMA_CPP_SHARED = ["llama", "qwen2", "qwen3", "gemma3", "mixtral", "qwen2-moe", "granite-hybrid",
                    "granite-hybrid-dense"]

# Encoders: name -> (model_type, config).
ENCODERS = {
    "bert": ("bert", dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
        hidden_act="gelu",
    )),
}
