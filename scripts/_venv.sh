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
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_venv.sh" "$ROOT/scripts/install" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$want" ]; then
  echo "[kvguard] installing dependencies into .venv (first run takes a few minutes)" >&2
  "$ROOT/scripts/install" dev "$VENV/bin/python"
  echo "$want" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
