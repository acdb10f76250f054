"""The README rows of bench_quant.py's speed results: eager int4 against the eager baselines, compiled
int4 against the compiled ones as the engine runs them; the baselines timed with batch 1 as two copies
of its row (the form before) stay out of the table."""

from deltamoe.benchmarks.table import FORMATTERS


def _row(fmt: str, decode: str, tok_s: float, vs_bf16: float, vs_fp32: float, **extra) -> dict:
    return {"format": fmt, "decode": decode, "decode_tok_s": tok_s, "speedup_vs_bf16": vs_bf16,
            "speedup_vs_fp32": vs_fp32, "memory_vs_bf16": 0.29, **extra}


def test_compiled_int4_row_reads_against_the_compiled_baselines() -> None:
    speed = [_row("fp32", "eager", 16.0, 1.6, 1.0), _row("bf16", "eager", 10.0, 1.0, 0.62),
             _row("int4 (W4A16), rest fp32", "eager", 24.0, 2.4, 1.5),
             _row("fp32", "compiled", 25.0, 1.19, 1.0), _row("bf16", "compiled", 21.0, 1.0, 0.84),
             _row("int4 (W4A16), rest fp32", "compiled", 40.0, 1.9, 1.6),
             _row("fp32", "compiled, two rows", 20.0, 1.1, 1.0), _row("bf16", "compiled, two rows", 18.0, 1.0, 0.9)]
    rows = FORMATTERS["quant"]({"preset": "small", "speed": speed,
                                "target": {"int4_decode_vs_bf16": 2.0, "int4_decode_vs_fp32": 2.0}})
    eager, compiled = rows
    assert "compiled" not in eager[0] and "1.5x" in eager[3]
    assert "compiled" in compiled[0] and "bf16 21.00 / fp32 25.00" in compiled[2]
    assert "1.9x / 1.6x" in compiled[3] and "missed" in compiled[4]
    assert "two rows" not in " ".join(map(str, compiled)) and "one row" not in compiled[3]


def test_another_presets_rows_name_their_command_and_claim_no_goal() -> None:
    """A speed-only run on another preset (`--preset medium`) shows its ratios under its own command;
    the goal column points at small's rows, where the goal is set."""
    speed = [_row("fp32", "compiled", 12.0, 0.6, 1.0), _row("bf16", "compiled", 20.0, 1.0, 1.67),
             _row("int4 (W4A16)", "compiled", 47.0, 2.35, 3.9)]
    (row,) = FORMATTERS["quant_speed_medium"]({"preset": "medium", "speed": speed, "compiled": True,
                                               "target": {"int4_decode_vs_bf16": 2.0, "int4_decode_vs_fp32": 2.0}})
    assert "medium (`python bench/bench_quant.py --speed-only --preset medium --compile`)" in row[0]
    assert "2.4x / 3.9x" in row[3] and row[4] == "(the goal is small's, above)"
