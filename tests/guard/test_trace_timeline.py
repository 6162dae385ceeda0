import asyncio
import io
import json
import sys
from pathlib import Path

import httpx
import pytest

from guard import cli
from guard.observe import timeline
from guard.observe.trace import TraceWriter
from tests.support.admission import PROMPT, Client, SlotPolicy, http_scope, make_guard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from server_helpers import start_engine  # noqa: E402


class Sink(io.StringIO):
    def close(self):  # keep the text readable after the writer closes it
        self.closed_by_writer = True


def test_trace_writer_buffers_up_to_the_bound_and_flushes_on_close():
    out = Sink()
    writer = TraceWriter(out, max_buffered=2)
    writer.write({"request_id": "a"})
    assert out.getvalue() == ""
    writer.write({"request_id": "b"})
    assert [json.loads(x)["request_id"] for x in out.getvalue().splitlines()] == ["a", "b"]
    writer.write({"request_id": "c"})
    writer.close()
    writer.write({"request_id": "d"})  # after close: dropped, no error
    assert [json.loads(x)["request_id"] for x in out.getvalue().splitlines()] == ["a", "b", "c"]


async def _stream_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream")]})
    await send({"type": "http.response.body", "body": b'data: {"text":"x"}\n\n', "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def test_middleware_traces_admitted_and_shed_requests():
    out = Sink()

    async def main():
        guard = make_guard(_stream_app, policy=SlotPolicy(num_slots=1, queue_s=None))
        guard.controller.trace = TraceWriter(out, max_buffered=100)
        ok = Client(PROMPT)
        await guard(http_scope(), ok.receive, ok.send)
        guard.controller.policy.num_slots = 0
        shed = Client(PROMPT)
        await guard(http_scope(), shed.receive, shed.send)
        bad = Client(b"{nope")
        await guard(http_scope(), bad.receive, bad.send)
        await guard.aclose()

    asyncio.run(main())
    admitted, shed, bad = [json.loads(x) for x in out.getvalue().splitlines()]
    assert admitted["decision"] == "admit" and admitted["outcome"] == "completed"
    assert admitted["replica"] == "local" and admitted["upstream_request_id"] == admitted["request_id"]
    assert admitted["arrival_s"] <= admitted["dispatch_s"] <= admitted["first_token_s"] <= admitted["completion_s"]
    assert admitted["predicted_ttft_s"] == 0.1 and admitted["met_slo"] is True
    assert shed["decision"] == "shed" and shed["outcome"] == "rejected" and shed["status"] == 503
    assert bad["status"] == 400 and bad["reason"] == "invalid_json"
    assert len({admitted["request_id"], shed["request_id"], bad["request_id"]}) == 3


def test_timeline_joins_by_request_id_with_exact_stages(tmp_path, capsys):
    guard_lines = [
        {"source": "guard", "request_id": "r1", "arrival_s": 100.0, "dispatch_s": 100.002,
         "completion_s": 100.5},
        {"source": "guard", "request_id": "shed", "arrival_s": 101.0, "dispatch_s": None,
         "completion_s": 101.001},
    ]
    engine_lines = [
        {"source": "engine", "request_id": "r1", "arrival_s": 7.0, "prefill_start_s": 7.01,
         "prefill_end_s": 7.05, "first_token_s": 7.05, "completion_s": 7.45},
    ]
    g, e = tmp_path / "guard.jsonl", tmp_path / "engine.jsonl"
    g.write_text("\n".join(json.dumps(x) for x in guard_lines) + "\n")
    e.write_text("\n".join(json.dumps(x) for x in engine_lines) + "\n")
    guard, engine = timeline.load_traces([str(g), str(e)])
    stages = timeline.stage_ms(guard["r1"], engine["r1"])
    assert stages["guard_queue"] == pytest.approx(2.0)
    assert stages["waiting"] == pytest.approx(10.0)
    assert stages["prefill"] == pytest.approx(40.0)
    assert stages["decode"] == pytest.approx(400.0)
    assert stages["delivery"] == pytest.approx(498.0 - 450.0)
    assert stages["total"] == pytest.approx(500.0)
    assert cli.main(["timeline", str(g), str(e), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_joined"] == 1 and summary["num_guard_only"] == 1
    assert summary["stages"]["prefill"]["p50_ms"] == pytest.approx(40.0)
    assert cli.main(["timeline", str(g), str(e)]) == 0
    assert "delivery" in capsys.readouterr().out


def test_percentile_and_bad_lines(tmp_path):
    assert timeline.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert timeline.percentile([5.0], 99) == 5.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"no_id": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        timeline.load_traces([str(bad)])


@pytest.mark.slow
def test_real_engine_and_guard_traces_join(tmp_path):
    guard_trace, engine_trace = tmp_path / "guard.jsonl", tmp_path / "engine.jsonl"
    config = tmp_path / "guard.toml"
    config.write_text(f'policy = "always-admit"\ntrace_path = "{guard_trace}"\n')
    with start_engine(["--model", "tiny", "--device", "cpu", "--guard", str(config),
                       "--trace", str(engine_trace)]) as eng:
        for stream in (False, True, True):
            body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream}
            response = httpx.post(eng.base_url + "/v1/completions", json=body, timeout=30, trust_env=False)
            assert response.status_code == 200
    guard, engine = timeline.load_traces([str(guard_trace), str(engine_trace)])
    assert len(guard) == 3 and set(guard) == set(engine)
    summary = timeline.summarize(timeline.join(guard, engine))
    assert summary["stages"]["prefill"]["n"] == 3 and summary["stages"]["delivery"]["n"] == 3


def test_trace_lines_reach_the_file_within_a_second_and_on_shutdown():
    import io

    from guard.observe.trace import TraceWriter
    from tests.support.admission import FakeClock

    clock, out = FakeClock(0.0), io.StringIO()
    trace = TraceWriter(out, max_buffered=100, clock=clock)
    trace.write({"request_id": "a"})
    assert out.getvalue() == ""  # buffered
    clock.advance(1.0)
    trace.write({"request_id": "b"})  # a second after the last flush: both go out
    assert out.getvalue().count("\n") == 2
    trace.write({"request_id": "c"})
    trace.flush()  # what the controller does every second and at shutdown
    assert out.getvalue().count("\n") == 3
