"""Why `bench_kda.py --compiled` and `kda_compiled_groups.py` disagreed, in one run: both benches at
K = V = 128, each in a fresh process, under glibc malloc's default thresholds and with freed
memory kept in the process (`process_memory.keep_freed_memory`, both benches' default now), side
by side as ratios to the recurrence measured in the same process, with each path's minor page
faults per run.

    .venv/bin/python bench/kda_bench_agreement.py [--threads 2] [--repeats 5] [--quick]

The table's bench runs T = 512, 2048 and then `--seq-len` (transformers' chunk KDA, the recurrence,
the eager and the compiled op in turn); the groups bench runs `--seq-len` only (the recurrence, the
eager op and the compiled op at `--group-chunks`). Only the `--seq-len` rows are compared. Under
glibc's defaults the recurrence's time includes the fresh pages it faults in every token (its
512 KiB states are mapped and unmapped, or the heap top trimmed and regrown), and how many depends
on what the process allocated before it; with freed memory kept, no path faults after its
warm-up. Results go to a temporary folder; prints one markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table  # noqa: E402
from process_memory import ALLOCATORS  # noqa: E402

from deltamoe.ops.kda_compiled import GROUP_CHUNKS  # noqa: E402

BENCH = Path(__file__).parent


def run_bench(script: str, args: list[str], results: Path) -> dict:
    """Run one bench script in a fresh process writing into `results`; its JSON."""
    env = {**os.environ, "DELTAMOE_BENCH_RESULTS": str(results)}
    subprocess.run([sys.executable, str(BENCH / script), *args], env=env, check=True)
    (path,) = results.glob("*.json")
    data = json.loads(path.read_text())
    path.unlink()
    return data


def table_bench_row(data: dict, seq_len: int) -> dict:
    r = next(r for r in data["rows"] if r["T"] == seq_len)
    return {"recurrent": r["recurrent_kda_wall_s"], "recurrent_cpu": r["recurrent_kda_cpu_s"],
            "eager": r["chunk_kda_wall_s"], "eager_cpu": r["chunk_kda_cpu_s"],
            "compiled": r["compiled_chunk_kda_wall_s"], "compiled_cpu": r["compiled_chunk_kda_cpu_s"],
            "faults": (r["recurrent_kda_faults"], r["chunk_kda_faults"], r["compiled_chunk_kda_faults"])}


def groups_bench_row(data: dict, group_chunks: int) -> dict:
    rows = {r["path"]: r for r in data["rows"]}
    rec, eager, comp = rows["recurrent_kda"], rows["chunk_kda"], rows[f"compiled G={group_chunks}"]
    return {"recurrent": rec["wall_s"], "recurrent_cpu": rec["cpu_s"], "eager": eager["wall_s"], "eager_cpu": eager["cpu_s"],
            "compiled": comp["wall_s"], "compiled_cpu": comp["cpu_s"],
            "faults": (rec["faults"], eager["faults"], comp["faults"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="compare at T = 2048 (both benches' --quick)")
    args = parser.parse_args()
    for name in ("threads", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    seq_len = 2048 if args.quick else 8192
    common = ["--threads", str(args.threads), "--repeats", str(args.repeats), *(["--quick"] if args.quick else [])]
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        for allocator in ALLOCATORS:
            flags = [*common, "--allocator", allocator]
            runs = {
                "bench_kda.py --compiled": table_bench_row(run_bench(
                    "bench_kda.py", ["--head-dim", "128", "--compiled", *flags], Path(tmp)), seq_len),
                "kda_compiled_groups.py": groups_bench_row(run_bench(
                    "kda_compiled_groups.py", ["--head-dim", "128",
                                               "--group-chunks", str(GROUP_CHUNKS), *flags], Path(tmp)), GROUP_CHUNKS),
            }
            for bench, r in runs.items():
                cells.append([
                    allocator, bench, f"{r['recurrent'] * 1e3:.0f} / {r['recurrent_cpu'] * 1e3:.0f}",
                    f"{r['recurrent'] / r['eager']:.1f}x / {r['recurrent_cpu'] / r['eager_cpu']:.1f}x",
                    f"{r['recurrent'] / r['compiled']:.1f}x / {r['recurrent_cpu'] / r['compiled_cpu']:.1f}x",
                    f"{r['eager'] / r['compiled']:.2f}x", " / ".join(f"{f:.0f}" for f in r["faults"]),
                ])
    print(f"T={seq_len}, B=1, H=8, K=V=128, fp32, {args.threads} threads, medians of {args.repeats}; "
          f"compiled G={GROUP_CHUNKS}; (wall / CPU)")
    print(markdown_table(["allocator", "bench", "recurrence (ms)", "eager vs recurrence", "compiled vs recurrence",
                          "compiled vs eager (wall)", "page faults per run (recurrence / eager / compiled)"], cells))


if __name__ == "__main__":
    main()
