"""``pip install kvguard`` is the guard alone: its core dependencies are exactly what guard/ and
policies/ import (torch and the engine's parsers are the ``engine`` extra)."""

import ast
import re
import sys
from pathlib import Path

from guard.config import tomllib

ROOT = Path(__file__).resolve().parents[1]
DIST_NAMES = {"prometheus_client": "prometheus-client"}
# the gateway extra's modules (kvguard epp), imported only under guard/epp/
GATEWAY_DIST_NAMES = {"grpc": "grpcio", "grpc_health": "grpcio-health-checking",
                      "google": "protobuf", "envoy": "xds-protos"}
EPP = ROOT / "guard" / "epp"
# the kv-events extra's modules (the precise prefix-cache view), imported only by this module,
# inside the functions that subscribe (a guard-only install never needs them)
KV_EVENTS = ROOT / "guard" / "replicas" / "kv_events.py"
KV_EVENTS_DIST_NAMES = {"zmq": "pyzmq", "msgpack": "msgpack"}


def _third_party_imports(package: str, *, only: Path | None = None,
                         skip: Path | None = EPP) -> set[str]:
    names = set()
    for path in ([only] if only is not None and only.is_file() else
                 (only or ROOT / package).rglob("*.py")):
        if only is None and (path == KV_EVENTS or (skip is not None and path.is_relative_to(skip))):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    local = {"guard", "policies", "engine", "chaos", "serving"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_core_dependencies_are_what_guard_and_policies_import():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    imported = {DIST_NAMES.get(n, n) for n in _third_party_imports("guard") | _third_party_imports("policies")}
    assert imported <= core, imported - core
    assert "torch" not in core and "transformers" not in core
    extras = project["optional-dependencies"]
    assert "torch" in _requirement_names(extras["engine"])
    assert "transformers" in _requirement_names(extras["bench"])
    # uvicorn: chaos.bench.guard serves with it; uvloop: the loop serving.h1server runs kvguard proxy
    # on; orjson: serving.json_body.loads, which parses guard's request bodies and state documents
    assert core - imported <= {"uvicorn", "uvloop", "orjson"}, core - imported



def test_the_gateway_extra_is_what_guard_epp_imports_beyond_the_core():
    """guard/epp/ alone imports gRPC and Envoy's messages, all of them from the gateway extra;
    its package __init__ and its director (picker) import none of it, so ``import guard.epp``
    works on a guard-only install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    gateway = _requirement_names(project["optional-dependencies"]["gateway"])
    assert set(GATEWAY_DIST_NAMES.values()) <= gateway
    imported = {GATEWAY_DIST_NAMES.get(n, DIST_NAMES.get(n, n))
                for n in _third_party_imports("guard", only=EPP)}
    assert imported <= core | gateway, imported - core - gateway
    assert imported & gateway == gateway  # every package of the extra is used
    for plain in ("__init__.py", "picker.py"):
        tree = ast.parse((EPP / plain).read_text())
        modules = {a.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for a in node.names}
        modules |= {node.module.split(".")[0] for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and node.module}
        assert not modules & set(GATEWAY_DIST_NAMES), (plain, modules & set(GATEWAY_DIST_NAMES))


def test_the_kv_events_extra_is_what_the_precise_view_imports_beyond_the_core():
    """Only guard/replicas/kv_events.py imports ZMQ and msgpack, both from the kv-events extra,
    and only inside functions: importing the module needs neither."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    extra = _requirement_names(project["optional-dependencies"]["kv-events"])
    imported = {KV_EVENTS_DIST_NAMES.get(n, DIST_NAMES.get(n, n))
                for n in _third_party_imports("guard", only=KV_EVENTS)}
    assert imported <= core | extra, imported - core - extra
    top_level = {a.name.split(".")[0] for node in ast.parse(KV_EVENTS.read_text()).body
                 if isinstance(node, ast.Import) for a in node.names}
    assert not top_level & set(KV_EVENTS_DIST_NAMES)



def test_chat_templates_need_jinja2_from_the_kv_events_extra_imported_only_when_compiled():
    """The guard's ``chat_template`` compiles through serving/chat_template.py, which imports
    jinja2 only inside the function that compiles: a guard-only install imports it fine and
    is told which extra to install when the key is set (tests/guard/test_chat_template.py)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "jinja2" in _requirement_names(project["optional-dependencies"]["kv-events"])
    assert "jinja2" not in _requirement_names(project["dependencies"])
    module = ROOT / "serving" / "chat_template.py"
    top_level = {a.name.split(".")[0] for node in ast.parse(module.read_text()).body
                 if isinstance(node, ast.Import) for a in node.names}
    top_level |= {node.module.split(".")[0] for node in ast.parse(module.read_text()).body
                  if isinstance(node, ast.ImportFrom) and node.module}
    assert "jinja2" not in top_level
    assert "jinja2" in _third_party_imports("serving", only=module)
