"""Building the C++ kernels (`ops.cpp_build`): a build killed half-way (its torch lock file left
behind) no longer makes every later load wait forever, another process's build is waited for only
so long, and the build folder is named by what decides the binary, not by the checkout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import textwrap
from pathlib import Path

import pytest

from deltamoe.ops import kda_fused
from deltamoe.ops.cpp_build import BUILD_FOLDERS, TORCH_LOCK_FILE, build_directory, cpu_has_avx2, exclusive_build

REPO = Path(__file__).resolve().parents[2]


def test_a_build_lock_held_elsewhere_is_waited_for_only_so_long(tmp_path):
    with exclusive_build(tmp_path):
        with pytest.raises(TimeoutError, match="building in .* for over"):
            with exclusive_build(tmp_path, timeout_s=0.3):
                pass
    with exclusive_build(tmp_path, timeout_s=0.3):  # released: taken at once
        pass


def test_a_killed_builder_leaves_no_lock_that_blocks_the_next(tmp_path):
    """A process killed mid-build holds the OS lock only while alive; its torch lock file is removed
    by the next builder (torch's own FileBaton would wait on it forever)."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from deltamoe.ops.cpp_build import exclusive_build
        with exclusive_build(Path({str(tmp_path)!r})):
            (Path({str(tmp_path)!r}) / {TORCH_LOCK_FILE!r}).touch()  # torch's baton, as a build takes it
            print("building", flush=True)
            time.sleep(600)
        """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "building"
        with pytest.raises(TimeoutError):
            with exclusive_build(tmp_path, timeout_s=0.3):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert (tmp_path / TORCH_LOCK_FILE).exists()
        with exclusive_build(tmp_path, timeout_s=5):
            assert not (tmp_path / TORCH_LOCK_FILE).exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_the_build_folder_follows_the_source_text_and_flags_not_the_path(tmp_path):
    one, other = tmp_path / "a" / "k.cpp", tmp_path / "b" / "k.cpp"
    for path in (one, other):
        path.parent.mkdir()
        path.write_text("int f() { return 1; }\n")
    assert build_directory("k", one, ["-O3"], []) == build_directory("k", other, ["-O3"], [])
    assert build_directory("k", one, ["-O3"], []) != build_directory("k", one, ["-O2"], [])
    other.write_text("int f() { return 2; }\n")
    assert build_directory("k", one, ["-O3"], []) != build_directory("k", other, ["-O3"], [])
    assert build_directory("k", one, [], []).parent.name == "deltamoe"


@pytest.mark.skipif(not cpu_has_avx2(), reason="the kernel is built for AVX2 / AVX-512 CPUs")
def test_a_stale_torch_lock_in_the_kernels_folder_does_not_hang_its_load():
    """The real KDA kernel (built at setup) loads in a fresh process with a stale lock file in its
    folder, which was a hang in FileBaton.wait before."""
    assert kda_fused._build() is None
    folder = BUILD_FOLDERS["deltamoe_kda_chunk"]
    stale = folder / TORCH_LOCK_FILE
    stale.touch()
    os.utime(stale, (time.time() - 3600, time.time() - 3600))  # an hour old: told apart from a live one
    probe = subprocess.run([sys.executable, "-c", "from deltamoe.ops import kda_fused; print(kda_fused.status())"],
                           cwd=REPO, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "DELTAMOE_KDA_KERNEL": "1"})
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "on"
    # The stale lock is gone. Another process loading the kernel meanwhile (an xdist worker, a second
    # checkout: the build folder is shared by content) holds a fresh one for the moment of its load.
    try:
        assert stale.stat().st_mtime > time.time() - 600
    except FileNotFoundError:
        pass

