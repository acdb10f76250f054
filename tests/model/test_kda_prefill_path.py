"""The KDA layer's prefill (no cache, T > 1) runs the chunked op, and gives what the plain
recurrence gives in its place."""

from __future__ import annotations

import pytest
import torch

from deltamoe.config import load_preset
from deltamoe.model import kda_layer
from deltamoe.ops.kda import recurrent_kda


def test_prefill_runs_chunk_kda_and_equals_the_recurrence(monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_preset("tiny")
    torch.manual_seed(0)
    layer = kda_layer.KimiDeltaAttention(config, config.layer_types.index("kda")).eval()
    with torch.no_grad():
        layer.A_log.uniform_(0.0, 2.8)
        layer.dt_bias.normal_()
    x = torch.randn(2, 150, config.hidden_size)  # more than two chunks of 64

    calls: list[int] = []
    chunk_kda = kda_layer.chunk_kda

    def counting_chunk_kda(q, *args, **kwargs):
        calls.append(q.shape[1])
        return chunk_kda(q, *args, **kwargs)

    monkeypatch.setattr(kda_layer, "chunk_kda", counting_chunk_kda)
    with torch.no_grad():
        fast = layer(x)
    assert calls == [150]

    monkeypatch.setattr(kda_layer, "chunk_kda", recurrent_kda)
    with torch.no_grad():
        reference = layer(x)
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
