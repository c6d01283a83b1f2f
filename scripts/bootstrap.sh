#!/usr/bin/env bash
# Creates (once) the project's virtual environment and installs asyncgrpo into it.
# Sourced by scripts/test.sh and launch.sh; afterwards $VENV_PY is the interpreter.
# Returns non-zero on failure and leaves the caller's shell options alone.
#
# torch is installed first and pinned (torch==2.13.0, or $ASYNCGRPO_TORCH_SPEC, e.g. a
# +cpu build from a CPU index), so that installing asyncgrpo finds it satisfied; installed
# later without a pin, pip would fetch the newest release with several GB of CUDA packages.
_bootstrap() {
    local repo_root venv torch_spec stamp want
    repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="${ASYNCGRPO_VENV:-$repo_root/.venv}"
    torch_spec="${ASYNCGRPO_TORCH_SPEC:-torch==2.13.0}"
    VENV_PY="$venv/bin/python"
    stamp="$venv/.asyncgrpo-installed"
    want="$(sha256sum < "$repo_root/pyproject.toml" | cut -c1-16) $torch_spec"

    if [ ! -x "$VENV_PY" ]; then
        echo "[bootstrap] creating virtual environment $venv" >&2
        python3 -m venv "$venv" || return 1
    fi
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        echo "[bootstrap] installing $torch_spec and asyncgrpo[dev] into $venv (first run takes a minute or two)" >&2
        # (setuptools' build of an editable install warns, in ten lines, of folders named as the package: ours is it)
        _pip_install --upgrade pip && _pip_install "$torch_spec" \
            && PYTHONWARNINGS="ignore:Editable installation" _pip_install -e "$repo_root[dev]" || return 1
        # The environment's flags, recorded once (asyncgrpo/flag_check.py): from the first launch on, a flag that is
        # not one is refused before the heavy imports.
        PYTHONPATH="$repo_root" "$VENV_PY" -c 'from asyncgrpo.config_parser import parse_config; parse_config([])' \
            > /dev/null 2>&1 || true
        echo "$want" > "$stamp"
    fi
    export VENV_PY
}
_pip_install() {  # pip, minus the warnings about index folders this machine's pip.conf names but lacks
    "$VENV_PY" -m pip install --quiet "$@" 2>&1 | { grep -v "is neither a file nor a directory" || true; } >&2
    return "${PIPESTATUS[0]}"
}
_bootstrap
