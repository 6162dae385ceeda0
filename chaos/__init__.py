"""kvguard chaos: drives servers from outside over HTTP and reports goodput.

Modules: ``schedule`` (seeded open-loop arrivals), ``client`` (one streamed request, observed),
``load`` (the open-loop runner), ``records`` (what one request looked like), ``goodput``
(goodput, three variants), ``summary`` / ``report`` / ``plots`` (the run folder),
``server_metrics`` (reconcile with the server's counters), ``sweep`` (capacity curve),
``load_cli`` (``kvguard load``); ``bench/`` holds the benchmark tooling (``kvguard bench``).
The chaos suite: ``topology`` / ``child`` (the fleet on loopback), ``clients`` / ``sdk_client``
(users' clients as they exist in the wild), ``users`` and ``user_record`` (open-loop users
judged from their arrival), ``faults``, ``scenarios``, ``scenario_run``, ``verdict``,
``chaos_report`` and ``chaos_cli`` (``kvguard chaos``), ``client_factory`` (a user's client
by kind), ``fleet_demo`` (``kvguard demo --scenario seed``).
"""

__all__: list[str] = []
