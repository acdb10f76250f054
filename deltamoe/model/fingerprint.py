"""`weights_fingerprint`: a short id of the weights a server loads, so servers that must hold the same
weights (a prefill/decode pair: one computes the cache, the other continues from it) can check it.

Hashing a whole checkpoint would read every byte again at start-up (a K3-sized one is terabytes), so
the fingerprint covers each shard's safetensors header (tensor names, dtypes, shapes, offsets), its
size and `SAMPLES` evenly spaced 4 KiB reads of its data: two trainings or fine-tunes of one
architecture differ in every sample, and equal files always agree. It is a check against a wrong
pairing, not a proof that two folders hold equal bytes. A preset's random weights are named by the
preset and the seed they are drawn with.

A weight update changes the served weights without a restart: `updated_fingerprint` folds a digest of
the update's tensors (names, dtypes, shapes and the same kind of evenly spaced samples of their
bytes) into the fingerprint, so two servers given the same update agree again and a server updated
alone no longer matches its peer.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import torch

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
        for at in _sample_starts(max(size - start - SAMPLE_BYTES, 0)):
            f.seek(start + at)
            h.update(f.read(SAMPLE_BYTES))


def _sample_starts(span: int) -> list[int]:
    """Where the `SAMPLES` reads of `SAMPLE_BYTES` start in data of `span + SAMPLE_BYTES` bytes: evenly
    spaced, the first at 0 and the last at the end."""
    return [span * i // (SAMPLES - 1) for i in range(SAMPLES)]


def updated_fingerprint(fingerprint: str, tensors: dict[str, torch.Tensor]) -> str:
    """`fingerprint` after an update that copied `tensors` (full tensors by model name) into the weights."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{fingerprint}\nupdate\n".encode())
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        flat = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_zeros(0, dtype=torch.uint8)
        if flat.numel() <= SAMPLES * SAMPLE_BYTES:
            h.update(flat.cpu().numpy().tobytes())
            continue
        for at in _sample_starts(flat.numel() - SAMPLE_BYTES):
            h.update(flat[at:at + SAMPLE_BYTES].cpu().numpy().tobytes())
    return h.hexdigest()
