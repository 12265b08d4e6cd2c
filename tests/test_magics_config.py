"""The launch options' defaults are traits of ``DistributedMagics`` (an IPython
``Configurable``): ``%config DistributedMagics.num_processes = 3`` and
``c.DistributedMagics.num_processes = 3`` in an IPython config file set them,
``%distributed_config`` wins over them, a cell's flags over both, and a value
a trait refuses is said in one line and changes nothing."""
from __future__ import annotations

import re

import pytest

from conftest import LoadedKernel
from kernel_harness import KernelSession

pytestmark = pytest.mark.timeout(240)

WORLD = "%%distributed --output text\nimport os\nprint('world', os.environ['WORLD_SIZE'])"


def ranks_of(res) -> dict:
    """rank -> the world size it saw, from the text view's lines."""
    assert res.status == "ok", res.error_text
    return {int(rank): int(world) for rank, world in re.findall(r"\[rank (\d+)\] world (\d+)", res.stdout)}


def profile(tmp_path, config: str) -> dict:
    """The environment of a kernel whose IPython profile has ``config`` as its ipython_config.py."""
    ipython_dir = tmp_path / "ipython"
    (ipython_dir / "profile_default").mkdir(parents=True)
    (ipython_dir / "profile_default" / "ipython_config.py").write_text(config)
    return {"IPYTHONDIR": str(ipython_dir)}


@pytest.fixture
def configured_kernel(clean_kernel):
    """The module's kernel; the trait and the defaults set by the test are undone after it."""
    yield clean_kernel
    clean_kernel.ok("%config DistributedMagics.num_processes = None\n%distributed_config --reset")


def test_config_magic_sets_the_ranks_of_the_next_cell(configured_kernel):
    k = configured_kernel
    assert k.ok("%config DistributedMagics.num_processes = 3").stderr == ""
    assert k.ok("%config DistributedMagics.num_processes").result == "3"
    assert ranks_of(k.run(WORLD, timeout=120)) == {0: 3, 1: 3, 2: 3}
    # It is a default: the cell's flag wins, and %distributed_config shows it as one.
    assert ranks_of(k.run(WORLD.replace("--output text", "--output text -n 2"), timeout=120)) == {0: 2, 1: 2}
    assert "%%distributed --num_processes 3" in k.ok("%distributed_config --output auto").stdout


def test_distributed_config_wins_over_the_trait_until_reset(configured_kernel):
    k = configured_kernel
    k.ok("%config DistributedMagics.num_processes = 3")
    assert "defaults for %%distributed: %%distributed --num_processes 2" in k.ok("%distributed_config -n 2").stdout
    assert ranks_of(k.run(WORLD, timeout=120)) == {0: 2, 1: 2}
    k.ok("%config DistributedMagics.num_processes = 4")   # a later %config does not undo %distributed_config
    assert ranks_of(k.run(WORLD, timeout=120)) == {0: 2, 1: 2}
    assert "%%distributed --num_processes 4" in k.ok("%distributed_config --reset").stdout
    assert ranks_of(k.run(WORLD, timeout=120)) == {0: 4, 1: 4, 2: 4, 3: 4}


def test_a_value_the_trait_refuses_is_said_and_changes_nothing(configured_kernel):
    k = configured_kernel
    k.ok("%config DistributedMagics.num_processes = 3")
    for line, said in (
            ("num_processes = 0", "DistributedMagics.num_processes = 0: --num_processes must be at least 1 (got 0)."),
            ("num_processes = 'three'", "The 'num_processes' trait of a DistributedMagics instance expected an int"),
            ("output = 'fancy'", "The 'output' trait of a DistributedMagics instance expected any of"),
            ("launcher = 'nowhere'", "DistributedMagics.launcher = 'nowhere': --launcher nowhere: ")):
        res = k.ok(f"%config DistributedMagics.{line}")
        assert res.stderr.startswith(f"accel_magics: {said}") and res.stderr.endswith(" Nothing was changed.\n"), \
            res.stderr
    # Said by the magics, not handed to logging (which would give the root logger a handler).
    assert k.ok("import logging\nlogging.getLogger().handlers").result == "[]"
    assert k.ok("%config DistributedMagics.num_processes").result == "3"
    assert ranks_of(k.run(WORLD, timeout=120)) == {0: 3, 1: 3, 2: 3}


