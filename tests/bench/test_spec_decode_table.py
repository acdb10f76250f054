"""The README rows of bench/results/spec_decode.json: figures, ratios and the conditional goal."""

from __future__ import annotations

from deltamoe.benchmarks.table import spec_decode_rows


def result(accept: float, speedup: float) -> dict:
    speed = lambda plain: {"tokens_per_s": {"plain": plain, "K=1": plain * 1.3, "K=2": plain * speedup,  # noqa: E731
                                            "K=3": plain * 1.5},
                           "speedup": {"K=1": 1.3, "K=2": speedup, "K=3": 1.5}}
    return {"model": {"train_steps": 600, "task": "recall+arithmetic+copy"},
            "target": {"speedup_batch1_k2": 1.6, "min_acceptance": 0.7},
            "acceptance": {kind: [{"k": k, "mean_acceptance": a} for k in (1, 2, 3)]
                           for kind, a in (("raw", accept), ("chat", accept - 0.2))},
            "speed": [{"batch": 1, **speed(100.0)}, {"batch": 8, **speed(400.0)}]}


def test_rows_show_figures_and_goal():
    rows = spec_decode_rows(result(0.8, 1.7))
    assert rows[0][1] == "170 tok/s; acceptance raw 0.80, chat 0.60"
    assert rows[0][2] == "plain decode 100 tok/s" and rows[0][3] == "**1.7x**"
    assert rows[0][4] == ">= 1.6x at acceptance >= 0.7 (met)"
    assert rows[2][1] == "520 / 680 / 600 tok/s" and rows[2][3] == "1.3x / 1.7x / 1.5x"
    assert spec_decode_rows(result(0.8, 1.5))[0][4].endswith("(missed)")
    assert "not reached" in spec_decode_rows(result(0.5, 1.2))[0][4]


def test_label_names_the_mtp_training_depth():
    d = result(0.8, 1.7)
    assert "depths" not in spec_decode_rows(d)[0][0]  # results written before the field: depth 1
    d["model"]["mtp_train_depth"] = 3
    assert "MTP layer trained at depths 1..3" in spec_decode_rows(d)[0][0]
    d["model"]["mtp_distill_steps"] = 300
    assert "MTP layer trained at depths 1..3, self-distilled 300 steps" in spec_decode_rows(d)[0][0]


def test_other_workloads_get_a_row_each_with_their_own_goal_verdict():
    d = result(0.3, 1.1)
    d["speed_by_workload"] = {"mix": d["speed"], "repeat": [{"batch": 1, "tokens_per_s": {"plain": 100.0, "K=2": 180.0},
                                                            "speedup": {"K=2": 1.8}}]}
    d["acceptance_k2_by_workload"] = {"mix": 0.3, "repeat": 0.9}
    rows = spec_decode_rows(d)
    assert "not reached" in rows[0][4] and len(rows) == 4
    assert rows[3][0] == "same, repeat prompts, batch 1, K = 2" and rows[3][1] == "180 tok/s; acceptance raw 0.90"
    assert rows[3][3] == "1.8x" and rows[3][4] == ">= 1.6x at acceptance >= 0.7 (met)"


def test_label_gives_the_exact_command_for_a_given_checkpoint_compiled():
    d = result(0.8, 1.7)
    assert "(`deltamoe bench spec_decode`)" in spec_decode_rows(d)[0][0] and "eager" in spec_decode_rows(d)[0][0]
    d["model"].update(given=True, checkpoint="/ckpt/spec")
    d.setdefault("workload", {})["compile_decode"] = True
    label = spec_decode_rows(d)[0][0]
    assert "(`python bench/bench_spec_decode.py --checkpoint /ckpt/spec --compile`)" in label and "compiled" in label


def test_rounds_give_the_median_and_spread_and_batch_8_shows_the_rule_beside_forced_speculation():
    d = result(0.8, 1.7)
    b1, b8 = d["speed"]
    b1.update(rounds=5, tokens_per_s_median={"plain": 90.0, "K=1": 110.0, "K=2": 150.0, "K=3": 130.0},
              speedup_median={"K=1": 1.2, "K=2": 1.62, "K=3": 1.4},
              speedup_spread={"K=1": [1.1, 1.3], "K=2": [1.41, 1.83], "K=3": [1.3, 1.5]})
    rule = {f"K={k} (rule)": 1.0 for k in (1, 2, 3)}
    b8["tokens_per_s"].update({m: 396.0 for m in rule})
    b8.update(rounds=3, tokens_per_s_median={**b8["tokens_per_s"], "K=3 (rule)": 372.0},
              speedup_median={"K=1": 0.55, "K=2": 0.56, "K=3": 0.5, "K=1 (rule)": 0.99, "K=2 (rule)": 0.98,
                              "K=3 (rule)": 0.93},
              speedup_spread={m: [0.9, 1.0] for m in ("K=1", "K=2", "K=3", *rule)})
    d["target"]["rule_batch8_vs_plain"] = 0.95
    d["workload"] = {"spec_max_batch_default": 4}
    rows = spec_decode_rows(d)
    # The headline is the median round, not the best one, with the rounds' spread beside it.
    assert rows[0][1].startswith("150 tok/s") and rows[0][2] == "plain decode 90 tok/s"
    assert rows[0][3] == "**1.6x** (median of 5 rounds: 1.41-1.83x)"
    assert rows[0][4] == ">= 1.6x at acceptance >= 0.7 (met)"
    assert rows[2][0].endswith("speculation forced (`--spec-max-batch 0`)")
    assert rows[3][0] == "same, batch 8, K=1 / K=2 / K=3, with the batch-size rule (`--spec-max-batch 4`, the default)"
    assert rows[3][1] == "396 / 396 / 372 tok/s"
    assert rows[3][3] == "0.99x / 0.98x / 0.93x (median of 3 rounds: 0.90-1.00x / 0.90-1.00x / 0.90-1.00x)"
    assert rows[3][4] == ">= 0.95x plain (missed)"  # K=3 under the rule at 0.93x
    d["workload"]["spec_batch_rule_default"] = "cost"  # results with the cost rule under the limit
    assert spec_decode_rows(d)[3][0] == ("same, batch 8, K=1 / K=2 / K=3, with the batch-size rule (`--spec-max-batch "
                                         "4`, the default, speculating under it only where the measured step costs "
                                         "say it pays)")
