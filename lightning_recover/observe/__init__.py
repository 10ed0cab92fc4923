"""Seeing a job while it runs: the monitor's status board, its HTTP server (``/metrics`` for Prometheus,
``/status`` as JSON, ``/`` a page), the JSON-lines event log, ``lightning-recover status``, the recovery
metrics in Lightning's loggers, and the package's logging.

Nothing here imports Lightning: the monitor (a coordinator process, or a launcher holding the etcd monitor
role) runs without it. docs/howto.md, "Watching a job", shows what a person sees.
"""
