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


# --------------------------------------------------------------------------------------------
# the benchmark's states: a Llama-like mixed-precision training state, and 10k small tensors


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    d_model: int
    n_layer: int
    d_ff: int
    head_dim: int

    def param_shapes(self) -> OrderedDict[str, tuple[int, ...]]:
        d, f = self.d_model, self.d_ff
        shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        shapes["model.embed_tokens.weight"] = (self.vocab_size, d)
        for i in range(self.n_layer):
            p = f"model.layers.{i}."
            shapes[p + "input_layernorm.weight"] = (d,)
            for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[p + f"self_attn.{m}.weight"] = (d, d)
            shapes[p + "post_attention_layernorm.weight"] = (d,)
            shapes[p + "mlp.gate_proj.weight"] = (f, d)
            shapes[p + "mlp.up_proj.weight"] = (f, d)
            shapes[p + "mlp.down_proj.weight"] = (d, f)
        shapes["model.norm.weight"] = (d,)
        shapes["lm_head.weight"] = (self.vocab_size, d)
        return shapes

    def n_params(self) -> int:
        return sum(math.prod(s) for s in self.param_shapes().values())


# bf16 parameter + fp32 master copy + fp32 exp_avg + fp32 exp_avg_sq
LLAMA_BYTES_PER_PARAM = 2 + 4 + 4 + 4
LLAMA_VOCAB = 32000


def llama_config_for_size(size_bytes: float) -> LlamaConfig:
    """The Llama-shaped config (untied embeddings, SwiGLU MLP) whose training state is closest to ``size_bytes``.

    Widths are multiples of 128, ``d_ff`` is 8/3 of the width rounded up to 256, and the depth is
    chosen near Llama's aspect ratio (``n_layer ~ d_model / 128``) and to hit the size.
    """
    target = max(size_bytes, 1.0) / LLAMA_BYTES_PER_PARAM
    best: tuple[float, LlamaConfig] | None = None
    for d in range(128, 8192 + 1, 128):
        vocab = int(min(LLAMA_VOCAB, max(256, 0.25 * target / d)))
        f = -(-(8 * d // 3) // 256) * 256
        head_dim = 128 if d >= 1024 else 64
        per_layer = 4 * d * d + 3 * d * f + 2 * d
        n_layer = round((target - 2 * vocab * d - d) / per_layer)
        if n_layer < 1:
            continue
        cfg = LlamaConfig(vocab, d, n_layer, f, head_dim)
        score = abs(math.log(n_layer / (d / 128.0))) + 10.0 * abs(cfg.n_params() - target) / target
        if best is None or score < best[0]:
            best = (score, cfg)
    if best is None:
        return LlamaConfig(256, 128, 1, 512, 64)
    return best[1]


def _lightning_version() -> str:
    try:
        import lightning

        return lightning.__version__
    except Exception:  # pragma: no cover - lightning is a dependency
        return "unknown"


def _wrap(state_dict: Any, optimizer_states: list, step: int, hparams: dict) -> dict[str, Any]:
    return {
        "epoch": 3,
        "global_step": step,
        "pytorch-lightning_version": _lightning_version(),
        "state_dict": state_dict,
        "loops": {"fit_loop": {"epoch_loop.state_dict": {"_batches_that_stepped": step}}},
        "callbacks": {},
        "optimizer_states": optimizer_states,
        "lr_schedulers": [{"base_lrs": [3e-4], "last_epoch": step, "_step_count": step + 1, "_last_lr": [3e-4]}],
        "hyper_parameters": hparams,
    }


def build_llama_checkpoint(size_gb: float, seed: int = 0) -> tuple[dict[str, Any], LlamaConfig]:
    """A Lightning-like checkpoint of a Llama-shaped model trained in mixed precision, ~``size_gb`` GB.

    ``state_dict``: bf16 parameters plus each layer's fp32 rotary ``inv_freq`` buffer (a small vector).
    ``optimizer_states``: per parameter an fp32 master copy, fp32 ``exp_avg`` and ``exp_avg_sq`` and a 0-d
    ``step`` (AdamW with fp32 master weights, as mixed-precision optimizers keep them).
    """
    cfg = llama_config_for_size(size_gb * 1e9)
    gen = torch.Generator().manual_seed(seed)
    step = 1000
    state_dict: OrderedDict[str, torch.Tensor] = OrderedDict()
    opt_state: dict[int, dict[str, torch.Tensor]] = {}
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    idx = 0
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm.weight"):
            master = torch.ones(shape) + 0.01 * torch.randn(shape, generator=gen)
        else:
            master = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
        state_dict[name] = master.to(torch.bfloat16)
        if ".self_attn.q_proj." in name:  # one rope buffer per layer, as HF Llama keeps it in each attention
            state_dict[name.replace("q_proj.weight", "rotary_emb.inv_freq")] = inv_freq.clone()
        opt_state[idx] = {
            "step": torch.tensor(float(step), dtype=torch.float32),
            "exp_avg": torch.empty(shape).normal_(0.0, 1e-3, generator=gen),
            "exp_avg_sq": torch.empty(shape).uniform_(0.0, 1e-6, generator=gen),
            "master_param": master,
        }
        idx += 1
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(idx))}]
    hp = {**asdict(cfg), "model": "llama-like", "precision": "bf16-mixed (fp32 master weights)"}
    return _wrap(state_dict, [{"state": opt_state, "param_groups": groups}], step, hp), cfg


