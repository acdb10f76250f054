"""`deltamoe quantize CKPT OUT --format int4|w4a8|mxfp4`: write a quantized checkpoint that
`load_model`, `generate` and `serve` run quantized."""

from __future__ import annotations

import typer

from deltamoe.errors import ConfigError


def quantize_command(
    source: str = typer.Argument(..., help="float checkpoint folder (or a preset name: random weights)"),
    out: str = typer.Argument(..., help="folder to write the quantized checkpoint to"),
    fmt: str = typer.Option(..., "--format", help="int4 (W4A16, g128), w4a8 (int4 weights + dynamic 8-bit "
                                                  "activations) or mxfp4 (routed experts, as K3 ships)"),
    group_size: int = typer.Option(None, "--group-size", help="int4 group along the input dim (32/64/128/256; "
                                                              "default 128)"),
    activations: str = typer.Option(None, "--activations", help="w4a8 activations: fp8 (default) or int8"),
    dtype: str = typer.Option("bfloat16", "--dtype", help="dtype of the tensors left unquantized: bfloat16 or float32"),
) -> None:
    """Quantize a checkpoint's weights (compressed-tensors layout, as real quantized checkpoints name them)."""
    if dtype not in ("bfloat16", "float32"):
        raise ConfigError(f"expected bfloat16 or float32, got {dtype!r}", field="--dtype")
    from deltamoe.model.quant_scheme import make_scheme  # imports torch: after the cheap checks

    try:
        scheme = make_scheme(fmt, group_size, activations)
    except ValueError as e:
        field, _, message = str(e).partition(": ")
        raise ConfigError(message, field=f"--{field.replace('_', '-')}") from None
    import torch

    from deltamoe.quantize.checkpoint import quantize_checkpoint

    stats = quantize_checkpoint(source, out, scheme, dtype=getattr(torch, dtype))
    if stats["requantized_from"]:
        typer.echo(f"note: {source} is an {stats['requantized_from']} checkpoint: dequantized, then quantized "
                   f"to {scheme.format} (both roundings' errors add; quantize the float checkpoint where you have it)",
                   err=True)
    typer.echo(f"wrote {out}: {stats['tensors']} tensors, {stats['bytes'] / 2**20:.1f} MiB "
               f"({stats['quantized_bytes'] / 2**20:.1f} MiB quantized {scheme.format}: "
               f"{stats['quantized_modules']} layers or expert stacks)")
    if stats["kept_float_modules"]:
        typer.echo(f"note: {stats['kept_float_modules']} targeted layers or expert stacks kept in float: their input "
                   f"width is no multiple of the group size {scheme.group_size} (listed in config.json's "
                   "quantization_config.ignore)", err=True)
