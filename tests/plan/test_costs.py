"""Bytes and FLOPs against the worked values of spec/hardware-and-recipes.md §3 and kimi-family §7."""

import pytest

from deltamoe.config import load_preset
from deltamoe.plan.costs import model_costs
from deltamoe.plan.reference_models import deepseek_v3


@pytest.fixture(scope="module")
def k3():
    return load_preset("kimi-k3")


def test_k3_weight_totals(k3):
    assert model_costs(k3, "bf16").weights.total == pytest.approx(5.56e12, rel=1e-3)
    assert model_costs(k3, "all-4bit").weights.total == pytest.approx(1.39e12, rel=1e-3)
    mx = model_costs(k3, "mxfp4").weights
    assert mx.total == 1_560_838_075_584  # routed x 0.53125 B + 57.19 B non-routed x 2 B, vision included
    assert mx.vision == 447_358_976 * 2
    assert model_costs(k3, "w4a8").weights.total == pytest.approx(1.518e12, rel=1e-3)


def test_cache_sizes(k3):
    bf16, fp8 = model_costs(k3, "mxfp4", "bf16"), model_costs(k3, "mxfp4", "fp8")
    assert k3.latent_cache_dim == 576
    assert bf16.mla_bytes_per_token_layer == 1152 and fp8.mla_bytes_per_token_layer == 576
    assert bf16.kv_bytes_per_token == 27_648 and fp8.kv_bytes_per_token == 13_824
    assert bf16.kda_recurrent_bytes_per_layer == 96 * 128 * 128 * 4 == 6_291_456
    assert bf16.kda_conv_bytes_per_layer == 110_592 * 2
    assert bf16.kda_state_bytes_per_seq == pytest.approx(449.4e6, rel=1e-3)
    half = model_costs(k3, "mxfp4", "bf16", kda_state_bytes=2)
    assert half.kda_state_bytes_per_seq == pytest.approx(232.3e6, rel=1e-3)
    # The state is independent of context; the latent cache grows linearly.
    assert fp8.seq_cache_bytes(2 ** 20) - fp8.seq_cache_bytes(0) == 2 ** 20 * 13_824


def test_dsa_indexer_keys():
    c = model_costs(load_preset("kimi-k3.1-pro"), "mxfp4", "fp8")
    assert c.indexer_bytes_per_token_layer == 132
    assert c.kv_bytes_per_token == 13_824 + 3_168
    assert model_costs(load_preset("kimi-k3.1-pro"), "mxfp4", "bf16").indexer_bytes_per_token_layer == 256


def test_moe_all_to_all_at_latent_width(k3):
    c = model_costs(k3, "mxfp4")
    assert c.a2a_bytes_per_token_layer() == 16 * 3_696 + 16 * 7_168 == 173_824
    assert c.a2a_bytes_per_token_layer() * 92 == pytest.approx(16.0e6, rel=1e-3)
    ds = model_costs(deepseek_v3(), "fp8")
    assert ds.a2a_bytes_per_token_layer() == 8 * 7_392 + 8 * 14_336
    assert ds.kv_bytes_per_token == 70_272


def test_flops_grow_as_the_attention_kind_says(k3):
    c = model_costs(k3, "mxfp4")
    assert sum(c.linear_flops_per_token) == 2 * 104_189_612_640
    assert c.attention_flops_decode(8192) == pytest.approx(41.5e9, rel=2e-3)
    assert c.attention_flops_decode(131072) == pytest.approx(657.6e9, rel=2e-3)
    assert c.attention_flops_prefill(2 ** 20) * 2 ** 20 == pytest.approx(811e15, rel=2e-3)
    # DSA attention is bounded by top-k; only the cheap indexer scan keeps growing.
    dsa = model_costs(load_preset("kimi-k3.1-pro"), "mxfp4")
    grow_mla = c.attention_flops_decode(1 << 20) - c.attention_flops_decode(1 << 19)
    grow_dsa = dsa.attention_flops_decode(1 << 20) - dsa.attention_flops_decode(1 << 19)
    assert grow_dsa < grow_mla / 5
    # KDA work per token does not depend on the context at all.
    kda_only = load_preset("kimi-k3").replace(layer_types=("kda",) * 93)
    flat = model_costs(kda_only, "mxfp4")
    assert flat.attention_flops_decode(10) == flat.attention_flops_decode(10 ** 6)


def test_weights_per_chip_split_experts_by_ep_and_rest_by_tp(k3):
    c = model_costs(k3, "mxfp4")
    w = c.weights
    per_chip = c.weights_per_chip(tp=8, ep=16, pp=1)
    expected = w.routed / 16 + (w.total - w.routed - w.norms) / 8 + w.norms
    assert per_chip == pytest.approx(expected, rel=1e-12)
