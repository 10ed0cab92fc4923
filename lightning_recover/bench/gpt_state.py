"""A GPT-like training state (model + AdamW) wrapped like a Lightning checkpoint.

The checkpoint benchmark needs a state whose *shape* resembles a real one: a few large
matrices (embeddings, attention and MLP weights) and many small tensors (biases, layer
norms, AdamW's 0-d ``step`` tensors). The config is GPT-2's layout scaled so that
parameters + ``exp_avg`` + ``exp_avg_sq`` (all fp32, i.e. 12 bytes per parameter) hit a
requested size.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

MiB = 1 << 20
GPT2_VOCAB = 50257
GPT2_CTX = 1024


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    n_ctx: int
    d_model: int
    n_layer: int

    def param_shapes(self) -> OrderedDict[str, tuple[int, ...]]:
        d = self.d_model
        shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        shapes["transformer.wte.weight"] = (self.vocab_size, d)
        shapes["transformer.wpe.weight"] = (self.n_ctx, d)
        for i in range(self.n_layer):
            p = f"transformer.h.{i}."
            shapes[p + "ln_1.weight"] = (d,)
            shapes[p + "ln_1.bias"] = (d,)
            shapes[p + "attn.c_attn.weight"] = (d, 3 * d)
            shapes[p + "attn.c_attn.bias"] = (3 * d,)
            shapes[p + "attn.c_proj.weight"] = (d, d)
            shapes[p + "attn.c_proj.bias"] = (d,)
            shapes[p + "ln_2.weight"] = (d,)
            shapes[p + "ln_2.bias"] = (d,)
            shapes[p + "mlp.c_fc.weight"] = (d, 4 * d)
            shapes[p + "mlp.c_fc.bias"] = (4 * d,)
            shapes[p + "mlp.c_proj.weight"] = (4 * d, d)
            shapes[p + "mlp.c_proj.bias"] = (d,)
        shapes["transformer.ln_f.weight"] = (d,)
        shapes["transformer.ln_f.bias"] = (d,)
        return shapes

    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())


def _embedding_params(d: int, target_params: float) -> tuple[int, int]:
    # Keep GPT-2's vocabulary when it fits; for tiny states shrink it so the embeddings stay
    # around a third of the parameters (a real small model would have a smaller vocab too).
    vocab = int(min(GPT2_VOCAB, max(256, 0.3 * target_params / d)))
    n_ctx = int(min(GPT2_CTX, max(64, 0.05 * target_params / d)))
    return vocab, n_ctx


def config_for_size(size_bytes: float) -> GPTConfig:
    """The GPT-2-shaped config whose params + AdamW moments (fp32) are closest to ``size_bytes``.

    Among widths that are multiples of 64, picks the one whose depth is closest to GPT-2's
    aspect ratio (roughly ``n_layer ~ d_model / 48``), then the depth that best hits the size.
    """
    target_params = max(size_bytes, 1.0) / 12.0
    best: tuple[float, GPTConfig] | None = None
    for d in range(64, 4096 + 1, 64):
        vocab, n_ctx = _embedding_params(d, target_params)
        emb = (vocab + n_ctx) * d + 2 * d
        per_layer = 12 * d * d + 13 * d
        n_layer = round((target_params - emb) / per_layer)
        if n_layer < 1:
            continue
        cfg = GPTConfig(vocab, n_ctx, d, n_layer)
        size_err = abs(cfg.n_params() - target_params) / target_params
        aspect_err = abs(math.log(n_layer / (d / 48.0)))
        score = aspect_err + 10.0 * size_err
        if best is None or score < best[0]:
            best = (score, cfg)
    if best is None:  # absurdly small: one narrow layer
        vocab, n_ctx = _embedding_params(64, target_params)
        return GPTConfig(vocab, n_ctx, 64, 1)
    return best[1]


def build_checkpoint(size_gb: float, seed: int = 0) -> tuple[dict[str, Any], GPTConfig]:
    """A Lightning-like checkpoint dict of about ``size_gb`` * 1e9 tensor bytes.

    Every tensor owns its storage (no views, no tied weights), so all serializers see the same
    payload. Values are random so nothing compresses.
    """
    cfg = config_for_size(size_gb * 1e9)
    gen = torch.Generator().manual_seed(seed)
    step = 1000
    state_dict: OrderedDict[str, torch.Tensor] = OrderedDict()
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    for idx, (name, shape) in enumerate(cfg.param_shapes().items()):
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            w = torch.ones(shape) + 0.01 * torch.randn(shape, generator=gen)
        else:
            w = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        state_dict["model." + name] = w
        exp_avg = torch.empty(shape).normal_(0.0, 1e-3, generator=gen)
        exp_avg_sq = torch.empty(shape).uniform_(0.0, 1e-6, generator=gen)
        opt_state[idx] = {
            "step": torch.tensor(float(step), dtype=torch.float32),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    n = len(state_dict)
    param_groups = [
        {
            "lr": 6e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "foreach": None,
            "maximize": False,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "decoupled_weight_decay": True,
            "initial_lr": 6e-4,
            "params": list(range(n)),
        }
    ]
    try:
        import lightning

        pl_version = lightning.__version__
    except Exception:  # pragma: no cover - lightning is a dependency
        pl_version = "unknown"
    checkpoint: dict[str, Any] = {
        "epoch": 3,
        "global_step": step,
        "pytorch-lightning_version": pl_version,
        "state_dict": state_dict,
        "loops": {
            "fit_loop": {
                "state_dict": {},
                "epoch_loop.state_dict": {"_batches_that_stepped": step},
                "epoch_progress": {
                    "total": {"ready": 4, "started": 4, "processed": 3, "completed": 3},
                    "current": {"ready": 4, "started": 4, "processed": 3, "completed": 3},
                },
                "epoch_loop.batch_progress": {
                    "total": {"ready": step, "started": step, "processed": step, "completed": step},
                    "current": {"ready": 250, "started": 250, "processed": 250, "completed": 250},
                    "is_last_batch": False,
                },
            },
            "validate_loop": {"state_dict": {}},
        },
        "callbacks": {},
        "optimizer_states": [{"state": opt_state, "param_groups": param_groups}],
        "lr_schedulers": [{"base_lrs": [6e-4], "last_epoch": step, "_step_count": step + 1, "_last_lr": [6e-4]}],
        "hyper_parameters": {**asdict(cfg), "lr": 6e-4, "batch_size": 16, "model": "gpt2-like"},
    }
    return checkpoint, cfg


def iter_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor in a nested dict/list/tuple, in order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{prefix}/{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{prefix}/{i}" if prefix else str(i))


def tensor_stats(checkpoint: Any) -> dict[str, Any]:
    """Tensor count, payload bytes and size distribution of a checkpoint."""
    sizes = [t.numel() * t.element_size() for _, t in iter_tensors(checkpoint)]
    buckets = [("<4KiB", 4 << 10), ("<64KiB", 64 << 10), ("<1MiB", MiB), ("<16MiB", 16 * MiB), (">=16MiB", None)]
    hist: dict[str, int] = {}
    lo = 0
    for label, hi in buckets:
        hist[label] = sum(1 for s in sizes if s >= lo and (hi is None or s < hi))
        lo = hi or 0
    small = [s for s in sizes if s < MiB]
    return {
        "tensors": len(sizes),
        "bytes": int(sum(sizes)),
        "tensors_lt_1mib": len(small),
        "bytes_in_tensors_lt_1mib": int(sum(small)),
        "largest_tensor_bytes": int(max(sizes, default=0)),
        "size_histogram": hist,
    }
