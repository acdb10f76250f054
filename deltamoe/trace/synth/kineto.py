"""Write one synthetic rank as a Kineto trace, the way PyTorch + NCCL would have written it.

Each kernel gets its CPU op, its launch (`cuda_runtime` with a correlation id), the kernel
itself on its stream and the `ac2g` flow pair; each collective gets `c10d::*`,
`record_param_comms` with the collective args, the `nccl:*` annotation and an NCCL kernel
carrying the args (as Kineto copies them). `distributedInfo` carries rank and groups.
Pipeline P2P is written as torch.distributed does: peers as ranks of the pipeline group, and
with `p2p="batched"` one `coalesced` SendRecv kernel per batch_isend_irecv (see `p2p`).
"""

from __future__ import annotations

import numpy as np
import orjson

from deltamoe.trace.synth.layout import Layout

LEAD = 15.0          # CPU launch runs this far ahead of the kernel start (us)
STREAM = {"C": 7, "M": 7, "X": 20, "S": 24, "R": 24}
BASE_NS = 1_790_857_026_000_000_000
T0 = 5_161_000_000_000.0  # trace-clock offset of the first step (us), like real exports

_DEV = {"all_reduce": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "all_to_all": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        "send": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        "recv": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
        "coalesced": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"}
_LEGACY = {"all_reduce": "ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclDevComm*, unsigned long, ncclWork*)",
           "all_to_all": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
           "send": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
           "recv": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
           "coalesced": "ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)"}
_C10D = {"all_reduce": "c10d::allreduce_", "all_to_all": "c10d::alltoall_base_",
         "send": "c10d::send", "recv": "c10d::recv_"}
_COLL_NAME = {"all_reduce": "allreduce", "all_to_all": "all_to_allv", "send": "send", "recv": "recv",
              "coalesced": "coalesced"}
_ANNOT = {"all_reduce": "nccl:all_reduce", "all_to_all": "nccl:all_to_all"}


class RankWriter:
    def __init__(self, lay: Layout, rank: int):
        self.lay, self.rank = lay, rank
        self.cpu = 100_000 + rank
        self.dev = rank % 8
        self.ev: list[dict] = []
        self.corr = 1
        self.ext = 1
        self.kernel_names = _DEV if lay.cfg.nccl_names == "dev" else _LEGACY
        self.seq: dict[int, int] = {}

    def _launch(self, op_name: str, kernel: dict, cat: str = "kernel", rt: str = "cudaLaunchKernel",
                cpu_args: dict | None = None) -> None:
        ts = kernel["ts"] - LEAD
        c, x = self.corr, self.ext
        self.corr += 1
        self.ext += 1
        self.ev.append({"ph": "X", "cat": "cpu_op", "name": op_name, "pid": self.cpu, "tid": self.cpu,
                        "ts": round(ts, 3), "dur": 8.0,
                        "args": {"External id": x, "Record function id": 0, "Ev Idx": x - 1,
                                 **(cpu_args or {})}})
        self.ev.append({"ph": "X", "cat": "cuda_runtime", "name": rt, "pid": self.cpu, "tid": self.cpu,
                        "ts": round(ts + 2, 3), "dur": 4.0,
                        "args": {"External id": x, "cbid": 211, "correlation": c}})
        self.ev.append({"ph": "s", "id": c, "pid": self.cpu, "tid": self.cpu, "ts": round(ts + 2, 3),
                        "cat": "ac2g", "name": "ac2g"})
        kernel["args"] = {"External id": x, "queued": 0, "device": self.dev, "context": 1,
                          "stream": kernel["tid"], "correlation": c, **kernel.get("args", {})}
        kernel["cat"] = cat
        self.ev.append(kernel)
        self.ev.append({"ph": "f", "id": c, "pid": self.dev, "tid": kernel["tid"], "ts": kernel["ts"],
                        "cat": "ac2g", "name": "ac2g", "bp": "e"})

    def compute(self, start: float, kernels: list[tuple[str, float]]) -> list[tuple[float, float]]:
        spans = []
        t = start
        for name, dur in kernels:
            self._launch("aten::mm", {"ph": "X", "name": name, "pid": self.dev, "tid": STREAM["C"],
                                      "ts": round(t, 3), "dur": round(dur, 3),
                                      "args": {"grid": [132, 1, 1], "block": [384, 1, 1],
                                               "registers per thread": 168, "shared memory": 213248,
                                               "warps per SM": 12.0, "est. achieved occupancy %": 19}})
            spans.append((round(t, 3), round(t, 3) + round(dur, 3)))
            t += dur
        return spans

    def memcpy(self, start: float, dur: float) -> tuple[float, float]:
        self._launch("aten::copy_", {"ph": "X", "name": "Memcpy HtoD (Pinned -> Device)", "pid": self.dev,
                                     "tid": STREAM["M"], "ts": round(start, 3), "dur": round(dur, 3),
                                     "args": {"bytes": 67108864, "memory bandwidth (GB/s)": 1677.7}},
                     cat="gpu_memcpy", rt="cudaMemcpyAsync")
        return round(start, 3), round(start, 3) + round(dur, 3)

    def _args(self, kind: str, gid: int, nbytes: int) -> dict:
        """record_param_comms args; ranks in them (`Rank`, `Src/Dst Rank`) are group ranks."""
        name, desc, ranks = self.lay.groups[gid]
        args = {"Collective name": _COLL_NAME[kind], "dtype": "BFloat16",
                "In msg nelems": nbytes // 2, "Out msg nelems": nbytes // 2,
                "In split size": "[]", "Out split size": "[]", "Group size": len(ranks),
                "Process Group Name": name, "Process Group Description": desc,
                "Process Group Ranks": _truncated(ranks), "Rank": ranks.index(self.rank)}
        if self.lay.cfg.with_seq and kind not in ("send", "recv", "coalesced"):
            k = self.seq.get(gid, 0)
            self.seq[gid] = k + 1
            args["Seq"] = k
        return args

    def comm(self, kind: str, gid: int, nbytes: int, start: float, end: float) -> tuple[float, float]:
        """A collective: c10d op > record_param_comms + `nccl:*` annotation > NCCL kernel with the args."""
        return self._kernel(kind, _ANNOT[kind], self._args(kind, gid, nbytes), start, end)

    def p2p(self, parts: list[tuple[str, int, int]], gid: int, start: float, end: float) -> tuple[float, float]:
        """Pipeline P2P in the pipeline group `gid`; parts: (send | recv, peer global rank, bytes).

        `batched` (torch.distributed.pipelining's batch_isend_irecv): each part is a
        record_param_comms op and an annotation that launch nothing, then one `coalesced`
        SendRecv kernel carries them all. `single` (isend / irecv): one kernel per part."""
        ranks = self.lay.groups[gid][2]
        me = ranks.index(self.rank)
        t0 = start - LEAD
        named = []
        for kind, peer, nbytes in parts:
            args = self._args(kind, gid, nbytes)
            args["Dst Rank" if kind == "send" else "Src Rank"] = ranks.index(peer)
            arrow = f"{me}->{ranks.index(peer)}" if kind == "send" else f"{me}<-{ranks.index(peer)}"
            named.append((kind, f"nccl:{kind} {arrow}", args))
        if self.lay.cfg.p2p == "single":
            (kind, annot, args), = named
            return self._kernel(kind, annot, args, start, end)
        for k, (kind, annot, args) in enumerate(named):
            ts = t0 - 4.0 * (len(named) - k)
            self.ev.append({"ph": "X", "cat": "cpu_op", "name": _C10D[kind], "pid": self.cpu, "tid": self.cpu,
                            "ts": round(ts, 3), "dur": 3.0, "args": {"External id": self.ext, "Record function id": 0}})
            self.ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": self.cpu,
                            "tid": self.cpu, "ts": round(ts + 0.5, 3), "dur": 2.0,
                            "args": {"External id": self.ext, "Record function id": 0, **args}})
            self.ev.append({"ph": "X", "cat": "user_annotation", "name": annot, "pid": self.cpu, "tid": self.cpu,
                            "ts": round(ts + 1.0, 3), "dur": 1.0,
                            "args": {"External id": self.ext + 1000000, "Record function id": 0}})
            self.ext += 1
        args = self._args("coalesced", gid, sum(n for _, _, n in parts))
        return self._kernel("coalesced", "nccl:coalesced", args, start, end, launcher="record_param_comms")

    def _kernel(self, kind: str, annot: str, args: dict, start: float, end: float,
                launcher: str | None = None) -> tuple[float, float]:
        ts = round(start, 3)
        self.ev.append({"ph": "X", "cat": "user_annotation", "name": annot, "pid": self.cpu,
                        "tid": self.cpu, "ts": round(start - LEAD + 1, 3), "dur": 6.0,
                        "args": {"External id": self.ext + 1000000, "Record function id": 0}})
        stream = STREAM["S" if kind in ("send", "recv", "coalesced") else "X"]
        self._launch(launcher or _C10D[kind], {"ph": "X", "name": self.kernel_names[kind], "pid": self.dev,
                                               "tid": stream, "ts": ts, "dur": round(end - start, 3),
                                               "args": dict(args)},
                     rt="cudaLaunchKernelExC", cpu_args=args if launcher else {})
        if launcher is None:
            # record_param_comms sits inside the c10d op and shares the kernel's External id.
            self.ev.append({"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": self.cpu,
                            "tid": self.cpu, "ts": round(start - LEAD + 0.5, 3), "dur": 7.0,
                            "args": {"External id": self.ext - 1, "Record function id": 0, **args}})
        return ts, ts + round(end - start, 3)

    def step_span(self, step: int, lo: float, hi: float) -> None:
        self.ev.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}",
                        "pid": self.cpu, "tid": self.cpu, "ts": round(lo, 3), "dur": round(hi - lo, 3),
                        "args": {"External id": 0, "Record function id": 0}})

    def document(self) -> bytes:
        c = self.lay.cfg
        meta = [{"ph": "M", "name": "process_name", "pid": self.cpu, "tid": 0, "args": {"name": "python"}},
                {"ph": "M", "name": "process_labels", "pid": self.dev, "tid": 0, "args": {"labels": f"GPU {self.dev}"}},
                {"ph": "M", "name": "thread_name", "pid": self.cpu, "tid": self.cpu,
                 "args": {"name": f"thread {self.cpu} (python)"}}]
        meta += [{"ph": "M", "name": "thread_name", "pid": self.dev, "tid": s, "args": {"name": f"stream {s} "}}
                 for s in sorted(set(STREAM.values()))]
        mine = set(self.lay.member[self.rank].values())
        groups = [{"pg_name": n, "pg_desc": d, "backend_config": "cuda:nccl", "pg_size": len(r), "ranks": list(r)}
                  for gi, (n, d, r) in enumerate(self.lay.groups) if gi in mine]
        doc = {"schemaVersion": 1,
               "deviceProperties": [{"id": self.dev, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045231616,
                                     "computeMajor": 9, "computeMinor": 0, "numSms": 132}],
               "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": c.ranks,
                                   "pg_count": len(groups), "pg_config": groups, "nccl_version": "2.21.5"},
               "host_name": f"node{self.rank // 8:05d}", "displayTimeUnit": "ms", "baseTimeNanoseconds": BASE_NS,
               "traceEvents": meta + self.ev + [
                   {"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "",
                    "ts": max(e["ts"] + e.get("dur", 0) for e in self.ev) + 1}],
               "traceName": f"rank{self.rank}.pt.trace.json"}
        return orjson.dumps(doc, option=0 if c.compact else orjson.OPT_INDENT_2)


def _truncated(ranks: tuple[int, ...]) -> str:
    """Kineto truncates list args beyond 30 entries."""
    if len(ranks) <= 30:
        return "[" + ", ".join(map(str, ranks)) + "]"
    return "[" + ", ".join(map(str, ranks[:29])) + ", ..., " + str(ranks[-1]) + "]"


def spans_array(spans: list[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    a = np.array(spans, dtype=float).reshape(-1, 2)
    return a[:, 0], a[:, 1]
