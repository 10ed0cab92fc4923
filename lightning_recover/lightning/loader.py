"""The training DataLoader as the Trainer sees it under ``strategy="recover"``: one token per step.

Microbatch ``(s, j)`` is built from the DataLoader's dataset by
:class:`~lightning_recover.data.MicrobatchSource`, so what a step reads depends only on the step
index, never on which replica computes it or how many replicas are alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any, Optional, cast

from torch.utils.data import DataLoader, IterableDataset

from lightning_recover.data import MicrobatchSource


class StepBatch:
    """What the Trainer sees as one training "batch": a token for one optimizer step.

    The step's index is ``trainer.global_step`` when it runs; its microbatches are built inside
    the strategy's ``training_step``. Callbacks' ``on_train_batch_start/end`` receive this token.
    """

    __slots__ = ("loader", "position")

    def __init__(self, loader: StepLoader, position: int) -> None:
        self.loader = loader
        self.position = position  # position within the Trainer's epoch (informational)

    def __repr__(self) -> str:
        return f"StepBatch(position={self.position}, microbatches={self.loader.source.M})"


class StepLoader:
    """The training DataLoader seen as one :class:`StepBatch` per optimizer step.

    Stateful for Lightning (``state_dict``/``load_state_dict``): the checkpoint records the
    microbatch layout, and resuming with a different one is refused (the data position would not
    mean the same samples).
    """

    def __init__(
        self, dataloader: object, microbatches: int, seed: int, resume_position: Optional[Callable[[], int]] = None
    ) -> None:
        self.dataloader = check_train_dataloader(dataloader)  # what Lightning hands the strategy: any iterable
        self.source = MicrobatchSource.from_dataloader(self.dataloader, microbatches, seed=seed)
        self.resume_position = resume_position  # where in the epoch a resumed run continues
        self._resuming = False

    def __len__(self) -> int:
        return self.source.steps_per_epoch

    def __iter__(self) -> Iterator[StepBatch]:
        # After a resume (checkpoint or rejoin) the first iteration continues mid-epoch, so that the
        # tokens left in it (and Lightning's ``is_last_batch``) match the steps left in the epoch.
        start = 0
        if self._resuming:
            self._resuming = False
            start = self.resume_position() if self.resume_position is not None else 0
        for position in range(start, len(self)):
            yield StepBatch(self, position)

    @property
    def samples_per_step(self) -> int:
        return self.source.b * self.source.M

    def _layout(self) -> dict[str, int]:
        return {
            "microbatches": self.source.M,
            "microbatch_size": self.source.b,
            # map-style (check_train_dataloader refuses a dataset without __len__); torch's Dataset type has none
            "samples": len(cast(Sized, self.source.dataset)),
            "seed": self.source.seed,
            "shuffle": int(self.source.shuffle),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"lightning_recover": self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resuming = True  # Lightning restores loader states only when it resumes a fit
        saved = state.get("lightning_recover") if isinstance(state, dict) else None
        if saved is None:
            return
        now = self._layout()
        diff = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
        if diff:
            detail = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diff.items())
            raise ValueError(
                f"the checkpoint was written with a different microbatch layout ({detail}). The step number only "
                "names the same samples under the same layout. HINT: resume with the same "
                "RecoverTrainerStrategy(microbatches=..., seed=...), DataLoader batch_size, shuffle and dataset; "
                "the replica count may differ."
            )


def check_train_dataloader(dataloader: object) -> DataLoader:
    """Refuse training loaders that cannot be cut into numbered microbatches, saying what to do; return the
    DataLoader."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(
            f"strategy='recover' needs a torch DataLoader for training, got {type(dataloader).__name__}. "
            "HINT: return `DataLoader(map_style_dataset, batch_size=microbatch_size, shuffle=...)` from "
            "train_dataloader(); one batch is one microbatch."
        )
    if isinstance(dataloader.dataset, IterableDataset) or not hasattr(dataloader.dataset, "__len__"):
        raise TypeError(
            "strategy='recover' cannot train on an IterableDataset: microbatch (step, j) must be addressable so a "
            "survivor can recompute a dead replica's share. HINT: use a map-style dataset "
            "(__len__/__getitem__), e.g. by materialising or indexing the stream."
        )
    if dataloader.batch_size is None:
        raise ValueError(
            "strategy='recover' needs the training DataLoader's batch_size (one batch = one microbatch); custom "
            "batch samplers are not supported. HINT: DataLoader(dataset, batch_size=b, shuffle=True)."
        )
    return dataloader


def epoch_position(trainer: Any, steps_per_epoch: int) -> int:
    """The step within the epoch a resumed fit continues at (microbatch data is a function of the step)."""
    limit = trainer.limit_train_batches
    if (isinstance(limit, float) and limit == 1.0) or (isinstance(limit, int) and limit >= steps_per_epoch):
        return trainer.global_step % steps_per_epoch
    return 0  # limit_train_batches: the Trainer's epochs are not data epochs; iterate from the start
