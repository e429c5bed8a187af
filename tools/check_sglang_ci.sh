#!/usr/bin/env bash
# CI step: tools/check_sglang.py and tests/unit/test_check_sglang.py against SGLang's own code, in a virtual environment
# of their own: sglang==$SGLANG_VERSION installed WITHOUT its dependencies (GPU wheels) plus the light packages that
# importing its parser and request classes needs (tools/sglang_check_requirements.txt: the CPU torch pinned, so nothing
# pulls a CUDA one). Prints "check_sglang: N checks, M mismatches"; exits non-zero on a mismatch or a failed test.
# The environment: $SGLANG_CHECK_VENV (default .venv-sglang-check, gitignored), made anew when missing or when the
# requirements or the version changed (in CI's fresh clone: always). It sees the system's packages (CI installed torch==2.13.0
# and asyncrl's dependencies there just before): what is pinned otherwise is installed in it, and nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23  # the release tools/check_sglang.py reads; pyproject's sglang extra is bounded to 0.5.x
venv=${SGLANG_CHECK_VENV:-.venv-sglang-check}
req=tools/sglang_check_requirements.txt
stamp=$(cat "$req" <(echo "sglang==$SGLANG_VERSION") | sha256sum | cut -d' ' -f1)
t0=$SECONDS
if [[ ! -f $venv/.stamp || $(cat "$venv/.stamp") != "$stamp" ]]; then
  echo "+ making $venv: sglang==$SGLANG_VERSION without its dependencies, then $req"
  rm -rf "$venv"
  python -m venv --system-site-packages "$venv"
  pip_install() {  # quiet; the resolver's notes on requirements left unmet on purpose (sglang's GPU wheels) or by
    # the system's own packages are not shown
    "$venv/bin/pip" install -q --no-compile "$@" 2>&1 |
      { grep -v -E "^\S+ \S+ requires |dependency resolver does not|^WARNING: Location" || true; }
  }
  pip_install --no-deps "sglang==$SGLANG_VERSION"
  pip_install -r "$req"
  "$venv/bin/python" -c "import torch, sys; v = torch.__version__; sys.exit(v.split('+')[0] != '2.13.0' and f'torch {v} in $venv')"
  echo "$stamp" >"$venv/.stamp"
  echo "check_sglang: environment made in $((SECONDS - t0)) s"
fi
export PYTHONPATH=.:tools/sglang_check_stubs
echo "+ $venv/bin/python tools/check_sglang.py"
"$venv/bin/python" -W ignore tools/check_sglang.py
echo "+ $venv/bin/python -m pytest -q tests/unit/test_check_sglang.py"
"$venv/bin/python" -m pytest -q tests/unit/test_check_sglang.py
echo "check_sglang: step took $((SECONDS - t0)) s"
