"""The compact per-rank summary a reader worker sends back: a few KB whatever the file size.

Everything the cross-rank analyses need is here; no event survives the reader. Times are
microseconds on the trace clock (Kineto `ts`), which is shared by all ranks of a job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

HEAT_BINS = 16  # compute-utilisation slices per step, for the ranks x time heat map


@dataclass
class Collectives:
    """One row per communication op on this rank, in time order."""

    pg: np.ndarray      # process group name ('' when the trace does not say, e.g. gloo)
    seq: np.ndarray     # sequence number within the group (ordinal when the trace has none)
    kind: np.ndarray    # 'all_reduce', 'all_to_all', 'send', 'recv', ...
    nbytes: np.ndarray  # payload bytes sent by this rank (received for recv)
    arrive: np.ndarray  # when this rank entered the op (comm kernel start / c10d call)
    end: np.ndarray     # when the op finished on this rank
    peer: np.ndarray    # P2P peer (global rank) or -1
    step: np.ndarray    # index into RankSummary.step_ids, -1 outside the kept steps
    # gloo: the thread the exchange ran on (a process group's work runs on its own worker
    # threads, so ops of one rank on one thread share a group), -1 when unknown; None: GPU trace.
    lane: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.arrive)


@dataclass
class RankSummary:
    rank: int
    world_size: int
    backend: str
    path: str
    host: str
    mode: str                      # 'gpu' (kernels) or 'cpu' (gloo / CPU-only trace)
    events: int
    groups: dict[str, tuple[int, ...] | range]  # process group name -> member ranks
    step_ids: np.ndarray           # ProfilerStep numbers kept
    window: np.ndarray             # (steps, 2) start/end of each step on the compute device
    compute: np.ndarray            # per step, union of compute kernels (us)
    comm: np.ndarray               # per step, union of communication (us)
    memcpy: np.ndarray             # per step, memcpy/memset not hidden under compute or comm
    idle: np.ndarray               # per step, nothing running
    overlap: np.ndarray            # per step, communication hidden under compute
    p2p_wait: np.ndarray           # per step, compute idle while a pipeline recv is pending
    pipe_first: np.ndarray         # per step, first compute start (NaN without P2P)
    pipe_end: np.ndarray           # per step, end of the last pipeline compute block
    pipe_busy: np.ndarray          # per step, compute busy within [pipe_first, pipe_end]
    heat: np.ndarray               # (steps, HEAT_BINS) compute utilisation
    coll: Collectives
    steps_in_trace: tuple[int, ...] = ()  # every ProfilerStep number of the file, kept or not
    warnings: list[str] = field(default_factory=list)
    # per step, communication in flight while the rank computes nothing (trace/exposed.py), in all
    # and per collective kind
    exposed: np.ndarray = field(default_factory=lambda: np.zeros(0))
    exposed_kind: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def step_time(self) -> np.ndarray:
        return self.window[:, 1] - self.window[:, 0] if len(self.window) else np.zeros(0)


@dataclass
class RankError:
    """A rank file that could not be used; reported, then skipped."""

    path: str
    message: str
    rank: int | None = None
