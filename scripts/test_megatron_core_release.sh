#!/usr/bin/env bash
# Run megatron-ext's Megatron-touching tests against another megatron-core release, in its own
# virtual environment (.venv-mcore-<version>), beside the one the README's setup made.
#
# Usage:  scripts/test_megatron_core_release.sh 0.19.2 [extra pytest args...]
#
# What runs: tests/megatron (seam parity, compressed training, resume, driver, data),
# tests/megatron_lm (Megatron-LM's pretrain_gpt.py: against MEGATRON_LM_DIR, or the tag of
# this megatron-core extracted from MEGATRON_LM_ARCHIVES, as CI does: tests/conftest.py;
# skipped without either), and the unit tests that import megatron-core (flag clashes, CPU
# execution). The pure-torch tests (tests/distributed, the other unit tests) do not depend on
# the megatron-core release and run once, in the main suite; so do the tests marked
# release_independent (pytest.ini: refusals decided by megatron-ext's own checks) and the ones
# marked release_covered (megatron-ext's own logic through a seam that other tests exercise on
# this release too). Budget:
# the README's test command (this script its second half) stays under 45 minutes on 2 cores.
#
# megatron-core 0.17+ declares Python >= 3.12. On Python 3.11 its cp311 wheel is installed
# with --ignore-requires-python (megatron-ext tests it there); on 3.12 nothing special is
# needed. triton is not installed: on CPU megatron-ext registers stand-ins for the two
# megatron-core modules that import it only to define GPU kernels.
#
# Environment: PYTHON (python3), TORCH_SPEC (torch==2.13.0: the local CPU wheel), PYTEST_WORKERS
# (2: pytest-xdist workers, each test file on one; 0: no workers), DRY_RUN (1: print the
# commands instead of running them).
set -euo pipefail
# bash >= 4.4 ('set -u' with empty arrays); RHEL/CentOS 7 ships 4.2.
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 404)); then
    echo "$0: needs bash >= 4.4, this is bash $BASH_VERSION; run it with a newer bash" \
        "(e.g. 'module load bash', then: bash $0)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
version=${1:?usage: $0 MEGATRON_CORE_VERSION [pytest args...]}
shift
python=${PYTHON:-python3}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
venv=".venv-mcore-${version}"
# DRY_RUN and run_cmd (run a command, or print it with DRY_RUN=1).
# shellcheck source=scripts/reproduce/common.sh
. scripts/reproduce/common.sh
if [ ! -x "$venv/bin/python" ]; then
    run_cmd "$python" -m venv "$venv"
fi
if [[ "$DRY_RUN" == 1 ]]; then
    echo ". $venv/bin/activate"
else
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
fi
run_cmd pip install -q "$torch_spec"
run_cmd pip install -q --no-deps --ignore-requires-python "megatron-core==${version}"
run_cmd pip install -q numpy packaging
run_cmd pip install -q --no-deps -e .
# megatron-ext's own dependencies and the test extra (Megatron-LM's imports included), without
# letting pip touch megatron-core.
run_cmd pip install -q einops sentencepiece datasets pyyaml psutil pytest pytest-xdist \
    tensorboard matplotlib six regex pydantic pybind11
# torchft (the test extra's pin) for pretrain_gpt.py's sites in separate jobs; its other
# dependencies are not torch.
run_cmd pip install -q --no-deps torchft==0.2.0
run_cmd pip install -q opentelemetry-api opentelemetry-exporter-otlp-proto-http opentelemetry-sdk
if [[ "$DRY_RUN" != 1 ]]; then
    installed=$(python -c "from megatron_ext.megatron.version import mcore_version; print(mcore_version())")
    echo "megatron-ext tests against megatron-core ${installed} (Python $(python -c 'import sys; print(sys.version.split()[0])'))"
fi
workers=${PYTEST_WORKERS:-2}
run_cmd python -m pytest -q -p no:cacheprovider -n "$workers" --dist loadfile \
    -m "not release_independent and not release_covered" tests/megatron \
    tests/megatron_lm tests/unit/test_flags.py tests/unit/test_cpu_execution.py \
    tests/unit/test_mcore_releases.py "$@"