def test_a_config_file_sets_the_defaults_and_distributed_config_wins(tmp_path):
    env = profile(tmp_path, "c.DistributedMagics.num_processes = 3\nc.DistributedMagics.output = 'text'\n")
    k = LoadedKernel(extra_env=env)
    try:
        assert k.ok("%config DistributedMagics.num_processes").result == "3"
        cell = WORLD.replace(" --output text", "")   # the text view: the config's output
        assert ranks_of(k.run(cell, timeout=120)) == {0: 3, 1: 3, 2: 3}
        k.ok("%distributed_config -n 2")
        assert ranks_of(k.run(cell, timeout=120)) == {0: 2, 1: 2}
        k.assert_no_leaks()
    finally:
        k.shutdown()


def test_a_refused_value_in_the_config_file_stops_the_extension_loading_and_says_which(tmp_path):
    k = KernelSession(extra_env=profile(tmp_path, "c.DistributedMagics.node_rank = 1\n"))
    try:
        res = k.run("%load_ext accel_magics")
        assert res.error is not None and res.error["ename"] == "UsageError", res.error_text
        assert res.error["evalue"].startswith(
            "accel_magics was not loaded: the IPython config (ipython_config.py, ipython_kernel_config.py or the "
            "command line) gives a value it refuses: DistributedMagics.node_rank = 1: --node_rank must be between 0 "
            "and --num_nodes - 1 = 0 (got 1)."), res.error_text
        # Nothing half made is left: no magic, and %config does not list the refused object.
        assert "Cell magic `%%distributed` not found" in k.run("%%distributed\npass").error_text
        assert "DistributedMagics" not in k.ok("%config").stdout
    finally:
        k.shutdown()


def test_values_set_together_are_checked_together_whatever_their_order():
    """A config file sets its values one by one; they are checked once all are
    set (node_rank 1 needs num_nodes 2, set after it)."""
    from traitlets.config import Config, Configurable
    from traitlets import TraitError

    from accel_magics.defaults import LaunchOptionTraits, configured

    class Owner(LaunchOptionTraits, Configurable):
        pass

    owner = Owner(config=Config({"Owner": {"node_rank": 1, "num_nodes": 2, "master_addr": "127.0.0.1"}}))
    assert (owner.node_rank, owner.num_nodes) == (1, 2)
    # Given: what the config names, even at the built-in value (it wins over an Accelerate config file's).
    assert configured(owner) == {"node_rank": 1, "num_nodes": 2, "master_addr": "127.0.0.1"}
    with pytest.raises(TraitError, match=r"Owner.node_rank = 1: --node_rank must be between 0 and --num_nodes - 1"):
        Owner(config=Config({"Owner": {"node_rank": 1}}))


def test_layer_two_is_read_again_after_a_trait_or_the_config_changes():
    """LaunchDefaults reads the traits once per change, not several times a
    cell: a trait set later, and a config that names a trait with the value it
    already has (it changes no trait, yet counts as given), are both seen."""
    from traitlets.config import Config, Configurable

    from accel_magics.defaults import LaunchDefaults, LaunchOptionTraits
    from accel_magics.state import MagicsState

    class Owner(Configurable, LaunchOptionTraits):
        pass

    state = MagicsState(launcher=object())
    owner = Owner()
    defaults = LaunchDefaults(owner, state)
    assert "num_processes" not in defaults.given()
    owner.num_processes = 3
    assert defaults.given()["num_processes"] == 3
    given = defaults.given()
    given["num_nodes"] = 9            # a caller's copy: the cache is not changed through it
    assert "num_nodes" not in defaults.given()
    owner.config.merge(Config({"Owner": {"num_nodes": 1}}))   # in place, as update_config merges: the
    defaults.forget()                                         # built-in value, named (DistributedMagics does this)
    assert defaults.given()["num_nodes"] == 1
