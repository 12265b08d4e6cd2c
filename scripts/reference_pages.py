#!/usr/bin/env python3
"""Write the generated parts of the documentation from the code they describe.

* docs/reference/options.md: the options table, from kernel_ext/options.py
  (and the %%distributed magic's own flags, from its parser);
* docs/design/timing.md: the ladders' timing constants, from kernel_ext/timing.py;
* docs/performance.md: the latest benchmark table, from bench/RESULTS.md.

Each page is hand-written except between its ``<!-- BEGIN generated: NAME -->``
and ``<!-- END generated: NAME -->`` lines, which this script owns.

    python scripts/reference_pages.py           # rewrite the generated parts
    python scripts/reference_pages.py --check   # exit 1, naming the pages, when one is stale
"""
from __future__ import annotations

import argparse
import ast
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def options_table() -> str:
    from accel_magics.kernel_ext import options

    rows = ["| option | meaning | default | in the form | session | `--launcher slurm` |",
            "| --- | --- | --- | --- | --- | --- |"]
    for option in options.OPTIONS:
        flags = ", ".join(f"`{flag}`" for flag in option.flags)
        if not option.is_flag:
            metavar = option.metavar or ("{" + ",".join(option.choices) + "}" if option.choices
                                         else option.name.upper())
            flags += f" `{metavar}`"
        if option.default_text:
            default = option.default_text
        elif option.is_flag:
            default = "off"
        elif option.default is None:
            default = "none"
        else:
            default = f"`{option.default:g}`" if isinstance(option.default, float) else f"`{option.default}`"
        session = "fixed when the session starts" if option.session_fixed else "per cell"
        slurm = f"refused: {option.not_on_slurm}" if option.not_on_slurm else "yes"
        rows.append(f"| {flags} | {_cell(option.help)} | {_cell(default)} | {_cell(option.label or '-')} | "
                    f"{session} | {_cell(slurm)} |")
    return "\n".join(rows)


def cell_flags_table() -> str:
    """The flags of %%distributed that are no launch option (--return, --session, --background)."""
    from accel_magics.kernel_ext import options
    from accel_magics.magics import DistributedMagics

    parser = DistributedMagics.distributed.parser
    rows = ["| flag | meaning |", "| --- | --- |"]
    launch = {f"--{name}" for name in options.NAMES}
    for action in parser._actions:
        long_flags = [flag for flag in action.option_strings if flag.startswith("--")]
        if not long_flags or set(long_flags) & launch or "--help" in long_flags:
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
        if action.nargs != 0:
            flags += f" `{action.metavar or action.dest.upper()}`"
        help_text = (action.help or "").replace("%%", "%")   # argparse's escape of a literal %
        rows.append(f"| {flags} | {_cell(help_text)} |")
    return "\n".join(rows)


def timing_table() -> str:
    """Every constant of kernel_ext/timing.py with its comment, section by section."""
    source = (ROOT / "kernel_ext" / "timing.py").read_text(encoding="utf-8")
    module = ast.parse(source)
    docstring = ast.get_docstring(module)
    out = ["The module's own account of the ladders (`kernel_ext/timing.py`):", "", "```text", docstring, "```",
           ""]
    section = None
    for line in source.splitlines():
        heading = re.match(r"# -- (.+?) -+$", line)
        if heading:
            section = heading.group(1)
            out += ["", f"**{section[0].upper() + section[1:]}**", "", "| constant | seconds | what it bounds |",
                    "| --- | --- | --- |"]
            continue
        constant = re.match(r"^([A-Z][A-Z_]+) = ([0-9.]+)\s*(?:#\s*(.*))?$", line)
        if constant and section:
            name, value, comment = constant.groups()
            out.append(f"| `{name}` | {float(value):g} | {_cell(comment or '')} |")
    return "\n".join(out).strip()


def results_table() -> str:
    text = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    if lines and lines[0].startswith("# "):   # the page has its own title
        lines = lines[1:]
    return "\n".join(lines).strip()


PAGES = {
    "docs/reference/options.md": {"options": options_table, "cell-flags": cell_flags_table},
    "docs/design/timing.md": {"timing": timing_table},
    "docs/performance.md": {"bench-results": results_table},
}


def render(text: str, parts: dict) -> str:
    for name, make in parts.items():
        pattern = re.compile(rf"(<!-- BEGIN generated: {re.escape(name)} -->\n)(?:.*?\n)?(<!-- END generated: "
                             rf"{re.escape(name)} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"reference_pages: no generated region {name!r}")
        body = make()
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when a page is not what the code says")
    args = parser.parse_args(argv)
    stale = []
    for page, parts in PAGES.items():
        path = ROOT / page
        text = path.read_text(encoding="utf-8")
        new = render(text, parts)
        if new != text:
            stale.append(page)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    if args.check and stale:
        print("stale (run python scripts/reference_pages.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    if not args.check:
        print("rewrote: " + (", ".join(stale) or "nothing (up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
