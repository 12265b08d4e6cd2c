# Sourced by scripts/setup.sh and scripts/host_check.sh: `find_uv TOOLS_DIR` prints the path
# of a uv to use (one on PATH, else the one in the tools venv TOOLS_DIR, made there with pip
# the first time), or nothing when uv cannot be had (the caller falls back to pip).
find_uv() {
    local tools=$1
    if ! command -v uv >/dev/null && [ ! -x "$tools/bin/uv" ]; then
        { python3 -m venv "$tools" && "$tools/bin/python" -m pip install -q uv; } >/dev/null 2>&1 || true
    fi
    command -v uv || { [ -x "$tools/bin/uv" ] && echo "$tools/bin/uv"; } || true
}
