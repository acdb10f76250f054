"""Point-to-point ops as torch.distributed records them: group-local peers and coalesced kernels.

Two facts of real traces (ProcessGroupNCCL / ProcessGroupGloo):

- Peers are ranks *inside the process group*: `Src Rank` / `Dst Rank`, the `nccl:send 1->2`
  annotation and gloo's `Concrete Inputs` all name group ranks. A stage of the pipeline group
  [1, 13, 25, 37] receiving from global rank 1 records `recv 1<-0`. The global rank is the
  group's rank list at that index (`distributedInfo.pg_config`, else the op's `Process Group
  Ranks`, else `Global rank start` + index x `Global rank stride`).
- `batch_isend_irecv` (torch.distributed.pipelining, Megatron's batched P2P) records each
  send / recv as a `record_param_comms` op (and a `nccl:send` / `nccl:recv` annotation) that
  launches nothing, then launches one `ncclDevKernel_SendRecv` with `Collective name`
  `coalesced` for all of them: one kernel may carry a send and a recv at once. Each such
  kernel is split here into one row per send / recv it carries, all with the kernel's times.
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence

from deltamoe.trace.classify import P2P_KINDS, collective_kind, dtype_bytes, peer_from_name

Ranks = Sequence[int]  # a tuple or a range

_PIPELINE_DESC = re.compile(r"pp|pipe", re.IGNORECASE)


def group_ranks(pg: str, groups: dict[str, Ranks], args: object = None) -> Ranks | None:
    """The global ranks of group `pg`: pg_config first, then the op's own args."""
    ranks = groups.get(pg)
    if ranks is not None:
        return ranks
    if args is None:
        return None
    listed = getattr(args, "pg_ranks", None)
    if isinstance(listed, str) and "..." not in listed:  # Kineto truncates beyond 30 entries
        try:
            return tuple(int(x) for x in listed.strip("[] ").split(",") if x.strip())
        except ValueError:
            pass
    start, stride = getattr(args, "rank_start", None), getattr(args, "rank_stride", None)
    size = getattr(args, "group_size", None)
    if isinstance(start, int) and isinstance(stride, int) and stride > 0 and isinstance(size, int) and size > 0:
        return range(start, start + stride * size, stride)
    return None


def to_global(peer: int, ranks: Ranks | None) -> int:
    """Group rank -> global rank; -1 when the group is unknown or the index is outside it."""
    if peer < 0 or ranks is None:
        return -1
    return int(ranks[peer]) if peer < len(ranks) else -1


def cpu_p2p_group(rank: int, groups: dict[str, Ranks], descs: dict[str, str]) -> Ranks | None:
    """The group a gloo send / recv of `rank` runs in; gloo does not record it.

    A pipeline group (described as `pp`/`pipe`, e.g. DeviceMesh's `mesh_pp`) when the rank has
    one, else the world (the default group)."""
    for name, ranks in groups.items():
        if rank in ranks and _PIPELINE_DESC.search(descs.get(name, "")) and len(ranks) > 1:
            return ranks
    world = [r for n, r in groups.items() if descs.get(n) == "default_pg"]
    if world:
        return world[0]
    return max(groups.values(), key=len) if groups else None


def cpu_peer(rank: int, local_peer: int, group: Ranks | None) -> int:
    """A gloo P2P peer: the group rank mapped through `group`; without one (the trace was
    recorded without `record_shapes`), the other member of a two-rank group."""
    if local_peer >= 0:
        return to_global(local_peer, group) if group is not None else local_peer
    if group is not None and len(group) == 2 and rank in group:
        return int(group[0] if group[1] == rank else group[1])
    return -1


def coalesced_parts(p2p_ops: list, annotations: list, owned: set, coalesced: list[tuple[float, int, str]],
                    single_launches: list[float]) -> dict[int, list[tuple[str, int, int]]]:
    """The sends and recvs each coalesced kernel carries.

    `p2p_ops`: (ts, Args) of record_param_comms send / recv; those whose External id is in
    `owned` launched their own kernel and are not parts. `annotations`: (name, ts, dur, tid)
    of P2P annotations, used when no record_param_comms op is available; one that spans the
    launch of a plain send / recv kernel (`single_launches`) belongs to that kernel.
    `coalesced`: (launch time, row, group) of each coalesced kernel. A part belongs to the first
    coalesced kernel of its group launched after it. Returns row -> [(kind, group peer, bytes)].
    """
    records: list[tuple[float, str, int, str, int]] = []  # (ts, kind, group peer, group, bytes)
    for ts, a in p2p_ops:
        if a.external_id in owned:
            continue
        kind = a.collective
        peer = a.dst if kind == "send" else a.src
        nelems = a.out_nelems if kind == "recv" else a.in_nelems
        nbytes = nelems * dtype_bytes(a.dtype or "float") if isinstance(nelems, int) else 0
        records.append((float(ts), kind, peer if isinstance(peer, int) else -1,
                        "" if a.pg_name is None else str(a.pg_name), nbytes))
    if not records:
        launches = sorted(single_launches)
        for name, ts, dur, _tid in annotations:
            kind = collective_kind(name)
            if kind not in P2P_KINDS:
                continue
            i = bisect_left(launches, ts)
            if i < len(launches) and launches[i] <= ts + dur:
                continue  # the annotation of a plain send / recv kernel
            records.append((float(ts), kind, peer_from_name(name), "", 0))
    by_group: dict[str, list[tuple[float, int]]] = {}
    for launch, row, pg in sorted(coalesced):
        by_group.setdefault(pg, []).append((launch, row))
        by_group.setdefault("", []).append((launch, row))
    out: dict[int, list[tuple[str, int, int]]] = {}
    for ts, kind, peer, pg, nbytes in sorted(records, key=lambda r: r[0]):
        kernels = by_group.get(pg) or by_group.get("", [])
        i = bisect_left(kernels, (ts, -1))
        if i < len(kernels):
            out.setdefault(kernels[i][1], []).append((kind, peer, nbytes))
    return out
