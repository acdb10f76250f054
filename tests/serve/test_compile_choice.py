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
    assert compile_by_default("cpu", 1, 1, "auto", torchrun=False)
    assert not compile_by_default("cpu", 2, 1, "auto", torchrun=False)  # worker ranks run eagerly
    assert not compile_by_default("cpu", 1, 2, "auto", torchrun=False)
    assert not compile_by_default("cpu", 1, 1, "auto", torchrun=True)
    assert not compile_by_default("cpu", 1, 1, "fp8", torchrun=False)
    assert not compile_by_default("cuda", 1, 1, "auto", torchrun=False)  # inductor's GPU kernels need Triton


def test_explicit_flags_win(default_on):
    assert resolve_compile(False, "cpu", 1, 1, "auto") is False
    assert resolve_compile(True, "cpu", 2, 1, "auto") is True  # check_workers then names --compile
    assert resolve_compile(None, "cpu", 1, 1, "auto") is True


def test_no_compiler_or_env_means_eager(monkeypatch, capsys):
    monkeypatch.delenv("DELTAMOE_COMPILE_DEFAULT", raising=False)
    monkeypatch.setattr(compile_choice, "_has_cxx", lambda: False)
    assert not compile_by_default("cpu", 1, 1, "auto", torchrun=False)
    assert "no C++ compiler" in capsys.readouterr().err
    monkeypatch.setattr(compile_choice, "_has_cxx", lambda: True)
    monkeypatch.setenv("DELTAMOE_COMPILE_DEFAULT", "0")
    assert not compile_by_default("cpu", 1, 1, "auto", torchrun=False)


def test_quantized_checkpoint_decodes_eagerly_by_default(default_on, tmp_path):
    import json

    plain, quantized, packed = (tmp_path / name for name in ("plain", "int4", "mxfp4"))
    for folder in (plain, quantized, packed):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"model_type": "kimi_linear"}))
    (quantized / "config.json").write_text(json.dumps({"quantization_config": {"format": "pack-quantized"}}))
    (packed / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.layers.1.mlp.experts.0.w1.weight_packed": "model-1.safetensors"}}))
    assert not compile_choice.quantized_checkpoint(str(plain))
    assert compile_choice.quantized_checkpoint(str(quantized)) and compile_choice.quantized_checkpoint(str(packed))
    assert not compile_choice.quantized_checkpoint("tiny")  # a preset
    assert resolve_compile(None, "cpu", 1, 1, "auto", str(plain)) is True
    assert resolve_compile(None, "cpu", 1, 1, "auto", str(quantized)) is False
    assert resolve_compile(None, "cpu", 1, 1, "auto", str(packed)) is False
    assert resolve_compile(True, "cpu", 1, 1, "auto", str(quantized)) is True  # --compile asks for it
