"""README rows of the training benches: blockwise FP8 quality and overlapped expert all-to-all."""

from deltamoe.benchmarks.table import FORMATTERS


def _fp8(fp8_losses: list[float], eval_gaps: list[float]) -> dict:
    """Three seed pairs: reference train losses 0.5 / 0.52 / 0.54, eval losses 0.6 each."""
    ref = [{"seed": i, "final_loss": 0.5 + 0.02 * i, "eval_loss": 0.6} for i in range(3)]
    fp8 = [{"seed": i, "final_loss": f, "eval_loss": 0.6 * (1 + g)} for i, (f, g) in enumerate(zip(fp8_losses, eval_gaps))]
    gaps = [f["final_loss"] / r["final_loss"] - 1 for r, f in zip(ref, fp8)]
    return {"precision": "fp32", "steps": 240, "seeds": 3, "tail_steps": 40, "goal_rel_gap": 0.01,
            "rel_gap": {"mean": sum(gaps) / 3, "std": 0.004}, "eval_rel_gap": {"mean": sum(eval_gaps) / 3, "std": 0.002},
            "seed_rel_spread": 0.0385, "seed_eval_rel_spread": 0.0, "fp32": ref, "fp8_blockwise": fp8}


def test_train_fp8_row_shows_means_over_seeds_and_judges_both_mean_gaps():
    [row] = FORMATTERS["train_fp8"](_fp8([0.503, 0.52, 0.54], [0.004, 0.0, 0.002]))
    assert "3 seeds" in row[0] and "240 steps" in row[0] and "last 40 steps" in row[0]
    assert row[1] == "0.5210 / 0.6012" and row[2] == "fp32 0.5200 / 0.6000"
    assert row[3] == "+0.2 % +- 0.4 % / +0.2 % +- 0.2 % (seed to seed: 3.9 % / 0.0 %)"
    assert row[4].startswith("mean within 1 % (met)")
    [row] = FORMATTERS["train_fp8"](_fp8([0.503, 0.52, 0.54], [0.02, 0.01, 0.03]))
    assert row[3].startswith("+0.2 % +- 0.4 % / +2.0 % +- 0.2 %") and row[4].startswith("mean within 1 % (missed)")
    [row] = FORMATTERS["train_fp8"]({**_fp8([0.5, 0.52, 0.54], [0, 0, 0]), "schedule_steps": 320, "eval_step": 200})
    assert "the first 240 of 320 steps (unfinished; eval loss at step 200)" in row[0]
    # The emulation note follows the device the runs trained on (results without one came from a CPU).
    bf16_cpu = {**_fp8([0.5, 0.52, 0.54], [0, 0, 0]), "precision": "bf16", "device": "cpu"}
    bf16_cpu["bf16"] = bf16_cpu.pop("fp32")
    [row] = FORMATTERS["train_fp8"](bf16_cpu)
    assert row[2] == "bf16 0.5200 / 0.6000" and row[4].endswith("on a CPU the e4m3 products are an exact emulation")
    [row] = FORMATTERS["train_fp8"]({**bf16_cpu, "device": "cuda"})
    assert row[4] == "mean within 1 % (met)"


def test_ep_overlap_row_shows_exposed_all_to_all_before_and_after():
    d = {"chunks": 4, "same_losses": True,
         "chunks_1": {"exposed_alltoall_s_per_step": 0.4, "step_s": 2.0},
         "chunks_4": {"exposed_alltoall_s_per_step": 1.5, "step_s": 2.5}}
    [row] = FORMATTERS["ep_overlap"](d)
    assert "--ep-chunks 4" in row[0] and row[1] == "1,500 ms (step 2,500 ms)" and row[2].startswith("one exchange 400 ms")
    assert row[3] == "3.8x the exposed time" and "(missed)" in row[4]
