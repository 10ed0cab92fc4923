"""The first write to fresh memory: the floor under a load into new tensors on this machine.

A load into fresh tensors (``load`` without ``into=``) writes every byte into memory that nobody has touched, so
the kernel maps each of its pages on that first write (``checkpoint/file/page_populate.py`` does it beside the
reads). A device can be read faster than that: then the load's floor is ``max(read, first touch)``, not the read.
In a virtual machine the host may have to map the page too: a balloon with free page reporting hands the guest's
freed memory back to the host, which unmaps it, so memory a process frees and a later one allocates is new to the
host again (:func:`hypervisor_takes_free_pages`).

:func:`first_touch_s` times exactly what a load does for its storages: a fresh ``torch.UntypedStorage`` of the
bytes, populated by the load's own ``PagePopulator``.
"""

from __future__ import annotations

import os
import time

import torch

from lightning_recover.checkpoint.file.page_populate import PagePopulator, populate_supported

_VIRTIO_BALLOON_F_REPORTING = 5  # linux/virtio_balloon.h: the device takes reported free pages back
_BALLOON_DEVICES = "/sys/bus/virtio/drivers/virtio_balloon"


def balloon_reports_free_pages(features: str) -> bool:
    """Whether a virtio balloon's negotiated ``features`` (its sysfs file: one character per bit, bit 0 first)
    include free page reporting."""
    bits = features.strip()
    return len(bits) > _VIRTIO_BALLOON_F_REPORTING and bits[_VIRTIO_BALLOON_F_REPORTING] == "1"


def hypervisor_takes_free_pages(devices: str = _BALLOON_DEVICES) -> bool:
    """Whether a virtio balloon of this machine (under ``devices``, the driver's sysfs directory) reports free
    pages to its host."""
    try:
        names = [n for n in os.listdir(devices) if n.startswith("virtio")]
    except OSError:
        return False
    for name in names:
        try:
            with open(os.path.join(devices, name, "features")) as f:
                if balloon_reports_free_pages(f.read()):
                    return True
        except OSError:
            continue
    return False


def first_touch_s(nbytes: int) -> float:
    """Seconds to map ``nbytes`` of fresh memory as a load maps its fresh storages (populated on a thread where
    the kernel can, else written by this one); the memory is freed before it returns."""
    storage = torch.UntypedStorage(nbytes)
    began = time.perf_counter()
    if populate_supported():
        PagePopulator([storage]).wait()
    else:
        torch.empty(0, dtype=torch.uint8).set_(storage).fill_(0)
    elapsed = time.perf_counter() - began
    del storage
    return elapsed
