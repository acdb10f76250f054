"""README rows of the training benches: blockwise FP8 quality and overlapped expert all-to-all."""

from deltamoe.benchmarks.table import FORMATTERS


def _fp8(fp8_loss: float, eval_gap: float) -> dict:
    return {"settings": {"run": {"precision": "fp32"}}, "steps": 300, "tail_steps": 20, "goal_rel_gap": 0.01,
            "rel_gap": fp8_loss / 0.5 - 1, "eval_rel_gap": eval_gap,
            "fp32": {"final_loss": 0.5, "eval_loss": 0.6}, "fp8_blockwise": {"final_loss": fp8_loss, "eval_loss": 0.61}}


def test_train_fp8_row_judges_both_gaps():
    [row] = FORMATTERS["train_fp8"](_fp8(0.503, 0.004))
    assert row[1] == "0.5030 / 0.6100" and row[2] == "fp32 0.5000 / 0.6000" and row[3] == "+0.6 % / +0.4 %"
    assert row[4].startswith("within 1 % (met)")
    d = {**_fp8(0.503, 0.02), "seed_rel_gap": 0.031, "seed_eval_rel_gap": -0.012}
    [row] = FORMATTERS["train_fp8"](d)
    assert row[3] == "+0.6 % / +2.0 % (seed to seed: +3.1 % / -1.2 %)" and row[4].startswith("within 1 % (missed)")


def test_ep_overlap_row_shows_exposed_all_to_all_before_and_after():
    d = {"chunks": 4, "same_losses": True,
         "chunks_1": {"exposed_alltoall_s_per_step": 0.4, "step_s": 2.0},
         "chunks_4": {"exposed_alltoall_s_per_step": 1.5, "step_s": 2.5}}
    [row] = FORMATTERS["ep_overlap"](d)
    assert "--ep-chunks 4" in row[0] and row[1] == "1,500 ms (step 2,500 ms)" and row[2].startswith("one exchange 400 ms")
    assert row[3] == "3.8x the exposed time" and "(missed)" in row[4]
