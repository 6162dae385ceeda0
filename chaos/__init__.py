"""kvguard chaos: drives servers from outside over HTTP and reports goodput.

Modules: ``schedule`` (seeded open-loop arrivals), ``client`` (one streamed request, observed),
``load`` (the open-loop runner), ``records`` (what one request looked like), ``goodput``
(DESIGN.md goodput, three variants), ``summary`` / ``report`` / ``plots`` (the run folder),
``server_metrics`` (reconcile with the server's counters), ``sweep`` (capacity curve),
``load_cli`` and ``bench_cli`` (the ``kvguard load`` / ``kvguard bench`` subcommands).
"""

__all__: list[str] = []
