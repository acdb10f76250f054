"""bench/kda_prefill_share.py times the KDA layer's pieces inside a real eager prefill by wrapping
them: the wrappers must see the calls, a fixed chunk length must reach the op, and everything
must be restored after."""

from __future__ import annotations

import tempfile

from deltamoe.model import kda_layer


def test_pieces_are_timed_inside_the_prefill_and_restored(bench_script) -> None:
    script = bench_script("kda_prefill_share")
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
