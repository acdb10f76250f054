"""Layouts, memory fit, SLOs and the bound each estimate names."""

import pytest

from deltamoe.config import load_preset
from deltamoe.errors import ConfigError, HardwareError
from deltamoe.plan.costs import model_costs
from deltamoe.plan.hardware import get_hardware
from deltamoe.plan.layout import PoolLayout, layout_candidates
from deltamoe.plan.roofline import decode_step, prefill_step
from deltamoe.plan.search import Planner, Workload, best_plan


@pytest.fixture(scope="module")
def k31():
    return model_costs(load_preset("kimi-k3.1-pro"), "mxfp4", "fp8")


def test_layout_candidates_respect_heads_domain_and_attnres(k31):
    lays = layout_candidates(k31.cfg, get_hardware("h200"), 32, "decode")
    assert lays and all(lay.chips == 32 for lay in lays)
    assert {lay.tp for lay in lays} == {1, 2, 4, 8}  # TP stays inside the 8-GPU NVLink domain
    assert max(lay.pp for lay in lays) == 8  # 93 layers = 8 AttnRes blocks of 12


def test_plan_on_h200_fits_and_meets_the_slo(k31):
    w = Workload(context=8192, output=1024, slo_ttft_s=5.0, slo_tpot_s=0.05)
    plan, plans = best_plan(k31, get_hardware("h200"), w, 32)
    assert plan.meets() and plan.tpot_s <= 0.05 and plan.ttft_s <= 5.0
    assert plan.output_per_chip == max(p.output_per_chip for p in plans if p.meets())
    for pool in (plan.prefill, plan.decode):
        if pool is not None:
            assert pool.memory.fits
            assert pool.step.bound in ("compute", "HBM", "scale-up link", "scale-out link", "latency")
    assert plan.decode.memory.total <= 141e9 * 0.9


def test_tighter_tpot_never_raises_throughput(k31):
    hw = get_hardware("h200")
    loose = best_plan(k31, hw, Workload(slo_tpot_s=0.1), 32)[0]
    tight = best_plan(k31, hw, Workload(slo_tpot_s=0.03), 32)[0]
    assert tight.output_per_chip <= loose.output_per_chip
    assert tight.tpot_s <= 0.03


def test_model_that_cannot_fit_says_what_is_short(k31):
    with pytest.raises(ConfigError) as e:
        best_plan(k31, get_hardware("h100"), Workload(), 8, "kimi-k3.1-pro")
    msg = str(e.value)
    assert e.value.field == "nodes" and "short by 1,018 GB" in msg and "kimi-k3.1-pro" in msg
    assert "--nodes 3" in e.value.hint


def test_unknown_numbers_stop_the_plan_with_all_of_them(k31):
    with pytest.raises(HardwareError) as e:
        best_plan(k31, get_hardware("m890-superpod"), Workload(), 64)
    assert "hbm_tbps" in str(e.value) and "fp4_tflops" in str(e.value)


def test_max_batch_is_the_memory_limit(k31):
    hw = get_hardware("h200")
    planner = Planner(k31, hw, Workload())
    lay = PoolLayout("decode", 8, 4, 1, 1)
    b = planner.max_batch(lay, 8704)
    assert planner._memory(lay, b, 8704, 0).fits and not planner._memory(lay, b + 1, 8704, 0).fits


def test_bounds_move_with_batch_and_domain(k31):
    b300, h200 = get_hardware("b300"), get_hardware("h200")
    one = decode_step(k31, b300, PoolLayout("decode", 8, 1, 1, 1), 1, 8704)
    assert one.bound == "latency" and one.hbm_s > one.compute_s  # bs 1: launch + collectives, then weights
    wide = decode_step(k31, h200, PoolLayout("decode", 1, 32, 1, 1), 256, 8704)
    assert wide.scaleout_s > wide.scaleup_s > 0  # EP32 spans 4 HGX nodes: most copies leave the node
    inside = decode_step(k31, get_hardware("gb200-nvl72"), PoolLayout("decode", 1, 32, 1, 1), 256, 8704)
    assert inside.scaleout_s == 0 and inside.scaleup_s > 0  # the same EP32 inside one NVL72 domain
    pre = prefill_step(k31, h200, PoolLayout("prefill", 8, 2, 1, 1), 16384, 8192)
    assert pre.bound == "compute"
