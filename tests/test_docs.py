"""The README and docs/ point only at things that exist.

Every module path (``guard/...py``, ``engine/...py``, ``policies/...py``, ``chaos/...py``,
``serving/...py``, ``scripts/...py``, ``tests/...py``) and every ``python -m MODULE`` named in
README.md or docs/*.md exists, and so does some file of every bare module name in backticks
(`` `retry_ratio.py` ``); every relative link resolves, its ``#anchor`` included; the
README stays a front door (at most 200 lines). A renamed or deleted module then fails here
instead of leaving a stale page.
"""

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MAX_README_LINES = 200

_MODULE_PATH = re.compile(
    r"(?<![\w/.-])((?:guard|engine|policies|chaos|serving|scripts|tests)/[\w/.-]*?\.py)\b")
_BARE_MODULE = re.compile(r"`([\w.]+\.py)`")
_PYTHON_M = re.compile(r"python3? -m ([A-Za-z_][\w.]*)")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(page.read_text()):
        anchor = github_anchor(heading)
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_module_path_named_exists(page):
    missing = sorted({p for p in _MODULE_PATH.findall(page.read_text())
                      if "*" not in p and not (REPO / p).is_file()})
    assert not missing, f"{_page_id(page)} names modules that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_bare_module_name_is_some_file(page):
    names = {p.name for p in REPO.glob("[!.]*/**/*.py")} | {p.name for p in REPO.glob("*.py")}
    missing = sorted(set(_BARE_MODULE.findall(page.read_text())) - names)
    assert not missing, f"{_page_id(page)} names modules no file has: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_python_m_module_exists(page):
    missing = sorted({m for m in _PYTHON_M.findall(page.read_text())
                      if importlib.util.find_spec(m.rstrip(".")) is None})
    assert not missing, f"{_page_id(page)} runs modules that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not this test's business
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert not broken, f"{_page_id(page)} has links that do not resolve: {broken}"


def test_the_readme_is_a_front_door():
    num_lines = len((REPO / "README.md").read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines"


@pytest.mark.parametrize("heading, anchor", [
    ("9. Chaos scenarios (`kvguard chaos run`)", "9-chaos-scenarios-kvguard-chaos-run"),
    ("The demo's default load: 1.2 × S", "the-demos-default-load-12--s"),
    ("[Benchmarks](docs/benchmarks.md) at a glance", "benchmarks-at-a-glance"),
])
def test_anchors_follow_githubs_rule(heading, anchor):
    assert github_anchor(heading) == anchor
