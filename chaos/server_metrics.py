"""The server's own counters, scraped before and after a run, so a report can reconcile.

``scrape`` reads a Prometheus text page; ``counter_deltas`` keeps the counters (``*_total``
and histogram ``*_count``) that moved; ``server_outcomes`` folds the known families — a kvguard
engine replica's and the kvguard guard's — into the outcome counter names.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chaos.client import require_loopback

__all__ = ["parse_metrics", "scrape", "counter_deltas", "server_outcomes", "family_total"]

# outcome -> sample name (summed over labels), per kind of server
_ENGINE = {
    "offered": "kvguard_engine_requests_received_total",
    "completed": "vllm:request_success_total",
    "rejected": "kvguard_engine_requests_rejected_total",
    "failed": "kvguard_engine_requests_failed_total",
    "canceled": "kvguard_engine_requests_aborted_total",
}
_GUARD = {
    "offered": "kvguard_requests_offered_total",
    "completed": "kvguard_requests_completed_total",
    "rejected": "kvguard_requests_rejected_total",
    "failed": "kvguard_requests_failed_total",
    "canceled": "kvguard_requests_canceled_total",
}


def _key(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page as ``'name{k="v",...}' -> value``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[_key(sample.name, sample.labels)] = float(sample.value)
    return out


def scrape(url: str, timeout_s: float = 5.0, *, admin_key: str | None = None,
           on_refused=None) -> dict[str, float] | None:
    """Scrape ``url`` (with ``Authorization: Bearer admin_key`` when given); None (not an
    exception) when the server has no metrics page. A 401/403 also gives None, and
    ``on_refused(url, status)`` is called so the caller can say why."""
    require_loopback(url)
    headers = {"authorization": f"Bearer {admin_key}"} if admin_key else None
    try:
        resp = httpx.get(url, timeout=timeout_s, trust_env=False, headers=headers)
    except httpx.HTTPError:
        return None
    if resp.status_code in (401, 403) and on_refused is not None:
        on_refused(url, resp.status_code)
    if resp.status_code != 200:
        return None
    return parse_metrics(resp.text)


def _is_counter(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith("_total") or name.endswith("_count")


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """after - before for every counter sample present after the run that moved."""
    out = {}
    for key, value in after.items():
        if _is_counter(key):
            delta = value - before.get(key, 0.0)
            if delta:
                out[key] = delta
    return out


def family_total(samples: dict[str, float], name: str) -> float | None:
    """Sum of one sample name over all its label sets; None when the name never appears."""
    hits = [v for k, v in samples.items() if k.split("{", 1)[0] == name]
    return sum(hits) if hits else None


def server_outcomes(deltas: dict[str, float], after: dict[str, float]) -> dict | None:
    """Outcome counts by the server, from whichever family (guard first, then engine) exists."""
    for kind, names in (("guard", _GUARD), ("engine", _ENGINE)):
        if family_total(after, names["offered"]) is None:
            continue
        counts = {o: int(family_total(deltas, n) or 0) for o, n in names.items()}
        return {"kind": kind, **counts}
    return None
