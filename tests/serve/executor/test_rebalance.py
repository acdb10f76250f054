"""The EPLB-style placement plan: heaviest experts first onto the least-loaded rank with room."""

from deltamoe.serve.executor.rebalance import imbalance, plan_placement


def test_plan_balances_a_skewed_layer_and_keeps_a_balanced_one():
    skewed = [100, 90, 10, 0, 5, 5, 80, 10]  # contiguous halves: 200 vs 100
    even = [10] * 8
    p = plan_placement([skewed, even], ep=2)
    assert p.imbalance_now[0] == 200 / 150 and p.imbalance_now[1] == 1.0
    held = p.experts[0]
    assert sorted(held[0] + held[1]) == list(range(8)) and len(held[0]) == len(held[1]) == 4
    loads = [sum(skewed[e] for e in rank) for rank in held]
    assert loads == [125, 175] and p.imbalance_planned[0] == 175 / 150  # the best split of these loads
    assert p.imbalance_planned[1] == 1.0


def test_imbalance_of_no_load_is_one():
    assert imbalance([0, 0]) == 1.0 and imbalance([3, 1]) == 1.5
