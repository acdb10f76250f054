"""Name patterns: which kernels are communication, which ops are collectives, and of what kind.

NCCL names changed across versions (`ncclKernel_*` before 2.19, `ncclDevKernel_*` after);
gloo runs have no kernels at all, only `gloo:*` annotations and `c10d::*` ops; other vendors
ship their own libraries (RCCL, MCCL, HCCL, oneCCL). All of that is data here, so a new
vendor is one more pattern (`--comm-pattern`), not new code.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

# Communication kernels on a GPU stream. DeepEP dispatch/combine are MoE token exchange,
# so they count as communication (HTA counts them as compute).
DEFAULT_COMM_KERNELS = (
    r"^nccl", r"^rccl", r"^mccl", r"^hccl", r"^c10d::", r"^oneccl", r"deep_ep::",
)
MEMORY_KERNELS = re.compile(r"^(Memcpy|Memset|dma)", re.IGNORECASE)

# Collective kind from whatever name we have: record_param_comms `Collective name`, an
# annotation (`nccl:all_reduce`, `gloo:all_to_all`), a c10d op or a kernel name.
_KIND_PATTERNS = [
    ("send", re.compile(r"(^|[:_])send(?!recv)", re.I)),
    ("recv", re.compile(r"(^|[:_])recv", re.I)),
    ("all_to_all", re.compile(r"all_?to_?all|alltoall", re.I)),
    ("all_reduce", re.compile(r"all_?reduce", re.I)),
    ("all_gather", re.compile(r"all_?gather", re.I)),
    ("reduce_scatter", re.compile(r"reduce_?scatter", re.I)),
    ("broadcast", re.compile(r"broadcast", re.I)),
    ("barrier", re.compile(r"barrier", re.I)),
    ("coalesced", re.compile(r"coalesced", re.I)),
    ("send_recv", re.compile(r"sendrecv", re.I)),
    ("reduce", re.compile(r"reduce", re.I)),
    ("gather", re.compile(r"gather", re.I)),
    ("scatter", re.compile(r"scatter", re.I)),
]
P2P_KINDS = frozenset({"send", "recv"})
KINDS = frozenset([k for k, _ in _KIND_PATTERNS] + ["other"])  # every kind collective_kind() returns

# `nccl:send 3->4` / `nccl:recv 4<-3`: the peer is in the annotation name.
_PEER = re.compile(r"(?:->|<-)\s*(\d+)\s*$")

DTYPE_BYTES = {"float": 4, "float32": 4, "bfloat16": 2, "half": 2, "float16": 2, "double": 8,
               "float64": 8, "int": 4, "int32": 4, "long": 8, "int64": 8, "int8": 1,
               "byte": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}

STEP = re.compile(r"ProfilerStep\s*#\s*(\d+)")


@functools.lru_cache(maxsize=4096)
def collective_kind(name: str) -> str:
    """Normalise any collective name to one kind ('all_reduce', 'send', ...)."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "other"


def peer_from_name(name: str) -> int:
    m = _PEER.search(name)
    return int(m.group(1)) if m else -1


def dtype_bytes(dtype: object) -> int:
    return DTYPE_BYTES.get(str(dtype).lower(), 4)


@dataclass(frozen=True)
class Patterns:
    """Configurable vendor patterns; passed to the reader workers (picklable)."""

    comm_kernels: tuple[str, ...] = DEFAULT_COMM_KERNELS
    # CPU-side collective annotations / ops (gloo, or any library that records them).
    cpu_collective_prefixes: tuple[str, ...] = ("gloo:", "c10d::", "mccl:", "hccl:")
    gpu_collective_prefixes: tuple[str, ...] = ("nccl:", "rccl:", "mccl:", "hccl:")
    _compiled: re.Pattern | None = field(default=None, compare=False, repr=False)

    def with_extra(self, extra: list[str]) -> "Patterns":
        return Patterns(comm_kernels=self.comm_kernels + tuple(extra),
                        cpu_collective_prefixes=self.cpu_collective_prefixes,
                        gpu_collective_prefixes=self.gpu_collective_prefixes)

    def comm_regex(self) -> re.Pattern:
        return re.compile("|".join(f"(?:{p})" for p in self.comm_kernels), re.IGNORECASE)
