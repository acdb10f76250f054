"""`deltamoe quantize` checkpoints: published layout, loading quantized, kernels vs references, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltamoe.errors import CheckpointError
from deltamoe.config import load_preset
from deltamoe.model.load import build_model, load_model
from deltamoe.model.packed_experts import PackedExperts
from deltamoe.model.quant_scheme import make_scheme, scheme_from_config, scheme_to_config
from deltamoe.model.quantize_modules import resident_weight_bytes
from deltamoe.model.quantized_linear import Int4Linear
from deltamoe.ops import int4_experts
from deltamoe.ops.int4_experts import kernel_block_rows
from deltamoe.quantize.checkpoint import quantize_checkpoint
from deltamoe.serve.engine.config import EngineConfig
from deltamoe.serve.engine.llm_engine import LLMEngine
from deltamoe.serve.engine.sampling import SamplingParams

# tiny: hidden 128, latent experts 64 x 96, so group 32 quantizes the experts too.
FORMATS = {"int4": ("int4", 32, None), "w4a8-fp8": ("w4a8", 32, "fp8"), "w4a8-int8": ("w4a8", 32, "int8"),
           "mxfp4": ("mxfp4", None, None)}
EXPERT = "language_model.model.layers.1.block_sparse_moe.experts.3.w2"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for key, args in FORMATS.items():
        path = tmp_path_factory.mktemp(key)
        quantize_checkpoint("tiny", path, make_scheme(*args), dtype=torch.float32)
        out[key] = path
    return out


def _logits(model, seed=0):
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_int4_checkpoint_uses_compressed_tensors_names(checkpoints):
    path = checkpoints["int4"]
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["format"] == "pack-quantized" and qc["config_groups"]["group_0"]["weights"]["group_size"] == 32
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors[f"{EXPERT}.weight_packed"].dtype == torch.int32
    assert tensors[f"{EXPERT}.weight_packed"].shape == (64, 96 // 8)  # [D', I/8]
    assert tensors[f"{EXPERT}.weight_scale"].shape == (64, 96 // 32)
    assert tensors[f"{EXPERT}.weight_shape"].tolist() == [64, 96]
    assert "language_model.model.layers.0.mlp.gate_proj.weight_packed" in tensors
    assert "language_model.lm_head.weight" in tensors  # ignored: stays float
    assert "language_model.model.layers.3.self_attn.kv_b_proj.weight" in tensors
    read, written = scheme_from_config(qc), make_scheme("int4", 32)
    assert read.ignore[:len(written.ignore)] == written.ignore  # then the float-kept modules by full name
    assert "language_model.lm_head" in read.ignore
    assert dataclasses.replace(read, ignore=written.ignore) == written


def test_mxfp4_checkpoint_quantizes_routed_experts_only(checkpoints):
    tensors = load_file(str(checkpoints["mxfp4"] / "model.safetensors"))
    assert tensors[f"{EXPERT}.weight_packed"].dtype == torch.uint8
    assert tensors[f"{EXPERT}.weight_packed"].shape == (64, 48)
    assert tensors[f"{EXPERT}.weight_scale"].shape == (64, 3)
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight" in tensors
    assert not any(n.endswith("weight_packed") and ".experts." not in n for n in tensors)


@pytest.mark.parametrize("key", list(FORMATS))
def test_quantized_model_runs_packed_and_matches_its_reference(checkpoints, key):
    model = load_model(checkpoints[key])
    linears = [m for m in model.modules() if isinstance(m, Int4Linear)]
    experts = [m for m in model.modules() if isinstance(m, PackedExperts)]
    assert len(experts) == 8  # every MoE layer: 7 of the trunk (layer 0 is dense) and the MTP layer
    if key == "mxfp4":
        assert not linears
    else:
        assert all(m.use_kernel for m in linears)
        assert not any(isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0 for n, m in model.named_modules()
                       if not n.endswith(("lm_head", "head", "kv_b_proj")))
    reference = load_model(checkpoints[key], quant_kernels=False)
    got, ref = _logits(model), _logits(reference)
    # Same arithmetic up to summation order; a bf16 output (or int8 activation) rounding step
    # that lands the other way moves a few logits by up to about 1 %.
    tol = 1e-5 if key == "mxfp4" else 2e-2
    assert (got - ref).abs().max() < tol * ref.abs().max()
    assert (got - ref).abs().median() < 2e-3 * ref.abs().max()
    dequantized = load_model(checkpoints[key], dequantize=True)
    assert (_logits(dequantized) - ref).abs().max() < 0.2 * ref.abs().max()  # activation rounding only
    assert resident_weight_bytes(model) < 0.6 * resident_weight_bytes(dequantized)


def test_mxfp4_experts_equal_the_dequantized_model(checkpoints):
    got = _logits(load_model(checkpoints["mxfp4"]))
    ref = _logits(load_model(checkpoints["mxfp4"], dequantize=True))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("key", ["int4", "mxfp4"])
def test_engine_greedy_output_equals_the_reference_model(checkpoints, key):
    prompts = [[256, 72, 101, 108], [256, 87, 104, 97, 116, 32, 105, 115], [256, 1, 2, 3, 4, 5]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    runs = []
    for kw in ({}, {"quant_kernels": False} if key == "int4" else {"dequantize": True}):
        engine = LLMEngine(load_model(checkpoints[key], **kw), config=EngineConfig(cache_memory="8MiB"))
        runs.append([c.token_ids for c in engine.generate(prompts, params, progress=False)])
    assert runs[0] == runs[1]
    assert all(len(t) == 10 for t in runs[0])


@pytest.mark.skipif(kernel_block_rows() is None, reason="no CPU int4 kernel with a known layout")
def test_batch_one_decode_runs_the_gathered_experts_and_equals_the_reference(checkpoints, monkeypatch):
    """One sequence decodes one token a step: each MoE layer runs its top-k int4 experts in two
    kernel calls on gathered operands. The gathered form sums the experts before rounding to bf16
    where the reference rounds each expert, so on a random-init model a greedy near-tie may flip:
    the check is teacher-forced, the logprob of every decoded token under the dequantising
    reference model (scored as a prompt) equal to the one the gathered path computed."""
    model = load_model(checkpoints["int4"])
    assert all(m.stack is not None for m in model.modules() if isinstance(m, PackedExperts))
    w4a8 = load_model(checkpoints["w4a8-fp8"])
    assert all(m.stack is None for m in w4a8.modules() if isinstance(m, PackedExperts))
    calls = []
    one_token = int4_experts.int4_experts_one_token
    monkeypatch.setattr(int4_experts, "int4_experts_one_token", lambda *a, **k: calls.append(1) or one_token(*a, **k))
    prompt = [256, 72, 101, 108, 108, 111]
    engine = LLMEngine(model, config=EngineConfig(cache_memory="8MiB", max_num_seqs=1))
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0),
                          progress=False)[0]
    assert len(out.token_ids) == 12
    assert len(calls) == 11 * 7  # 11 decode steps x the trunk's 7 MoE layers (the MTP layer does not run)
    reference = LLMEngine(load_model(checkpoints["int4"], quant_kernels=False), config=EngineConfig(cache_memory="8MiB"))
    scored = reference.generate([prompt + out.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                                progress=False)[0].prompt_logprobs
    want = torch.tensor([lp.logprob for lp in scored[-12:]])
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    assert [lp.token_id for lp in scored[-12:]] == out.token_ids
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)


def test_missing_quantized_tensor_names_it(checkpoints, tmp_path):
    src = checkpoints["int4"]
    tensors = load_file(str(src / "model.safetensors"))
    del tensors[f"{EXPERT}.weight_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(CheckpointError, match="experts.3.w2.weight_scale"):
        load_model(tmp_path)
    del tensors["language_model.model.layers.0.mlp.up_proj.weight_packed"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.0.mlp.up_proj.weight"):
        load_model(tmp_path)


def test_k3_style_config_with_the_format_in_its_group_reads_as_mxfp4():
    qc = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*shared_experts.*"],
          "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "targets": ["Linear"],
                                        "weights": {"num_bits": 4, "type": "float", "group_size": 32}}}}
    scheme = scheme_from_config(qc)
    assert scheme.format == "mxfp4" and scheme.ignore == ("lm_head", "re:.*shared_experts.*")


def test_unsupported_quantization_config_is_a_checkpoint_error():
    qc = scheme_to_config(make_scheme("int4"))
    qc["config_groups"]["group_0"]["weights"]["symmetric"] = False
    with pytest.raises(CheckpointError, match="symmetric int4"):
        scheme_from_config(qc)
    with pytest.raises(CheckpointError, match="quant_method"):
        scheme_from_config({"quant_method": "gptq"})


def test_make_scheme_rejects_bad_options():
    with pytest.raises(ValueError, match="format"):
        make_scheme("nf4")
    with pytest.raises(ValueError, match="group_size"):
        make_scheme("int4", 48)
    with pytest.raises(ValueError, match="activations"):
        make_scheme("int4", activations="fp8")
    assert make_scheme("w4a8").activations == "fp8"


def test_quantize_command_writes_a_loadable_checkpoint(tmp_path, capsys):
    from deltamoe.cli import main

    assert main(["quantize", "tiny", str(tmp_path / "q"), "--format", "w4a8", "--group-size", "32",
                 "--activations", "int8"]) == 0
    assert "quantized w4a8" in capsys.readouterr().out
    model = load_model(tmp_path / "q")
    linear = model.model.layers[0].mlp.gate_proj
    assert isinstance(linear, Int4Linear) and linear.activations == "int8"
    assert model.lm_head.weight.dtype == torch.float32  # loaded in fp32 from the bf16 file
    with safe_open(str(tmp_path / "q" / "model.safetensors"), "pt") as f:
        assert f.get_slice("language_model.lm_head.weight").get_dtype() == "BF16"


@pytest.mark.parametrize("args,field", [(["--format", "nf4"], "--format"),
                                        (["--format", "int4", "--group-size", "48"], "--group-size"),
                                        (["--format", "int4", "--group-size", "0"], "--group-size"),
                                        (["--format", "mxfp4", "--activations", "fp8"], "--activations"),
                                        (["--format", "int4", "--dtype", "fp16"], "--dtype")])
def test_quantize_command_bad_options_exit_2_with_one_line(tmp_path, capsys, args, field):
    from deltamoe.cli import main

    assert main(["quantize", "tiny", str(tmp_path / "q"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {field}:") and "\n" not in err
    assert not (tmp_path / "q").exists()


def test_saving_a_quantized_model_is_refused(checkpoints, tmp_path):
    from deltamoe.model.weights import save_checkpoint

    with pytest.raises(CheckpointError, match="not saved"):
        save_checkpoint(load_model(checkpoints["mxfp4"]), tmp_path / "copy")


def test_quantize_refuses_its_own_source_and_bad_outputs(tmp_path, capsys):
    """Quantizing in place would replace the float weights; a file, an empty name or an unwritable place
    for OUT is one line too."""
    from deltamoe.cli import main
    from deltamoe.model.load import build_model
    from deltamoe.model.weights import save_checkpoint
    from deltamoe.config import load_preset

    src = tmp_path / "src"
    save_checkpoint(build_model(load_preset("tiny")), src, max_shard_bytes=2 << 20)
    before = sorted(p.name for p in src.iterdir())
    (tmp_path / "file").write_text("x")
    for out, message in [(str(src), "is the source checkpoint"), (str(tmp_path / "file"), "is not a folder"),
                         ("", "empty output folder"), ("/proc/deltamoe-q", "cannot write")]:
        assert main(["quantize", str(src), out, "--format", "int4"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: out: ") and message in err, err
    assert sorted(p.name for p in src.iterdir()) == before


def test_a_checkpoint_written_over_another_leaves_none_of_its_files(tmp_path):
    """Sharded over single-file and back: the old index or shards never outlive the new checkpoint."""
    from deltamoe.config import load_preset
    from deltamoe.model.load import build_model
    from deltamoe.model.weights import save_checkpoint

    out = tmp_path / "ckpt"
    save_checkpoint(build_model(load_preset("tiny"), seed=1), out, max_shard_bytes=2 << 20)
    assert (out / "model.safetensors.index.json").exists()
    assert main_quantize(out.parent / "ckpt", tmp_path) == 0
    quantized = load_model(tmp_path / "q")  # the fresh folder
    save_checkpoint(build_model(load_preset("tiny"), seed=2), out)  # one file over the shards
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    reloaded = load_model(out)
    assert torch.equal(reloaded.lm_head.weight, build_model(load_preset("tiny"), seed=2).lm_head.weight)
    quantize_checkpoint("tiny", out, make_scheme("int4"))  # over a float checkpoint: loads as the quantized one
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert isinstance(load_model(out).model.layers[0].mlp.gate_proj, Int4Linear)
    assert isinstance(quantized.model.layers[0].mlp.gate_proj, Int4Linear)
    save_checkpoint(build_model(load_preset("tiny"), seed=3), out, max_shard_bytes=2 << 20)  # shards over one file
    assert "model.safetensors" not in {p.name for p in out.iterdir()}
    assert torch.equal(load_model(out).lm_head.weight, build_model(load_preset("tiny"), seed=3).lm_head.weight)


def main_quantize(src, tmp_path) -> int:
    from deltamoe.cli import main

    return main(["quantize", str(src), str(tmp_path / "q"), "--format", "int4"])


@pytest.mark.parametrize("key", list(FORMATS))
def test_config_ignore_names_every_target_kept_in_float(checkpoints, key):
    """What a compressed-tensors reader (vLLM) reads off the config matches the file: every module the
    config group targets and `ignore` does not name holds packed weights, and every one it names holds a
    plain `weight` (compressed-tensors matching: the module name, or `re:` + a full match)."""
    import re

    config = json.loads((checkpoints[key] / "config.json").read_text())["quantization_config"]
    ignore = config["ignore"]
    targets_experts = config["config_groups"]["group_0"]["targets"] != ["Linear"]

    def ignored(module: str) -> bool:
        return any(re.fullmatch(p[3:], module) if p.startswith("re:") else module == p for p in ignore)

    from torch import nn

    from deltamoe.model.checkpoint_names import param_to_checkpoint
    from deltamoe.model.ffn import RoutedExperts

    with safe_open(str(checkpoints[key] / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    packed = {n.removesuffix(".weight_packed") for n in names if n.endswith(".weight_packed")}
    float_model = build_model(load_preset("tiny"))
    linears = set()  # the targets' published module names: every Linear and expert projection
    for name, module in float_model.named_modules():
        if isinstance(module, nn.Linear):
            linears.add(param_to_checkpoint(f"{name}.weight", float_model.config).removesuffix(".weight"))
        elif isinstance(module, RoutedExperts):
            for w in ("w1", "w2", "w3"):
                linears.update(n.removesuffix(".weight") for n in param_to_checkpoint(f"{name}.{w}", float_model.config))
    plain = {n.removesuffix(".weight") for n in names if n.endswith(".weight")} & linears
    assert packed and plain and packed <= linears
    for module in packed:
        assert not ignored(module), module
    for module in plain:
        is_expert = ".experts." in module
        if targets_experts and not is_expert:
            continue  # mxfp4 targets the routed experts only
        assert ignored(module), module


def test_a_group_that_quantizes_no_layer_is_refused_and_a_partial_one_says_what_stayed_float(tmp_path, capsys):
    """tiny without its MTP layer has no input width that 256 divides: writing a float copy labelled
    int4 is an error naming --group-size; with it, the one layer quantized and the rest kept float are said."""
    from deltamoe.cli import main
    from deltamoe.model.weights import save_checkpoint

    src = tmp_path / "no-mtp"
    save_checkpoint(build_model(dataclasses.replace(load_preset("tiny"), num_nextn_predict_layers=0)), src)
    assert main(["quantize", str(src), str(tmp_path / "q"), "--format", "int4", "--group-size", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --group-size: ") and "quantizes no layer" in err and err.count("\n") == 1, err
    assert not (tmp_path / "q").exists()

    assert main(["quantize", "tiny", str(tmp_path / "q"), "--format", "int4", "--group-size", "256"]) == 0
    captured = capsys.readouterr()
    assert "quantized int4: 1 layers or expert stacks" in captured.out
    kept = len(json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["ignore"])
    assert "kept in float" in captured.err and "group size 256" in captured.err
    assert kept >= int(captured.err.split("note: ")[1].split()[0])


def test_a_quantized_source_is_dequantized_then_quantized_with_a_note(checkpoints, tmp_path, capsys):
    """K3 ships MXFP4 experts: quantizing that checkpoint to int4 dequantizes it first (was an error
    after the whole load, telling a CLI user to pass dequantize=True)."""
    from deltamoe.cli import main

    assert main(["quantize", str(checkpoints["mxfp4"]), str(tmp_path / "q"), "--format", "int4",
                 "--group-size", "32"]) == 0
    assert "is an mxfp4 checkpoint: dequantized, then quantized to int4" in capsys.readouterr().err
    requantized = load_model(tmp_path / "q")
    assert isinstance(requantized.model.layers[0].mlp.gate_proj, Int4Linear)
    from deltamoe.model.weights import save_checkpoint

    save_checkpoint(load_model(checkpoints["mxfp4"], dequantize=True), tmp_path / "float")
    quantize_checkpoint(tmp_path / "float", tmp_path / "via-float", make_scheme("int4", 32, None))
    torch.testing.assert_close(_logits(requantized), _logits(load_model(tmp_path / "via-float")), rtol=0, atol=0)
