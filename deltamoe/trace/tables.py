"""First reduction of raw Kineto events into small columnar tables (one pass, no lookback).

This is the hot loop of the analyzer: every event of a rank passes through `EventTables.add`
exactly once, in whatever chunk it arrived, and only the few fields later analyses need are
kept. Tables from several chunks of one file are concatenated with `merge`, so a large file
can be split across worker processes. Joins that need the whole file (kernel -> launch ->
step, kernel -> record_param_comms) happen afterwards in `build.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamoe.trace.classify import STEP, Patterns

# kernel class codes
COMPUTE, COMM, MEMORY = 0, 1, 2
_RUNTIME_CATS = frozenset({"cuda_runtime", "musa_runtime", "privateuse1_runtime", "hip_runtime",
                           "xpu_runtime", "cuda_driver", "musa_driver"})
_MEMORY_CATS = frozenset({"gpu_memcpy", "gpu_memset"})
# Args of a collective worth keeping (everything else on record_param_comms is dropped).
COLL_ARGS = ("Collective name", "Process Group Name", "Process Group Description", "Seq",
             "In msg nelems", "Out msg nelems", "dtype", "Src Rank", "Dst Rank", "Group size")


def _coll_args(args: dict) -> dict:
    return {k: args[k] for k in COLL_ARGS if k in args}


@dataclass
class EventTables:
    """Columns gathered from events; lists of tuples are cheap to append and pickle."""

    kernels: list = field(default_factory=list)      # (ts, dur, cls, stream, correlation, ext, name_id)
    kernel_coll: dict = field(default_factory=dict)  # kernel index -> collective args
    runtimes: list = field(default_factory=list)     # (correlation, ts)
    param_comms: dict = field(default_factory=dict)  # External id -> collective args
    annotations: list = field(default_factory=list)  # (name, ts, dur, tid) for comm annotations
    cpu_coll_ops: list = field(default_factory=list)  # (name, ts, dur, tid, concrete inputs)
    cpu_ops: list = field(default_factory=list)      # (ts, dur, tid) of cpu_op events
    steps: list = field(default_factory=list)        # (step number, ts, dur, tid)
    names: dict = field(default_factory=dict)        # kernel name -> id (interned per chunk)
    events: int = 0

    def add(self, events: list, patterns: Patterns) -> None:
        comm_re = patterns.comm_regex()
        cpu_prefixes = patterns.cpu_collective_prefixes
        gpu_prefixes = patterns.gpu_collective_prefixes
        kernels, runtimes, cpu_ops = self.kernels.append, self.runtimes.append, self.cpu_ops.append
        names, kernel_coll, param_comms = self.names, self.kernel_coll, self.param_comms
        cls_of: dict[str, int] = {}
        self.events += len(events)
        for e in events:
            if e.get("ph") != "X":
                continue
            cat = e.get("cat")
            if cat == "kernel":
                name = e["name"]
                cls = cls_of.get(name)
                if cls is None:
                    cls = COMM if comm_re.search(name) else COMPUTE
                    cls_of[name] = cls
                nid = names.get(name)
                if nid is None:
                    nid = names[name] = len(names)
                args = e.get("args") or {}
                if cls == COMM and "Collective name" in args:
                    kernel_coll[len(self.kernels)] = _coll_args(args)
                kernels((e["ts"], e["dur"], cls, args.get("stream", e.get("tid", 0)),
                         args.get("correlation", -1), args.get("External id", -1), nid))
            elif cat == "cpu_op":
                name = e["name"]
                ts, dur, tid = e["ts"], e["dur"], e.get("tid", 0)
                if name.startswith("ProfilerStep"):  # older exports record steps as cpu_op
                    self._step(name, ts, dur, tid)
                    continue
                cpu_ops((ts, dur, tid))
                if name == "record_param_comms":
                    args = e.get("args") or {}
                    param_comms[args.get("External id", -1)] = _coll_args(args)
                elif name.startswith(cpu_prefixes):
                    ci = (e.get("args") or {}).get("Concrete Inputs")
                    self.cpu_coll_ops.append((name, ts, dur, tid, ci))
            elif cat in _RUNTIME_CATS:
                corr = (e.get("args") or {}).get("correlation")
                if corr is not None:
                    runtimes((corr, e["ts"]))
            elif cat in _MEMORY_CATS:
                args = e.get("args") or {}
                kernels((e["ts"], e["dur"], MEMORY, args.get("stream", e.get("tid", 0)),
                         args.get("correlation", -1), -1, -1))
            elif cat == "user_annotation":  # GPU mirrors of annotations would double count
                name = e["name"]
                if name.startswith("ProfilerStep"):
                    self._step(name, e["ts"], e["dur"], e.get("tid", 0))
                elif name.startswith(cpu_prefixes) or name.startswith(gpu_prefixes):
                    self.annotations.append((name, e["ts"], e["dur"], e.get("tid", 0)))

    def _step(self, name: str, ts: float, dur: float, tid: object) -> None:
        m = STEP.search(name)
        if m:
            self.steps.append((int(m.group(1)), ts, dur, tid))

    @staticmethod
    def merge(parts: list["EventTables"]) -> "EventTables":
        """Concatenate chunk tables in file order, re-interning kernel names."""
        out = EventTables()
        for p in parts:
            remap = {}
            for name, nid in p.names.items():
                remap[nid] = out.names.setdefault(name, len(out.names))
            base = len(out.kernels)
            out.kernels.extend((k[0], k[1], k[2], k[3], k[4], k[5], remap.get(k[6], -1))
                               for k in p.kernels)
            out.kernel_coll.update({base + i: a for i, a in p.kernel_coll.items()})
            out.runtimes.extend(p.runtimes)
            out.param_comms.update(p.param_comms)
            out.annotations.extend(p.annotations)
            out.cpu_coll_ops.extend(p.cpu_coll_ops)
            out.cpu_ops.extend(p.cpu_ops)
            out.steps.extend(p.steps)
            out.events += p.events
        return out
