"""`generate` and `serve` compile by default where the compiled decode step serves the launch."""

from __future__ import annotations

import pytest

from deltamoe.serve import compile_choice
from deltamoe.serve.compile_choice import compile_by_default, resolve_compile


@pytest.fixture
def default_on(monkeypatch):
    monkeypatch.delenv("DELTAMOE_COMPILE_DEFAULT", raising=False)
    monkeypatch.setattr(compile_choice, "_has_cxx", lambda: True)


def test_default_compiles_one_cpu_process_only(default_on):
    assert compile_by_default("cpu", 1, 1, torchrun=False)
    assert not compile_by_default("cpu", 2, 1, torchrun=False)  # worker ranks run eagerly
    assert not compile_by_default("cpu", 1, 2, torchrun=False)
    assert not compile_by_default("cpu", 1, 1, torchrun=True)
    assert not compile_by_default("cuda", 1, 1, torchrun=False)  # inductor's GPU kernels need Triton


def test_explicit_flags_win(default_on):
    assert resolve_compile(False, "cpu", 1, 1) is False
    assert resolve_compile(True, "cpu", 2, 1) is True  # every worker rank compiles
    assert resolve_compile(None, "cpu", 1, 1) is True


def test_no_compiler_or_env_means_eager(monkeypatch, capsys):
    monkeypatch.delenv("DELTAMOE_COMPILE_DEFAULT", raising=False)
    monkeypatch.setattr(compile_choice, "_has_cxx", lambda: False)
    assert not compile_by_default("cpu", 1, 1, torchrun=False)
    assert "no C++ compiler" in capsys.readouterr().err
    monkeypatch.setattr(compile_choice, "_has_cxx", lambda: True)
    monkeypatch.setenv("DELTAMOE_COMPILE_DEFAULT", "0")
    assert not compile_by_default("cpu", 1, 1, torchrun=False)


def test_quantized_checkpoint_without_a_compiled_form_decodes_eagerly_by_default(default_on, tmp_path):
    """Int4 W4A16 compiles by default like full precision; W4A8 and MXFP4 experts have no compiled form."""
    import json

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}

    def int4(acts):
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}}}

    configs = {"plain": {"model_type": "kimi_linear"}, "int4": {"quantization_config": int4(None)},
               "w4a8": {"quantization_config": int4({"num_bits": 8, "type": "float", "dynamic": True})},
               "mxfp4": {"quantization_config": {"format": "mxfp4-pack-quantized", "config_groups": {}}},
               "packed": {"model_type": "kimi_k3"}}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    (tmp_path / "packed" / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.1.mlp.experts.0.w1.weight_packed": "model-1.safetensors"}}))
    eager = {name for name in configs if compile_choice.quantized_without_compiled_form(str(tmp_path / name))}
    assert eager == {"w4a8", "mxfp4", "packed"}
    assert not compile_choice.quantized_without_compiled_form("tiny")  # a preset
    assert {name for name in configs if resolve_compile(None, "cpu", 1, 1, str(tmp_path / name))} \
        == {"plain", "int4"}
    assert resolve_compile(True, "cpu", 1, 1, str(tmp_path / "w4a8")) is True  # --compile asks for it
