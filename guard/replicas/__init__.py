"""What the guard knows about its replicas: load state, reservations, state polling, state
documents (``/kvguard/state``, vLLM ``/metrics``, unknown capacity) and the step-time fitter."""

__all__: list[str] = []
