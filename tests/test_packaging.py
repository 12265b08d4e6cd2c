"""The installed package (issue 14): a real, non-editable install, used from a
kernel outside the repository; nothing generic in site-packages."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

try:
    import tomllib
except ImportError:   # Python 3.10
    import tomli as tomllib

import pytest

pytestmark = pytest.mark.timeout(300)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel pip builds from the repository, installed into a directory of its own."""
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), REPO],
                           capture_output=True, text=True, timeout=240)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
    assert len(wheels) == 1, wheels
    target = tmp_path_factory.mktemp("site")
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
                           str(out / wheels[0])], capture_output=True, text=True, timeout=120)
    assert inst.returncode == 0, inst.stderr[-3000:]
    return {"wheel": out / wheels[0], "target": str(target), "build_log": build.stdout + build.stderr}


def test_the_wheel_installs_one_top_level_package(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"accel_magics"}, tops
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for path in ("accel_magics/kernel_ext/rank/worker.py", "accel_magics/kernel_ext/node_agent/slurm_agent.py",
                 "accel_magics/kernel_ext/wire/payload.py", "accel_magics/widgets/progress_view.py"):
        assert path in names, path
    # The SPDX license string: no deprecation warning from setuptools at build time.
    assert "project.license" not in installed["build_log"] and "License classifiers" not in installed["build_log"]
    env = {**os.environ, "PYTHONPATH": installed["target"]}
    show = subprocess.run([sys.executable, "-m", "pip", "show", "-f", "accel_magics"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert f"Location: {installed['target']}" in show.stdout, show.stdout
    files = [line.strip() for line in show.stdout.split("Files:", 1)[1].splitlines() if line.strip()]
    assert files and not [f for f in files if f.startswith(("kernel_ext/", "widgets/"))], files


def test_requires_python_matches_what_ci_runs():
    """CI runs the oldest and the newest Python requires-python claims (3.10, 3.13)."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["requires-python"] == ">=3.10"
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    assert "3.10" in ci and "3.13" in ci
    assert project["license"] == "Apache-2.0"


def test_a_kernel_outside_the_repository_runs_a_cell_from_the_installed_package(installed, tmp_path):
    from conftest import LoadedKernel

    k = LoadedKernel(extra_env={"PYTHONPATH": installed["target"]}, cwd=str(tmp_path))
    try:
        where = k.ok("import accel_magics, accel_magics.kernel_ext.rank.worker as w\nprint(accel_magics.__file__)"
                     ).stdout.strip()
        assert where.startswith(installed["target"]), where
        res = k.run("%%distributed -n 2 --output text\nimport accel_magics.kernel_ext.rank.worker as w, os\n"
                    "print(os.environ['RANK'], w.__file__)\n", timeout=90)
        assert res.status == "ok", res.error_text
        for rank in (0, 1):
            assert f"[rank {rank}] {rank} {installed['target']}" in res.stdout, res.stdout
        k.assert_no_leaks()
    finally:
        k.shutdown()


def test_the_main_jobs_output_is_outside_the_test_paths():
    """nbval collected notebooks/out/quickstart.ipynb, so the test count depended
    on whether the main job had run."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        testpaths = tomllib.load(f)["tool"]["pytest"]["ini_options"]["testpaths"]
    script = open(os.path.join(REPO, "scripts", "quickstart.sh")).read()
    assert "--output-dir out " in script
    out = os.path.join(REPO, "out")
    assert all(os.path.commonpath([out, os.path.join(REPO, p)]) != os.path.join(REPO, p) for p in testpaths), \
        testpaths
