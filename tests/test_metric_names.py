"""Both Prometheus endpoints of ``kvguard engine --guard`` pass the rules ``promtool check
metrics`` applies (client_golang's promlint), parsed with prometheus-client's own parser.

One exception, on purpose: the ``vllm:*`` families keep vLLM's names (colons included) so
that anything that watches vLLM can watch a kvguard replica; every other family must be a
plain Prometheus name.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent / "engine"))
from server_helpers import start_engine  # noqa: E402

pytestmark = pytest.mark.slow

KEY = "sk-lint"
CONFIG = f"""
policy = "slo"
[[tenants]]
name = "acme"
api_key = "{KEY}"
"""
VLLM_PREFIX = "vllm:"
_BASE_UNITS = {"seconds", "bytes", "meters", "metres", "grams", "joules", "volts", "amperes",
               "celsius", "kelvin"}
_NON_BASE_UNITS = {"minutes", "hours", "days", "weeks", "bits", "inches", "yards", "miles",
                   "kelvins", "fahrenheit", "rankine", "calories", "pounds", "ounces"}
_UNIT_PREFIXES = ("pico", "nano", "micro", "milli", "centi", "deci", "deca", "hecto", "kilo",
                  "kibi", "mega", "mibi", "giga", "gibi", "tera", "tebi", "peta", "pebi")
_ABBREVIATIONS = ("s", "ms", "us", "ns", "sec", "b", "kb", "mb", "gb", "tb", "pb", "m", "h", "d")
_TYPES = ("counter", "gauge", "histogram", "summary", "gaugehistogram")
_CAMEL = re.compile(r"[a-z][A-Z]")
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _has_part(name: str, part: str) -> bool:
    return f"_{part}_" in name or name.endswith(f"_{part}")


def _unit_problems(name: str) -> list[str]:
    for word in name.split("_"):
        if word in _BASE_UNITS:
            return []
        if word in _NON_BASE_UNITS or any(
                word.startswith(p) and word[len(p):] in _BASE_UNITS | _NON_BASE_UNITS
                for p in _UNIT_PREFIXES):
            return [f"use base units, not {word!r}"]
    return []


def lint(text: str) -> list[str]:
    """promlint's problems for one exposition (``vllm:`` colons allowed)."""
    problems = []
    declared_counters = set(re.findall(r"^# TYPE (\S+) counter$", text, re.MULTILINE))
    for family in text_string_to_metric_families(text):
        # prometheus-client strips a counter's _total from the family name
        name = family.name + ("_total" if family.type == "counter" else "")
        lower = name.lower()
        found = []
        if not _NAME.match(name):
            found.append("invalid metric name")
        if ":" in name and not name.startswith(VLLM_PREFIX):
            found.append("metric names should not contain ':'")
        if not family.documentation:
            found.append("no help text")
        if _CAMEL.search(name):
            found.append("metric names should be snake_case")
        found += [f"metric name should not include type {t!r}" for t in _TYPES
                  if _has_part(lower, t)]
        found += ["abbreviated unit" for a in _ABBREVIATIONS if _has_part(lower, a)]
        found += _unit_problems(lower)
        if family.type == "counter" and family.name + "_total" not in declared_counters:
            found.append('counter metrics should have "_total" suffix')
        if family.type not in ("counter", "unknown") and name.endswith("_total"):
            found.append('non-counter metrics should not have "_total" suffix')
        if family.type not in ("histogram", "gaugehistogram") and name.endswith("_bucket"):
            found.append('non-histogram metrics should not have "_bucket" suffix')
        if family.type not in ("histogram", "summary", "gaugehistogram", "unknown") and (
                name.endswith("_count") or name.endswith("_sum")):
            found.append("_count/_sum are for histograms and summaries")
        for sample in family.samples:
            for label in sample.labels:
                if _CAMEL.search(label):
                    found.append(f"label {label!r} should be snake_case")
                if label == "le" and family.type not in ("histogram", "gaugehistogram"):
                    found.append('non-histogram metrics should not have "le" label')
                if label == "quantile" and family.type != "summary":
                    found.append('non-summary metrics should not have "quantile" label')
        problems += [f"{name}: {p}" for p in dict.fromkeys(found)]
    return problems


