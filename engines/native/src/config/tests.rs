//! `config.json` parsing and RoPE frequencies, on hand-written configs.

use gantry_engine_abi::{EngineError, Status};

use super::*;

fn cfg(extra: &str) -> Result<ModelConfig, EngineError> {
    let text = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 100 {extra}}}"#
    );
    parse(text.as_bytes(), None)
}

#[test]
fn a_llama_config_gets_transformers_defaults() {
    let c = cfg("").expect("config");
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(c.head_dim, 16);
    assert!(!c.tie_embeddings);
    assert_eq!(c.ropes[0].theta, 10_000.0);
    assert!((c.attn_scale - 0.25).abs() < 1e-7);
}

#[test]
fn unknown_classes_and_rope_types_are_refused_by_name() {
    let e = parse(br#"{"architectures": ["MambaForCausalLM"]}"#, None).expect_err("mamba");
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("MambaForCausalLM"), "{}", e.message);
    let e = cfg(r#", "rope_scaling": {"rope_type": "longrope", "factor": 2}"#).expect_err("x");
    assert_eq!(e.status, Status::Unsupported);
    assert!(
        e.message.contains("rope_scaling.rope_type` `longrope`"),
        "{}",
        e.message
    );
    let e = cfg(r#", "hidden_act": "relu2""#).expect_err("act");
    assert!(e.message.contains("hidden_act"), "{}", e.message);
}

#[test]
fn missing_and_mistyped_fields_are_named() {
    let e = parse(
        br#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#,
        None,
    )
    .expect_err("no layers");
    assert_eq!(e.status, Status::ModelCorrupt);
    assert!(e.message.contains("num_hidden_layers"), "{}", e.message);
    let e = cfg(r#", "rms_norm_eps": "small""#).expect_err("eps");
    assert!(e.message.contains("rms_norm_eps"), "{}", e.message);
}

#[test]
fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
    let c = cfg(
        r#", "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
    )
    .expect("config");
    let plain = Rope {
        theta: 500000.0,
        scaling: RopeScaling::None,
    };
    let (scaled, _) = c.ropes[0].inv_freq(16);
    let (base, _) = plain.inv_freq(16);
    assert_eq!(scaled[0], base[0]);
    assert!((scaled[7] - base[7] / 8.0).abs() < 1e-12);
}

#[test]
fn gemma3_layers_alternate_windows_and_bases() {
    let text = br#"{"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64,
        "num_hidden_layers": 6, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "intermediate_size": 128, "vocab_size": 100, "sliding_window": 8,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 32}"#;
    let c = parse(text, None).expect("gemma");
    assert_eq!(c.layers[0].window, Some(8));
    assert_eq!(c.layers[0].rope, 1);
    assert_eq!(c.layers[5].window, None);
    assert_eq!(c.layers[5].rope, 0);
    assert_eq!(c.ropes[1].theta, 10_000.0);
    assert!(c.tie_embeddings && c.norm_plus_one && c.qk_norm);
    assert_eq!(c.activation, Activation::GeluTanh);
}

fn moe_cfg(class: &str, extra: &str) -> Result<ModelConfig, EngineError> {
    let text = format!(
        r#"{{"architectures": ["{class}"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 100 {extra}}}"#
    );
    parse(text.as_bytes(), None)
}

#[test]
fn qwen3_moe_takes_transformers_defaults_and_its_dense_layers() {
    let c = moe_cfg(
        "Qwen3MoeForCausalLM",
        r#", "num_experts": 8, "mlp_only_layers": [1], "decoder_sparse_step": 2"#,
    )
    .expect("config");
    assert_eq!(c.architecture, Architecture::Qwen3Moe);
    assert!(c.qk_norm);
    assert_eq!(c.ropes[0].theta, 10_000.0);
    let moe = c.moe.expect("experts");
    assert_eq!(
        (moe.experts, moe.top_k, moe.intermediate, moe.normalize),
        (8, 8, 768, false)
    );
    assert_eq!(moe.naming, MoeNaming::Qwen);
    // Every second layer is sparse (step 2: layers 1 and 3), except layer 1 (mlp_only).
    let sparse: Vec<bool> = c.layers.iter().map(|l| l.moe).collect();
    assert_eq!(sparse, [false, false, false, true]);
}

#[test]
fn mixtral_routes_every_layer_and_renormalises() {
    let c = moe_cfg("MixtralForCausalLM", r#", "num_local_experts": 4"#).expect("config");
    let moe = c.moe.expect("experts");
    assert_eq!(
        (moe.experts, moe.top_k, moe.intermediate, moe.normalize),
        (4, 2, 128, true)
    );
    assert_eq!(
        moe.naming.expert(3, 1),
        [
            "model.layers.3.block_sparse_moe.experts.1.w1".to_string(),
            "model.layers.3.block_sparse_moe.experts.1.w3".to_string(),
            "model.layers.3.block_sparse_moe.experts.1.w2".to_string()
        ]
    );
    assert!(c.layers.iter().all(|l| l.moe));
    assert_eq!(c.ropes[0].theta, 1_000_000.0);
}

#[test]
fn a_top_k_larger_than_the_experts_is_refused_by_name() {
    let e = moe_cfg(
        "MixtralForCausalLM",
        r#", "num_local_experts": 4, "num_experts_per_tok": 5"#,
    )
    .expect_err("top-k");
    assert_eq!(e.status, Status::ModelCorrupt);
    assert!(e.message.contains("num_experts_per_tok"), "{}", e.message);
    let e = moe_cfg(
        "Qwen3MoeForCausalLM",
        r#", "num_experts": 4, "mlp_only_layers": "all""#,
    )
    .expect_err("list");
    assert!(e.message.contains("mlp_only_layers"), "{}", e.message);
}

#[test]
fn quantized_checkpoints_other_than_fp8_are_refused_naming_the_method() {
    for method in ["awq", "gptq", "bitsandbytes", "mxfp4"] {
        let e = cfg(&format!(
            r#", "quantization_config": {{"quant_method": "{method}", "bits": 4}}"#
        ))
        .expect_err(method);
        assert_eq!(e.status, Status::Unsupported);
        assert!(
            e.message
                .contains(&format!("quantization_config.quant_method` `{method}`")),
            "{}",
            e.message
        );
    }
    let c = cfg(r#", "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}"#).expect("fp8");
    assert_eq!(
        c.fp8,
        Some(crate::weights::Fp8 {
            block: Some([128, 128])
        })
    );
    let c = cfg(r#", "quantization_config": {"quant_method": "fp8"}"#).expect("per tensor");
    assert_eq!(c.fp8, Some(crate::weights::Fp8 { block: None }));
    let e = cfg(r#", "quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}"#)
        .expect_err("e5m2");
    assert!(
        e.message.contains("quantization_config.fmt"),
        "{}",
        e.message
    );
}

#[test]
fn e4m3_values_decode_as_the_format_says() {
    use crate::weights::e4m3_to_f32;
    assert_eq!(e4m3_to_f32(0x38), 1.0);
    assert_eq!(e4m3_to_f32(0xb8), -1.0);
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    assert_eq!(e4m3_to_f32(0x00), 0.0);
    assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
}

#[test]
fn qwen2_moe_has_a_shared_expert_and_qkv_bias() {
    let c = moe_cfg("Qwen2MoeForCausalLM", r#", "num_experts": 8"#).expect("config");
    assert_eq!(c.architecture, Architecture::Qwen2Moe);
    assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
    let moe = c.moe.expect("experts");
    assert_eq!(
        (
            moe.experts,
            moe.top_k,
            moe.intermediate,
            moe.shared,
            moe.normalize
        ),
        (8, 4, 1408, Some(5632), false)
    );
    assert_eq!(
        moe.naming.shared(2).1,
        "model.layers.2.mlp.shared_expert_gate".to_string()
    );
}

fn bamba(extra: &str) -> Result<ModelConfig, EngineError> {
    let text = format!(
        r#"{{"architectures": ["BambaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 100, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
        "mamba_n_groups": 2 {extra}}}"#
    );
    parse(text.as_bytes(), None)
}

#[test]
fn a_bamba_config_marks_its_state_space_layers_and_half_rotary_heads() {
    let c = bamba(r#", "attn_layer_indices": [1, 3]"#).expect("config");
    assert_eq!(c.architecture, Architecture::Bamba);
    let mamba: Vec<bool> = c.layers.iter().map(|l| l.mamba).collect();
    assert_eq!(mamba, [true, false, true, false]);
    assert_eq!(c.attention_layers(), 2);
    // BambaConfig: RoPE on half of each head unless `partial_rotary_factor` says otherwise.
    assert_eq!(c.rotary_dim, 8);
    let m = c.mamba.as_ref().expect("a Mamba-2 spec");
    assert_eq!((m.inner(), m.conv_dim(), m.in_proj_rows()), (128, 192, 328));
    // (4 - 1) × 192 convolution inputs and 8 × 16 × 16 scan values, in each of two layers.
    assert_eq!(c.state_floats_per_sequence(), 2 * (3 * 192 + 8 * 16 * 16));
    let full = bamba(r#", "partial_rotary_factor": 1.0"#).expect("config");
    assert_eq!(full.rotary_dim, 16);
    assert!(full.layers.iter().all(|l| l.mamba));
}

#[test]
fn inconsistent_bamba_shapes_are_refused_naming_the_fields() {
    let e = bamba(r#", "mamba_expand": 3"#).expect_err("heads × head_dim ≠ expand × hidden");
    assert_eq!(e.status, Status::ModelCorrupt);
    assert!(e.message.contains("mamba_expand"), "{}", e.message);
    let e = bamba(r#", "attn_layer_indices": [7]"#).expect_err("no layer 7");
    assert!(e.message.contains("attn_layer_indices"), "{}", e.message);
    let e = bamba(r#", "mamba_n_groups": 3"#).expect_err("8 heads in 3 groups");
    assert!(e.message.contains("mamba_n_groups"), "{}", e.message);
    let e = bamba(r#", "partial_rotary_factor": 0.1"#).expect_err("1 of 16 dimensions");
    assert!(e.message.contains("partial_rotary_factor"), "{}", e.message);
}

/// A Nemotron-H config as the Hub writes it: the layer pattern as a string, the old key names,
/// `time_step_limit` with Python's bare `Infinity`.
fn nemotron_h(extra: &str) -> Result<ModelConfig, EngineError> {
    let text = format!(
        r#"{{"architectures": ["NemotronHForCausalLM"], "hidden_size": 64, "num_hidden_layers": 5,
        "hybrid_override_pattern": "M-E*M", "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "vocab_size": 100, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "layer_norm_epsilon": 1e-5,
        "time_step_limit": [0.0, Infinity] {extra}}}"#
    );
    parse(text.as_bytes(), None)
}

#[test]
fn a_nemotron_h_config_reads_its_layer_pattern_routing_and_infinite_time_step_limit() {
    let c = nemotron_h("").expect("config");
    assert_eq!(c.architecture, Architecture::NemotronH);
    let kinds: Vec<(bool, bool, bool, bool)> = c
        .layers
        .iter()
        .map(|l| (l.mixer, l.mamba, l.mlp, l.moe))
        .collect();
    assert_eq!(
        kinds,
        [
            (true, true, false, false),
            (false, false, true, false),
            (false, false, true, true),
            (true, false, false, false),
            (true, true, false, false),
        ]
    );
    // K/V only for the one attention layer; recurrent state for the two Mamba layers.
    assert_eq!(c.attention_layers(), 1);
    let m = c.mamba.as_ref().expect("a Mamba-2 spec");
    assert_eq!(
        (m.inner(), m.norm_groups, m.dt_limit),
        (128, 2, (0.0, f32::INFINITY))
    );
    assert_eq!(c.state_floats_per_sequence(), 2 * (3 * 192 + 8 * 16 * 16));
    assert_eq!((c.rotary_dim, c.activation), (0, Activation::Relu2));
    let moe = c.moe.as_ref().expect("experts");
    assert_eq!(
        moe.routing,
        Routing::Sigmoid {
            groups: 2,
            topk_groups: 1,
            scale: 2.5
        }
    );
    assert_eq!((moe.shared, moe.normalize), (Some(48), true));
    assert_eq!(c.embed_name(), "backbone.embeddings.weight");
    // transformers 5 writes the list and infinity its own way.
    let v5 = nemotron_h(
        r#", "layers_block_type": ["linear_attention", "mlp", "moe", "full_attention", "linear_attention"],
        "time_step_limit": [0.001, {"__float__": "Infinity"}]"#,
    )
    .expect("config");
    assert_eq!(v5.layers, c.layers);
    assert_eq!(v5.mamba.expect("spec").dt_limit, (0.001, f32::INFINITY));
}

#[test]
fn nemotron_h_options_the_engine_lacks_are_refused_naming_the_field() {
    let e = nemotron_h(r#", "moe_latent_size": 16"#).expect_err("latent experts");
    assert_eq!(e.status, Status::Unsupported);
    assert!(e.message.contains("moe_latent_size"), "{}", e.message);
    let e = nemotron_h(r#", "mlp_hidden_act": "gelu""#).expect_err("gelu");
    assert!(e.message.contains("mlp_hidden_act"), "{}", e.message);
    let e = nemotron_h(r#", "num_hidden_layers": 6"#).expect_err("6 layers, a pattern of 5");
    assert!(e.message.contains("num_hidden_layers"), "{}", e.message);
    let e = nemotron_h(r#", "hybrid_override_pattern": "M-X""#).expect_err("X");
    assert!(
        e.message.contains("hybrid_override_pattern[2]"),
        "{}",
        e.message
    );
    let e = nemotron_h(r#", "n_group": 3"#).expect_err("8 experts in 3 groups");
    assert!(e.message.contains("n_group"), "{}", e.message);
}

#[test]
fn a_gpt_oss_config_gets_its_released_defaults_and_mxfp4_is_read_for_it_alone() {
    let c = parse(
        br#"{"architectures": ["GptOssForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}}"#,
        None,
    )
    .expect("gpt-oss");
    assert_eq!(c.architecture, Architecture::GptOss);
    assert_eq!((c.n_layers, c.hidden, c.head_dim), (36, 2880, 64));
    // Sliding first, then full, alternating; every layer a mixture of experts.
    assert_eq!(c.layers[0].window, Some(128));
    assert_eq!(c.layers[1].window, None);
    assert!(c.layers.iter().all(|l| l.moe && l.attends()));
    let moe = c.moe.as_ref().expect("experts");
    assert_eq!(
        (moe.experts, moe.top_k, moe.naming),
        (128, 4, MoeNaming::GptOss)
    );
    assert!(c.qkv_bias && c.o_bias && c.attn_sinks && c.mxfp4);
    assert_eq!(c.activation, Activation::ClampedSwiglu { limit: 7.0 });
    assert!(matches!(
        c.ropes[0].scaling,
        RopeScaling::Yarn {
            factor: 32.0,
            truncate: false,
            ..
        }
    ));
    // An explicit layer pattern, the original checkpoint's `experts_per_token`, a limit.
    let c = parse(
        br#"{"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 2, "experts_per_token": 2,
        "layer_types": ["full_attention", "sliding_attention"], "swiglu_limit": 5.0}"#,
        None,
    )
    .expect("gpt-oss");
    assert_eq!((c.layers[0].window, c.layers[1].window), (None, Some(128)));
    assert_eq!(c.moe.expect("experts").top_k, 2);
    assert_eq!(c.activation, Activation::ClampedSwiglu { limit: 5.0 });
    assert!(!c.mxfp4);
    let e = parse(
        br#"{"architectures": ["GptOssForCausalLM"], "num_local_experts": 2, "num_experts_per_tok": 3}"#,
        None,
    )
    .expect_err("top-k");
    assert!(e.message.contains("num_experts_per_tok"), "{}", e.message);
}

#[test]
fn yarn_without_truncation_ramps_between_the_exact_correction_dimensions() {
    let rope = |truncate: bool| Rope {
        theta: 10_000.0,
        scaling: RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.0,
            truncate,
        },
    };
    // head_dim 16: the fast correction dimension is below 0 (clamped), the slow one
    // 16·ln(64 / 2π) / (2·ln 10⁴) ≈ 2.016, rounded up to 3 when truncating.
    let high = 16.0 * (64.0 / (2.0 * std::f64::consts::PI)).ln() / (2.0 * 10_000f64.ln());
    for (truncate, high) in [(false, high), (true, high.ceil())] {
        let (f, _) = rope(truncate).inv_freq(16);
        let base = 1.0 / 10_000f64.powf(2.0 / 16.0);
        let keep = 1.0 - 1.0 / high;
        let want = base / 4.0 * (1.0 - keep) + base * keep;
        assert!(
            ((f[1] as f64) - want).abs() < 1e-7,
            "truncate {truncate}: {} vs {want}",
            f[1]
        );
    }
}
