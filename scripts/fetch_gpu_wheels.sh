#!/usr/bin/env bash
# Downloads into .whl/ the wheels a GPU machine without internet needs for scripts/gpu_check.sh:
# the packages asyncgrpo needs that a machine with torch, transformers and accelerate
# lacks (trl, peft, datasets, watchdog, and what they need beyond those), plus pytest.
#
#   bash scripts/fetch_gpu_wheels.sh            # run where pip reaches an index; then copy
#                                               # the repository (with .whl/) to the GPU machine
#
# GPU_WHEELS_SKIP="pyarrow pandas ..." leaves out packages the GPU machine already has (a smaller
# .whl/); GPU_WHEELS_EXTRA="bitsandbytes==0.50.2 ..." adds more (bitsandbytes for the QLoRA test,
# transformers==5.24.0 to run the version .venv has rather than the machine's).
#
# Wheels only (--only-binary), for CPython 3.12 on manylinux x86_64 (override with
# GPU_PYTHON_VERSION=3.11 etc.), no dependency resolution (--no-deps): the list below is
# the whole set. Versions are the ones scripts/bootstrap.sh installed into .venv when this
# list was made (`.venv/bin/pip list`); change them together with pyproject.toml.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$REPO_ROOT/.whl"
PY_VERSION="${GPU_PYTHON_VERSION:-3.12}"
PIP=(python3 -m pip)
[ -x "$REPO_ROOT/.venv/bin/python" ] && PIP=("$REPO_ROOT/.venv/bin/python" -m pip)

PACKAGES=(
    trl==1.16.0
    peft==0.21.2
    datasets==5.2.0
    watchdog==7.1.0
    # datasets' dependencies that torch/transformers/accelerate do not bring
    pyarrow==26.0.1
    pandas==3.1.1
    python-dateutil==4.0.0
    tzdata==2026.6
    dill==0.4.1
    multiprocess==0.70.19
    xxhash==4.1.0
    # the test runner (often missing from inference images)
    pytest==9.2.0
    pluggy==1.7.0
    iniconfig==2.3.1
)

# shellcheck disable=SC2206  # word splitting wanted: a list of specs
PACKAGES+=(${GPU_WHEELS_EXTRA:-})
for skip in ${GPU_WHEELS_SKIP:-}; do
    for i in "${!PACKAGES[@]}"; do
        [ "${PACKAGES[$i]%%==*}" = "$skip" ] && unset 'PACKAGES[i]'
    done
done
PACKAGES=("${PACKAGES[@]}")

mkdir -p "$DEST"
echo "[fetch_gpu_wheels] ${#PACKAGES[@]} packages for CPython $PY_VERSION manylinux x86_64 into $DEST"
for spec in "${PACKAGES[@]}"; do
    # (minus pip's warnings about index folders a machine's pip.conf names but lacks)
    "${PIP[@]}" download --quiet --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 \
        -d "$DEST" "$spec" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[fetch_gpu_wheels] error: could not download $spec" >&2; exit 1; }
done
echo "[fetch_gpu_wheels] done: $(ls "$DEST"/*.whl | wc -l) wheels, $(du -sh "$DEST" | cut -f1) in $DEST"
echo "[fetch_gpu_wheels] next, on the GPU machine: bash scripts/gpu_check.sh"
