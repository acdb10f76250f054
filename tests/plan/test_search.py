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
    # 24 H100 hold the bytes in total but no layout (TP8 x DP3 puts 74 GB on a 68 GB chip): 32 is the first.
    assert "32 chips (--chips 32) or --nodes 4" in e.value.hint


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


def test_does_not_fit_hint_names_a_count_whose_layouts_fit(k31):
    """The hint comes from the layouts, not total bytes: 13-15 H200 hold the bytes but no layout, 16 does."""
    h200 = get_hardware("h200")
    with pytest.raises(ConfigError) as e:
        best_plan(k31, h200, Workload(), 8, "kimi-k3.1-pro")
    assert "short by 579 GB" in str(e.value)
    assert e.value.hint.startswith("the first count whose layouts fit is 16 chips (--chips 16) or --nodes 2")
    planner = Planner(k31, h200, Workload())
    assert [n for n in range(13, 17) if planner.fits(n)] == [16]
    assert best_plan(k31, h200, Workload(), 16)[0].chips == 16
    for chips in (14, 15):
        with pytest.raises(ConfigError) as e:
            best_plan(k31, h200, Workload(), chips, "kimi-k3.1-pro")
        msg = str(e.value)
        assert "short by" not in msg and "the total fits but no layout does" in msg
        assert "16 chips (--chips 16)" in e.value.hint


def test_large_pools_search_a_refined_split_grid(k31, monkeypatch):
    """Up to SPLIT_POINTS splits every one is tried (the documented examples); beyond, a grid refined
    around its best point: a few hundred splits for 100,000 chips, not 12,499."""
    from deltamoe.plan import search

    h200 = get_hardware("h200")
    tried: list[int] = []
    real = Planner._split

    def counting(self, chips, p_chips):
        tried.append(p_chips)
        return real(self, chips, p_chips)

    monkeypatch.setattr(Planner, "_split", counting)
    best_plan(k31, h200, Workload(slo_ttft_s=3, slo_tpot_s=0.05), 128)
    assert sorted(tried) == list(range(8, 128, 8))  # all 15 splits of the 16-node example
    tried.clear()
    plan = best_plan(k31, h200, Workload(slo_ttft_s=3, slo_tpot_s=0.05), 100_000)[0]
    assert len(set(tried)) < 4 * search.SPLIT_POINTS and plan.chips == 100_000
    with pytest.raises(ConfigError) as e:
        best_plan(k31, h200, Workload(), search.MAX_CHIPS + 8)
    assert e.value.field == "chips" and "1,000,000" in str(e.value)


def test_divisors_are_sorted_and_complete():
    from deltamoe.plan.layout import divisors

    assert divisors(1) == [1] and divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert divisors(896) == [d for d in range(1, 897) if 896 % d == 0]
