"""ModelConfig: golden configs, the released V4.1-Flash numbers, HF round trip, and the errors
(each must name the field and the bad value)."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from deepinfer_jax.config import ModelConfig, preset

GOLDEN_CONFIGS = ["tiny_fp8", "tiny_bf16", "tiny_fp8_long", "tiny_fp8_long_allsel"]


def _golden_dict(golden_dir, name: str = "tiny_fp8") -> dict:
    return json.loads((golden_dir / name / "config.json").read_text())


def _raises(d: dict, *needles: str) -> str:
    with pytest.raises(ValueError) as ei:
        ModelConfig.from_hf_dict(d)
    msg = str(ei.value)
    for n in needles:
        assert n in msg, f"{n!r} not in error message {msg!r}"
    return msg


# ----------------------------------------------------------------------------- golden configs


@pytest.mark.parametrize("name", GOLDEN_CONFIGS)
def test_golden_configs_load(golden_dir, name):
    cfg = ModelConfig.from_json(golden_dir / name)                  # directory form
    assert cfg == ModelConfig.from_json(golden_dir / name / "config.json")
    tc = _golden_dict(golden_dir, name)["text_config"]
    assert cfg.num_hidden_layers == 6 and cfg.num_nextn_predict_layers == 2
    assert cfg.compress_ratios == (0, 2, 2, 1, 1, 1, 0, 0)
    assert cfg.kv_source_layer_ids == (1, 3) and cfg.index_source_layer_ids == (1, 3, 5)
    assert cfg.candidate_source_layer_id == 3
    assert cfg.sliding_window == tc["sliding_window"]
    assert cfg.index_topk == tc["index_topk"]
    assert cfg.candidate_topk_blocks == tc["candidate_topk_blocks"]
    assert cfg.yarn_factor == 4.0
    assert cfg.yarn_original_max_position_embeddings == tc["rope_scaling"]["original_max_position_embeddings"]
    assert cfg.engram_num_embeddings == tuple(tc["engram_num_embeddings"])
    assert cfg.dspark_target_layer_ids == (3, 4, 5)
    if name == "tiny_bf16":
        assert (cfg.weight_dtype, cfg.expert_dtype) == ("bf16", "bf16")
    else:
        assert (cfg.weight_dtype, cfg.expert_dtype) == ("fp8", "fp4")
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_golden_sizes(golden_dir):
    short = ModelConfig.from_json(golden_dir / "tiny_fp8")
    long = ModelConfig.from_json(golden_dir / "tiny_fp8_long")
    allsel = ModelConfig.from_json(golden_dir / "tiny_fp8_long_allsel")
    assert (short.sliding_window, long.sliding_window) == (8, 16)
    assert (long.index_topk, allsel.index_topk) == (16, 384)
    assert (allsel.candidate_topk_blocks, allsel.candidate_block_size) == (48, 8)


# ----------------------------------------------------------------------------- released numbers


def test_flash_preset_matches_release():
    c = preset("v41-flash")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_nextn_predict_layers) == (129280, 5120, 40, 3)
    assert (c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.q_lora_rank) == (64, 512, 64, 1280)
    assert (c.o_groups, c.o_lora_rank, c.sliding_window) == (8, 1024, 128)
    assert c.rms_norm_eps == 1e-20 and c.swiglu_limit == 10
    assert len(c.compress_ratios) == 43
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)
    assert c.kv_source_layer_ids == (2, 8, 14, 20)
    assert c.index_source_layer_ids == (2, 8, 14, 20, 24, 28, 32, 36)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (20, 2048, 8)
    assert (c.rope_theta, c.compress_rope_theta) == (10000, 160000)
    assert (c.yarn_factor, c.yarn_beta_fast, c.yarn_beta_slow) == (16, 32, 1)
    assert c.yarn_original_max_position_embeddings == 65536
    assert c.max_position_embeddings == 1048576
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (384, 1, 6)
    assert c.moe_intermediate_size == 2304 and c.routed_scaling_factor == 1.5
    assert c.scoring_func == "sqrtsoftplus" and c.norm_topk_prob
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps) == (4, 20, 1e-6)
    assert c.engram_layer_ids == (1, 14)
    assert (c.engram_max_ngram_size, c.engram_n_heads, c.engram_head_dim) == (4, 8, 256)
    assert c.engram_compressed_vocab_size == 99092
    assert (c.dspark_block_size, c.dspark_target_layer_ids, c.dspark_markov_rank) == (5, (37, 38, 39), 256)
    assert (c.dspark_n_routed_experts, c.dspark_num_experts_per_tok) == (128, 3)
    assert (c.bos_token_id, c.eos_token_id, c.pad_token_id, c.image_token_id) == (0, 1, 2, 129264)
    assert (c.weight_dtype, c.expert_dtype, c.weight_block_size) == ("fp8", "fp4", 32)
    # derived: DSpark stages use their own expert counts, layer 21 reads KV source 20
    assert c.moe_experts(40) == (128, 3) and c.moe_experts(39) == (384, 6)
    assert c.kv_source_of(21) == 20 and c.index_source_of(21) == 20 and c.index_source_of(37) == 36
    assert c.kv_source_of(0) == -1


def test_flash_hf_dict_layout():
    d = preset("v41-flash").to_hf_dict()
    assert d["quantization_config"] == {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                                        "expert_dtype": "fp4"}
    assert d["text_config"]["rope_scaling"] == {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0,
                                                "beta_slow": 1.0, "original_max_position_embeddings": 65536}
    assert d["text_config"]["compress_ratios"] == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    assert d["image_token_id"] == 129264


# ----------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("cfg", [
    preset("v41-flash"),
    preset("v41-tiny"),
    preset("v41-tiny").replace(weight_dtype="bf16", expert_dtype="bf16"),
    preset("v41-tiny").replace(expert_dtype="fp8"),
    preset("v41-tiny").replace(yarn_original_max_position_embeddings=0),
    preset("v41-tiny").replace(candidate_source_layer_id=-1),
    preset("v41-tiny").replace(num_nextn_predict_layers=0, compress_ratios=(0, 2, 2, 1, 1, 1)),
], ids=["flash", "tiny", "tiny_bf16", "tiny_fp8_experts", "no_yarn", "no_candidates", "no_dspark"])
def test_hf_dict_round_trip(cfg, tmp_path):
    d = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(d).to_hf_dict() == d           # the dict is a fixpoint
    want = cfg
    if cfg.yarn_original_max_position_embeddings == 0:
        # YaRN off: to_hf_dict writes no rope_scaling, so the (inert) yarn_factor / betas come back
        # as the defaults. They change no computation (rope.rope_freqs ignores them when off).
        want = dataclasses.replace(cfg, yarn_factor=ModelConfig.yarn_factor,
                                   yarn_beta_fast=ModelConfig.yarn_beta_fast,
                                   yarn_beta_slow=ModelConfig.yarn_beta_slow)
    assert ModelConfig.from_hf_dict(d) == want
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(d))) == want
    cfg.to_json(tmp_path / "config.json")
    assert ModelConfig.from_json(tmp_path) == want


def test_golden_to_hf_dict_keeps_text_fields(golden_dir):
    d = _golden_dict(golden_dir)
    out = ModelConfig.from_hf_dict(d).to_hf_dict()
    for k, v in d["text_config"].items():
        assert out["text_config"][k] == v, k
    assert out["quantization_config"] == d["quantization_config"]


def test_presets():
    assert preset("v41-tiny").sliding_window == 8
    with pytest.raises(ValueError, match="v41-huge") as ei:
        preset("v41-huge")
    assert "v41-flash" in str(ei.value) and "v41-tiny" in str(ei.value)


# ----------------------------------------------------------------------------- error cases


@pytest.fixture
def gd(golden_dir):
    return _golden_dict(golden_dir)


def _tc(d: dict) -> dict:
    return d["text_config"]


def test_compress_ratios_wrong_length(gd):
    d = copy.deepcopy(gd)
    _tc(d)["compress_ratios"] = [0, 2, 2, 1, 1, 1, 0]
    _raises(d, "compress_ratios", repr((0, 2, 2, 1, 1, 1, 0)), "length 7", "8")
    d = copy.deepcopy(gd)
    _tc(d)["compress_ratios"] = [0, 2, 2, 1, 1, 1, 0, 0, 0]
    _raises(d, "compress_ratios", repr((0, 2, 2, 1, 1, 1, 0, 0, 0)), "length 9")


def test_kv_sources_not_sorted(gd):
    _tc(gd)["kv_source_layer_ids"] = [3, 1]
    _raises(gd, "kv_source_layer_ids", repr((3, 1)), "sorted")


def test_kv_source_on_ratio0_layer(gd):
    _tc(gd)["kv_source_layer_ids"] = [0, 1, 3]
    _raises(gd, "kv_source_layer_ids", repr((0, 1, 3)), "layer 0", "ratio 0")


@pytest.mark.parametrize("w", [0, -3])
def test_sliding_window_below_one(gd, w):
    _tc(gd)["sliding_window"] = w
    _raises(gd, f"sliding_window={w!r}")


def test_index_sources_missing_kv_source(gd):
    _tc(gd)["index_source_layer_ids"] = [1, 5]      # KV source 3 is not an index source
    _tc(gd)["candidate_source_layer_id"] = 1
    _raises(gd, "index_source_layer_ids", repr((1, 5)), "KV source 3")


def test_candidate_source_not_index_source(gd):
    _tc(gd)["candidate_source_layer_id"] = 4
    _raises(gd, "candidate_source_layer_id=4", "index_source_layer_ids")


def test_unknown_quant_method(gd):
    gd["quantization_config"]["quant_method"] = "int4_awq"
    _raises(gd, "quant_method", "'int4_awq'")


@pytest.mark.parametrize("bs", [[128, 128], [32, 16]])
def test_weight_block_size_not_32(gd, bs):
    gd["quantization_config"]["weight_block_size"] = bs
    _raises(gd, "weight_block_size", repr(bs))


def test_weight_block_size_field_not_32(gd):
    flat = dict(_tc(gd), weight_dtype="fp8", expert_dtype="fp4", weight_block_size=64)
    _raises(flat, "weight_block_size=64")


def test_experts_per_tok_exceeds_experts(gd):
    _tc(gd)["num_experts_per_tok"] = 9
    _raises(gd, "num_experts_per_tok=9", "n_routed_experts=8")


def test_dspark_experts_per_tok_exceeds_experts(gd):
    _tc(gd)["dspark_num_experts_per_tok"] = 5
    _raises(gd, "dspark_num_experts_per_tok=5", "dspark_n_routed_experts=4")


def test_non_json_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{"text_config": {"vocab_size": 256,')
    with pytest.raises(ValueError) as ei:
        ModelConfig.from_json(p)
    assert str(p) in str(ei.value) and "JSON" in str(ei.value)
    p.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="JSON object.*list"):
        ModelConfig.from_json(p)


def test_missing_file(tmp_path):
    missing = tmp_path / "nope" / "config.json"
    with pytest.raises(ValueError) as ei:
        ModelConfig.from_json(missing)
    assert str(missing) in str(ei.value) and "not found" in str(ei.value)
    with pytest.raises(ValueError) as ei:       # a directory without config.json
        ModelConfig.from_json(tmp_path)
    assert str(tmp_path / "config.json") in str(ei.value)


def test_wrong_type_field(gd):
    _tc(gd)["num_hidden_layers"] = "6"
    _raises(gd, "num_hidden_layers", "'6'")


# ----------------------------------------------------------------------------- required fields


@pytest.mark.parametrize("field", ["sliding_window", "index_topk", "rope_scaling", "max_position_embeddings",
                                   "vocab_size", "compress_ratios", "hc_sinkhorn_iters", "engram_n_heads"])
def test_missing_required_field_names_field_and_file(gd, tmp_path, field):
    """No silent V4.1-Flash default for a field the released config always has."""
    del _tc(gd)[field]
    p = tmp_path / "config.json"
    p.write_text(json.dumps(gd))
    with pytest.raises(ValueError) as ei:
        ModelConfig.from_json(tmp_path)
    msg = str(ei.value)
    assert f"text_config.{field}" in msg and str(p) in msg and "missing" in msg, msg


def test_missing_fields_are_all_listed(gd):
    del _tc(gd)["sliding_window"], _tc(gd)["index_topk"]
    _raises(gd, "text_config.sliding_window, text_config.index_topk")


@pytest.mark.parametrize("key", ["factor", "original_max_position_embeddings"])
def test_rope_scaling_needs_factor_and_original_length(gd, key):
    del _tc(gd)["rope_scaling"][key]
    _raises(gd, f"rope_scaling.{key}")


def test_rope_scaling_null_turns_yarn_off(gd):
    _tc(gd)["rope_scaling"] = None
    assert ModelConfig.from_hf_dict(gd).yarn_original_max_position_embeddings == 0


def test_fields_of_features_turned_off_may_be_omitted(gd):
    tc = _tc(gd)
    tc["engram_layer_ids"] = []
    tc["candidate_source_layer_id"] = None
    for k in [k for k in tc if k.startswith("engram_") and k != "engram_layer_ids"]:
        del tc[k]
    del tc["candidate_block_size"], tc["candidate_topk_blocks"]
    cfg = ModelConfig.from_hf_dict(gd)
    assert not cfg.engram_enabled and cfg.candidate_source_layer_id == -1
    del gd["bos_token_id"], gd["image_token_id"]   # top-level token ids: not part of the model
    assert ModelConfig.from_hf_dict(gd).bos_token_id == ModelConfig.bos_token_id


@pytest.mark.parametrize("cfg", [preset("v41-flash"), preset("v41-tiny"),
                                 preset("v41-tiny").replace(yarn_original_max_position_embeddings=0)],
                         ids=["flash", "tiny", "no_yarn"])
def test_written_configs_are_complete(cfg, tmp_path):
    """Every writer goes through to_hf_dict: it writes every required field."""
    from deepinfer_jax.config import missing_required_fields
    from deepinfer_jax.checkpoint.random_checkpoint import write_random_model_config

    d = cfg.to_hf_dict()
    assert missing_required_fields(d["text_config"], d) == []
    write_random_model_config(cfg.replace(engram_layer_ids=(), engram_num_embeddings=()), tmp_path, tokenizer=False)
    assert ModelConfig.from_json(tmp_path).num_hidden_layers == cfg.num_hidden_layers


# ----------------------------------------------------------------------------- configs that could not run


@pytest.mark.parametrize("changes, field", [
    (dict(weight_dtype="bf16", expert_dtype="bf16", head_dim=48), "head_dim=48"),     # KV cache rounding
    (dict(o_groups=1, o_lora_rank=40), "o_lora_rank=40"),                           # fp8 wo_b input 40
    (dict(weight_dtype="bf16", expert_dtype="fp4"), "expert_dtype='fp4'"),           # not expressible
])
def test_configs_that_cannot_run_are_refused(changes, field):
    """Each was accepted and then failed at load or at the first step (found by test_generality)."""
    with pytest.raises(ValueError, match=f"ModelConfig.{field}"):
        preset("v41-tiny").replace(**changes)
