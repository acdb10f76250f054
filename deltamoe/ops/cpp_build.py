"""Building our C++ CPU kernels (`ops/csrc/`) on first use with `torch.utils.cpp_extension`.

g++ and ninja (the `ninja` package's executable) compile a kernel once per source and flags,
cached under torch's extensions folder in a folder named by a hash of the source text, the flags and
the torch version: two checkouts (or two versions of a kernel) never rebuild each other's copy, and
an unchanged kernel is found again wherever the checkout lives.

torch guards a build with a lock *file* that stays behind when the building process is killed, and
every later load then waits on it forever. We hold an OS lock (`flock`, released by the kernel when
its holder dies) around the build; whoever holds it knows no deltamoe build is running, so a torch
lock file found then is stale and removed. The wait for another process's build is bounded. The kernels' `at::parallel_for` is a header template, so
they are built with -fopenmp: without it an extension's copy runs serially whatever torch's thread
count (the soname matches torch's bundled libgomp: one OpenMP runtime in the process).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator

import torch

VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # torch's own CPU capability names
BUILD_WAIT_SECONDS = 600.0  # another process's build of the same kernel: the int4 one takes ~1 min
TORCH_LOCK_FILE = "lock"  # torch.utils.cpp_extension's FileBaton in the build folder
BUILD_FOLDERS: dict[str, Path] = {}  # extension name -> the folder it was last built in (for `status`, tests)


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in VECTOR_CAPABILITIES


def build_directory(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> Path:
    """The folder `name` builds in: under torch's extensions root, named by what decides the binary."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for part in (source.read_bytes(), repr((cflags, ldflags)).encode(), torch.__version__.encode()):
        digest.update(part)
        digest.update(b"\0")
    # torch's own root (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/pyXY_cpu), folder "deltamoe"
    return Path(cpp_extension._get_build_directory("deltamoe", verbose=False)) / f"{name}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def exclusive_build(folder: Path, timeout_s: float = BUILD_WAIT_SECONDS) -> Iterator[None]:
    """Hold `folder`'s build lock (waiting at most `timeout_s` for another process's build), with
    any torch lock file left by a killed build removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "deltamoe.flock", "a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building in {folder} for over "
                                       f"{timeout_s:.0f} s") from None
                time.sleep(0.1)
        try:
            (folder / TORCH_LOCK_FILE).unlink(missing_ok=True)  # nobody else builds here: it is stale
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_cpp_extension(name: str, source: Path, cflags: list[str], ldflags: list[str] | None = None) -> str | None:
    """Compile and load `source` as the torch library `name`; None when it loaded, else why not."""
    try:
        import ninja  # noqa: F401  (torch's builder runs the `ninja` executable this package ships)
        from torch.utils import cpp_extension
    except ImportError as e:
        return f"cannot build: {e}"
    ninja_dir = getattr(ninja, "BIN_DIR", None)
    if ninja_dir and ninja_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja_dir + os.pathsep + os.environ.get("PATH", "")
    cflags, ldflags = [*cflags, "-fopenmp"], [*(ldflags or []), "-fopenmp"]
    try:
        folder = BUILD_FOLDERS[name] = build_directory(name, source, cflags, ldflags)
        with exclusive_build(folder):
            cpp_extension.load(name=name, sources=[str(source)], extra_cflags=cflags, extra_ldflags=ldflags,
                               build_directory=str(folder), is_python_module=False, verbose=False)
    except Exception as e:  # a missing compiler surfaces as several exception types
        return f"build failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return None


def kernel_status(kernel: str, env_switch: str, build: Callable[[], str | None], fallback: str,
                  unsupported: Callable[[], str | None] = lambda: None) -> str:
    """'on', or why `kernel` is not used here: turned off by `env_switch`="0", no AVX2, what
    `unsupported` reports, or its build (`build`: None when it loaded) failed; a failed build
    warns that `fallback` runs instead."""
    if os.environ.get(env_switch, "1") == "0":
        return f"off ({env_switch}=0)"
    if not cpu_has_avx2():
        return f"off (CPU capability {torch.backends.cpu.get_cpu_capability()}, no AVX2)"
    why = unsupported()
    if why is not None:
        return f"off ({why})"
    why = build()
    if why is not None:
        warnings.warn(f"deltamoe {kernel} {why}; {fallback} runs instead", stacklevel=3)
        return f"off ({why})"
    return "on"
