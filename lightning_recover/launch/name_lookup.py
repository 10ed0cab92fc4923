"""Whether this host's resolver answers the reverse lookup torch's TCPStore client makes on every connection.

Why: torch's TCPStore client (the embedded coordinator's, and every process group's rendezvous store) looks up
the name of the address it connects to (``getnameinfo`` without ``NI_NUMERICHOST``) each time it connects, and it
connects to an IPv4 address as its IPv4-mapped IPv6 form (``::ffff:a.b.c.d``), which ``/etc/hosts`` does not
match by its IPv4 line. The lookup then goes to DNS; a resolver that drops such queries makes each connection wait
for its timeout (5 s by default, more with retries). A job opens its connections in bursts (start-up, every
regroup), so this is a stall per replica per connection, seen as slow joins with nothing in the logs. The launcher
runs the same lookup once, beside its start, and says so in one line with the fix when it is slow.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Optional

#: A reverse lookup slower than this is worth a line: a connection's own cost on a host network is ~1 ms.
SLOW_LOOKUP = 0.5


def mapped_address(host: str) -> str:
    """The address torch's client connects to for ``host``: its IPv4-mapped IPv6 form, as ``getaddrinfo`` gives
    it for ``AF_INET6`` with ``AI_V4MAPPED`` (an IPv6 address stays itself)."""
    infos = socket.getaddrinfo(host, None, socket.AF_INET6, socket.SOCK_STREAM, 0, socket.AI_V4MAPPED | socket.AI_ALL)
    return str(infos[0][4][0])


def lookup_seconds(address: str, within: float) -> Optional[float]:
    """Seconds the reverse lookup of ``address`` took, or None when it did not finish within ``within`` (it goes on
    in a daemon thread: nothing waits for a resolver's timeout here)."""
    took: list[float] = []

    def look() -> None:
        began = time.monotonic()
        try:
            socket.getnameinfo((address, 0, 0, 0), socket.NI_NUMERICSERV)
        except OSError:
            pass  # a failed lookup is still a finished one: torch then prints the address
        took.append(time.monotonic() - began)

    thread = threading.Thread(target=look, name="lr-name-lookup", daemon=True)
    thread.start()
    thread.join(within)
    return took[0] if took else None


def slow_lookup_line(host: str, address: str, seconds: Optional[float], within: float = SLOW_LOOKUP) -> Optional[str]:
    """The launcher's line about the lookup of ``host`` (torch's ``address`` for it) that took ``seconds`` (None: not
    done within ``within``); None when it was quick."""
    if seconds is not None and seconds <= within:
        return None
    took = f"over {within:g}s" if seconds is None else f"{seconds:.2f}s"
    return (
        f"the reverse lookup of {address} ({host}) took {took}: torch's TCPStore client makes one on every "
        "connection, so each replica's control-plane and process-group connections may wait as long. HINT: add "
        f"'{address} {'localhost' if address == '::ffff:127.0.0.1' else '<its name>'}' to /etc/hosts, "
        "or run a caching resolver (nscd)"
    )


def check_in_background(host: str, say: Callable[[str], object], within: float = SLOW_LOOKUP) -> threading.Thread:
    """Look ``host`` up as torch's client will, on a daemon thread, and ``say`` the line when it is slow."""

    def check() -> None:
        try:
            address = mapped_address(host)
        except OSError:
            return  # not resolvable at all: the coordinator's own start says so
        line = slow_lookup_line(host, address, lookup_seconds(address, within), within)
        if line is not None:
            say(line)

    thread = threading.Thread(target=check, name="lr-name-lookup-check", daemon=True)
    thread.start()
    return thread
