#!/usr/bin/env bash
# Download, into .whl/, the wheels that a GPU machine without internet access needs on top of its own
# torch, transformers, peft, matplotlib, requests, pyyaml, psutil, tqdm, click, attrs, pygments,
# python-dateutil and packaging: papermill and the Jupyter kernel stack (the lessons' runner),
# ipyparallel with cloudpickle (fsdplab.Cluster) and pytest (tests/gpu, run by scripts/gpu_run.py).
# Targets CPython on x86-64 Linux, for the GPU machine's Python (compiled wheels such as pyzmq, tornado,
# rpds-py and debugpy import only on the version they were built for). No torch here.
#
#   bash scripts/fetch_gpu_wheels.sh [--dry-run] [PYTHON_VERSION]
#   PYTHON_VERSION: the GPU machine's `python3 -c 'import sys; print(*sys.version_info[:2], sep=".")'`, e.g. 3.10;
#   default: the version of $PYTHON (else python3) here. --dry-run prints the pip command and fetches nothing.
#
# On the GPU machine (copy .whl/ along, it is git-ignored through .git/info/exclude):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
PY="${PYTHON:-python3}"
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
TARGET="${1:-$("$PY" -c 'import sys; print(*sys.version_info[:2], sep=".")')}"
if ! [[ "$TARGET" =~ ^3\.[0-9]+$ ]]; then
  echo "PYTHON_VERSION must look like 3.11 (the GPU machine's major.minor), not '$TARGET'" >&2
  exit 2
fi

# One version of each (two versions of a name stop the whole install there). Pure-python wheels
# resolve to the "any" platform; the rest are manylinux builds for CPython $TARGET.
PACKAGES=(
  # notebook execution
  papermill==2.7.0 entrypoints==0.4.2 tenacity==9.2.1 nbclient==0.11.0 nbformat==5.11.1
  fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==0.30.0
  # the kernel and its client
  jupyter_client==8.10.0 jupyter_core==5.9.1 platformdirs==4.14.8 traitlets==5.15.0 pyzmq==27.3.0
  tornado==6.6.1 ipykernel==7.4.0 comm==0.2.3 debugpy==1.8.22 matplotlib-inline==0.2.2
  nest-asyncio2==1.7.4
  # IPython (8.x: no extra lexer package) and what it imports
  ipython==8.37.0 decorator==5.2.1 jedi==0.20.0 parso==0.8.7 prompt_toolkit==3.0.52 wcwidth==0.7.0
  pexpect==4.9.0 ptyprocess==0.7.0 stack_data==0.6.3 asttokens==3.0.1 executing==2.2.1 pure_eval==0.2.3
  # ranks and dashboards
  ipyparallel==9.2.0 cloudpickle==3.1.3 ipywidgets==8.1.9 widgetsnbextension==4.0.16 jupyterlab_widgets==3.0.17
  # the GPU checks are pytest tests
  pytest==9.0.3 iniconfig==2.3.0 pluggy==1.6.0
)

PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_12_x86_64 manylinux2010_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
DOWNLOAD=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" --implementation cp
          "${PLATFORMS[@]}" -d .whl "${PACKAGES[@]}")
if [ "$DRY_RUN" = 1 ]; then
  echo "${DOWNLOAD[*]}"
  exit 0
fi
mkdir -p .whl
grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -f .whl/*.whl
"${DOWNLOAD[@]}"

count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "expected ${#PACKAGES[@]} wheels in .whl/, found $count" >&2
  exit 1
fi
echo "$count wheels for CPython $TARGET, $(du -sh .whl | cut -f1) in .whl/"
