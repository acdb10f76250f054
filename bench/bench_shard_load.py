"""Peak memory of one --tp/--ep serving rank's load: reading only its shard (`load_shard`) against
loading the whole model and cutting it (`shard_for_serving(load_model(...))`, what every rank did
before), side by side in one run on the same checkpoint.

Usage: python bench/bench_shard_load.py [--preset small] [--layouts 1x2,2x1] [--dtype bfloat16] [--quick]
                                        [--format mxfp4|int4|w4a8]
Layouts are TPxEP. Each path runs in a fresh gloo job (tp x ep spawned processes, one thread each)
so that the peaks are the load's own. Per rank: seconds to load, the process's peak resident memory
above what it held before the load (VmHWM, reset at the start, minus RSS before), and the bytes of
the weights it keeps (packed ones included). Writes bench/results/shard_load.json (--quick: `tiny`,
shard_load_quick.json).

`--format F`: the checkpoint is quantized first (`deltamoe quantize --format F`, group 32 for int4 /
w4a8) and the reference is one process loading it packed (`load_model`: a packed model cannot be
cut after loading), against each rank reading its share; results in shard_load_F.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from common import result_name, write_result  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.hf_config import load_config  # noqa: E402
from deltamoe.model.load import build_model, load_model  # noqa: E402
from deltamoe.model.packed_experts import PackedExperts  # noqa: E402
from deltamoe.model.quant_scheme import make_scheme  # noqa: E402
from deltamoe.model.quantized_linear import Int4Linear  # noqa: E402
from deltamoe.model.weights import save_checkpoint  # noqa: E402
from deltamoe.quantize.checkpoint import quantize_checkpoint  # noqa: E402
from deltamoe.parallel.mesh import build_mesh  # noqa: E402
from deltamoe.serve.executor.config import WorkerConfig  # noqa: E402
from deltamoe.serve.executor.shard_load import load_shard  # noqa: E402
from deltamoe.serve.executor.sharding import shard_for_serving  # noqa: E402

PATHS = ("whole model, then cut", "own shard only")
PACKED_PATHS = ("whole model, one process", "own shard only")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the peak resident size (VmHWM) afresh (Linux 4.0+). ru_maxrss cannot serve: it keeps the
    parent's peak across fork and exec, and the parent held the whole model to save the checkpoint."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _rank(rank: int, world: int, port: int, path: str, ckpt: str, tp: int, ep: int, dtype: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dims = WorkerConfig(tp=tp, ep=ep).dims(load_config(ckpt))
    mesh = build_mesh(dims, "cpu")
    _reset_peak()
    before = _rss_bytes()
    start = time.perf_counter()
    if path == PATHS[0]:
        model = shard_for_serving(load_model(ckpt, dtype=getattr(torch, dtype)), dims, mesh)
    elif path == PACKED_PATHS[0]:
        model = load_model(ckpt, dtype=getattr(torch, dtype))
    else:
        model = load_shard(ckpt, getattr(torch, dtype), "cpu", dims, mesh)
    seconds = time.perf_counter() - start
    peak = _peak_bytes()
    kept = sum((t.to_local() if hasattr(t, "to_local") else t).nbytes
               for t in {id(t): t for t in model.state_dict(keep_vars=True).values()}.values())
    kept += sum(m.resident_bytes() for m in model.modules() if isinstance(m, (Int4Linear, PackedExperts)))
    result = {"rank": rank, "seconds": seconds, "peak_above_start_bytes": peak - before, "weights_kept_bytes": kept}
    results: list[object] | None = [None] * world if rank == 0 else None
    dist.gather_object(result, results, dst=0)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(ckpt: Path, tp: int, ep: int, dtype: str, tmp: Path, paths: tuple[str, str] = PATHS) -> dict:
    """Both paths' per-rank figures for one layout."""
    rows = {}
    for path in paths:
        out = tmp / "ranks.json"
        mp.spawn(_rank, args=(tp * ep, _free_port(), path, str(ckpt), tp, ep, dtype, str(out)), nprocs=tp * ep,
                 join=True)
        rows[path] = json.loads(out.read_text())
        print(f"tp{tp} ep{ep} {path:>22}: peak above start "
              f"{max(r['peak_above_start_bytes'] for r in rows[path]) / 2**20:8.1f} MiB (worst rank), kept "
              f"{max(r['weights_kept_bytes'] for r in rows[path]) / 2**20:8.1f} MiB, "
              f"{max(r['seconds'] for r in rows[path]):6.2f} s")
    whole, own = (max(r["peak_above_start_bytes"] for r in rows[p]) for p in paths)
    return {"tp": tp, "ep": ep, "ranks": rows, "peak_ratio_own_over_whole": own / whole}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--layouts", default="1x2,2x1", help="TPxEP, comma-separated")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="the tiny preset, results in shard_load_quick.json")
    parser.add_argument("--format", dest="fmt", choices=("mxfp4", "int4", "w4a8"), default=None,
                        help="quantize the checkpoint first; reference: one process loading it packed")
    args = parser.parse_args()
    preset = "tiny" if args.quick else args.preset
    layouts = [tuple(int(n) for n in layout.split("x")) for layout in args.layouts.split(",")]
    paths = PATHS if args.fmt is None else PACKED_PATHS
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / preset
        save_checkpoint(build_model(load_preset(preset), dtype=getattr(torch, args.dtype)).eval(), ckpt)
        if args.fmt is not None:
            packed = Path(tmp) / f"{preset}-{args.fmt}"
            scheme = make_scheme(args.fmt, None if args.fmt == "mxfp4" else 32, "fp8" if args.fmt == "w4a8" else None)
            quantize_checkpoint(ckpt, packed, scheme, dtype=getattr(torch, args.dtype))
            ckpt = packed
        checkpoint_bytes = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        runs = [run_layout(ckpt, tp, ep, args.dtype, Path(tmp), paths) for tp, ep in layouts]
    print(f"checkpoint {checkpoint_bytes / 2**20:.1f} MiB; own shard's peak / whole model's: "
          + ", ".join(f"tp{r['tp']} ep{r['ep']} {r['peak_ratio_own_over_whole']:.2f}" for r in runs))
    name = "shard_load" if args.fmt is None else f"shard_load_{args.fmt}"
    write_result(result_name(name, args.quick), {
        "preset": preset, "dtype": args.dtype, "threads_per_rank": 1, "checkpoint_bytes": checkpoint_bytes,
        "format": args.fmt, "paths": list(paths), "layouts": runs})


if __name__ == "__main__":
    main()
