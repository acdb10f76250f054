"""The README rows of bench_quant.py's speed results: compiled int4 also read against fp32 with its
batch 1 as one row (like with like)."""

from deltamoe.benchmarks.table import FORMATTERS


def _row(fmt: str, decode: str, tok_s: float, vs_bf16: float, vs_fp32: float, **extra) -> dict:
    return {"format": fmt, "decode": decode, "decode_tok_s": tok_s, "speedup_vs_bf16": vs_bf16,
            "speedup_vs_fp32": vs_fp32, "memory_vs_bf16": 0.29, **extra}


def test_compiled_int4_row_names_the_one_row_baseline() -> None:
    speed = [_row("fp32", "eager", 16.0, 1.6, 1.0), _row("bf16", "eager", 10.0, 1.0, 0.62),
             _row("int4 (W4A16), rest fp32", "eager", 24.0, 2.4, 1.5),
             _row("fp32", "compiled", 20.0, 1.1, 1.0), _row("bf16", "compiled", 18.0, 1.0, 0.9),
             _row("int4 (W4A16), rest fp32", "compiled", 40.0, 2.22, 2.0, speedup_vs_fp32_one_row=1.6),
             _row("fp32", "compiled, one row", 25.0, 1.2, 1.0), _row("bf16", "compiled, one row", 21.0, 1.0, 0.84)]
    rows = FORMATTERS["quant"]({"preset": "small", "speed": speed,
                                "target": {"int4_decode_vs_bf16": 2.0, "int4_decode_vs_fp32": 2.0}})
    eager, compiled = rows
    assert "compiled" not in eager[0] and "one row" not in eager[3]
    assert "compiled" in compiled[0] and "fp32 20.00" in compiled[2]
    assert "1.6x fp32 one row" in compiled[3]
