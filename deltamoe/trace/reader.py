"""Read a folder of per-rank Kineto traces into RankSummaries, in parallel, one file at a time.

Each file (the usual case: one rank, one profiled window) is parsed in a worker process and
reduced to a RankSummary there; only the summary crosses back. Files up to `whole_bytes`
are decoded in one piece, larger ones slice by slice (see jsonsplit.py), which keeps the
working set in cache. Files above `slice_threshold` have their slices parsed by all
workers, so one huge rank file still uses every core and never sits in memory whole.
The parent therefore holds one summary per rank, never events.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from deltamoe.errors import TraceError
from deltamoe.trace import jsonsplit, schema
from deltamoe.trace.build import StepRange, build_summary
from deltamoe.trace.classify import Patterns
from deltamoe.trace.summary import RankError, RankSummary
from deltamoe.trace.tables import EventTables

SLICE_THRESHOLD = 16 << 20   # above this (decompressed) a file is sliced across workers
# Slices small enough that a slice's JSON and its decoded events stay in cache: at 1 MB
# parsing takes about half the CPU time it takes at 8 MB (fewer cache misses, and freed
# memory is reused instead of being returned to the OS and faulted in again).
SLICE_BYTES = 1 << 20
SLICES_PER_TASK = 8
WHOLE_BYTES = 4 << 20  # up to this a file is decoded in one piece; above, slice by slice


@dataclass(frozen=True)
class ReadConfig:
    patterns: Patterns = field(default_factory=Patterns)
    steps: StepRange = (None, None)
    slice_threshold: int = SLICE_THRESHOLD
    slice_bytes: int = SLICE_BYTES
    whole_bytes: int = WHOLE_BYTES


def find_traces(folder: str | Path) -> list[str]:
    """Every *.json / *.json.gz below `folder` (any case: `.JSON`, `.Json.GZ`); names starting
    with '_' or '.' are ignored.

    The same files as `Path(folder).rglob("*")` filtered by name and `is_file()` (symlinked
    directories are not entered, symlinked files count), walked with os.scandir: ~3x faster.
    """
    root = Path(folder)
    if not root.is_dir():
        raise TraceError(f"not a directory: {folder}", field="DIR",
                         hint="pass the folder that holds one trace file per rank")
    files: list[str] = []
    todo = [str(root)]
    while todo:
        try:
            with os.scandir(todo.pop()) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            try:
                if e.is_dir() and not e.is_symlink():
                    todo.append(e.path)
                elif (not e.name.startswith(("_", ".")) and e.name.lower().endswith((".json", ".json.gz"))
                      and e.is_file()):
                    files.append(e.path)
            except OSError:
                continue
    if not files:
        raise TraceError(f"no *.json or *.json.gz trace files in {folder}", field="DIR")
    return sorted(files)


def read_one(path: str, cfg: ReadConfig, size: int | None = None) -> RankSummary | RankError:
    """Parse and reduce one file in this process (worker entry point); `size`: decompressed bytes."""
    if (_size(path) if size is None else size) > cfg.whole_bytes:
        return read_sliced(path, cfg)
    gc_was_on = gc.isenabled()
    gc.disable()  # millions of fresh dicts would trigger useless cyclic collections
    try:
        data = jsonsplit.read_bytes(path)
        if len(data) < 64 and not data.strip():  # else the decoder says "Input data was truncated"
            raise TraceError("empty file" if not data else "empty file (only whitespace)", field=path)
        doc = schema.decode_trace(data)
        del data
        if doc.traceEvents is None:
            raise TraceError("no traceEvents array found", field=path, hint="is this a Kineto trace?")
        tables = EventTables()
        tables.add(doc.traceEvents, cfg.patterns)
        doc.traceEvents = None
        return build_summary(tables, doc.header(), path, cfg.steps)
    except TraceError as e:
        return _rank_error(path, e)
    except (orjson.JSONDecodeError, schema.DecodeError) as e:
        return RankError(path, f"{path}: invalid JSON ({e})")
    except Exception as e:  # a malformed event must cost one rank, not the whole analysis
        return RankError(path, f"{path}: {type(e).__name__}: {e}")
    finally:
        if gc_was_on:
            gc.enable()


def _read_slices(job: tuple[list[jsonsplit.Slice], ReadConfig]) -> EventTables:
    """Consecutive slices parsed one by one (each stays in cache), returned as one table."""
    run, cfg = job
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        parts = []
        for sl in run:
            t = EventTables()
            data = sl.read()
            try:
                events = jsonsplit.parse_slice(data)
            except (orjson.JSONDecodeError, schema.DecodeError) as e:  # say where in the file, not the slice
                raise schema.DecodeError(jsonsplit.slice_error_message(sl, data, e)) from None
            t.add(events, cfg.patterns)
            parts.append(t.freeze())
        return EventTables.merge(parts).freeze()
    finally:
        if gc_was_on:
            gc.enable()


def _runs(parts: Iterator[jsonsplit.Slice], n: int) -> Iterator[list[jsonsplit.Slice]]:
    run: list[jsonsplit.Slice] = []
    for sl in parts:
        run.append(sl)
        if len(run) == n:
            yield run
            run = []
    if run:
        yield run


def read_sliced(path: str, cfg: ReadConfig, pool=None) -> RankSummary | RankError:
    """Parse a large file slice by slice (in `pool` when given) and reduce it here."""
    try:
        header, parts = jsonsplit.slices(path, cfg.slice_bytes)
        # A run of slices per task: a table per 1 MB slice sent back to the parent would
        # cost it ~0.2 s per million events in IPC alone.
        jobs = ((run, cfg) for run in _runs(parts, SLICES_PER_TASK))
        mapped = pool.imap(_read_slices, jobs) if pool is not None else map(_read_slices, jobs)
        tables = EventTables.merge(list(mapped))
        header.update(header.pop("__tail__", {}))
        return build_summary(tables, header, path, cfg.steps)
    except TraceError as e:
        return _rank_error(path, e)
    except (orjson.JSONDecodeError, schema.DecodeError) as e:
        return RankError(path, f"{path}: invalid JSON ({e})")
    except Exception as e:
        return RankError(path, f"{path}: {type(e).__name__}: {e}")


def read_all(paths: list[str], cfg: ReadConfig, workers: int = 0,
             on_done: Callable[[str], None] | None = None,
             meanwhile: Callable[[], None] | None = None) -> Iterator[RankSummary | RankError]:
    """Yield one result per path (any order). `workers` <= 1 reads in this process.

    `meanwhile` runs in this process once the reader processes are started (at once when
    there are none): parent-only work, e.g. imports, that then overlaps with the reading."""
    workers = workers or min(os.cpu_count() or 1, len(paths))
    sizes = {p: _size(p) for p in paths}
    big = [p for p in paths if sizes[p] > cfg.slice_threshold]
    small = [p for p in paths if sizes[p] <= cfg.slice_threshold]
    if workers <= 1:
        if meanwhile:
            meanwhile()
        _keep_buffers_in_heap()
        for p in big:
            yield _done(read_sliced(p, cfg), p, on_done)
        for p in small:
            yield _done(read_one(p, cfg, sizes[p]), p, on_done)
        return
    # fork: workers start in milliseconds; they are started before any progress thread.
    gc.freeze()  # the workers' collector then neither scans nor copies the inherited objects
    try:
        if big:
            import multiprocessing as mp

            import numpy.ma  # noqa: F401  np.unique loads it on first use: once here, not in every worker
            with mp.get_context("fork").Pool(workers, initializer=_init_pool_worker) as pool:
                if meanwhile:
                    meanwhile()
                    meanwhile = None
                for p in big:
                    yield _done(read_sliced(p, cfg, pool), p, on_done)
        if small:
            for res in _forked(small, sizes, cfg, workers, meanwhile):
                yield _done(res, res.path, on_done)
        elif meanwhile:
            meanwhile()
    finally:
        gc.unfreeze()


_CLAIM = 8  # bytes per claim: first file index and file count of a run (4 + 4, little-endian)
_FRAME = 8  # bytes of the length before each pickled batch of results


def _forked(paths: list[str], sizes: dict[str, int], cfg: ReadConfig, workers: int,
            meanwhile: Callable[[], None] | None = None) -> Iterator[RankSummary | RankError]:
    """Read whole files in `workers` forked children; yield results as they come back.

    Leaner than multiprocessing.Pool (three handler threads in the parent, per-task pickling,
    ~0.1 s of CPU at 256 files of ~3 ms each), and it needs no multiprocessing import: the
    children inherit the path list and claim runs of files from a pipe filled beforehand
    (a read of 4 bytes from a pipe is atomic, so each claim goes to exactly one child, and a
    child that is slowed down simply claims fewer); each child sends each run's summaries
    back, pickled, on its own pipe. A child that dies leaves its unfinished files reported
    as errors, not a hang.
    """
    import select

    n = len(paths)
    claim_r, claim_w = os.pipe()
    runs = _claims(n, workers)
    claims = b"".join(start.to_bytes(4, "little") + count.to_bytes(4, "little") for start, count in runs)
    view = memoryview(claims)
    while view:
        view = view[os.write(claim_w, view):]
    os.close(claim_w)  # drained claims then read as end-of-file
    children: dict[int, int] = {}  # result pipe (read end) -> child pid
    try:
        for _ in range(min(workers, len(runs))):
            res_r, res_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # child: never returns
                os.close(res_r)
                _child(paths, sizes, cfg, claim_r, res_w)
            os.close(res_w)
            children[res_r] = pid
        os.close(claim_r)
        claim_r = -1
        if meanwhile:
            meanwhile()
        pending = set(range(n))
        buffers = {fd: bytearray() for fd in children}
        poll = select.poll()
        for fd in children:
            poll.register(fd, select.POLLIN)
        open_fds = set(children)
        while open_fds:
            for fd, _ in poll.poll():
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    poll.unregister(fd)
                    open_fds.discard(fd)
                    continue
                buf = buffers[fd]
                buf += chunk
                while len(buf) >= _FRAME:
                    size = int.from_bytes(buf[:_FRAME], "little")
                    if len(buf) < _FRAME + size:
                        break
                    batch = pickle.loads(buf[_FRAME:_FRAME + size])
                    del buf[:_FRAME + size]
                    for i, res in batch:
                        pending.discard(i)
                        yield res
        for i in sorted(pending):
            yield RankError(paths[i], f"{paths[i]}: the reader process died before reading it")
    finally:
        if claim_r >= 0:
            os.close(claim_r)
        for fd, pid in children.items():
            os.close(fd)  # a child still writing gets EPIPE and exits
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _claims(n: int, workers: int) -> list[tuple[int, int]]:
    """(first, count) runs covering 0..n-1: up to 8 files (a few ms of work) per claim, fewer
    towards the end so the children finish together; at most 4,096 claims (32 KB), so
    they all fit in a pipe before any child reads."""
    cap = max(8, -(-n // 4096))
    out, start = [], 0
    while start < n:
        count = max(1, min(cap, (n - start) // (4 * workers)))
        out.append((start, count))
        start += count
    if len(out) > 4096:  # very many workers: equal runs instead
        size = -(-n // 4096)
        out = [(i, min(size, n - i)) for i in range(0, n, size)]
    return out


def _child(paths: list[str], sizes: dict[str, int], cfg: ReadConfig, claim_fd: int, out_fd: int) -> None:
    code = 1
    try:
        _keep_buffers_in_heap()
        n = len(paths)
        while True:
            claim = os.read(claim_fd, _CLAIM)
            if len(claim) < _CLAIM:
                break
            start, count = int.from_bytes(claim[:4], "little"), int.from_bytes(claim[4:], "little")
            batch = [(i, read_one(paths[i], cfg, sizes[paths[i]])) for i in range(start, min(n, start + count))]
            # Protocol 4: with 5, each array loads as a view on its own bytearray (~50% more memory).
            data = pickle.dumps(batch, protocol=4)
            view = memoryview(len(data).to_bytes(_FRAME, "little") + data)
            while view:
                view = view[os.write(out_fd, view):]
        code = 0
    except BaseException:  # noqa: BLE001  the parent reports the files this child did not send
        pass
    finally:
        os._exit(code)


def _init_pool_worker() -> None:
    """A pool worker ends on SIGTERM, which is how `Pool.terminate` stops it: a handler the parent
    installed (a CLI command run in-process that takes SIGTERM as Ctrl-C) is inherited by the fork
    and kept a worker blocked on the task queue alive, so the pool's exit waited for it forever."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _keep_buffers_in_heap()


