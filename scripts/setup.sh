#!/usr/bin/env bash
# Install the project and everything its tests and examples need, on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --upgrade pip -q
# A plain `torch` requirement would pull a multi-GB CUDA build: take the CPU wheel first.
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev]"
