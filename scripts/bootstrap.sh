#!/usr/bin/env bash
# Create .venv and install deltamoe into it (editable). Usage: scripts/bootstrap.sh [extra,...]
#   scripts/bootstrap.sh        # runtime only
#   scripts/bootstrap.sh test   # + the parity-test oracles (transformers, fla-core; never triton)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
# System packages, installed when missing in one apt step (quick when present; needs root, as in
# CI). The Mooncake transfer engine (prefill/decode hand-off) loads libibverbs.so.1 (absent on a
# fresh Debian/Ubuntu machine), libnuma.so.1 and libcurl.so.4; Inductor's compiled decode and the
# C++ kernels (deltamoe/ops/csrc: one-row int4, fused KDA chunks) build with a C++ compiler.
missing=()
for lib in "libibverbs.so.1:libibverbs1" "libnuma.so.1:libnuma1" "libcurl.so.4:libcurl4"; do
  ldconfig -p 2>/dev/null | grep -q "${lib%%:*} " || missing+=("${lib##*:}")
done
command -v g++ >/dev/null || command -v c++ >/dev/null || missing+=(g++)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    # a fresh machine has no package lists yet: update first, then install
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  else
    echo "warning: missing ${missing[*]} (the P/D hand-off needs the libraries, compiled decode and the C++ kernels a C++ compiler): apt-get install -y ${missing[*]}" >&2
  fi
fi
python3 -m venv .venv
# torch first, pinned to the CPU build: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
if [ -n "$extras" ]; then
  .venv/bin/pip install -q -e ".[${extras}]"
else
  .venv/bin/pip install -q -e .
fi
if .venv/bin/python -c "import triton" 2>/dev/null; then
  echo "error: triton is installed in .venv; transformers would route KimiLinear to triton kernels that fail on CPU" >&2
  exit 1
fi
# Build the C++ kernels now (cached under torch's extensions folder), not in the first int4 decode
# step or the first prefill: the one-row int4 kernel (about a minute) and the fused KDA chunk kernel
# (~10 s), which every prefill, evaluation and server start would otherwise wait for once.
.venv/bin/python -c "from deltamoe.ops import int4_matvec as m, kda_fused as k
print('int4 one-row kernel:', m.status()); print('KDA chunk kernel:', k.status())"
