"""bench/kda_prefill_share.py times the KDA layer's pieces inside a real eager prefill by wrapping
them: the wrappers must see the calls, a fixed chunk length must reach the op, and everything
must be restored after."""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

from deltamoe.model import kda_layer

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_script():
    sys.path.insert(0, str(BENCH))  # the script imports bench_serve_offline and common beside it
    try:
        spec = importlib.util.spec_from_file_location("kda_prefill_share", BENCH / "kda_prefill_share.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_pieces_are_timed_inside_the_prefill_and_restored() -> None:
    script = load_script()
    with tempfile.TemporaryDirectory() as tmp:
        script.hf_model().save_pretrained(tmp)
        model = script.load_model(tmp)
    before = {name: getattr(kda_layer, name) for name in script.KDA_PIECES}
    chunk_sizes = []
    op = kda_layer.chunk_kda

    def spy(*args, **kwargs):
        chunk_sizes.append(kwargs.get("chunk_size"))
        return op(*args, **kwargs)

    kda_layer.chunk_kda = before["chunk_kda"] = spy
    try:
        seconds = script.prefill_seconds(model, script.make_prompts(3), chunk_size=5)
        restored = all(getattr(kda_layer, name) is fn for name, fn in before.items())
    finally:
        kda_layer.chunk_kda = op
    assert restored
    assert chunk_sizes and set(chunk_sizes) == {5}
    assert all(seconds[name] > 0 for name in (*script.KDA_PIECES, "KimiDeltaAttention", "MoE"))
    assert seconds["chunk_kda"] < seconds["KimiDeltaAttention"] < seconds["total"]
    assert all("forward" not in vars(m) for m in model.modules())  # the classes' forwards again
