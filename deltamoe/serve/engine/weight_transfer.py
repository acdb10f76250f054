"""How named tensors travel from a trainer to an engine: their specs, buckets, and the transfer group.

Both ends share this module, so they agree on the wire format without sending it:
- `TensorSpec`: a tensor's name, dtype and shape. The trainer announces the specs of an update
  first (vLLM's `update_weights` info: names, dtype names, shapes); the engine checks them all
  before a byte moves.
- `plan_buckets`: consecutive tensors grouped up to `bucket_bytes` (one oversized tensor is a bucket
  of its own). Each bucket travels as one flat byte buffer, so a sync is a few large broadcasts
  instead of one per tensor (slime's 512 MB buckets).
- `TransferGroup`: a two-or-more-process gloo group of its own (the trainer is rank 0, the engine
  rank >= 1), independent of any default process group either side already runs in (the engine's
  TP/EP workers, the trainer's torchrun job). Its store is a TCPStore that the trainer opens.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 512 * 2**20
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, dtype_name(tensor.dtype), tuple(tensor.shape))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.torch_dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"weights travel as one of {sorted(_DTYPES)}, not {name}")
    return name


def known_dtype(name: str) -> bool:
    return name in _DTYPES


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[int]]:
    """Indices of `specs` per bucket, in order: a bucket closes before it would pass `bucket_bytes`.
    `bucket_bytes` <= 0: one tensor per bucket (the per-tensor baseline)."""
    buckets: list[list[int]] = []
    size = 0
    for i, spec in enumerate(specs):
        if not buckets or bucket_bytes <= 0 or size + spec.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += spec.nbytes
    return buckets


_ALIGN = 8  # every tensor starts at a multiple of 8 bytes, so its bytes can be viewed as any dtype


def layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """Byte offsets of the tensors in one bucket's buffer, and the buffer's size."""
    offsets, end = [], 0
    for spec in specs:
        offsets.append(end)
        end += -(-spec.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def bucket_sizes(specs: list[TensorSpec], bucket_bytes: int) -> list[int]:
    """The byte size of each broadcast the specs make: what every rank must agree on before any is
    sent (a receive buffer of another size is a fatal error inside gloo, which aborts the process)."""
    return [layout([specs[i] for i in bucket])[1] for bucket in plan_buckets(specs, bucket_bytes)]


def plan_fingerprint(sizes: list[int]) -> tuple[int, int]:
    """(total bytes, a 62-bit hash of the sizes in order): equal on every rank iff the plans are."""
    digest = hashlib.sha256(",".join(map(str, sizes)).encode()).digest()
    return sum(sizes), int.from_bytes(digest[:8], "little") >> 2


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer holding the tensors' bytes at `layout`'s offsets."""
    specs = [TensorSpec(str(i), dtype_name(t.dtype), tuple(t.shape)) for i, t in enumerate(tensors)]
    offsets, size = layout(specs)
    buffer = torch.zeros(size, dtype=torch.uint8)
    for t, spec, offset in zip(tensors, specs, offsets):
        buffer[offset:offset + spec.nbytes] = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return buffer


def unpack(buffer: torch.Tensor, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """The tensors `pack` laid out, as views into `buffer` (copy them to keep them past the buffer)."""
    offsets, size = layout(specs)
    if size != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes for tensors that take {size}")
    return [buffer[o:o + s.nbytes].view(s.torch_dtype).view(s.shape) for s, o in zip(specs, offsets)]


class TransferGroup:
    """A gloo group of `world_size` processes: the trainer (rank 0) broadcasts, engines receive.

    Built directly on `ProcessGroupGloo` over its own store, so it never touches (or needs) the
    default group. Two phases, so the trainer can learn its port before it waits: the constructor
    opens (rank 0) or reaches the store, `connect` meets the others. Every collective gives up after `timeout_s`: a peer that dies is an error, not a hang."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} in a transfer group of {world_size} (the trainer is rank 0, "
                             f"engines 1..{world_size - 1})")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        # The trainer opens the store (port 0: the OS picks a free one, read back from `port`).
        self.store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=self.timeout,
                                   wait_for_workers=False)
        self.pg: dist.ProcessGroupGloo | None = None

    @property
    def port(self) -> int:
        return self.store.port

    def connect(self) -> "TransferGroup":
        """Meet the other ranks (blocks until all of them call it, at most `timeout_s`)."""
        if self.pg is None:
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("deltamoe-weights", self.store), self.rank,
                                            self.world_size, self.timeout)
        return self

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In place from rank `src` (CPU tensors: gloo)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.connect().pg.broadcast([tensor], opts).wait()
        return tensor

    def agree(self, ok: bool, sizes: list[int]) -> tuple[bool, bool]:
        """Every rank says whether it goes ahead (an engine: it accepted the announced specs) and which
        broadcasts it expects (`bucket_sizes`: the trainer's from the tensors it will send, an
        engine's from the announced specs). All learn (every rank went ahead, every plan is the
        same), so that no one waits for bytes that will never be sent, and no buffer of the wrong
        size meets a broadcast."""
        total, digest = plan_fingerprint(sizes)
        # MIN over (x, -x) gives min and -max at once: the plans agree iff min == max everywhere.
        flag = torch.tensor([1 if ok else 0, total, -total, digest, -digest], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.connect().pg.allreduce([flag], opts).wait()
        went, lo_t, hi_t, lo_d, hi_d = flag.tolist()
        return bool(went), lo_t == -hi_t and lo_d == -hi_d

    def close(self) -> None:
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]
