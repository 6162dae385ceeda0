"""A bad guard configuration stops a plain ``uvicorn --lifespan auto`` at start-up, naming the
key (the middleware reads and validates its configuration when it is constructed, not in the
lifespan hook that ``--lifespan auto`` would swallow)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

APPS = {
    "wrapped": """
        from guard.middleware import AdmissionMiddleware

        async def inner(scope, receive, send):
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 200, "headers": []})
                await send({"type": "http.response.body", "body": b"ok"})

        app = AdmissionMiddleware(inner)
    """,
    "starlette": """
        from starlette.applications import Starlette
        from guard import AdmissionMiddleware, load_config

        app = Starlette()
        app.add_middleware(AdmissionMiddleware, config=load_config())
    """,
}


def _uvicorn(tmp_path, app: str, config_text: str) -> subprocess.Popen:
    (tmp_path / "guarded_app.py").write_text(textwrap.dedent(APPS[app]))
    config = tmp_path / "guard.toml"
    config.write_text(config_text)
    env = {**os.environ, "KVGUARD_CONFIG": str(config), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "guarded_app:app", "--lifespan", "auto",
         "--host", "127.0.0.1", "--port", "0", "--app-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


@pytest.mark.parametrize("app", sorted(APPS))
def test_typo_in_a_key_exits_naming_it(tmp_path, app):
    proc = _uvicorn(tmp_path, app, 'polcy = "slo"\n')
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, output
    assert "polcy: unknown configuration key" in output


@pytest.mark.parametrize("app", sorted(APPS))
def test_a_valid_config_starts(tmp_path, app):
    proc = _uvicorn(tmp_path, app, 'policy = "slo"\n')
    try:
        for line in proc.stdout:
            if "Uvicorn running on" in line or proc.poll() is not None:
                break
        assert proc.poll() is None, "uvicorn exited with a valid config"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
