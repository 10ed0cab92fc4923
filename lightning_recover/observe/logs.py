"""The package's logging: named loggers under ``lightning_recover``, one handler set up by a program's entry
point (the CLI, the coordinator process), and the filters of noise a user cannot act on.

A library never configures logging on import: a script that uses the strategies keeps its own logging setup,
and ``logging.getLogger("lightning_recover").setLevel(...)`` tunes ours. The programs this package runs
itself (``lightning-recover ...``, the coordinator) print ``[TAG] message`` lines on stderr, as before.
"""

from __future__ import annotations

import logging
import sys
import warnings

ROOT = "lightning_recover"
#: Set on the handler this module installs, so that a second call replaces it instead of doubling lines.
_HANDLER_NAME = "lightning-recover"


def configure_logging(tag: str = "lightning-recover", level: int | str = "INFO") -> logging.Handler:
    """Log the package's records as ``[tag] message`` lines on stderr at ``level``; returns the handler.
    Idempotent within a process (a second call replaces the handler).

    Raises:
        ValueError: ``level`` names no logging level.
    """
    chosen = level
    if isinstance(chosen, str):
        number = logging.getLevelName(chosen.upper())
        if not isinstance(number, int):
            raise ValueError(
                f"log level {chosen!r} is not one of DEBUG, INFO, WARNING, ERROR. HINT: e.g. level='DEBUG'"
            )
        chosen = number
    root = logging.getLogger(ROOT)
    for old in [h for h in root.handlers if h.get_name() == _HANDLER_NAME]:
        root.removeHandler(old)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(logging.Formatter(f"[{tag}] %(message)s"))
    root.addHandler(handler)
    root.setLevel(chosen)
    return handler


class _DropMessages(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, *prefixes: str) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


_LITLOGGER_TIP = _DropMessages("💡 Tip: For seamless cloud logging")


def quiet_lightning_noise() -> None:
    """Filter what Lightning and torch say in every replica that nobody running a recover job can act on.
    Each filter matches one message only; everything else of theirs is left as it is."""
    # Lightning finds `srun` on PATH and advises prepending it to the script. A recover job's replicas are
    # started by our launcher (under Slurm: `srun lightning-recover run ...`, docs/howto.md), never by srun
    # directly, so the advice is wrong here, and each replica process would repeat it.
    warnings.filterwarnings("ignore", message=r"The `srun` command is available on your system but is not used")
    # Lightning's own copy of torch's tree flattening (lightning/pytorch/utilities/_pytree.py) builds
    # `LeafSpec()`, which torch >= 2.10 deprecates; the call is inside Lightning, not in the user's code.
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    # The Trainer advertises a hosted logger on every fit, in every replica process: not a problem to fix.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        target = logging.getLogger(name)
        if _LITLOGGER_TIP not in target.filters:
            target.addFilter(_LITLOGGER_TIP)
