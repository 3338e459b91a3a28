#!/usr/bin/env bash
# Run megatron-ext's Megatron-touching tests against another megatron-core release, in its own
# virtual environment (.venv-mcore-<version>), beside the one the README's setup made.
#
# Usage:  scripts/test_megatron_core_release.sh 0.19.2 [extra pytest args...]
#
# What runs: tests/megatron (seam parity, compressed training, resume, driver, data),
# tests/megatron_lm (skipped without MEGATRON_LM_DIR), and the unit tests that import
# megatron-core (flag clashes, CPU execution). The pure-torch tests (tests/distributed, the
# other unit tests) do not depend on the megatron-core release and run once, in the main suite.
#
# megatron-core 0.17+ declares Python >= 3.12. On Python 3.11 its cp311 wheel is installed
# with --ignore-requires-python (megatron-ext tests it there); on 3.12 nothing special is
# needed. triton is not installed: on CPU megatron-ext registers stand-ins for the two
# megatron-core modules that import it only to define GPU kernels.
#
# Environment: PYTHON (python3), TORCH_SPEC (torch==2.13.0: the local CPU wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: $0 MEGATRON_CORE_VERSION [pytest args...]}
shift
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
venv=".venv-mcore-${version}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
pip install -q "$torch_spec"
pip install -q --no-deps --ignore-requires-python "megatron-core==${version}"
pip install -q numpy packaging
pip install -q --no-deps -e .
# megatron-ext's own dependencies and the test extra, without letting pip touch megatron-core.
pip install -q sentencepiece datasets pyyaml psutil pytest tensorboard matplotlib
installed=$(python -c "from megatron_ext.megatron.version import mcore_version; print(mcore_version())")
echo "megatron-ext tests against megatron-core ${installed} (Python $(python -c 'import sys; print(sys.version.split()[0])'))"
python -m pytest -q -p no:cacheprovider tests/megatron tests/megatron_lm \
    tests/unit/test_flags.py tests/unit/test_cpu_execution.py tests/unit/test_mcore_releases.py "$@"
