"""Every ```python and ```bash example in docs/*.md runs, so the docs cannot drift from the code.

The convention, for whoever writes a page:
- A page's ```python and ```bash blocks run in document order in one fresh temp folder (the
  working directory). Python blocks share one namespace, like cells of a notebook; each bash
  block runs with `bash -e`, with `deltamoe` and `python` taken from this virtualenv.
- ```console blocks are transcripts: each `$ ` line (with its `\` continuation lines) runs in
  the repository root (so repository paths work; transcripts only read), any exit code is fine, and every number shown in the transcript must appear in what the commands
  print, so the figures quoted in the docs cannot go stale. Other fences (```toml, ```text,
  plain ```) are not run.
- `<!-- doc-test: skip REASON -->` on the line before a fence: not run. Only for what cannot run
  in CI (torchrun jobs, a live server, minutes of benchmarking); keep these rare and say why.
- `<!-- doc-test: file NAME -->` on the line before a fence: the block is written to NAME in the
  temp folder before the page runs (a run file, a small corpus), and not run.
- Scale-down, applied to every block before it runs: `--steps N` / `steps = N` with N > 10
  become 1, and `/tmp/` becomes the temp folder. Nothing else is rewritten.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = sorted(p.stem for p in DOCS.glob("*.md"))  # every page, including ones added later
FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*doc-test:\s*(skip|file)\s+(.*?)\s*-->\s*$")
RUN_KINDS = {"python", "bash", "console"}
NUMBER = re.compile(r"\d[\d,.]*\d|\d")
PAGE_TIMEOUT_S = 600  # generous: a shared, loaded machine runs the training page ~10x slower than a quiet one


@dataclass
class Block:
    kind: str  # python | bash | file
    code: str
    line: int  # 1-based line of the opening fence
    arg: str = ""  # file name, or skip reason


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        lang, code = m.group(1), m.group(2)
        previous = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(previous)
        if marker and marker.group(1) == "skip":
            found.append(Block("skip", code, line, marker.group(2)))
        elif marker:
            found.append(Block("file", code, line, marker.group(2)))
        elif lang in RUN_KINDS:
            found.append(Block(lang, code, line))
    return found


def console_commands(code: str) -> tuple[str, list[str]]:
    """A transcript's commands (as one bash script) and the numbers its output lines show."""
    commands, numbers, continued = [], [], False
    for line in code.splitlines():
        if line.startswith("$ ") or continued:
            commands.append(line[2:] if line.startswith("$ ") else line)
            continued = line.endswith("\\")
        else:
            numbers += NUMBER.findall(line)
    return "\n".join(commands), numbers


def scale_down(code: str, tmp: Path) -> str:
    small = lambda m: m.group(1) + ("1" if int(m.group(2)) > 10 else m.group(2))  # noqa: E731
    code = re.sub(r"(--steps[ =])(\d+)", small, code)
    code = re.sub(r"(^\s*steps\s*=\s*)(\d+)", small, code, flags=re.M)
    return code.replace("/tmp/", f"{tmp}/")


# The page runner: one process per page, blocks in order, python blocks in one namespace.
RUNNER = r'''
import json, re, subprocess, sys, traceback
NUMBER = re.compile(NUMBER_PATTERN)
REPO_ROOT = REPO_PATH
steps = json.load(open(sys.argv[1]))
namespace = {"__name__": "__main__"}
for step in steps:
    where = f"{step['page']}:{step['line']} ({step['kind']} block)"
    print(f"=== {where}", flush=True)
    if step["kind"] == "console":
        out = subprocess.run(["bash", "-c", step["code"]], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                             cwd=REPO_ROOT)
        shown = set(NUMBER.findall(out.stdout + out.stderr))
        missing = [n for n in step["numbers"] if n not in shown]
        if missing:
            print(out.stdout + out.stderr)
            print(f"DOC-TEST FAILED {where}: the transcript shows {missing}, the commands print otherwise", flush=True)
            sys.exit(1)
    elif step["kind"] == "bash":
        rc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", step["code"]], stdin=subprocess.DEVNULL).returncode
        if rc:
            print(f"DOC-TEST FAILED {where}: exit code {rc}", flush=True)
            sys.exit(1)
    else:
        try:
            exec(compile(step["code"], where, "exec"), namespace)
        except BaseException:
            traceback.print_exc(file=sys.stdout)
            print(f"DOC-TEST FAILED {where}", flush=True)
            sys.exit(1)
'''.replace("NUMBER_PATTERN", repr(NUMBER.pattern)).replace("REPO_PATH", repr(str(REPO)))


def test_the_subsystem_pages_exist():
    assert {"model", "serving", "training", "planner", "traces", "parallel"} <= set(PAGES)


def test_skips_are_rare_and_explained():
    skipped = [(p, b) for p in PAGES for b in blocks(DOCS / f"{p}.md") if b.kind == "skip"]
    run = [b for p in PAGES for b in blocks(DOCS / f"{p}.md") if b.kind in RUN_KINDS]
    assert all(len(b.arg) > 10 for _, b in skipped), "say why a block is skipped"
    assert len(skipped) <= len(run) // 2, skipped


@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page: str, tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    steps = []
    for b in blocks(DOCS / f"{page}.md"):
        if b.kind == "file":
            (work / b.arg).parent.mkdir(parents=True, exist_ok=True)
            (work / b.arg).write_text(scale_down(b.code, work))
        elif b.kind == "console":
            code, numbers = console_commands(scale_down(b.code, work))
            steps.append({"page": f"docs/{page}.md", "line": b.line, "kind": b.kind, "code": code, "numbers": numbers})
        elif b.kind in RUN_KINDS:
            steps.append({"page": f"docs/{page}.md", "line": b.line, "kind": b.kind, "code": scale_down(b.code, work)})
    if not steps:
        pytest.skip(f"docs/{page}.md has no runnable blocks")
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    (tmp_path / "runner.py").write_text(RUNNER)
    venv_bin = Path(sys.executable).parent
    # One torch thread per process: the examples are tiny, and on a shared two-core machine two spinning
    # OpenMP threads per process make them many times slower.
    env = {**os.environ, "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
           "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "steps.json")], cwd=work,
                         env=env, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    assert out.returncode == 0, (out.stdout[-6000:] + "\n--- stderr ---\n" + out.stderr[-4000:])


def test_markers_transcripts_and_scale_down(tmp_path: Path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n```python\nx = 1\n```\n\n<!-- doc-test: skip a live server for ever -->\n```bash\nserve\n```\n"
                    "\n<!-- doc-test: file run.toml -->\n```toml\nsteps = 300\n```\n\n```toml\nnot run\n```\n\n"
                    "```console\n$ deltamoe plan \\\n    --nodes 4\nchose 165.5 tok/s on 32 chips\n```\n")
    found = blocks(page)
    assert [(b.kind, b.line, b.arg) for b in found] == [
        ("python", 3, ""), ("skip", 8, "a live server for ever"), ("file", 13, "run.toml"), ("console", 21, "")]
    assert console_commands(found[3].code) == ("deltamoe plan \\\n    --nodes 4", ["165.5", "32"])
    assert scale_down("deltamoe train --steps 300 --eval-every 25 --out /tmp/x\nsteps = 200\n", tmp_path) == (
        f"deltamoe train --steps 1 --eval-every 25 --out {tmp_path}/x\nsteps = 1\n")
    assert scale_down("--steps 3 --profile-steps 2:3", tmp_path) == "--steps 3 --profile-steps 2:3"
