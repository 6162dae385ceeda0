"""Where the suite keeps bytecode when the environment says not to write it next to the sources
(tests/support/bytecode.py, applied by tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

from tests.support.bytecode import pycache_prefix

REPO = Path(__file__).resolve().parents[1]


def test_a_prefix_in_the_temp_dir_only_where_bytecode_is_not_written():
    expected = os.path.join("/tmp/x", f"kvguard-pytest-pycache-{os.getuid()}")
    assert pycache_prefix({"PYTHONDONTWRITEBYTECODE": "1"}, "/tmp/x") == expected
    assert pycache_prefix({}, "/tmp/x") is None  # bytecode is written as usual
    assert pycache_prefix({"PYTHONDONTWRITEBYTECODE": ""}, "/tmp/x") is None
    # a prefix the environment names is kept
    assert pycache_prefix({"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": "/c"},
                          "/tmp/x") is None


def test_a_process_the_suite_starts_reads_what_an_earlier_one_compiled(tmp_path):
    """Under PYTHONDONTWRITEBYTECODE a session's conftest moves bytecode to the prefix: a
    process a test starts writes kvguard's modules there, and the next one loads them."""
    test = tmp_path / "test_child.py"
    test.write_text(
        "import os, subprocess, sys\n"
        "def test_child():\n"
        "    code = 'import guard.config, sys; print(guard.config.__cached__)'\n"
        "    runs = [subprocess.run([sys.executable, '-c', code], capture_output=True,\n"
        "                           text=True, check=True).stdout.strip() for _ in range(2)]\n"
        "    prefix = os.environ['PYTHONPYCACHEPREFIX']\n"
        "    assert 'PYTHONDONTWRITEBYTECODE' not in os.environ\n"
        "    assert runs[0] == runs[1] and runs[0].startswith(prefix), (runs, prefix)\n"
        "    assert os.path.exists(runs[0])\n")
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPYCACHEPREFIX", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_TESTRUNUID")}
    env |= {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-p", "no:cacheprovider",
                           "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(test)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / f"kvguard-pytest-pycache-{os.getuid()}").is_dir()
