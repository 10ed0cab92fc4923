"""How the tests compare: a run's state against a reference, and a measured time against a documented bound.

One slack rule for every time bound the docs state: a measurement passes when it is at most the bound plus
:data:`SLACK` (a waiting process is scheduled late on a loaded 2-core machine, CI's), or plus
:data:`EXIT_SLACK` where the measurement also takes in processes exiting and being reaped.
"""

from __future__ import annotations

import torch

#: Seconds a measured time may exceed the documented bound it checks.
SLACK = 1.5
#: The same, for a bound that ends when processes have exited and their parent reaped them (an interpreter's
#: exit on a loaded 2-core machine takes seconds).
EXIT_SLACK = 3.0


def max_relative_difference(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest difference between ``state`` and ``reference`` over their tensors, relative to the largest
    magnitude of the reference tensor (in float64, whatever the tensors' dtype)."""
    worst = 0.0
    for key, ref in reference.items():
        diff = (state[key].double() - ref.double()).abs().max().item()
        worst = max(worst, diff / max(ref.double().abs().max().item(), 1e-12))
    return worst


def assert_same(a: dict, b: dict) -> None:
    """``a`` and ``b`` hold the same keys, equal values and bitwise-equal tensors of the same dtype and shape."""
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == b[k].dtype and v.shape == b[k].shape, k
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def checkpoint_io_config(io) -> tuple:
    """What configures a checkpoint IO, the wrapper's settings before the wrapped IO's: a pickled or deep-copied IO
    must compare equal to its original. Any other IO (Lightning's own) is its type alone."""
    from lightning_recover import AsyncUringCheckpointIO, UringCheckpointIO  # here: the unit tier imports this module

    if isinstance(io, AsyncUringCheckpointIO):
        return (
            type(io),
            io.eager_bytes,
            io.max_pending_bytes,
            io.flush_bytes_per_s,
            *checkpoint_io_config(io.checkpoint_io),
        )
    if isinstance(io, UringCheckpointIO):
        return (type(io), io.new_engine().kwargs, io.weights_only, io.verify)
    return (type(io),)
