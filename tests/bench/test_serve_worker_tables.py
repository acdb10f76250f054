"""README rows of bench_serve_workers.py and bench_serve_online.py --peer transformers, from their JSON shapes."""

from __future__ import annotations

from deltamoe.benchmarks.table import FORMATTERS, HEADERS


def layout(tps: float, tpot_ms: float, tp: int = 1, ep: int = 1, async_scheduling: bool = False,
           compile_decode: bool = False) -> dict:
    return {"tp": tp, "ep": ep, "async_scheduling": async_scheduling, "compile_decode": compile_decode,
            "seconds": 8192 / tps, "tokens_per_s": tps, "mean_tpot_ms": tpot_ms, "p50_tpot_ms": tpot_ms,
            "greedy_equal_to_one_process": 1.0}


def test_serve_workers_rows():
    d = {"workload": {"model": "small", "prompts": 64, "new_tokens": 128}, "threads": 2,
         "layouts": {"1 process": layout(200, 300),
                     "1 process, async scheduling": layout(230, 260, async_scheduling=True),
                     "tp 2": layout(150, 400, tp=2), "ep 2": layout(180, 350, ep=2)}}
    rows = FORMATTERS["serve_workers"](d)
    assert len(rows) == 4 and all(len(r) == len(HEADERS) for r in rows)
    assert "`small`, 64 prompts x 128 tokens" in rows[0][0] and rows[0][1] == "200 tok/s; TPOT 300 ms"
    assert rows[1][0] == "same, 1 process, async scheduling" and rows[1][3] == "1.1x"
    assert rows[2][3] == "0.75x" and rows[3][1] == "180 tok/s; TPOT 350 ms"


def test_serve_workers_compiled_rows_compare_with_the_compiled_process():
    d = {"workload": {"model": "small", "prompts": 64, "new_tokens": 128}, "threads": 2,
         "layouts": {"1 process": layout(200, 300), "1 process, compiled": layout(500, 120, compile_decode=True),
                     "tp 2, compiled": layout(250, 240, tp=2, compile_decode=True)}}
    rows = FORMATTERS["serve_workers"](d)
    assert rows[1][2:4] == ["1 process", "2.5x"]
    assert rows[2][0] == "same, tp 2, compiled" and rows[2][2:4] == ["1 process, compiled", "0.50x"]


def test_serve_online_vs_transformers_rows():
    def run(c: int, tps: float, tpot: float) -> dict:
        return {"concurrency": c, "output_throughput": tps, "p50_tpot_ms": tpot, "completed": 4 * c}

    ours = [run(1, 100, 9), run(8, 480, 13), run(32, 800, 31)]
    peer = [run(1, 20, 45), run(8, 40, 190), run(32, 50, 600)]
    ratios = {str(a["concurrency"]): {"output_throughput": a["output_throughput"] / b["output_throughput"],
                                      "p50_tpot": b["p50_tpot_ms"] / a["p50_tpot_ms"]} for a, b in zip(ours, peer)}
    d = {"config": {"model": "Kimi Linear tiny (transformers-saved)", "async_scheduling": True}, "runs": ours,
         "peer_runs": peer, "ratio_vs_peer": ratios, "target": {"output_throughput_ratio_at": 8, "ratio": 10.0}}
    [row] = FORMATTERS["serve_online_vs_transformers"](d)
    assert "`--async-scheduling`" in row[0] and "1 / 8 / 32 clients" in row[0]
    assert row[1] == "100 / 480 / 800 tok/s; TPOT 9 / 13 / 31 ms"
    assert row[2] == "transformers serve 20 / 40 / 50 tok/s; TPOT 45 / 190 / 600 ms"
    assert row[3] == "5.0x / 12.0x / 16.0x" and row[4] == ">= 10x at 8 clients (met)"
    d["runs"][1]["output_throughput"], d["ratio_vs_peer"]["8"]["output_throughput"] = 200, 5.0
    assert FORMATTERS["serve_online_vs_transformers"](d)[0][4] == ">= 10x at 8 clients (missed)"