def _keep_buffers_in_heap() -> None:
    """Serve file and slice buffers (~1 MB each) from the heap, reused file after file.

    glibc maps every allocation above M_MMAP_THRESHOLD (128 KB until a larger block has
    been freed) with mmap and unmaps it on free, so each slice's buffers would be faulted
    in afresh: ~0.5 s of system time per million events. Raising the threshold (and the
    trim threshold with it) keeps them in the heap. Other C libraries: nothing to do.
    """
    import ctypes  # here, not at import time: only reader processes need it (~3 ms)

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 16 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 64 << 20)
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>


def _size(path: str) -> int:
    """Decompressed size for *.gz (the gzip trailer), the file size otherwise (no open)."""
    try:
        return jsonsplit.uncompressed_size(path) if path.lower().endswith(".gz") else os.path.getsize(path)
    except OSError:
        return 0


def _rank_error(path: str, e: TraceError) -> RankError:
    """The error as one line that starts with the file (most name it as their field already)."""
    line = e.one_line()
    return RankError(path, line if line.startswith(path) else f"{path}: {line}")


def _done(res: RankSummary | RankError, path: str, cb: Callable[[str], None] | None):
    if cb:
        cb(path)
    return res


def dedupe_ranks(results: list[RankSummary | RankError]) -> tuple[list[RankSummary], list[RankError]]:
    """Split results; a second file claiming an already-seen rank is an error, not an overwrite."""
    ok: dict[int, RankSummary] = {}
    errors = [r for r in results if isinstance(r, RankError)]
    for r in sorted((r for r in results if isinstance(r, RankSummary)), key=lambda r: r.path):
        if r.rank in ok:
            errors.append(RankError(r.path, f"{r.path}: duplicate rank {r.rank} (also in {ok[r.rank].path}); skipped", r.rank))
        else:
            ok[r.rank] = r
    return [ok[k] for k in sorted(ok)], errors
