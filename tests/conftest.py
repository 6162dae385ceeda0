"""Suite-wide rules for parallel runs (pytest-xdist: ``-n 2 --dist loadfile`` in pyproject's
addopts; ``-n 0`` runs everything in this one process, in the natural order).

* ``--dist loadfile``: every test file is one unit of work, so a module-scoped fixture (a fleet,
  a chaos run) starts on one worker only, never once per worker.
* ``cpu_heavy`` tests (and every ``smollm2`` test: torch on all cores) never run at the same
  time as each other: each holds one lock file shared by the workers of this run while it runs
  (its fixtures included). They are the tests whose result depends on getting the CPU when it
  asks — a load generator that must keep its schedule, gaps or rates that a starved process
  would stretch — and the torch runs that would starve them. Other tests run beside them.
  The wait for the lock is not part of a test's ``--timeout``.
* ``exclusive`` tests (the chaos quick runs, whose verdict is only valid when their load
  generator never waits for a CPU) run with nothing else: every other test holds a shared lock
  while it runs, an exclusive test the exclusive one; a gate lock taken first keeps the other
  worker from starting new tests while an exclusive test waits for the running one to end.
* Under xdist torch runs one intra-op thread (``OMP_NUM_THREADS=1``, set here before anything
  imports torch, so the processes a test starts inherit it): the other worker is nearly always
  running a test of its own, and two OpenMP threads on a 2-core machine that is also running
  that test spin at every barrier (a 135 M-parameter decode step measured 10-30x slower than
  on one thread while the other core was busy).
* Under xdist the files are handed out in the order of ``tests/support/file_order.py``: the
  exclusive files first (the other worker idles beside them wherever they come), then each
  file with ``cpu_heavy`` tests followed by its share of the other ``slow`` files (so the
  worker beside a heavy file has light work, not another heavy test to wait for), then the
  many fast files, which fill in at the end.
* Where the environment says not to write bytecode (``PYTHONDONTWRITEBYTECODE``), the suite
  and every process it starts write theirs under a prefix in the temp dir instead
  (``tests/support/bytecode.py``): otherwise each of the several hundred processes compiles
  every kvguard module it imports from source, and each worker rewrites every test file again.
* Chaos quick tests that need a valid run (``needs_valid_run``) and skipped because theirs was
  invalid are counted in one line of the summary, and the session fails when every one of them
  skipped (``tests/support/invalid_runs.py``): a run that is always invalid cannot pass.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.support.bytecode import pycache_prefix
from tests.support.file_order import FileMarks, file_order
from tests.support.invalid_runs import InvalidRunsReport

_HEAVY_MARKS = ("cpu_heavy", "smollm2")

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

_PYCACHE_PREFIX = pycache_prefix(os.environ, tempfile.gettempdir())
if _PYCACHE_PREFIX is not None:  # before xdist starts its workers: they inherit it
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = _PYCACHE_PREFIX
    sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the process that reports: xdist's controller, or -n 0
        config.pluginmanager.register(InvalidRunsReport(), "kvguard-invalid-runs")


def _is_heavy(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in _HEAVY_MARKS)


def _is_slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def _lock_path(name: str) -> str | None:
    """This run's lock file ``name`` (None without xdist: nothing to share)."""
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return None
    return os.path.join(tempfile.gettempdir(), f"kvguard-pytest-{run_id}.{name}.lock")


@contextlib.contextmanager
def _cpu_heavy_lock() -> Iterator[None]:
    """Exclusive across this run's workers (nothing to do without xdist)."""
    path = _lock_path("cpu-heavy")
    if path is None:
        yield
        return
    with open(path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)  # released by the OS if this worker dies
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def _whole_machine_lock(exclusive: bool) -> Iterator[None]:
    """Shared by ordinary tests, exclusive for ``exclusive`` ones (see the module docstring)."""
    gate_path, all_path = _lock_path("gate"), _lock_path("all")
    if gate_path is None:
        yield
        return
    mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
    with open(gate_path, "a") as gate, open(all_path, "a") as whole:
        fcntl.flock(gate, mode)
        try:
            fcntl.flock(whole, mode)
        finally:
            if not exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(whole, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outside pytest-timeout's timer
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    exclusive = item.get_closest_marker("exclusive") is not None
    with _cpu_heavy_lock() if _is_heavy(item) else contextlib.nullcontext(), \
            _whole_machine_lock(exclusive):
        yield


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    marks = {f: FileMarks(num_tests=len(its),
                          exclusive=any(i.get_closest_marker("exclusive") for i in its),
                          heavy=any(map(_is_heavy, its)), slow=any(map(_is_slow, its)))
             for f, its in files.items()}
    items[:] = [item for f in file_order(marks) for item in files[f]]
