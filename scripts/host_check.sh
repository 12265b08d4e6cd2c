#!/usr/bin/env bash
# A notebook host's pinned environment (.ci/host-HOST.txt: Kaggle's, Colab's image): a fresh
# venv with those packages installed first, then `pip install` of this package the way a user
# runs it there (no constraints): no pinned package may change version. Then a 2-rank cell
# in a real kernel of that venv (scripts/host_cell.py).
#
#   scripts/host_check.sh kaggle      # or colab; HOST_VENV=... keeps the venv elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
host=${1:?usage: scripts/host_check.sh HOST   (HOST: $(ls .ci/host-*.txt | sed 's/.*host-//; s/\.txt$//' | tr '\n' ' '))}
pins=".ci/host-$host.txt"
[ -f "$pins" ] || { echo "host_check: no $pins" >&2; exit 2; }
want=$(sed -n 's/.*(python: \([0-9]*\.[0-9]*\).*/\1/p' "$pins" | head -1)

find_python() {
    # pyenv's shims run only the global version: take the interpreter itself, and check it runs.
    local candidate
    for candidate in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python 2>/dev/null | sort -V -r) \
                     "$(command -v "python$1" 2>/dev/null)"; do
        if [ -n "$candidate" ] && "$candidate" -c "import sys; assert sys.version_info[:2] == tuple(map(int, '$1'.split('.')))" 2>/dev/null; then
            echo "$candidate"
            return 0
        fi
    done
    echo "host_check: no Python $1 on this machine" >&2
    return 1
}
python=${PYTHON:-$(find_python "$want")}
venv=${HOST_VENV:-.venv-host-$host}
rm -rf "$venv"
start=$SECONDS
"$python" -m venv "$venv"
py="$PWD/$venv/bin/python"
pip() {   # the venv's pip, without the notes of a machine's local index that lacks a package
    "$py" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

# 1. The host's packages, as its image has them: with uv, as Kaggle builds its image (and
#    uv's cache makes a second run take seconds, not minutes of unpacking CUDA wheels), else
#    pip. PIP_CONSTRAINT replaces a constraint of pip's own configuration (a machine's
#    torch cap) with the pins themselves; uv reads no pip configuration.
. scripts/find_uv.sh
uv=$(find_uv "${HOST_TOOLS:-.venv-tools}")   # the tools venv is shared with scripts/setup.sh (uv and its cache)
[ -n "$uv" ] || echo "host_check: no uv (pip installs the host's packages: slower)"
if [ -n "$uv" ]; then
    "$uv" pip install -q --python "$py" -r "$pins"
else
    PIP_CONSTRAINT="$PWD/$pins" pip install -q -r "$pins"
fi
pip freeze --all > "$venv/before.txt"
echo "host_check: $host's packages installed ($("$py" -V), ${uv:+uv, }$(sed -n 's/^torch==//p' "$pins")) in $((SECONDS - start)) s"
step=$SECONDS

# 2. This package, non-editable, with nothing holding pip back (an empty constraint file
#    replaces the machine's): what `pip install accel_magics` does in that image.
wheel_dir=$(mktemp -d)
trap 'rm -rf "$wheel_dir"' EXIT
pip wheel -q --no-deps -w "$wheel_dir" . >/dev/null
rm -rf build   # the wheel build's scratch (ignored by git)
PIP_CONSTRAINT=/dev/null pip install -q "$wheel_dir"/accel_magics-*.whl
pip freeze --all > "$venv/after.txt"

# 3. No pinned package changed version (nor went away).
"$py" - "$pins" "$venv/before.txt" "$venv/after.txt" <<'PY'
import re, sys
pins_file, before_file, after_file = sys.argv[1:4]

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

def versions(path):
    out = {}
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        m = re.match(r"([A-Za-z0-9_.\-]+)\s*(?:==|\s@\s)\s*(\S+)", line)
        if m:
            out[norm(m.group(1))] = m.group(2)
    return out

pins, before, after = versions(pins_file), versions(before_file), versions(after_file)
bad = []
for name, pinned in pins.items():
    was, now = before.get(name), after.get(name)
    if was is None or was.split("+")[0] != pinned:
        bad.append(f"{name}: pinned {pinned}, the host's install gave {was}")
    elif now != was:
        bad.append(f"{name}: {was} -> {now} (installing accel_magics changed it)")
added = sorted(set(after) - set(before))
print(f"host_check: accel_magics installed; pinned packages unchanged: {len(pins) - len(bad)} of {len(pins)}; "
      f"added: {', '.join(f'{n}=={after[n]}' for n in added)}")
if bad:
    print("host_check: FAILED\n  " + "\n  ".join(bad))
    sys.exit(1)
PY

echo "host_check: pip install of the package and the check took $((SECONDS - step)) s"

# 4. A 2-rank cell in a real kernel of this venv, driven over the Jupyter protocol.
"$py" scripts/host_cell.py
echo "host_check: $host done in $((SECONDS - start)) s"
