"""LiteLLM proxy as a comparison target: its own virtualenv, offline, on loopback.

``ensure_venv(path)`` creates ``.venv-litellm/`` (``python3 -m venv`` + ``pip install
'litellm[proxy]'``) unless it already has a ``litellm`` executable, so LiteLLM's pins never
touch kvguard's environment. :func:`litellm_child` runs one worker in front of one
OpenAI-compatible upstream, with telemetry off and the bundled model-cost map (no network).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from chaos.child import ChildProcess

__all__ = ["ensure_venv", "litellm_child"]

_CONFIG = """model_list:
  - model_name: {model}
    litellm_params:
      model: openai/{model}
      api_base: {upstream}/v1
      api_key: none
litellm_settings:
  telemetry: false
  drop_params: true
"""


def ensure_venv(path: Path, *, log=print) -> Path:
    """The ``litellm`` executable in ``path`` (a virtualenv), installing it if missing."""
    exe = path / "bin" / "litellm"
    if exe.exists():
        return exe
    log(f"installing litellm[proxy] into {path} (one time; needs the package index)")
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([str(path / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)
    if not exe.exists():
        raise RuntimeError(f"pip installed litellm[proxy] but {exe} is missing")
    return exe


def _liveliness(url: str) -> bool:
    try:
        return httpx.get(url + "/health/liveliness", timeout=2.0,
                         trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def litellm_child(exe: Path, upstream: str, model: str, port: int, work_dir: Path,
                  master_key: str) -> ChildProcess:
    """A one-worker LiteLLM proxy on ``127.0.0.1:port`` routing ``model`` to ``upstream``;
    clients authenticate with ``Authorization: Bearer <master_key>``."""
    config = work_dir / "litellm.yaml"
    config.write_text(_CONFIG.format(model=model, upstream=upstream))
    env = {"LITELLM_MASTER_KEY": master_key, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
           "LITELLM_LOG": "ERROR", "NO_PROXY": "*", "no_proxy": "*",
           "PYTHONPATH": ""}  # its own venv only
    return ChildProcess(
        "litellm", lambda p: [str(exe), "--config", str(config), "--host", "127.0.0.1",
                              "--port", str(p), "--num_workers", "1"],
        _liveliness, port=port, env=env)
