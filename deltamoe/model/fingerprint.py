"""`weights_fingerprint`: a short id of the weights a server loads, so servers that must hold the same
weights (a prefill/decode pair: one computes the cache, the other continues from it) can check it.

Hashing a whole checkpoint would read every byte again at start-up (a K3-sized one is terabytes), so
the fingerprint covers each shard's safetensors header (tensor names, dtypes, shapes, offsets), its
size and `SAMPLES` evenly spaced 4 KiB reads of its data: two trainings or fine-tunes of one
architecture differ in every sample, and equal files always agree. It is a check against a wrong
pairing, not a proof that two folders hold equal bytes. A preset's random weights are named by the
preset and the seed they are drawn with.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from deltamoe.model.weights import checkpoint_files

SAMPLES = 64
SAMPLE_BYTES = 4096


def weights_fingerprint(source: str | Path, dtype: str, seed: int = 0) -> str:
    """16 hex digits for the weights `load_model(source, dtype, seed=seed)` gives (folder or preset)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"dtype={dtype}\n".encode())
    path = Path(source)
    if not path.is_dir():
        h.update(f"preset={source} seed={seed}\n".encode())
        return h.hexdigest()
    for name in sorted(checkpoint_files(path)):
        h.update(f"file={name}\n".encode())
        _hash_shard(h, path / name)
    return h.hexdigest()


def _hash_shard(h, file: Path) -> None:
    size = file.stat().st_size
    h.update(struct.pack("<Q", size))
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        h.update(f.read(header_len))
        start = 8 + header_len
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            h.update(f.read(SAMPLE_BYTES))
