"""Cache bytes per token of context and fixed state per sequence: Kimi K3 / K3.1 layouts vs all-MLA.

Computed from the engine's own cache layout (`CacheLayout`, what HybridCache allocates), no
allocation: K3's 24 MLA layers hold 576 latent values per token each (bf16), its 69 KDA layers a
fixed recurrent state (96 x 128 x 128 fp32) + conv state per sequence. The peer is the same dims
with every layer MLA (a dense-attention K3), expected to need about 4x the per-token bytes.

    .venv/bin/python bench/bench_serve_cache_bytes.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import markdown_table, result_name, write_result  # noqa: E402

from deltamoe.config import load_preset  # noqa: E402
from deltamoe.serve.engine.cache_layout import CacheLayout  # noqa: E402

CONTEXTS = (4096, 32768, 131072, 1048576)
# K3's per-token cache bytes are expected at about a quarter of the all-MLA layout's.
TARGET = {"variant": "Kimi K3 (69 KDA + 24 MLA)", "per_token_vs_all_mla": [0.2, 0.3]}


def gib(n: float) -> str:
    return f"{n / 2**30:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same (no timing), written to serve_cache_bytes_quick.json")
    args = parser.parse_args()
    k3 = load_preset("kimi-k3")
    variants = {
        "Kimi K3 (69 KDA + 24 MLA)": k3,
        "Kimi K3.1 Pro (69 KDA + 24 DSA)": load_preset("kimi-k3.1-pro"),
        "same dims, all 93 layers MLA": k3.replace(layer_types=("mla",) * k3.num_hidden_layers),
    }
    layouts = {name: CacheLayout.from_config(cfg, block_size=16, dtype=torch.bfloat16) for name, cfg in variants.items()}
    dense = layouts["same dims, all 93 layers MLA"]
    rows, results = [], {}
    for name, lay in layouts.items():
        per_seq = {n: lay.bytes_per_token * n + lay.bytes_per_state_slot for n in CONTEXTS}
        results[name] = {"bytes_per_token": lay.bytes_per_token, "state_bytes_per_sequence": lay.bytes_per_state_slot,
                         "per_token_vs_all_mla": lay.bytes_per_token / dense.bytes_per_token,
                         "bytes_per_sequence": per_seq}
        rows.append([name, f"{lay.bytes_per_token:,}", f"{lay.bytes_per_token / dense.bytes_per_token:.3f}",
                     f"{lay.bytes_per_state_slot / 2**20:,.1f}"]
                    + [f"{gib(per_seq[n])} ({per_seq[n] / (dense.bytes_per_token * n + dense.bytes_per_state_slot):.2f})"
                       for n in CONTEXTS])
    path = write_result(result_name("serve_cache_bytes", args.quick), {
        "dtype": "bf16 latents/keys/conv, fp32 KDA state", "variants": results, "target": TARGET})
    print("Cache per sequence: latent KV + indexer keys per token (bf16), KDA state fixed (fp32).\n")
    print(markdown_table(["layout", "bytes / token", "vs all-MLA", "fixed state / seq (MiB)"]
                         + [f"GiB at {n // 1024}k (vs all-MLA)" for n in CONTEXTS], rows))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
