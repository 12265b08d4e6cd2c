"""The launch options come from one table (kernel_ext/options.py): the parser,
the help, %distributed_config's command line, the config form, LaunchConfig's
defaults and the session and Slurm checks are built from it, and no other
module writes a default down."""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from accel_magics.kernel_ext import options
from accel_magics.kernel_ext.environment import LaunchConfig

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _parser():
    from accel_magics.magics import DistributedMagics

    return DistributedMagics.distributed.parser


def test_the_parser_has_every_option_of_the_table_with_its_flags_choices_and_default_in_the_help():
    actions = {a.dest: a for a in _parser()._actions}
    for option in options.OPTIONS:
        action = actions[option.name]
        assert tuple(action.option_strings) == option.flags
        assert action.default is None   # "not given" is None: the table's default applies later
        assert action.choices == (list(option.choices) if option.choices and isinstance(action.choices, list)
                                  else option.choices)
        assert action.help == option.help_text()
        if option.is_flag:
            assert action.const is True and action.nargs == 0   # --oversubscribe: no value
        elif option.default is not None:
            value = f"{option.default:g}" if isinstance(option.default, float) else str(option.default)
            assert re.search(rf"[dD]efault:? {re.escape(value)}\b", action.help), action.help
        elif option.default_text:
            assert option.default_text in action.help


def test_the_launchers_names_and_help_are_the_placements_registrys():
    """--launcher takes a placement's name: checked by the magics against the
    registry (an unknown one is their UsageError, test_placements.py)."""
    from accel_magics.kernel_ext.kernel.placement import placement_descriptions, placement_names
    from accel_magics.widgets.config_form import ConfigForm

    option = options.BY_NAME["launcher"]
    assert option.choice_names() == placement_names() and placement_names()[:2] == ("local", "slurm")
    assert option.help_text() == f"{option.help} Installed: {', '.join(placement_names())}. Default: local."
    assert placement_descriptions() == {"local": "", "slurm": ""}   # described in the option's own help
    form = ConfigForm({"launcher": "slurm"}, check=lambda values: "", apply=lambda values: None, describe=str)
    assert list(form.fields["launcher"].options) == list(placement_names())
    assert form.fields["launcher"].value == "slurm"


def test_launch_config_defaults_are_the_tables():
    fields = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    for name, default in options.DEFAULTS.items():
        if name in fields:
            assert fields[name] == default, name


def test_the_config_form_fields_and_choices_are_the_tables():
    from accel_magics.widgets.config_form import LABELS, MIXED

    assert LABELS == {o.name: o.label for o in options.OPTIONS if o.label}
    assert [v for _, v in MIXED[1:]] == list(options.BY_NAME["mixed_precision"].choices)


def test_the_command_line_leaves_out_the_tables_defaults():
    from accel_magics.magics import command_line

    assert command_line(dict(options.DEFAULTS)) == "%%distributed"
    assert command_line({**options.DEFAULTS, "stall_timeout": 5.0}) == "%%distributed --stall_timeout 5"


def test_no_other_module_writes_a_default_down():
    """A literal default next to an option's name (``"stall_timeout", 30.0``,
    ``or 300.0``) outside the table is a second place to keep in step."""
    literals = {repr(v) for v in options.DEFAULTS.values() if isinstance(v, (int, float)) and v not in (0, 1)}
    literals |= {str(options.DEFAULT_MULTINODE_PORT)}   # (loopback addresses are not only a default)
    offenders = []
    for path in [*ROOT.glob("accel_magics/*.py"), *ROOT.glob("widgets/*.py"), ROOT / "kernel_ext/environment.py"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if any(re.search(rf"(?<![\w.]){re.escape(lit)}(?![\w.])", code) for lit in literals) \
                    and not code.strip().startswith(("%", '"%', "'%")) and "%distributed_config" not in code:
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_session_and_slurm_rules_come_from_the_table():
    from accel_magics import session_magic

    assert session_magic.SESSION_FIXED == tuple(o.name for o in options.OPTIONS if o.session_fixed)
    assert set(options.NOT_ON_SLURM) == {"node_rank", "master_addr", "config_file", "rendezvous_key"}
