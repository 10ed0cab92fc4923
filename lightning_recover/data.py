"""Which samples form microbatch (s, j): a pure function of the step, the id and the seed.

Microbatch ``j`` of step ``s`` holds samples ``[(s'*M + j)*b, (s'*M + j + 1)*b)`` of the epoch's
seeded permutation (``s'`` = the step within its epoch). Which replica computes it never changes
what data it holds; that is what makes recovery exact, not only statistically equivalent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler
from torch.utils.data.dataloader import default_collate


class MicrobatchSource:
    """Builds microbatch (s, j) of a map-style dataset.

    Args:
        dataset: a map-style dataset (``__len__`` and ``__getitem__``).
        microbatch_size: samples per microbatch (``b``); the DataLoader's ``batch_size``.
        microbatches: microbatches per optimizer step (``M``).
        shuffle: a fresh seeded permutation per epoch, else the dataset's order.
        seed: permutation seed (the same on every replica).
        collate_fn: turns a list of samples into a batch.
    """

    def __init__(
        self,
        dataset: Dataset,
        microbatch_size: int,
        microbatches: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
    ) -> None:
        if microbatch_size < 1:
            raise ValueError(f"microbatch_size must be >= 1, got {microbatch_size}")
        self.dataset = dataset
        self.b = microbatch_size
        self.M = microbatches
        self.shuffle = shuffle
        self.seed = seed
        self.collate_fn = collate_fn or default_collate
        self.steps_per_epoch = len(dataset) // (self.b * self.M)  # type: ignore[arg-type]
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"the dataset has {len(dataset)} samples, fewer than one step needs "  # type: ignore[arg-type]
                f"(microbatches={self.M} x batch_size={self.b}). HINT: lower microbatches or batch_size."
            )
        self._perm_epoch = -1
        self._perm: Sequence[int] = []

    @classmethod
    def from_dataloader(cls, loader: DataLoader, microbatches: int, seed: int = 0) -> MicrobatchSource:
        if loader.batch_size is None:
            raise ValueError("the DataLoader needs a batch_size (one batch = one microbatch)")
        if not hasattr(loader.dataset, "__len__"):
            raise ValueError("strategy='recover' needs a map-style dataset (with __len__/__getitem__)")
        return cls(
            loader.dataset,
            loader.batch_size,
            microbatches,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            collate_fn=loader.collate_fn,
        )

    def indices(self, step: int, j: int) -> Sequence[int]:
        if not 0 <= j < self.M:
            raise IndexError(f"microbatch id {j} outside 0..{self.M - 1}")
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                self._perm = torch.randperm(n, generator=gen).tolist()
            else:
                self._perm = range(n)
            self._perm_epoch = epoch
        start = (within * self.M + j) * self.b
        return self._perm[start : start + self.b]

    def batch(self, step: int, j: int) -> Any:
        return self.collate_fn([self.dataset[i] for i in self.indices(step, j)])
