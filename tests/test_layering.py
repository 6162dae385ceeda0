"""The import direction between the packages: guard and policies never pull in torch."""

import subprocess
import sys


def test_guard_and_policies_do_not_import_torch():
    """Every module of guard/ and policies/, sub-packages included (guard.replicas,
    guard.budget, ...): no torch, no engine."""
    code = (
        "import sys, guard, policies, guard.cli\n"
        "import importlib, pkgutil\n"
        "seen = []\n"
        "for pkg in (guard, policies):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        importlib.import_module(m.name)\n"
        "        seen.append(m.name)\n"
        "assert 'guard.replicas.load_state' in seen and 'guard.controller' in seen, seen\n"
        "assert 'torch' not in sys.modules, sorted(k for k in sys.modules if 'torch' in k)\n"
        "assert 'engine' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_engine_does_not_import_guard():
    code = (
        "import sys, importlib, pkgutil, engine\n"
        "for m in pkgutil.iter_modules(engine.__path__):\n"
        "    importlib.import_module('engine.' + m.name)\n"
        "assert 'guard' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serving_imports_neither_torch_nor_engine_nor_guard():
    code = (
        "import sys, importlib, pkgutil, serving\n"
        "for m in pkgutil.iter_modules(serving.__path__):\n"
        "    importlib.import_module('serving.' + m.name)\n"
        "bad = [k for k in ('torch', 'engine', 'guard', 'uvicorn') if k in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_guard_without_redis_does_not_import_redis_py():
    """What ``kvguard proxy`` and ``kvguard epp`` import to start (their CLIs, the proxy's app,
    the EPP's server, the controller, the budget package) leaves redis-py (~50 ms of every
    start) to a guard that uses Redis: the Redis stores and clients load on first use."""
    code = (
        "import sys\n"
        "import guard.proxy.cli, guard.proxy.app, guard.epp.cli, guard.epp.server\n"
        "import guard.controller, guard.config\n"
        "from guard.budget import MemoryStore, build_budget_store\n"
        "bad = [k for k in ('redis', 'tenacity') if k in sys.modules]\n"
        "assert not bad, bad\n"
        "from guard.budget import FallbackStore, RedisStore\n"
        "assert FallbackStore.__module__ == 'guard.budget.fallback' and 'redis' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