@pytest.mark.parametrize(("text", "problem"), [
    ("# HELP kvguard:x_total x\n# TYPE kvguard:x_total counter\nkvguard:x_total 1\n", "':'"),
    ("# HELP a_ms x\n# TYPE a_ms gauge\na_ms 1\n", "abbreviated"),
    ("# HELP a_milliseconds x\n# TYPE a_milliseconds gauge\na_milliseconds 1\n", "base units"),
    ("# HELP a_total x\n# TYPE a_total gauge\na_total 1\n", '"_total"'),
    ("# TYPE a gauge\na 1\n", "no help"),
    ("# HELP a x\n# TYPE a counter\na 1\n", '"_total" suffix'),
    ("# HELP a_gauge x\n# TYPE a_gauge gauge\na_gauge 1\n", "type 'gauge'"),
    ('# HELP a x\n# TYPE a gauge\na{fooBar="1"} 1\n', "snake_case"),
])
def test_the_linter_catches_what_promtool_would(text, problem):
    assert any(problem in p for p in lint(text)), lint(text)


def test_vllm_names_keep_their_colon():
    text = "# HELP vllm:x_total x\n# TYPE vllm:x_total counter\nvllm:x_total 1\n"
    assert lint(text) == []


@pytest.fixture(scope="module")
def guarded_engine(tmp_path_factory):
    config = tmp_path_factory.mktemp("guard") / "guard.toml"
    config.write_text(CONFIG)
    with start_engine(["--model", "tiny", "--device", "cpu", "--num-blocks", "64",
                       "--guard", str(config)]) as eng:
        yield eng


def test_both_endpoints_pass_the_lint(guarded_engine):
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=guarded_engine.base_url, timeout=60.0, trust_env=False,
                      headers=headers) as client:
        # fill the labelled series: a completion, a stream, a rejection
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}
                           ).status_code == 200
        with client.stream("POST", "/v1/completions",
                           json={"prompt": [1, 2], "max_tokens": 2, "stream": True}) as r:
            assert r.status_code == 200
            r.read()
        assert client.post("/v1/completions", content=b"{").status_code == 400
        pages = {path: client.get(path) for path in ("/metrics", "/kvguard/metrics")}
    for path, page in pages.items():
        assert page.status_code == 200, (path, page.text)
        families = list(text_string_to_metric_families(page.text))
        assert len(families) > 5, path
        assert lint(page.text) == [], path


def promtool_problems(text: str) -> list[str]:
    """``promtool check metrics`` on one exposition: its problems with kvguard-owned families
    (the ``vllm:*`` names are vLLM's on purpose), or a skip when promtool is absent."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          text=True, timeout=60)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return [line for line in lines if not line.startswith(VLLM_PREFIX)]


def test_the_engine_endpoints_are_promtool_clean(guarded_engine):
    with httpx.Client(base_url=guarded_engine.base_url, timeout=60.0, trust_env=False,
                      headers={"authorization": f"Bearer {KEY}"}) as client:
        assert client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}
                           ).status_code == 200
        pages = [client.get(path).text for path in ("/metrics", "/kvguard/metrics")]
    for page in pages:
        assert promtool_problems(page) == []


def test_the_proxy_endpoint_passes_the_lint_and_promtool(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent / "guard" / "proxy"))
    from proxy_helpers import proxy_child, running, upstream_child, write_config

    with running(upstream_child("ok", "m")) as upstream, \
            running(proxy_child([upstream.url], write_config(tmp_path),
                                state_source="none")) as proxy, \
            httpx.Client(base_url=proxy.url, timeout=60.0, trust_env=False) as client:
        assert client.post("/v1/completions", json={"model": "m", "prompt": "hi",
                                                    "max_tokens": 2}).status_code == 200
        page = client.get("/kvguard/metrics").text
    assert "kvguard_proxy_ejections_total" in page
    assert lint(page) == []
    assert promtool_problems(page) == []
