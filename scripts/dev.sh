#!/usr/bin/env bash
# One entry point for set-up + the two jobs: `scripts/dev.sh demo [args]` and `scripts/dev.sh test [pytest args]`.
# Finds Python 3.12, creates/reuses .venv, installs the package with the pinned CPU stack.
set -euo pipefail
cd "$(dirname "$0")/.."

find_python() {
  for c in "${PYTHON:-}" python3.12 /root/.pyenv/versions/3.12.*/bin/python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3.12; do
    [ -n "$c" ] || continue
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
      command -v "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then
    v=$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12' | tail -n1 || true)
    [ -n "$v" ] && PYENV_VERSION="$v" pyenv which python3.12 && return 0
  fi
  echo "error: Python 3.12 not found (set PYTHON=/path/to/python3.12)" >&2; return 1
}

# DEEPINFER_STACK=pinned (default): .venv with the tested pins of constraints/cpu-torch.txt.
# DEEPINFER_STACK=latest: .venv-latest with the newest releases pyproject.toml's ranges allow
# (an unpinned resolve; CI runs the suite on both).
STACK=${DEEPINFER_STACK:-pinned}
case "$STACK" in
  pinned) VENV=.venv; PINS=(-c constraints/cpu-torch.txt) ;;
  latest) VENV=.venv-latest; PINS=() ;;
  *) echo "error: DEEPINFER_STACK=$STACK: expected 'pinned' or 'latest'" >&2; exit 2 ;;
esac

ensure_venv() {  # $1: the extras to install (demo: dev; test and setup: dev,grammar)
  local extras=${1:-dev,grammar}
  local stamp=$VENV/.deepinfer-installed-${extras/,/-}
  if [ ! -x $VENV/bin/python ]; then
    "$(find_python)" -m venv $VENV
  fi
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints/cpu-torch.txt -nt "$stamp" ]; then
    $VENV/bin/python -m pip install -q --upgrade pip >/dev/null
    # [grammar] (xgrammar, structured output; the demo does not need it) is part of the test command: its tests must run,
    # never skip. xgrammar 0.2 imports torch (and transformers) at import time, and PyPI has only
    # the CUDA build of torch for Python 3.12 on Linux x86_64, so this pulls torch + its nvidia-*
    # wheels + triton: 3.07 GB of wheels, 6.6 GB installed, about 260 s per fresh venv on a 2-core
    # machine (`pip install --no-cache-dir -e ".[dev,grammar]"`; README, Install). Nothing cheaper is
    # sound: torch's CUDA libraries are DT_NEEDED by libtorch_cuda.so (without them
    # `import torch` fails), and triton is a dependency of torch itself. CI's two venvs
    # (pinned, latest) each pay it in a fresh clone; a checkout that has them reuses them (stamp).
    $VENV/bin/python -m pip install -q -e ".[$extras]" "${PINS[@]}"
    touch "$stamp"
  fi
}

cmd=${1:-}; shift || true
case "$cmd" in
  demo) ensure_venv dev; exec $VENV/bin/deepinfer-jax generate "$@" ;;
  test) ensure_venv
        $VENV/bin/python -c 'from importlib.metadata import version as v; print("stack ('"$STACK"'):", ", ".join(f"{p} {v(p)}" for p in ("jax", "jaxlib", "flax", "orbax-checkpoint", "numpy")))'
        # two pytest workers (pytest-xdist), a test file per worker: most of the suite's time is
        # single-threaded XLA compiles, so two cores run it in about half the time.
        # DEEPINFER_TEST_WORKERS=0 runs in one process
        exec env XLA_FLAGS="${XLA_FLAGS:-}" $VENV/bin/python -m pytest -q --durations=25 \
          -n "${DEEPINFER_TEST_WORKERS:-2}" --dist loadfile "$@" ;;
  setup) ensure_venv ;;
  *) echo "usage: scripts/dev.sh {demo|test|setup} [args]" >&2; exit 2 ;;
esac
