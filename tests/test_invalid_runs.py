"""The session-level tally of chaos quick tests skipped because their run was invalid.

Real pytest sessions in a subprocess, on a small generated suite whose tests skip the way
tests/chaos/test_chaos_quick.py's do: the summary names the invalid skips, and a session in
which every ``needs_valid_run`` test skipped fails, also under xdist (the CI's ``-n 2``).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

CONFTEST = '''
from tests.support.invalid_runs import InvalidRunsReport

def pytest_configure(config):
    config.addinivalue_line("markers", "needs_valid_run: judged only on a valid run")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(InvalidRunsReport(), "kvguard-invalid-runs")
'''

SUITE = '''
import pytest
from tests.support.invalid_runs import invalid_run_reason

VALID = {valid!r}

@pytest.mark.needs_valid_run
@pytest.mark.parametrize("scenario", ["burst", "replica-kill"])
def test_judged_on_a_valid_run(scenario):
    if scenario not in VALID:
        pytest.skip(invalid_run_reason("send lag p99 300 ms"))
    assert True

def test_not_marked_skips_for_another_reason():
    pytest.skip("no redis-server")
'''


def run_suite(tmp_path: Path, valid: list[str], *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_quick.py").write_text(SUITE.format(valid=valid))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_session_where_every_run_was_invalid_fails_and_says_so(tmp_path):
    result = run_suite(tmp_path, [])
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    assert "2 chaos quick runs were invalid and skipped" in result.stdout
    assert "test_judged_on_a_valid_run[burst]" in result.stdout
    assert "send lag p99 300 ms" in result.stdout
    assert "FAILED (a run that is always invalid must not pass)" in result.stdout


def test_one_valid_run_passes_and_the_other_is_still_counted(tmp_path):
    result = run_suite(tmp_path, ["replica-kill"])
    assert result.returncode == pytest.ExitCode.OK, result.stdout
    assert "1 chaos quick runs were invalid and skipped: " \
           "test_judged_on_a_valid_run[burst]; 1 judged on a valid run" in result.stdout


def test_no_invalid_run_prints_nothing(tmp_path):
    result = run_suite(tmp_path, ["burst", "replica-kill"])
    assert result.returncode == pytest.ExitCode.OK, result.stdout
    assert "chaos quick runs" not in result.stdout


def test_under_xdist_the_controller_counts_the_workers_skips(tmp_path):
    result = run_suite(tmp_path, [], "-n", "2")
    assert result.returncode == pytest.ExitCode.TESTS_FAILED, result.stdout
    assert "2 chaos quick runs were invalid and skipped" in result.stdout
