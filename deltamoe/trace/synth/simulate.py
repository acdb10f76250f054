"""Put times on every rank's ops for one step: each rank runs until it must wait for a peer.

Collectives complete when the last member arrives plus the transfer time, so early
arrivers' communication kernels stretch (as NCCL kernels spin) and the last arriver's is
short. A pipeline recv completes when the matching send has delivered. This is what makes a
slow rank visible to the analyzer the way it is in a real job: through the waits it causes.
"""

from __future__ import annotations

from collections import deque

from deltamoe.trace.synth.layout import Layout


def simulate_step(lay: Layout, progs: dict[int, list[tuple]], start: dict[int, float]) -> dict[int, list]:
    """Return, per rank, one (start, end) per op ((nan, nan) for waits)."""
    n = len(progs)
    t_comp = dict(start)
    t_comm: dict[int, float | None] = dict(start)
    t_p2p = dict(start)
    pc = {r: 0 for r in progs}
    times: dict[int, list] = {r: [None] * len(p) for r, p in progs.items()}
    seq: dict[tuple[int, int], int] = {}
    pending: dict[tuple[int, int], list] = {}      # (group, seq) -> [(rank, op index, arrival, async)]
    sent: dict[tuple[int, int], list[float]] = {}  # (src, dst) -> delivery times in order
    recvd: dict[tuple[int, int], int] = {}
    waiting_recv: dict[tuple[int, int], int] = {}  # (src, dst) -> blocked receiver
    waiting_comm: set[int] = set()
    sr_posted: dict[tuple[int, int], float] = {}  # (rank, op index) -> when a batched op was posted
    runnable = deque(progs)
    queued = set(progs)
    done = 0

    def wake(r: int) -> None:
        if r not in queued:
            queued.add(r)
            runnable.append(r)

    def deliver(src: int, dst: int, at: float) -> None:
        sent.setdefault((src, dst), []).append(at)
        w = waiting_recv.pop((src, dst), None)
        if w is not None:
            wake(w)

    def take(src: int, dst: int) -> float | None:
        """Arrival time of dst's next message from src; None (dst now waits) if not sent yet."""
        k = recvd.get((src, dst), 0)
        arrivals = sent.get((src, dst), [])
        if len(arrivals) <= k:
            waiting_recv[(src, dst)] = dst
            return None
        recvd[(src, dst)] = k + 1
        return arrivals[k]

    while runnable:
        r = runnable.popleft()
        queued.discard(r)
        prog, i = progs[r], pc[r]
        while i < len(prog):
            op = prog[i]
            code = op[0]
            if code == "C":
                dur = sum(d for _, d in op[2])
                times[r][i] = (t_comp[r], t_comp[r] + dur)
                t_comp[r] += dur
            elif code == "M":
                times[r][i] = (t_comp[r], t_comp[r] + op[1])
                t_comp[r] += op[1]
            elif code == "X":
                if t_comm[r] is None:
                    waiting_comm.add(r)
                    break
                gid = op[1]
                members = lay.groups[gid][2]
                k = seq.get((r, gid), 0)
                seq[(r, gid)] = k + 1
                arrive = max(t_comp[r], t_comm[r])
                lst = pending.setdefault((gid, k), [])
                lst.append((r, i, arrive, op[5]))
                t_comm[r] = None
                if len(lst) == len(members):
                    del pending[(gid, k)]
                    end = max(a for _, _, a, _ in lst) + op[3]
                    for m, mi, a, is_async in lst:
                        times[m][mi] = (a, end)
                        t_comm[m] = end
                        if not is_async:
                            t_comp[m] = end
                        if m != r:
                            pc_m = pc[m]
                            if not is_async and pc_m == mi + 1:
                                wake(m)
                            elif m in waiting_comm:
                                waiting_comm.discard(m)
                                wake(m)
                    i += 1
                    continue
                i += 1
                if not op[5]:
                    break  # blocked until the last member arrives
                continue
            elif code == "S":
                s0 = max(t_comp[r], t_p2p[r])
                times[r][i] = (s0, s0 + op[2])
                t_p2p[r] = s0 + op[2]
                deliver(r, op[1], s0 + op[2])
            elif code == "SR":  # the send part is posted once, then the kernel waits for the recv
                posted = sr_posted.get((r, i))
                if posted is None:
                    posted = sr_posted[(r, i)] = max(t_comp[r], t_p2p[r])
                    deliver(r, op[1], posted + op[2])
                arrival = take(op[4], r)
                if arrival is None:
                    break
                end = max(posted + op[2], posted + 5.0, arrival)
                times[r][i] = (posted, end)
                t_comp[r] = t_p2p[r] = end
            elif code == "R":
                arrival = take(op[1], r)
                if arrival is None:
                    break
                posted = max(t_comp[r], t_p2p[r])
                end = max(posted + 5.0, arrival)
                times[r][i] = (posted, end)
                t_comp[r] = t_p2p[r] = end
            elif code == "W":
                if t_comm[r] is None:
                    waiting_comm.add(r)
                    break
                t_comp[r] = max(t_comp[r], t_comm[r])
                times[r][i] = (t_comp[r], t_comp[r])
            i += 1
        pc[r] = i
        if i == len(prog):
            done += 1
    if pending or any(pc[r] < len(progs[r]) for r in progs):
        stuck = [r for r in progs if pc[r] < len(progs[r])][:5]
        raise RuntimeError(f"synthetic schedule deadlocked (ranks {stuck} of {n})")
    return times
