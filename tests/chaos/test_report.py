"""Run output: every file, summaries that reconcile with the server's own counters, sweeps."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from chaos.goodput import Window
from chaos.load import LoadResult
from chaos.report import RUN_FILES, read_records, write_run
from chaos.summary import build_summary
from chaos.sweep import SweepPoint, capacity, capacity_label, sweep_rates
from guard.cli import main as kvguard
from policies.cost import RequestClass

_HELPERS = Path(__file__).parents[1] / "engine" / "server_helpers.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
OUTCOMES = ("completed", "rejected", "failed", "canceled")


def _server_helpers():
    spec = importlib.util.spec_from_file_location("engine_server_helpers", _HELPERS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


def _assert_run_files(out: Path) -> dict:
    for name in RUN_FILES:
        assert (out / name).stat().st_size > 0, name
    for name in ("timeline.png", "latency_cdf.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    summary = json.loads((out / "summary.json").read_text())
    assert len(read_records(out / "requests.jsonl")) == summary["counts"]["offered"]
    assert "## Goodput" in (out / "report.md").read_text()
    return summary


def test_load_against_the_sim_engine_reconciles_with_its_metrics(tmp_path):
    if not _HELPERS.exists():
        pytest.skip("tests/engine/server_helpers.py is not there yet")
    helpers = _server_helpers()
    out = tmp_path / "run"
    with helpers.start_engine(["--model", "llama-7b", "--backend", "sim", "--gpu", "h100-80g",
                               "--time-scale", "5", "--max-num-batched-tokens", "512"],
                              timeout_s=60.0) as eng:
        # prompts up to 6000 tokens: some exceed max_model_len 4096 -> 400 (rejected);
        # ~20k prompt tokens/s offered against ~7k/s of prefill at time scale 5: the first
        # requests finish, the queue then grows past the 2 s client timeout -> some canceled.
        rc = kvguard(["load", "--url", eng.base_url, "--rate", "10", "--duration", "3",
                      "--warmup", "0.5", "--prompt-tokens", "16:6000", "--output-tokens",
                      "1:12", "--timeout", "2.0", "--drain-timeout", "1", "--seed", "3",
                      "--out", str(out), "--quiet"])
    assert rc == 0, eng.output()[-2000:]
    summary = _assert_run_files(out)
    counts = summary["counts"]
    assert summary["reconciles"]
    assert counts["offered"] == sum(counts[o] for o in OUTCOMES) > 20
    assert counts["completed"] > 0 and counts["rejected"] > 0 and counts["canceled"] > 0
    assert set(counts["rejected_by"]) == {"400 -"}
    server = summary["server"]
    assert server["outcomes"]["kind"] == "engine"
    rec = server["reconcile"]
    # exact, except requests the client timed out on in the instant the server finished them
    assert rec["explained"], rec
    assert rec["num_canceled_unseen"] == 0, rec
    races = rec["num_canceled_but_settled"]
    assert races["rejected"] == races["failed"] == 0 and races["completed"] <= 2, rec
    assert rec["matches"] == (races["completed"] == 0)
    assert server["outcomes"]["offered"] == counts["offered"]
    gp = summary["goodput"]["total"]
    assert gp["num_offered"] == sum(r.scheduled_s >= 0.5 for r in read_records(
        out / "requests.jsonl"))
    assert gp["num_good"]["strict"] <= gp["num_good"]["p99_gap"] <= gp["num_successful"]


def _hand_records():
    from test_goodput import RECORDS
    return RECORDS


def test_write_run_from_hand_built_records(tmp_path):
    records = _hand_records()
    classes = {"interactive": RequestClass("interactive", 1.0, 0.1),
               "batch": RequestClass("batch", 5.0, 1.0)}
    result = LoadResult(records=tuple(records), duration_s=12.0, wall_s=13.0, cpu_s=1.3,
                        scheduled_rate_per_s=1.0, achieved_rate_per_s=0.9)
    window = Window(2.0, 12.0)
    summary = build_summary(result, declared_rate_per_s=1.0, shape="constant",
                            classes=classes, window=window)
    write_run(tmp_path, records, summary, classes, window)
    got = _assert_run_files(tmp_path)
    assert got["counts"]["rejected_by"] == {"503 -": 1}
    assert got["counts"]["truncated"] == 1
    assert got["goodput"]["total"]["num_good"] == {"strict": 3, "p99_gap": 4, "mean_tpot": 5}
    assert any("off its schedule" in w for w in got["warnings"])   # 10 % short
    assert got["load_generator"]["cpu_percent_of_one_core"] == pytest.approx(10.0)


def test_sweep_rates_and_capacity_knee():
    assert sweep_rates("0.5:2:0.5", 40) == [20.0, 40.0, 60.0, 80.0]
    with pytest.raises(ValueError):
        sweep_rates("2:1:0.5", 40)
    pts = [SweepPoint(r, 100, r, 0.0, 0.0, ratio) for r, ratio in
           [(20, 1.0), (40, 0.95), (60, 0.85), (80, 0.92)]]
    assert capacity(pts) == 40          # 80 recovers, but goodput already fell at 60
    assert capacity(pts[2:3]) is None
    assert capacity_label(pts, capacity(pts)) == "40 req/s"
    assert capacity_label(pts[:2], capacity(pts[:2])) == "≥ 40 req/s"  # every rate passed
    assert capacity_label(pts[2:3], None) == "none"


def test_sweep_cli_writes_the_curve(tmp_path, echo_url, capsys):
    out = tmp_path / "sweep"
    rc = kvguard(["load", "--url", echo_url, "--duration", "1", "--sweep", "0.5:1:0.5",
                  "--base-rate", "20", "--output-tokens", "4", "--metrics-url", "none",
                  "--out", str(out), "--quiet"])
    assert rc == 0
    doc = json.loads((out / "sweep.json").read_text())
    assert [p["rate_per_s"] for p in doc["points"]] == [10.0, 20.0]
    assert doc["capacity_rate_per_s"] == 20.0 and doc["capacity_is_lower_bound"]
    assert "of offered): ≥ 20 req/s" in capsys.readouterr().out
    assert (out / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    for sub in ("rate_10", "rate_20"):
        _assert_run_files(out / sub)


def test_reconcile_exact_and_explained_by_client_cancels():
    from chaos.summary import reconcile
    client = {"offered": 10, "completed": 6, "rejected": 2, "failed": 0, "canceled": 2}
    exact = reconcile(client, dict(client, kind="engine"))
    assert exact["matches"] and exact["explained"] and exact["num_canceled_unseen"] == 0
    # one cancel the server had already completed, one it never saw
    raced = reconcile(client, dict(client, offered=9, completed=7, canceled=0, kind="guard"))
    assert not raced["matches"] and raced["explained"]
    assert raced["num_canceled_unseen"] == 1
    assert raced["num_canceled_but_settled"] == {"completed": 1, "rejected": 0, "failed": 0}
    # the server rejected a request the client saw complete: not explainable
    wrong = reconcile(client, dict(client, completed=5, rejected=3, kind="engine"))
    assert not wrong["matches"] and not wrong["explained"]
    assert reconcile(client, None) is None


def test_cli_class_mix_and_explicit_api_keys(tmp_path, echo_url):
    out = tmp_path / "mix"
    rc = kvguard(["load", "--url", echo_url, "--rate", "30", "--duration", "1",
                  "--shape", "constant", "--mix", "interactive:1.0:0.08:1,batch:30:1:1",
                  "--api-keys", "chaos-tenant-0,chaos-tenant-1", "--output-tokens", "4",
                  "--metrics-url", "none", "--out", str(out), "--quiet"])
    assert rc == 0
    summary = _assert_run_files(out)
    per_class = summary["goodput"]["per_class"]
    assert set(per_class) == {"interactive", "batch"}
    assert sum(c["num_offered"] for c in per_class.values()) == 30
    assert summary["classes"]["batch"] == {"ttft_s": 30.0, "itl_s": 1.0}
    records = read_records(out / "requests.jsonl")
    assert {r.tenant for r in records} == {"chaos-tenant-0", "chaos-tenant-1"}
    # the echo server rejects tenant 1 with 503 and serves tenant 0
    assert all((r.outcome == "rejected") == (r.tenant == "chaos-tenant-1") for r in records)


def test_cli_refuses_a_bad_mix(capsys):
    assert kvguard(["load", "--url", "http://127.0.0.1:9", "--rate", "1", "--duration", "1",
                    "--mix", "interactive:1.0", "--metrics-url", "none"]) == 2
    assert "--mix" in capsys.readouterr().err


def test_metrics_scrape_sends_the_admin_key_and_says_when_refused(capsys):
    """A guard that protects its metrics answers 401 without the admin key: ``kvguard load``
    sends ``--admin-key`` (default $KVGUARD_ADMIN_API_KEY) and says why it cannot reconcile."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from chaos import load_cli

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("authorization") == "Bearer sk-admin"
            body = b"kvguard_requests_total 3\n" if ok else b"{}"
            self.send_response(200 if ok else 401)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/kvguard/metrics"
        assert load_cli._scrape_all([url], "sk-admin") == {"kvguard_requests_total": 3.0}
        assert load_cli._scrape_all([url], None) is None
        assert "answered 401: pass --admin-key" in capsys.readouterr().err
        args = load_cli.argparse.ArgumentParser()
        load_cli.configure(args)
        assert args.parse_args(["--url", url, "--rate", "1", "--duration", "1",
                                "--admin-key", "k"]).admin_key == "k"
    finally:
        server.shutdown()
