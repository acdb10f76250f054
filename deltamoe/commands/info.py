"""`deltamoe info PRESET|PATH [--json]`: parameter counts and weight bytes, computed on the meta device."""

from __future__ import annotations

import json
import math

import typer
from rich.console import Console
from rich.table import Table

from deltamoe.hf_config import load_config


def _human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}{unit}"
    return f"{n:.0f} {unit}".strip()


def info(model: str = typer.Argument(..., help="preset name (tiny, kimi-k3, ...) or a config/checkpoint path"),
         as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table")) -> None:
    """Total and active parameters and weight bytes by precision, without allocating the model."""
    config = load_config(model)
    from deltamoe.model.params import count_parameters  # imports torch: after the model is known to exist

    counts = count_parameters(config)
    layers = {t: config.layer_types.count(t) for t in ("kda", "mla", "dsa")}
    # Whole bytes: a block-scaled format's fractional average rounds up to what storage takes.
    weight_bytes = {key: math.ceil(value) for key, value in counts.weight_bytes().items()}
    report = {"model": model, "model_type": config.model_type, "layers": layers, **counts.to_dict(),
              "weight_bytes": weight_bytes}
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    table = Table(title=f"{model} ({config.model_type}: {layers['kda']} KDA, {layers['mla']} MLA, {layers['dsa']} DSA layers)")
    table.add_column("quantity")
    table.add_column("exact", justify="right")
    table.add_column("approx. / share", justify="right")
    rows = [
        ("total parameters (text)", f"{counts.total:,}", _human(counts.total)),
        ("active parameters per token", f"{counts.active:,}", _human(counts.active)),
        ("routed expert parameters", f"{counts.routed_experts:,}", f"{100 * counts.routed_experts / counts.total:.1f} %"),
        ("embedding / lm_head", f"{counts.embedding:,} / {counts.lm_head:,}", ""),
        ("MTP layers", f"{counts.mtp:,}", ""),
        ("vision tower + projector", f"{counts.vision:,}", _human(counts.vision)),
        ("total incl. vision", f"{counts.total_with_vision:,}", _human(counts.total_with_vision)),
    ]
    names = {"bf16": "weights BF16", "fp8": "weights FP8 (128x128 blocks)",
             "mxfp4_experts": "weights MXFP4 experts + BF16 rest", "all_4bit": "weights all 4-bit"}
    for key, value in weight_bytes.items():
        rows.append((names[key], f"{value:,} B", f"{_human(value, 'B')} ({value / 2**30:,.1f} GiB)"))
    for row in rows:
        table.add_row(*row)
    Console().print(table)
