"""The README rows of bench/bench_compile_start.py's results: first start judged against its target,
and the step compiled vs eager."""

from __future__ import annotations

from deltamoe.benchmarks.table import FORMATTERS, compile_start_rows


def result(wall_s: float) -> dict:
    step = {"1": {"wall_ms": 6.0, "cpu_ms": 6.0}, "16": {"wall_ms": 16.0, "cpu_ms": 30.0}}
    eager = {"1": {"wall_ms": 12.0, "cpu_ms": 12.0}, "16": {"wall_ms": 40.0, "cpu_ms": 70.0}}
    return {"config": {"preset": "tiny", "threads": 2, "batch": 16, "mode": "regions"},
            "first_start": {"wall_s": wall_s, "cpu_s": 70.0, "graphs": 9},
            "step_ms": {"compiled": step, "eager": eager}, "target": {"first_start_s": 60.0}}


def test_rows_show_first_start_graphs_and_step_ratios():
    assert FORMATTERS["compile_start"] is compile_start_rows
    start, steps = compile_start_rows(result(55.0))
    assert start[1] == "55.0 s (70.0 s CPU), 9 graphs" and start[4] == "<= 60 s (met)"
    assert steps[1:4] == ["6.0 / 16.0 ms", "eager 12.0 / 40.0 ms", "2.0x / 2.5x"]
    assert compile_start_rows(result(75.0))[0][4] == "<= 60 s (missed)"


def test_the_command_names_the_default_form():
    """`deltamoe bench compile_start` runs whole layers (the default form); files that name no form
    are the attention + FFN regions, rerun with `--form parts`."""
    layers, parts = result(55.0), result(55.0)
    layers["config"]["form"], parts["config"]["form"] = "layers", "parts"
    assert "(`deltamoe bench compile_start`)" in compile_start_rows(layers)[0][0]
    assert "whole-layer regions" in compile_start_rows(layers)[0][0]
    assert "--form parts" in compile_start_rows(parts)[0][0]
    assert "--form parts" in compile_start_rows(result(55.0))[0][0]
