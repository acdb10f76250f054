"""Whether `generate` and `serve` compile their decode step: `--compile`, `--no-compile`, or the default.

The default compiles (serve/engine/compiled_decode.py, whole decoder layers as regions: a first start
of the `tiny` preset compiles three graphs, about 50 s on two quiet cores; a later one loads
inductor's disk cache) wherever the compiled path serves the launch: one process, a CPU
(inductor's GPU kernels need Triton, which deltamoe does not install), full-precision or int4
W4A16 weights (pages in the model's dtype or fp8) and a C++ compiler on the machine. Other
quantized checkpoints (W4A8, MXFP4 experts) decode eagerly: their experts have no compiled form.
Elsewhere the default decodes eagerly; `--compile` asked for explicitly
where it cannot run stays an error naming the option. DELTAMOE_COMPILE_DEFAULT=0 makes the
default eager everywhere (the test suite sets it: a first compile takes a minute or more per model).

Imports no torch (but to read a quantized checkpoint's scheme): the CLI decides before loading anything.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path


def compile_by_default(device: str, tp: int, ep: int, torchrun: bool, quantized: bool = False) -> bool:
    """What the default (no --compile / --no-compile) means for this launch."""
    if os.environ.get("DELTAMOE_COMPILE_DEFAULT", "1") == "0":
        return False
    if tp * ep > 1 or torchrun or quantized or not device.startswith("cpu"):
        return False
    if not _has_cxx():
        print("note: no C++ compiler found (g++ or $CXX): decoding eagerly; install one for the compiled "
              "decode step, or pass --no-compile to silence this", file=sys.stderr)
        return False
    return True


def _has_cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX") or "", "g++", "c++", "clang++") if c)


def quantized_without_compiled_form(model: str) -> bool:
    """Whether `model` is a checkpoint folder with quantized weights that the compiled decode step
    does not run: a `quantization_config` in its config.json that `model.quant_scheme` does not read
    as int4 W4A16 (W4A8, MXFP4, or one loading will refuse), or packed expert tensors
    (`weight_packed`, K3's MXFP4 experts) named in its index.
    A preset name, or a folder this cannot read, counts as full precision: loading reports the rest."""
    folder = Path(model)
    try:
        config = json.loads((folder / "config.json").read_text())
        if isinstance(config, dict) and "quantization_config" in config:
            return not _int4_w4a16(config["quantization_config"])
        index = json.loads((folder / "model.safetensors.index.json").read_text())
    except (OSError, ValueError):
        return False
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    return isinstance(weight_map, dict) and any(str(name).endswith("weight_packed") for name in weight_map)


def _int4_w4a16(qc: object) -> bool:
    """Whether a `quantization_config` is int4 weights with float activations, as the loader reads it
    (imports torch: only for a quantized checkpoint, which loads torch next anyway)."""
    from deltamoe.errors import CheckpointError
    from deltamoe.model.quant_scheme import scheme_from_config

    try:
        return isinstance(qc, dict) and scheme_from_config(qc).format == "int4"
    except (CheckpointError, AttributeError, TypeError, ValueError, KeyError):
        return False  # loading names what is wrong with it


def resolve_compile(flag: bool | None, device: str, tp: int, ep: int, model: str = "") -> bool:
    """`flag`: True (--compile), False (--no-compile) or None (the default)."""
    if flag is not None:
        return flag
    from deltamoe.serve.executor.config import launched_by_torchrun

    return compile_by_default(device, tp, ep, launched_by_torchrun(),
                              quantized=bool(model) and quantized_without_compiled_form(model))
