"""Building our C++ CPU kernels (`ops/csrc/`) on first use with `torch.utils.cpp_extension`.

g++ and ninja (the `ninja` package's executable) compile a kernel once per source and flags,
cached under torch's extensions folder. The kernels' `at::parallel_for` is a header template, so
they are built with -fopenmp: without it an extension's copy runs serially whatever torch's thread
count (the soname matches torch's bundled libgomp: one OpenMP runtime in the process).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Callable

import torch

VECTOR_CAPABILITIES = ("AVX2", "AVX512")  # torch's own CPU capability names


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in VECTOR_CAPABILITIES


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
    try:
        cpp_extension.load(name=name, sources=[str(source)], extra_cflags=[*cflags, "-fopenmp"],
                           extra_ldflags=[*(ldflags or []), "-fopenmp"], is_python_module=False, verbose=False)
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
