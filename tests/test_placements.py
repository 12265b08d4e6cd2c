"""Placements are found through the entry point group ``accel_magics.placements``
(issue 46, item 1): a plug-in installed only as an entry point (a module and
its ``*.dist-info``, nothing else) runs every mode through the magics, an
unknown name is refused before anything launches, and a plug-in that cannot
be imported is left out with a warning while the built-ins go on working."""
from __future__ import annotations

import os
import re
import sys

import pytest

from accel_magics.kernel_ext.kernel.local_placement import LocalPlacement
from accel_magics.kernel_ext.kernel.placement import (BUILT_IN, GROUP, PlacementNotFound,
                                                      PlacementRegistry)

pytestmark = pytest.mark.timeout(240)

PLUGIN = '''
from accel_magics.placements import LocalPlacement

LAUNCHES = []   # the attempt number of every launch CountedPlacement made


class MinePlacement(LocalPlacement):
    name = "mine"


class CountedPlacement(LocalPlacement):
    """Records each launch, so a test sees that the magics ran through it."""

    name = "counted"

    def launch(self, cfg, payload, **kw):
        LAUNCHES.append(kw.get("attempt", 0))
        return super().launch(cfg, payload, **kw)
'''


def install(site, package: str, module_source: str, entry_points: str) -> None:
    """``package`` as pip would leave it: a module and its dist-info (no other metadata)."""
    (site / f"{package}.py").write_text(module_source)
    info = site / f"{package}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points)


def plugin_site(site, group: str = GROUP) -> None:
    install(site, "myplug", PLUGIN, f"[{group}]\nmine = myplug:MinePlacement\ncounted = myplug:CountedPlacement\n")
    install(site, "brokenplug", "import no_such_module_anywhere\n", f"[{group}]\nbroken = brokenplug:Broken\n")


# -- the lookup functions, as plain functions --------------------------------------------

@pytest.fixture
def test_group(tmp_path, monkeypatch):
    """A group of this test's own, its plug-ins on sys.path (the process's registry is left alone)."""
    group = "accel_magics_test_placements"
    plugin_site(tmp_path, group)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield group
    for name in ("myplug", "brokenplug"):
        sys.modules.pop(name, None)


def test_the_built_ins_are_found_without_any_entry_point():
    registry = PlacementRegistry(group="accel_magics_test_no_such_group")
    assert registry.names() == ("local", "slurm")
    from accel_magics.kernel_ext.kernel.slurm import SlurmPlacement

    assert registry.find("local") is LocalPlacement and registry.find("slurm") is SlurmPlacement


def test_the_built_ins_are_declared_as_entry_points_in_pyproject():
    try:
        import tomllib
    except ImportError:   # Python 3.10
        import tomli as tomllib
    with open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["entry-points"][GROUP]
    assert declared == BUILT_IN


def test_a_plugin_is_found_by_its_entry_point_and_imported_only_when_asked(test_group, capsys):
    registry = PlacementRegistry(group=test_group)
    assert set(registry.declared()) == {"local", "slurm", "mine", "counted", "broken"}
    assert "myplug" not in sys.modules   # declared is not imported
    mine = registry.find("mine")
    assert mine.name == "mine" and issubclass(mine, LocalPlacement) and mine.__module__ == "myplug"
    assert "brokenplug" not in sys.modules and capsys.readouterr().err == ""   # only what was asked for


def test_a_broken_plugin_warns_once_in_one_line_and_the_others_still_work(test_group, capsys):
    registry = PlacementRegistry(group=test_group)
    assert registry.names() == ("local", "slurm", "mine", "counted")
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.search(r"placement plug-in 'broken' \(brokenplug:Broken, from brokenplug 0\.1\) could not be loaded "
                     r"and is left out: ModuleNotFoundError: No module named 'no_such_module_anywhere'", err), err
    assert registry.names() == ("local", "slurm", "mine", "counted")
    assert capsys.readouterr().err == ""   # said once
    with pytest.raises(PlacementNotFound, match=r"'broken' could not be loaded: ModuleNotFoundError.*"
                                                r"Known: local, slurm, mine, counted\."):
        registry.find("broken")
    assert registry.find("local") is LocalPlacement


