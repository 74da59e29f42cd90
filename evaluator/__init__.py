"""evaluator process package: ``comap evaluator`` (held-out probes and success rate of every new adapter
version while the system runs), ``comap eval`` and ``comap compare``.

It plays its games with the actor's own code (``actors``) and meets the other processes through
``comap_async.wire``; only the drivers (``experiments``, ``benchmarks``) and the CLI import it."""