@dataclass(frozen=True)
class SmallTensorsConfig:
    n_tensors: int
    n_layer: int
    d_model: int


_SMALL_HEAD_DIM = 64


def _small_layer_tensors(d: int, n_small: int) -> list[tuple[str, tuple[int, ...]]]:
    """``n_small`` small tensors of one layer: norms, biases, quantisation scales, per-head vectors."""
    fixed: list[tuple[str, tuple[int, ...]]] = [
        ("ln_1.weight", (d,)),
        ("ln_1.bias", (d,)),
        ("ln_2.weight", (d,)),
        ("ln_2.bias", (d,)),
        ("attn.q_norm.weight", (_SMALL_HEAD_DIM,)),
        ("attn.k_norm.weight", (_SMALL_HEAD_DIM,)),
    ]
    for lin, out in (("attn.q", d), ("attn.k", d), ("attn.v", d), ("attn.o", d), ("mlp.up", 4 * d), ("mlp.down", d)):
        fixed += [(f"{lin}.bias", (out,)), (f"{lin}.weight_scale", (out,)), (f"{lin}.input_scale", ())]
    out = fixed[:n_small]
    j = 0
    while len(out) < n_small:  # per-head gates and 0-d scales fill the rest
        out.append((f"attn.heads.{j // 2}.gate", (_SMALL_HEAD_DIM,)) if j % 2 == 0 else (f"scales.{j // 2}", ()))
        j += 1
    return out


def small_tensors_config(size_bytes: float, n_tensors: int = 10000, n_layer: int = 64) -> SmallTensorsConfig:
    """Width of the 6 fp32 matrices per layer (``12 d^2`` params) so the whole state is about ``size_bytes``."""
    n_layer = max(1, min(n_layer, n_tensors // 8))
    d = max(64, round(math.sqrt(max(size_bytes, 1.0) / (n_layer * 12 * 4)) / 64) * 64)
    return SmallTensorsConfig(n_tensors, n_layer, d)


def build_small_tensors_checkpoint(
    size_gb: float, n_tensors: int = 10000, n_layer: int = 64, seed: int = 0
) -> tuple[dict[str, Any], SmallTensorsConfig]:
    """``n_tensors`` tensors totalling about ``size_gb`` GB: 6 large fp32 matrices per layer carry the bytes,
    every other tensor is small (norm weights and biases, linear biases and scales, per-head vectors, 0-d
    scales). A model-only Lightning checkpoint (no optimizer state)."""
    cfg = small_tensors_config(size_gb * 1e9, n_tensors, n_layer)
    d, L = cfg.d_model, cfg.n_layer
    gen = torch.Generator().manual_seed(seed)
    n_small = n_tensors - 6 * L
    state_dict: OrderedDict[str, torch.Tensor] = OrderedDict()
    for i in range(L):
        p = f"layers.{i}."
        per = n_small // L + (1 if i < n_small % L else 0)
        for name, shape in _small_layer_tensors(d, per):
            state_dict[p + name] = torch.rand(shape, generator=gen) if shape else torch.rand((), generator=gen)
        for lin, shape in (
            ("attn.q", (d, d)),
            ("attn.k", (d, d)),
            ("attn.v", (d, d)),
            ("attn.o", (d, d)),
            ("mlp.up", (4 * d, d)),
            ("mlp.down", (d, 4 * d)),
        ):
            state_dict[p + lin + ".weight"] = torch.empty(shape).normal_(0.0, 0.02, generator=gen)
    hp = {**asdict(cfg), "model": "many-small-tensors"}
    return _wrap(state_dict, [], 1000, hp), cfg


STATES = ("gpt", "llama", "small10k")
DEFAULT_SIZE_GB = {"gpt": 2.0, "llama": 2.0, "small10k": 1.0}


def build_state(kind: str, size_gb: float | None = None, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(checkpoint, description)`` of one of :data:`STATES` at about ``size_gb`` GB (default per state)."""
    if size_gb is None:
        size_gb = DEFAULT_SIZE_GB[kind]
    if kind == "gpt":
        ckpt, cfg = build_checkpoint(size_gb, seed)
        desc = f"GPT-like d_model={cfg.d_model} n_layer={cfg.n_layer} vocab={cfg.vocab_size} n_ctx={cfg.n_ctx} + AdamW"
    elif kind == "llama":
        ckpt, cfg = build_llama_checkpoint(size_gb, seed)
        desc = (
            f"Llama-like bf16 params + fp32 master/exp_avg/exp_avg_sq, d_model={cfg.d_model} "
            f"n_layer={cfg.n_layer} d_ff={cfg.d_ff} vocab={cfg.vocab_size}"
        )
    elif kind == "small10k":
        ckpt, cfg = build_small_tensors_checkpoint(size_gb, seed=seed)
        desc = f"{cfg.n_tensors} tensors, {cfg.n_layer} layers of 6 fp32 d={cfg.d_model} matrices + small tensors"
    else:
        raise ValueError(f"unknown state {kind!r}; choose from {STATES}")
    return ckpt, {"state": kind, "size_gb_requested": size_gb, "config": asdict(cfg), "description": desc}