def test_an_unknown_name_lists_the_known_ones_and_says_how_to_add_one(test_group, capsys):
    registry = PlacementRegistry(group=test_group)
    with pytest.raises(PlacementNotFound) as caught:
        registry.find("nosuch")
    text = str(caught.value)
    assert "there is no placement 'nosuch'. Known: local, slurm, mine, counted." in text
    assert "Left out: 'broken' (ModuleNotFoundError" in text
    assert f"entry point of the group {test_group!r}" in text and "help(accel_magics.placements)" in text


def test_an_entry_point_must_name_a_placement_of_that_name(tmp_path, monkeypatch, capsys):
    group = "accel_magics_test_wrong"
    install(tmp_path, "wrongplug", "from accel_magics.placements import LocalPlacement\n"
                                   "class Other(LocalPlacement):\n    name = 'other'\n"
                                   "class NotOne:\n    name = 'notone'\n",
            f"[{group}]\nmisnamed = wrongplug:Other\nnotone = wrongplug:NotOne\nlocal = wrongplug:Other\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        registry = PlacementRegistry(group=group)
        assert registry.names() == ("local", "slurm")
        assert registry.find("local") is LocalPlacement   # a plug-in cannot take a built-in's name
        err = capsys.readouterr().err
        assert "'local' (wrongplug:Other, from wrongplug 0.1) ignored: the name is taken" in err, err
        assert "its class's name is 'other', not 'misnamed'" in err, err
        assert "wrongplug:NotOne is not a subclass of accel_magics.placements.Placement" in err, err
    finally:
        sys.modules.pop("wrongplug", None)


def test_the_public_module_exports_the_base_classes_and_the_lookup():
    import accel_magics.placements as public

    for name in ("Placement", "Attempt", "LocalPlacement", "find_placement", "placement_names", "PlacementNotFound"):
        assert name in public.__all__ and getattr(public, name)
    assert 'name = "mine"' in public.__doc__ and f'[project.entry-points."{GROUP}"]' in public.__doc__
    assert public.find_placement("local") is LocalPlacement and public.placement_names()[:2] == ("local", "slurm")


# -- a real kernel, the plug-ins installed only as entry points -----------------------------

@pytest.fixture(scope="module")
def plugin_kernel(tmp_path_factory):
    from conftest import LoadedKernel

    class PluginKernel(LoadedKernel):
        loaded = None   # what %load_ext said

        def ok(self, code, timeout=60):
            res = super().ok(code, timeout)
            if code == "%load_ext accel_magics":
                self.loaded = res
            return res

    site = tmp_path_factory.mktemp("site")
    plugin_site(site)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    k = PluginKernel(extra_env={"PYTHONPATH": path})
    try:
        yield k
    finally:
        k.shutdown()


@pytest.fixture
def pk(plugin_kernel):
    yield plugin_kernel
    plugin_kernel.run("%distributed_session stop", timeout=60)
    plugin_kernel.assert_no_leaks()


def launches(k) -> list:
    return eval(k.ok("import myplug; print(myplug.LAUNCHES)").stdout)


@pytest.mark.parametrize("name", ["mine", "counted"])
def test_a_plugin_runs_every_mode(pk, name):
    k = pk
    before = launches(k)
    res = k.ok(f"%%distributed -n 2 --launcher {name} --output text\nimport os\nprint('hi', os.environ['RANK'])\n"
               "6 * 7", timeout=90)
    assert "[rank 0] hi 0" in res.stdout and "[rank 1] hi 1" in res.stdout and res.result == "42", res.stdout

    k.ok(f"%%distributed -n 2 --launcher {name} --background --output text\nimport os\nint(os.environ['RANK']) + 5")
    assert k.ok("h = _\nh.wait(60)", timeout=90).result == "5"

    res = k.ok(f"%%distributed -n 2 --launcher {name} --max_restarts 1 --output text\nimport os\n"
               "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
               "if attempt == '0' and os.environ['RANK'] == '1':\n    raise RuntimeError('flaky')\n"
               "'attempt ' + attempt", timeout=120)
    assert res.result == "'attempt 1'", res.stdout + res.stderr

    k.ok(f"%distributed_session start -n 2 --launcher {name}", timeout=90)
    k.ok("%%distributed --session --output text\nimport os\nkept = 10 + int(os.environ['RANK'])")
    res = k.ok("%%distributed --session --output text\nprint('kept', kept)\nkept")
    assert "[rank 0] kept 10" in res.stdout and "[rank 1] kept 11" in res.stdout and res.result == "10", res.stdout
    status = k.ok("%distributed_session status").stdout
    assert "2 rank(s)" in status and "kept" in status, status

    if name == "counted":   # each mode started its ranks through the plug-in: a session's start too
        assert launches(k)[len(before):] == [0, 0, 0, 1, 0]
    else:
        assert launches(k) == before


def test_a_plugin_session_with_max_restarts_restarts_a_lost_session_and_says_its_state_is_gone(pk):
    """``--max_restarts 1`` on a session started through a plug-in that only
    subclasses LocalPlacement: a rank that dies in a cell loses the session;
    its ranks start afresh (through the plug-in again, on a fresh rendezvous),
    the output says the state is gone, the cell runs again on the fresh
    ranks, and the session lives on from there."""
    k = pk
    before = launches(k)
    k.ok("%distributed_session start -n 2 --launcher counted --max_restarts 1", timeout=90)
    k.ok("%%distributed --session --output text\nimport os\nkept = 10 + int(os.environ['RANK'])")
    pids = k.ok("%distributed_session status").stdout
    flaky = ("%%distributed --session --output text\nimport os\n"
             "if 'kept' in globals() and os.environ['RANK'] == '1':\n    os._exit(3)\n"
             "print('here', os.environ['MASTER_PORT'])\n'kept' in globals()")
    res = k.ok(flaky, timeout=120)
    assert res.result == "False", res.stdout + res.stderr   # ran again, on ranks that never had it
    assert re.search(r"accel_magics: the session was lost in In\[\d+\] \(.*\); restarting it on a fresh rendezvous "
                     r"\(restart 1 of 1\): its state is gone \((?:\w+, )*kept(?:, \w+)* with it\); In\[\d+\] runs again on the "
                     r"fresh ranks\.", res.stdout), res.stdout
    assert res.stdout.count("[accel_magics] attempt 2 of 2 (attempt 1: rank 1 failed: exited with code 3") == 1, \
        res.stdout   # the record's note, as for a one-shot run's restart
    assert "[rank 0] here" in res.stdout and "[rank 1] here" in res.stdout, res.stdout
    assert launches(k)[len(before):] == [0, 0]   # the start, then the restart: both through the plug-in
    res = k.ok("%%distributed --session --output text\nkept = 'new'\nkept")
    assert res.result == "'new'", res.stdout
    status = k.ok("%distributed_session status").stdout
    assert "2 rank(s)" in status and "kept" in status, status
    old = set(re.findall(r"^\s+\d+\s+(\d+)\s", pids, re.M))
    assert old and not old & set(re.findall(r"^\s+\d+\s+(\d+)\s", status, re.M)), (pids, status)   # fresh ranks
    # A cell that raises leaves every rank at its prompt with its state: no restart.
    res = k.run("%%distributed --session --output text\nraise ValueError('no restart')", timeout=60)
    assert res.error["ename"] == "DistributedRunError" and "restarting" not in res.stdout, res.stdout
    assert k.ok("%%distributed --session --output text\nkept").result == "'new'"
    assert launches(k)[len(before):] == [0, 0]


def test_an_unknown_launcher_is_refused_before_anything_launches(pk):
    k = pk
    for line in ("%%distributed -n 2 --launcher nosuch --output text\nprint('ran')",
                 "%distributed_session start -n 2 --launcher nosuch",
                 "%distributed_config --launcher nosuch"):
        res = k.run(line, timeout=60)
        assert res.status == "error" and res.error["ename"] == "UsageError", (line, res.error_text)
        text = res.error["evalue"]
        assert "there is no placement 'nosuch'. Known: local, slurm, mine, counted." in text, text
        assert "entry point of the group 'accel_magics.placements'" in text, text
        assert "Left out: 'broken' (ModuleNotFoundError" in text, text
        assert "ran" not in res.stdout and "[rank" not in res.stdout
    k.ok("%distributed_session start -n 2 --launcher mine", timeout=90)
    res = k.run("%distributed_session restart --launcher nosuch", timeout=60)
    assert res.error["ename"] == "UsageError" and "there is no placement 'nosuch'" in res.error["evalue"] \
        and "The session was left as it was." in res.error["evalue"], res.error_text
    assert "2 rank(s)" in k.ok("%distributed_session status").stdout   # still running
    k.ok("%distributed_session stop", timeout=60)
    # Slurm keeps its own cell mode: outside an allocation it still says so itself.
    for line in ("%%distributed -n 2 --launcher slurm\npass", "%distributed_session start -n 2 --launcher slurm"):
        res = k.run(line, timeout=60)
        assert res.error["ename"] == "UsageError" and "needs a Slurm allocation" in res.error["evalue"], res.error_text
    state = k.ok("m = get_ipython().magics_manager.registry['DistributedMagics']\n"
                 "print(getattr(m.state.session, 'alive', False), m.state.defaults)").stdout
    assert state.strip() == "False {}", state   # no session started, the defaults not changed


def test_a_broken_plugin_warns_at_load_and_the_built_ins_still_run(pk):
    k = pk
    said = k.loaded.stderr
    assert re.search(r"accel_magics: placement plug-in 'broken' \(brokenplug:Broken, from brokenplug 0\.1\) could "
                     r"not be loaded and is left out: ModuleNotFoundError: No module named "
                     r"'no_such_module_anywhere'\n", said), said
    assert said.count("placement plug-in") == 1, said
    res = k.run("%%distributed -n 2 --launcher broken --output text\nprint('ran')", timeout=60)
    assert res.error["ename"] == "UsageError" and "'broken' could not be loaded: ModuleNotFoundError" \
        in res.error["evalue"], res.error_text
    res = k.ok("%%distributed -n 2 --launcher local --output text\nimport os\nos.environ['WORLD_SIZE']", timeout=90)
    assert res.result == "'2'", res.stdout


def test_the_help_and_the_config_form_list_the_plugins(pk):
    k = pk
    res = k.ok("from accel_magics.magics import DistributedMagics\n"
               "[a] = [a for a in DistributedMagics.distributed.parser._actions if a.dest == 'launcher']\n"
               "print(a.help)\n"
               "from accel_magics.widgets.config_form import ConfigForm\n"
               "form = ConfigForm({'launcher': 'mine'}, check=lambda v: '', apply=lambda v: None, describe=str)\n"
               "print(list(form.fields['launcher'].options), form.fields['launcher'].value)\n"
               "form.widget.close()")
    assert "local: ranks on this machine" in res.stdout and "slurm: on every node of the Slurm allocation" \
        in res.stdout, res.stdout
    assert "Installed: local, slurm, mine (a plug-in: myplug:MinePlacement, from myplug 0.1), counted (a plug-in: " \
        "myplug:CountedPlacement, from myplug 0.1). Default: local." in res.stdout, res.stdout
    assert "broken" not in res.stdout.split("\n")[0]
    assert "['local', 'slurm', 'mine', 'counted'] mine" in res.stdout, res.stdout
    res = k.ok("%distributed_config --launcher mine")
    assert "--launcher mine" in res.stdout, res.stdout
    k.ok("%distributed_config --reset")
