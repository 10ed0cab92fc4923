"""The control plane's scheduling priority on a host the job's processes share (``LIGHTNING_RECOVER_CONTROL_NICE``).

A replica takes the coordinator for lost when it does not answer within a bound, and an etcd monitor role is lost
when its lease is not renewed within its TTL. On a host whose training processes take every core, the processes
that answer and renew (the coordinator; the launcher, which holds the monitor role and the coordinator link) are
given the nice value of ``LIGHTNING_RECOVER_CONTROL_NICE`` where it is set. On Linux a nice value belongs to a
thread, and the threads and processes a thread starts inherit it: a launcher sets it on its main thread before it
starts any other, so that none of its threads waits on the interpreter lock held by one running at a lower
priority, and the processes it starts set the launcher's own value back before their command runs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Optional

from lightning_recover import env

_RANGE = "an integer from -20 to 19, e.g. -10"


def control_nice(environ: Mapping[str, str] = os.environ) -> Optional[int]:
    """The nice value ``LIGHTNING_RECOVER_CONTROL_NICE`` asks for; None where it is unset or empty.

    Raises:
        ValueError: the value is not a nice value (the message names the variable and the range).
    """
    text = environ.get(env.CONTROL_NICE, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{env.CONTROL_NICE}={text!r} is not a nice value ({_RANGE})") from None
    if not -20 <= value <= 19:
        raise ValueError(f"{env.CONTROL_NICE}={value} is not a nice value ({_RANGE})")
    return value


def set_thread_nice(value: int) -> None:
    """Give the calling thread (and the threads and processes it starts from now on) the nice value ``value``.

    Raises:
        ValueError: a nice value lower than the thread's is not permitted to this process.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, value)
    except PermissionError:
        raise ValueError(
            f"{env.CONTROL_NICE}={value}: lowering a nice value needs root or CAP_SYS_NICE; run as root, or unset it"
        ) from None


def check_nice_permitted(value: int) -> None:
    """Raise what :func:`set_thread_nice` would, without changing any thread of this process but a throwaway one.

    Raises:
        ValueError: as :func:`set_thread_nice`.
    """
    refused: list[ValueError] = []

    def attempt() -> None:
        try:
            set_thread_nice(value)
        except ValueError as exc:
            refused.append(exc)

    thread = threading.Thread(target=attempt, name="lr-nice-check")
    thread.start()
    thread.join()
    if refused:
        raise refused[0]
