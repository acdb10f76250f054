"""bench/kda_cost_split.py times `chunk_kda`'s stages by wrapping the op's two stage functions: the
wrappers must see every group, and the op's result must not change under them."""

from __future__ import annotations

import pytest
import torch

from deltamoe.ops import kda, kda_fused


def test_stages_add_up_and_the_op_is_restored(monkeypatch, bench_script) -> None:
    script = bench_script("kda_cost_split")
    monkeypatch.setattr(kda, "GROUP_ELEMENTS", 1)  # one group per chunk: four groups of 16
    x = script.make_inputs(64, "softplus", head_dim=8)
    terms, state_pass = kda._chunk_terms, kda._state_pass

    r = script.measure(x, chunk_size=16, repeats=2, split_ops=False)  # the profiler takes seconds to start

    assert kda._chunk_terms is terms and kda._state_pass is state_pass
    assert r["chunks_used"] and max(r["chunks_used"]) <= 16
    stages = r["stages_s"]
    assert set(stages) == {"state-independent", "state pass", "o into token order, rest"}
    assert stages["state-independent"] > 0 and stages["state pass"] > 0
    assert abs(sum(stages.values()) - r["total_s"]) < 1e-9
    o, _ = kda.chunk_kda(**x, use_qk_l2norm=True, chunk_size=16)
    o_ref, _ = kda.recurrent_kda(**x, use_qk_l2norm=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_op_kinds_of_one_run(bench_script) -> None:
    script = bench_script("kda_cost_split")
    x = script.make_inputs(64, "softplus", head_dim=8)
    with torch.no_grad(), kda_fused.turned_off():  # the torch path's ops (the fused kernel has none to split)
        ops, matmuls = script.op_split(lambda: kda.chunk_kda(**x, use_qk_l2norm=True, chunk_size=16))
    assert set(ops) == {"matmul", "solve", "allocation", "rest"}
    assert ops["matmul"] > 0 and ops["solve"] > 0 and ops["rest"] > 0
    # The state pass's W S_0 of each chunk: [B*H, C, K] x [B*H, K, V] = [8, 16, 8] x [8, 8, 8], in
    # baddbmm(out=) (U is its input), once per chunk: 2 * 8 * 16 * 8 * 8 flops each.
    w_s = [m for m in matmuls if m["op"] == "aten::baddbmm" and m["shapes"][1] == [8, 16, 8]]
    assert len(w_s) == 1 and w_s[0]["calls"] == 4
    assert w_s[0]["gflop"] == pytest.approx(4 * 2 * 8 * 16 * 8 * 8 / 1e9)
    assert script.isolated_seconds(w_s[0]["op"], w_s[0]["shapes"], repeats=3) > 0
