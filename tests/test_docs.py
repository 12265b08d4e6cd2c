"""The documentation's code runs as written.

Every fenced block of README.md, CONTRIBUTING.md and docs/**/*.md says what it is:

* ```python: run, in order, in a real kernel of its own per page (after
  ``%load_ext accel_magics``), as a headless executor (nbconvert) runs a
  notebook, so the output is the text view's; it must succeed, or raise what a
  ``<!-- raises: NAME -->`` line just before it names;
* ```text: output, shown, not run; with ``<!-- expected output -->`` just
  before it, every line of it must be in the output of the python block
  above it (``...`` in a line stands for any text: a number that varies);
* anything else (```bash, ```yaml), or a python block that cannot run here,
  has ``<!-- not run: why -->`` just before it.

The generated parts of the reference pages match the code
(scripts/reference_pages.py --check), and the site builds with
``mkdocs build --strict`` where mkdocs is installed (the docs extra).
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import LoadedKernel

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
MARK = re.compile(r"^<!-- (not run|raises|expected output)(?::\s*(.*?))?\s*-->$")


@dataclasses.dataclass
class Block:
    page: pathlib.Path
    line: int            # 1-based line of the opening fence
    lang: str
    code: str
    mark: str = ""       # "not run", "raises", "expected output" or ""
    why: str = ""        # the reason (not run) or the exception's name (raises)

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(page: pathlib.Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, lang = opening.groups()
        start, i = i, i + 1
        body = []
        while i < len(lines) and lines[i].rstrip() != indent + "```":
            body.append(lines[i][len(indent):])
            i += 1
        assert i < len(lines), f"{page}:{start + 1}: a code block is never closed"
        i += 1
        before = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(before)
        found.append(Block(page, start + 1, lang, "\n".join(body) + "\n", *(mark.groups(default="") if mark
                                                                            else ("", ""))))
    return found


def test_every_code_block_says_what_it_is():
    wrong = []
    for page in PAGES:
        for block in blocks(page):
            if block.mark == "not run" and not block.why:
                wrong.append(f"{block}: 'not run' without a reason")
            elif block.mark == "expected output" and block.lang != "text":
                wrong.append(f"{block}: expected output must be a text block")
            elif block.mark == "raises" and (block.lang != "python" or not block.why):
                wrong.append(f"{block}: 'raises' needs a python block and an exception's name")
            elif block.lang not in ("python", "text") and block.mark != "not run":
                wrong.append(f"{block}: neither python (run), text (output) nor marked 'not run: why'")
    assert not wrong, "\n".join(wrong)


def test_the_readme_is_a_front_page_that_links_to_pages_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 16 * 1024, f"README.md is {len(readme.encode())} bytes (at most 16 KB)"
    links = re.findall(r"\]\(((?!https?:|#)[^)#\s]+)", readme)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    # The first example: load the extension, then a %%distributed cell, both run (below).
    runnable = [b for b in blocks(ROOT / "README.md") if b.lang == "python" and b.mark != "not run"]
    assert runnable[0].code.strip() == "%load_ext accel_magics"
    assert any(b.code.startswith("%%distributed") for b in runnable)
    # The two commands: the main job and the test command CI runs (.ci/run).
    assert "scripts/quickstart.sh" in readme and "scripts/test.sh" in readme


def _shown(line: str, output: str) -> bool:
    """An expected line is in the output; ``...`` in it stands for any text (a number that varies)."""
    line = line.strip()
    if line in ("", "..."):
        return True
    pattern = ".*".join(re.escape(part) for part in line.split("..."))
    return re.search(pattern, output) is not None


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


RUNNABLE = [page for page in PAGES if any(b.lang == "python" and b.mark != "not run" for b in blocks(page))]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", RUNNABLE, ids=_page_id)
def test_the_pages_python_runs_as_written(page):
    workdir = tempfile.mkdtemp(prefix="accel-docs-")
    kernel = LoadedKernel(cwd=workdir)
    try:
        last = None
        for block in blocks(page):
            if block.lang == "python" and block.mark != "not run":
                # As nbconvert and papermill run a notebook (no input(): the text view).
                res = kernel.result_of(kernel.kc.execute(block.code, store_history=True, allow_stdin=False),
                                       timeout=180)
                seen = "\n".join([res.stdout, res.stderr, res.result or "", res.error_text])
                if block.mark == "raises":
                    assert res.status == "error" and res.error["ename"] == block.why, \
                        f"{block}: expected {block.why}, got {res.status}:\n{seen}"
                else:
                    assert res.status == "ok", f"{block} failed:\n{block.code}\n{seen}"
                last = (block, seen)
            elif block.mark == "expected output":
                assert last is not None, f"{block}: expected output with no python block above it"
                missing = [line for line in block.code.splitlines() if not _shown(line, last[1])]
                assert not missing, f"{block}: not in the output of {last[0]}: {missing}\noutput:\n{last[1]}"
        try:
            kernel.assert_no_leaks()
        except AssertionError as exc:
            raise AssertionError(f"{page.relative_to(ROOT)} left something behind: {exc}") from None
    finally:
        kernel.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.timeout(60)
def test_the_generated_reference_pages_are_up_to_date():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference_pages.py"), "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.timeout(120)
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e .[docs])")
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "index.html").exists()


def test_the_defaults_the_pages_state_are_the_options():
    from accel_magics.kernel_ext import options

    stall = options.BY_NAME["stall_timeout"].default
    rendezvous = options.BY_NAME["rendezvous_timeout"].default
    assert f"`--stall_timeout` ({stall:g} s)" in (ROOT / "README.md").read_text(encoding="utf-8")
    hang = (ROOT / "docs" / "how-to" / "debug-a-hang.md").read_text(encoding="utf-8")
    assert f"`--stall_timeout` ({stall:g} s by default)" in hang
    assert f"`--rendezvous_timeout` ({rendezvous:g} s)" in hang


def test_the_markers_are_read_as_the_convention_says(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n<!-- expected output -->\n```text\n1\n```\n\n"
                    "<!-- not run: needs two machines -->\n\n```bash\nsalloc -N 2\n```\n\n"
                    "<!-- raises: ValueError -->\n```python\nraise ValueError\n```\n\n```bash\nls\n```\n"
                    "  ```python\n  indented = True\n  ```\n", encoding="utf-8")
    found = [(b.lang, b.mark, b.why, b.code) for b in blocks(page)]
    assert found == [("python", "", "", "x = 1\n"), ("text", "expected output", "", "1\n"),
                     ("bash", "not run", "needs two machines", "salloc -N 2\n"),
                     ("python", "raises", "ValueError", "raise ValueError\n"), ("bash", "", "", "ls\n"),
                     ("python", "", "", "indented = True\n")]
    assert _shown("[rank 0] epoch 1: ...", "[rank 0] epoch 1: 92.97") and not _shown("epoch 2: ...", "epoch 1: 3")
