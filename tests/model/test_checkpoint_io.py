"""Safetensors I/O with the published names: sharded round trip, K3 layout, MXFP4 experts, clear errors."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltamoe.errors import CheckpointError
from deltamoe.model.load import build_model, load_model
from deltamoe.model.weights import save_checkpoint
from deltamoe.ops.quant import quantize_mxfp4


def all_names(path):
    index = path / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return set(f.keys())


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_round_trip_k3_layout(tmp_path, configs):
    cfg = configs["k3.1"]()
    model = build_model(cfg, seed=3)
    save_checkpoint(model, tmp_path, max_shard_bytes=200_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len({p.name for p in tmp_path.glob("model-*.safetensors")}) > 1
    assert not list(tmp_path.glob(".*.tmp"))
    names = all_names(tmp_path)
    # K3 published names: language_model. prefix, per-expert w1/w2/w3, dense mlp at layer 0, indexer
    assert "language_model.model.layers.1.block_sparse_moe.experts.6.w2.weight" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names
    assert "language_model.model.layers.2.self_attn.indexer.k_norm.bias" in names
    assert "language_model.model.layers.0.self_attention_res_proj.weight" in names
    loaded = load_model(tmp_path)
    assert same_weights(model, loaded)
    ids = torch.randint(0, cfg.vocab_size, (1, 9))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, loaded(ids).logits)


def test_kimi_linear_layout_names(tmp_path, configs):
    model = build_model(configs["kimi_linear"](), seed=1)
    save_checkpoint(model, tmp_path)
    names = all_names(tmp_path)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names  # dense layer 0, Kimi Linear naming
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in names
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("model.layers.0.self_attn.A_log").get_shape()) == (1, 1, 3, 1)
    assert same_weights(model, load_model(tmp_path))


def _rewrite(path, edit):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f))


def test_missing_tensor_is_named(tmp_path, configs):
    save_checkpoint(build_model(configs["k3"]()), tmp_path)
    name = "language_model.model.layers.2.self_attn.kv_b_proj.weight"
    _rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match="missing tensor") as e:
        load_model(tmp_path)
    assert e.value.field == name


def test_missing_expert_is_named(tmp_path, configs):
    save_checkpoint(build_model(configs["k3"]()), tmp_path)
    name = "language_model.model.layers.3.block_sparse_moe.experts.4.w3.weight"
    _rewrite(tmp_path, lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert e.value.field == name


def test_unexpected_and_misshaped_tensors(tmp_path, configs):
    save_checkpoint(build_model(configs["k3"]()), tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"language_model.model.layers.0.self_attn.bogus.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="unexpected tensor"):
        load_model(tmp_path)
    save_checkpoint(build_model(configs["k3"]()), tmp_path)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    _rewrite(tmp_path, lambda t: t.update({name: torch.zeros(5, 5)}))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    assert e.value.field == name and "(5, 5)" in str(e.value) and "(24, 48)" in str(e.value)


def test_non_finite_weights_are_named(tmp_path, configs):
    """NaN or inf weights decoded NaN logits (a sampling traceback, or token 0 forever greedy)."""
    save_checkpoint(build_model(configs["k3"]()), tmp_path)
    name = "language_model.lm_head.weight"

    def poison(t):
        t[name][0, :3] = float("nan")

    _rewrite(tmp_path, poison)
    with pytest.raises(CheckpointError, match="holds 3 non-finite value") as e:
        load_model(tmp_path)
    assert e.value.field == name


def test_no_weights_and_corrupt_shard(tmp_path, configs):
    save_checkpoint(build_model(configs["k3"]()), tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError):
        load_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)


def test_mxfp4_packed_experts_dequantised_on_load(tmp_path, configs):
    """Experts stored as compressed-tensors MXFP4 (weight_packed + weight_scale) load to their dequantised values."""
    cfg = configs["k3"](latent_moe_size=32, moe_intermediate_size=32)  # group size 32 along the input dim
    model = build_model(cfg, seed=5)
    save_checkpoint(model, tmp_path)
    expected = {}

    def pack(tensors):
        for name in [n for n in tensors if ".experts." in n]:
            w = tensors.pop(name)
            packed, scale = quantize_mxfp4(w)
            base = name[: -len(".weight")]
            tensors[base + ".weight_packed"], tensors[base + ".weight_scale"] = packed, scale
            expected[name] = (packed, scale)

    _rewrite(tmp_path, pack)
    loaded = load_model(tmp_path)
    from deltamoe.ops.quant import dequantize_mxfp4

    packed, scale = expected["language_model.model.layers.1.block_sparse_moe.experts.2.w2.weight"]
    want = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    assert torch.equal(loaded.model.layers[1].block_sparse_moe.experts.w2[2], want)
    orig = model.model.layers[1].block_sparse_moe.experts.w2[2]
    assert ((want - orig).norm() / orig.norm()) < 0.2  # 4-bit, but the same tensor
    # a lone half is an error naming the expert
    _rewrite(tmp_path, lambda t: t.pop("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale"))
    with pytest.raises(CheckpointError, match="weight_scale"):
        load_model(tmp_path)


def test_transformers_loads_our_kimi_linear_checkpoint(tmp_path, configs):
    transformers = pytest.importorskip("transformers")
    cfg = configs["kimi_linear"](q_lora_rank=16)
    model = build_model(cfg, seed=11).eval()
    save_checkpoint(model, tmp_path)
    ref = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 15))
    with torch.no_grad():
        a, b = model(ids).logits, ref(ids).logits
    assert ((a - b).norm() / b.norm()).item() <= 1e-4


def test_weights_files_get_the_mode_of_the_config(tmp_path, configs):
    """safetensors creates its files 0600; a checkpoint's weights are as readable as its config.json."""
    save_checkpoint(build_model(configs["k3.1"](), seed=3), tmp_path, max_shard_bytes=200_000)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert len(set(modes.values())) == 1, modes


def test_a_write_cut_short_leaves_no_hidden_shard_file(tmp_path, monkeypatch):
    """Ctrl-C during `deltamoe quantize` / an export left a full-size `.model.safetensors.tmp` behind."""
    from deltamoe.model import weights

    def cut_short(tensors, filename, metadata=None):
        open(filename, "wb").write(b"\0" * 4096)  # part of the shard is on disk when the interrupt lands
        raise KeyboardInterrupt

    monkeypatch.setattr(weights, "save_file", cut_short)
    with pytest.raises(KeyboardInterrupt):
        weights.save_tensors({"w": torch.zeros(4)}, tmp_path / "out", {"model_type": "x"})
    assert [p.name for p in (tmp_path / "out").iterdir()] == []


def test_a_tied_config_over_a_checkpoint_with_its_own_head_warns(tmp_path, configs):
    """config.json ties the head, the file holds a different lm_head: the embedding is the head (as in
    transformers), said in a warning; an equal head or none loads quietly."""
    import dataclasses
    import warnings

    cfg = configs["k3.1"]()
    save_checkpoint(build_model(cfg, seed=3), tmp_path / "untied")  # lm_head differs from the embedding
    config = json.loads((tmp_path / "untied" / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (tmp_path / "untied" / "config.json").write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="tie_word_embeddings, so language_model.lm_head.weight .* is not used"):
        model = load_model(tmp_path / "untied")
    assert model.lm_head.weight is model.model.embed_tokens.weight

    save_checkpoint(build_model(dataclasses.replace(cfg, tie_word_embeddings=True), seed=3), tmp_path / "tied")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tmp_path / "tied")
