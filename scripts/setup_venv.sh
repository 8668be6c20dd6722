#!/usr/bin/env bash
# `make setup`: the checkout's venv, built once and rebuilt when what it was built from changes
# (the interpreter PYTHON names, the torch choice) or brought up to date when pyproject.toml does.
# Without a GPU and without a choice, the CPU-only torch is taken from PyTorch's index when that
# index answers; a machine that cannot reach it (a mirror-only CI) gets PyPI's wheel, and is told.
set -euo pipefail
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH=${TORCH:?TORCH names the torch and torchvision pins}
CPU=${CPU:-}
TORCH_INDEX=${TORCH_INDEX:-}
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
DRY_RUN=${SETUP_DRY_RUN:-}  # say the plan, build nothing (tests/test_setup.py)
STAMP=$VENV/.mmkv-setup

say() { echo "make setup: $*"; }

version=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3]) if sys.version_info >= (3, 11) else sys.exit(1)' 2>/dev/null) || {
  say "mmkv needs Python 3.11 or newer; '$PYTHON' is not (PYTHON=python3.13 picks another)"
  exit 2
}

# What was asked for, not what a probe found: a flaky network never rebuilds a venv.
if [ -n "$TORCH_INDEX" ]; then request="index $TORCH_INDEX"
elif [ "$CPU" = 0 ]; then request="pypi"
elif [ -n "$CPU" ]; then request="cpu"
else request="auto"; fi
wanted="python $version; torch $TORCH from $request"
project=$(sha256sum pyproject.toml | cut -c1-16)

if [ -f "$STAMP" ]; then
  built=$(sed -n 1p "$STAMP")
  built_project=$(sed -n 2p "$STAMP")
elif [ -x "$VENV/bin/python" ]; then  # a venv from before the stamp: keep its own choice
  built="python $("$VENV/bin/python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])'); torch $TORCH from $request"
  built_project=""
else
  built=""
  built_project=""
fi

if [ -n "$built" ] && [ "$built" = "$wanted" ] && [ "$built_project" = "$project" ] && [ -x "$VENV/bin/mmkv" ]; then
  say "$VENV is up to date ($wanted)"
  exit 0
fi

clear=""
if [ -n "$built" ] && [ "$built" != "$wanted" ]; then
  say "rebuilding $VENV: it was built with $built; now $wanted"
  clear="--clear"
fi

index="$TORCH_INDEX"
case "$request" in
  cpu) index=$CPU_INDEX ;;
  auto)
    if command -v nvidia-smi > /dev/null; then
      say "an NVIDIA GPU is here: PyPI's torch (a CUDA build, about 6.6 GB)"
    elif "$PYTHON" -c "import urllib.request as u; u.urlopen('$CPU_INDEX/torch/', timeout=5)" 2> /dev/null; then
      say "no NVIDIA GPU here: the CPU-only torch (about 200 MB) from $CPU_INDEX (CPU=0 takes PyPI's CUDA build)"
      index=$CPU_INDEX
    else
      say "no NVIDIA GPU here, but $CPU_INDEX cannot be reached: PyPI's torch (a CUDA build, about 6.6 GB);"
      say "  TORCH_INDEX=URL names a mirror of CPU wheels"
    fi ;;
esac

if [ -n "$DRY_RUN" ]; then say "would install torch from ${index:-PyPI}"; exit 0; fi
[ -z "$clear" ] && [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv $clear "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q ${index:+--index-url "$index"} $TORCH
# compat: a path entry rather than an import hook, so type checkers (mypy, pyright) see mmkv;
# setuptools' notice that the mode is transitional is kept out of sight unless the install fails.
# A setuptools without the mode gets the plain editable install, and a word.
log=$(mktemp)
extras='.[test,serve,ray,s3,eval]'
if ! "$VENV/bin/pip" install -q --config-settings editable_mode=compat -e "$extras" > "$log" 2>&1; then
  say "setuptools refused its compat editable mode: a plain one (type checkers may not see mmkv)"
  "$VENV/bin/pip" install -q -e "$extras" > "$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
fi
rm -f "$log"
printf '%s\n%s\n' "$wanted" "$project" > "$STAMP"
say "mmkv is installed in $VENV: 'source $VENV/bin/activate' puts mmkv on your PATH (or call $VENV/bin/mmkv)"
