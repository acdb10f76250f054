"""The README rows of bench_kda.py's results, with and without `--compiled --cpu-time`."""

from deltamoe.benchmarks.table import FORMATTERS


def _results(compiled: bool) -> dict:
    row = {"T": 8192, "chunk_kda_s": 0.2, "transformers_s": 4.0, "recurrent_kda_s": 3.0,
           "speedup_vs_transformers": 20.0, "speedup_vs_recurrent": 15.0}
    config = {"B": 1, "H": 8, "K": 128, "V": 128, "dtype": "float32", "threads": 1}
    if compiled:
        row.update(compiled_chunk_kda_s=0.15, compiled_speedup_vs_transformers=26.7, compiled_speedup_vs_recurrent=20.0,
                   compiled_vs_eager=1.33, compile_cpu_s=12.4)
        config["clock"] = "process CPU time"
    return {"config": config, "rows": [row], "target": {"speedup_vs_recurrent": 20.0}}


def test_compiled_results_add_a_row_and_name_their_flags() -> None:
    plain = FORMATTERS["kda_k128_t1"](_results(False))
    assert len(plain) == 1 and "--threads 1`" in plain[0][0] and "CPU time" not in plain[0][0]
    first, compiled = FORMATTERS["kda_k128_t1"](_results(True))
    assert "--threads 1 --compiled --cpu-time`" in first[0] and "1 thread, CPU time" in first[0]
    assert compiled[1] == "150 ms" or compiled[1].startswith("150")
    assert "1.33x its speed" in compiled[2] or "1.3x its speed" in compiled[2]
    assert "12 CPU s" in compiled[0] and "group of chunk steps" in compiled[0]
    assert first[4] == ">= 20x (missed)" and compiled[4] == ">= 20x (met)"  # each row judged by its own ratio


def test_a_run_under_glibc_default_thresholds_names_its_flag() -> None:
    results = _results(False)
    results["config"]["allocator"] = "default"
    (row,) = FORMATTERS["kda_k128_default_malloc"](results)
    assert "--threads 1 --allocator default`" in row[0]
    results["config"]["allocator"] = "steady"
    assert "--allocator" not in FORMATTERS["kda_k128"](results)[0][0]


def test_the_goal_is_judged_by_the_lower_of_the_median_and_the_fastest_runs_ratio() -> None:
    # The recurrence faulted in its later rounds: its median is slow, its fastest run is not.
    results = _results(True)
    results["rows"][0].update(best_speedup_vs_recurrent=6.0, best_compiled_speedup_vs_recurrent=8.8,
                              recurrent_kda_faults=877_492)
    first, compiled = FORMATTERS["kda_k128_t1"](results)
    assert "(fastest runs 8.8x; recurrence median run 877,492 page faults)" in compiled[3]
    assert compiled[4] == ">= 20x (missed)"  # 20x by the medians, 8.8x by the fastest runs
    results["rows"][0].update(best_speedup_vs_recurrent=15.2, best_compiled_speedup_vs_recurrent=21.0)
    first, compiled = FORMATTERS["kda_k128_t1"](results)
    assert "fastest runs" not in first[3] and compiled[4] == ">= 20x (met)"
