#!/usr/bin/env bash
# CI step: dead code in asyncrl/. vulture (the dev extra's pinned version) over asyncrl/ and tools/vulture_allow.py
# (the names that look unused but are not, each with its reason); exits non-zero on any finding (vulture: 3).
# Confidence 60: vulture's lowest level, the one that reports unused functions, methods, classes, properties and
# attributes (they are all 60%: a name read only through getattr or by a library cannot be ruled out). At 80 and
# up vulture reports only unused imports, locals and unreachable code, which ruff (F401, F841) mostly catches.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m vulture asyncrl tools/vulture_allow.py --min-confidence 60
echo "check_dead_code: no unused names in asyncrl/ (vulture, confidence 60)"
