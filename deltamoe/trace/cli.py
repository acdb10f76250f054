"""`deltamoe trace analyze` and `deltamoe trace synth`."""

from __future__ import annotations

import os

import typer

from deltamoe.errors import TraceError
from deltamoe.trace.command import parse_steps, run_analyze
from deltamoe.trace.command import progress as _progress

__all__ = ["app", "analyze", "synth", "parse_steps"]

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Analyse per-rank PyTorch profiler traces, or synthesise some with known ground truth.")


@app.command()
def analyze(
    folder: str = typer.Argument(..., metavar="DIR", help="folder with one Kineto trace per rank (.json / .json.gz)"),
    json_out: str = typer.Option(None, "--json", metavar="OUT.json", help="write the full report as JSON"),
    html_out: str = typer.Option(None, "--html", metavar="OUT.html", help="write a self-contained HTML report"),
    workers: int = typer.Option(0, "--workers", help="reader processes (0: one per CPU)"),
    steps: str = typer.Option(None, "--steps", metavar="A:B", help="keep ProfilerStep numbers A <= n < B"),
    comm_pattern: list[str] = typer.Option([], "--comm-pattern",
                                           help="extra regex for communication kernels (other vendors)"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar or summary"),
) -> None:
    """Find stragglers, pipeline bubbles, overlap and imbalance in a folder of per-rank traces."""
    run_analyze(folder, json_out, html_out, workers, steps, comm_pattern, quiet)


def _imbalance(spec: str | None) -> tuple[tuple[int, float], ...]:
    """'R:F[,R:F...]' gives rank R a token share F times the mean."""
    if not spec:
        return ()
    out = []
    try:
        for part in spec.split(","):
            r, f = part.split(":")
            out.append((int(r), float(f)))
    except ValueError:
        raise TraceError(f"cannot parse {spec!r}", field="--imbalance", hint="use RANK:FACTOR[,RANK:FACTOR]") from None
    return tuple(out)


@app.command()
def synth(
    outdir: str = typer.Argument(..., metavar="OUTDIR"),
    ranks: int = typer.Option(..., "--ranks"),
    steps: int = typer.Option(4, "--steps"),
    pp: int = typer.Option(1, "--pp", help="pipeline stages (1F1B)"),
    microbatches: int = typer.Option(0, "--microbatches", help="0: 2*pp with pipelines, else 2"),
    tp: int = typer.Option(1, "--tp"),
    ep: int = typer.Option(0, "--ep", help="expert-parallel group size (0: largest divisor of dp up to 8)"),
    layers: int = typer.Option(2, "--layers", help="layers per stage (more layers, more events)"),
    straggler: list[int] = typer.Option([], "--straggler", help="rank to slow down (repeatable)"),
    slowdown: float = typer.Option(1.5, "--slowdown", help="compute time factor of stragglers"),
    imbalance: str = typer.Option(None, "--imbalance", metavar="RANK:FACTOR,...", help="MoE hot ranks"),
    nccl_names: str = typer.Option("dev", "--nccl-names", help="dev: ncclDevKernel_*, legacy: ncclKernel_*"),
    p2p: str = typer.Option("batched", "--p2p", help="batched: coalesced kernels (batch_isend_irecv); single: isend/irecv"),
    compact: bool = typer.Option(False, "--compact", help="compact JSON instead of Kineto's pretty layout"),
    gz: bool = typer.Option(False, "--gz", help="write .json.gz"),
    jitter: float = typer.Option(0.02, "--jitter"),
    seed: int = typer.Option(0, "--seed"),
    workers: int = typer.Option(0, "--workers", help="writer processes (0: one per CPU)"),
) -> None:
    """Write realistic per-rank Kineto traces (DP/TP/PP/EP, 1F1B, NCCL) plus _ground_truth.json."""
    from rich.console import Console

    from deltamoe.trace.synth import SynthConfig, generate

    if nccl_names not in ("dev", "legacy"):
        raise TraceError(f"unknown value {nccl_names!r}", field="--nccl-names", hint="dev or legacy")
    cfg = SynthConfig(ranks=ranks, steps=steps, pp=pp, microbatches=microbatches, tp=tp, ep=ep, layers=layers,
                      stragglers=tuple(straggler), slowdown=slowdown, hot_ranks=_imbalance(imbalance),
                      jitter=jitter, seed=seed, nccl_names=nccl_names, compact=compact, gz=gz, p2p=p2p)
    console = Console(stderr=True)
    with _progress(console) as bar:
        task = bar.add_task("writing ranks", total=ranks)

        def tick() -> None:
            bar.advance(task)
            bar.refresh()
        truth = generate(cfg, outdir, workers or min(os.cpu_count() or 1, 2), on_rank=tick)
    ev = sum(r["events"] for r in truth["ranks"])
    console.print(f"wrote {ranks} rank traces ({ev:,} events) and _ground_truth.json to {outdir}")
