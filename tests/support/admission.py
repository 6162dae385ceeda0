"""Tiny builders shared by the guard tests."""

from __future__ import annotations

from guard.replicas.reservations import Reservation
from policies.cost import RequestClass, RequestCost

INTERACTIVE = RequestClass("interactive", ttft_s=1.0, itl_s=0.08, priority=0)
BATCH = RequestClass("batch", ttft_s=30.0, itl_s=1.0, priority=2)


def make_cost(request_id: str = "r1", *, klass: RequestClass = INTERACTIVE, arrival_s: float = 0.0,
              deadline_s: float | None = None, num_blocks: int = 2, tenant: str = "acme",
              is_retry: bool = False) -> RequestCost:
    return RequestCost(
        request_id=request_id, tenant=tenant, request_class=klass, num_prompt_tokens=10,
        max_tokens=16, num_expected_output_tokens=8, num_blocks=num_blocks, arrival_s=arrival_s,
        deadline_s=arrival_s + klass.ttft_s if deadline_s is None else deadline_s,
        is_retry=is_retry,
    )


def reserved(cost: RequestCost, replica_id: str = "local") -> Reservation:
    """A reservation of ``cost`` on ``replica_id`` outside any load state (ticket tests)."""
    return Reservation(replica_id, cost, cost.arrival_s)


class FakeClock:
    def __init__(self, now_s: float = 0.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, dt_s: float) -> None:
        self.now_s += dt_s


def state_doc(num_free_blocks: int = 1000, max_model_len: int = 256, block_size: int = 16) -> dict:
    """A minimal ``/kvguard/state`` document of an idle replica."""
    return {
        "model": "tiny", "backend": "sim", "max_model_len": max_model_len, "block_size": block_size,
        "num_total_blocks": num_free_blocks, "num_free_blocks": num_free_blocks,
        "max_num_seqs": 64, "max_num_batched_tokens": 512, "num_preemptions": 0,
        "step_count": 0, "now_s": 0.0, "running": [], "waiting": [], "iterations": [],
        "timing_model": None, "time_scale": 1.0,
    }


class SlotPolicy:
    """A test policy: admit while fewer than ``num_slots`` are in flight, else queue (or shed)."""

    name = "slots"

    def __init__(self, num_slots: int = 1, queue_s: float | None = 5.0) -> None:
        self.num_slots = num_slots
        self.queue_s = queue_s
        self.samples = []
        self.admitted_ids = []

    def decide(self, cost, snapshot):
        from policies.decision import Admit, Queue, Shed

        if sum(r.num_inflight for r in snapshot.replicas) < self.num_slots:
            return Admit("local", predicted_ttft_s=0.1)
        if self.queue_s is None:
            return Shed(503, "overloaded")
        return Queue(until_s=cost.arrival_s + self.queue_s)

    def admitted(self, cost, replica_id, now_s):
        self.admitted_ids.append(cost.request_id)

    def observe(self, sample):
        self.samples.append(sample)


def make_guard(app, policy=None, clock=None, **config):
    """An AdmissionMiddleware over ``app`` with an injected, primed LoadState."""
    from prometheus_client import CollectorRegistry

    from guard.config import GuardConfig
    from guard.middleware import AdmissionMiddleware
    from guard.replicas.load_state import LoadState

    clock = clock or FakeClock(1.0)
    load_state = LoadState()
    load_state.update_from_kvguard_state("local", state_doc(), clock())
    return AdmissionMiddleware(app, GuardConfig(**config), registry=CollectorRegistry(), clock=clock,
                               policy=policy or SlotPolicy(), load_state=load_state)


def http_scope(path: str = "/v1/completions", method: str = "POST", headers=()) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


class Client:
    """Hand-driven ASGI receive/send for one request."""

    def __init__(self, body: bytes) -> None:
        import asyncio

        self.inbox: asyncio.Queue = asyncio.Queue()
        self.inbox.put_nowait({"type": "http.request", "body": body, "more_body": False})
        self.sent: list[dict] = []
        self.on_send = None  # optional callback(message)

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        if self.on_send is not None:
            self.on_send(message)

    def disconnect(self) -> None:
        self.inbox.put_nowait({"type": "http.disconnect"})

    @property
    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None

    @property
    def headers(self) -> dict:
        return {k.decode(): v.decode() for k, v in self.sent[0]["headers"]} if self.sent else {}

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


PROMPT = b'{"model": "tiny", "prompt": "hello there", "max_tokens": 8, "stream": true}'


async def admit(controller, path: str = "/v1/completions", headers=None, body: bytes = b"",
                client_gone=None):
    """What an adapter does with a whole body: ``decide``, then ``wait`` when told to."""
    from guard.admission.request import AdmissionRequest
    from guard.admission.wait import Wait

    result = controller.decide(AdmissionRequest(path, headers or {}, body, client_gone))
    if isinstance(result, Wait):
        result = await controller.wait(result)
    return result
