"""What a pack or a micro-batch costs to train: a linear term in tokens and an attention term in L².

A sequence of ``L`` tokens, as the attention kernel sees it, costs

    cost(L) = linear * L + attention * L**2        (FLOPs, forward + backward)

and a pack (sequences concatenated, THD / varlen attention) costs the sum over its sequences:
tokens of different sequences never attend to each other. A micro-batch of padded rows (BSHD,
dynamic batching) costs ``rows * cost(W)`` for its padded width ``W``: a dense kernel computes
every row to ``W`` whatever its real length.

**The kernel's length.** Context parallelism splits each sequence into ``2*CP`` chunks, so each
sequence is padded to the CP multiple before the kernel sees it (``packing.padding`` has the
rule). The cost uses the padded length in the model's layout: ``"stored"`` (Megatron-LM: the
stored sequence ``L``) or ``"runtime"`` (Megatron-Bridge: the segment after the label shift,
``L - 1``). Dividing the work over the CP ranks scales every cost alike, so it changes no
balance and is left out.

**The FLOP count** (per token and layer, forward; hidden ``h``, FFN ``f``, ``n`` query heads and
``g`` key/value groups of ``d`` channels each, vocabulary ``V``; a multiply-add is 2 FLOPs):

======================  ===================================  ===========================
part                    forward FLOPs                        scales with
======================  ===================================  ===========================
QKV projection          ``2 * h * d * (n + 2 g)``            L
attention output        ``2 * n * d * h``                    L
MLP, gated (SwiGLU)     ``2 * 3 * h * f`` (``2 * 2 * h * f``  L
                        without a gate)
logits (once)           ``2 * h * V``                        L
scores ``Q K^T``        ``2 * n * d * L`` per token, halved  L²
                        by the causal mask
weighted sum ``P V``    the same                             L²
======================  ===================================  ===========================

so a causal sequence's attention core is ``2 * n * d * L**2`` forward FLOPs per layer:
flash-attention skips the blocks above the diagonal, computing ~L²/2 of the L² scores (the
diagonal blocks add ``O(L * block)``, ignored). Backward: a matmul's backward is two matmuls
of the same size (input and weight gradients), so the linear parts cost ``3x`` their forward;
flash-attention's backward recomputes the scores and runs five matmuls against the forward's
two, so the attention core costs ``1 + 2.5 = 3.5x`` its forward (FlashAttention-2, Dao 2023,
section 3.2). Full activation recomputation (``recompute=True``) runs each forward once more:
``4x`` and ``4.5x``. Hence

    linear    = k_lin * (layers * (2hd(n + 2g) + 2ndh + 2*m*h*f) + 2hV),   k_lin = 3 (4)
    attention = k_att * layers * 2 * n * d,                                k_att = 3.5 (4.5)

with ``m = 3`` for a gated MLP, 2 otherwise. For Llama-3-8B that is 45.0 GFLOP per token and
0.92 MFLOP per token², so attention is 8 % of a 4,096-token sequence's cost, 40 % at 32k and
73 % at 128k. Only the ratio ``attention / linear`` matters for balance; the absolute values
make the report's per-rank costs FLOPs. Embedding lookups, norms, softmax and the optimizer
step are left out (they are linear in tokens and small, or independent of the data).

Example::

    model = CostModel.from_preset("llama3-8b", pad_multiple=4)   # CP=2
    costs = pack_costs(seq_lengths, pack_offsets, model)         # float64 per pack
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Dict, Mapping, Optional

import numpy as np

from ..errors import ShardError
from ..format import PAD_LAYOUT_RUNTIME, PAD_LAYOUT_STORED, PAD_LAYOUTS
from . import _kernels

__all__ = ["ModelShape", "PRESETS", "CostModel", "pack_costs", "shard_pack_costs", "microbatch_cost",
           "kernel_lengths"]

#: Forward+backward multiples (see the module doc): linear layers, flash-attention's core.
LINEAR_FWD_BWD = 3.0
ATTENTION_FWD_BWD = 3.5


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ShardError(f"{name} must be an integer >= 1", field=name, actual=value)


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that its FLOP count needs.

    ``num_query_groups`` is the number of key/value heads (GQA; equal to the heads for MHA);
    ``kv_channels`` the per-head dimension (default ``hidden_size / num_attention_heads``).
    """

    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    gated_mlp: bool = True
    kv_channels: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                     "vocab_size"):
            _positive_int(name, getattr(self, name))
        if self.kv_channels is not None:
            _positive_int("kv_channels", self.kv_channels)

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of every part that is linear in the sequence length."""
        h, d, n, g = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_query_groups
        mlp_matrices = 3 if self.gated_mlp else 2
        per_layer = 2 * h * d * (n + 2 * g) + 2 * n * d * h + 2 * mlp_matrices * h * self.ffn_hidden_size
        return float(self.num_layers * per_layer + 2 * h * self.vocab_size)

    def attention_flops_per_token2(self) -> float:
        """Forward FLOPs per L² of a causal sequence's attention core (scores and weighted sum)."""
        return float(self.num_layers * 2 * self.num_attention_heads * self.head_dim)


#: Published dimensions (the models' Hugging Face ``config.json``).
PRESETS: Dict[str, ModelShape] = {
    "llama3-8b": ModelShape(hidden_size=4096, ffn_hidden_size=14336, num_layers=32, num_attention_heads=32,
                            num_query_groups=8, vocab_size=128256),
    "llama3-70b": ModelShape(hidden_size=8192, ffn_hidden_size=28672, num_layers=80, num_attention_heads=64,
                             num_query_groups=8, vocab_size=128256),
    "llama3.2-1b": ModelShape(hidden_size=2048, ffn_hidden_size=8192, num_layers=16, num_attention_heads=32,
                              num_query_groups=8, vocab_size=128256, kv_channels=64),
    "qwen2.5-7b": ModelShape(hidden_size=3584, ffn_hidden_size=18944, num_layers=28, num_attention_heads=28,
                             num_query_groups=4, vocab_size=152064),
    "qwen2.5-72b": ModelShape(hidden_size=8192, ffn_hidden_size=29568, num_layers=80, num_attention_heads=64,
                              num_query_groups=8, vocab_size=152064),
}


@dataclass(frozen=True)
class CostModel:
    """``cost(L) = linear * L + attention * L**2`` on the kernel's length of each sequence.

    Attributes:
        linear: FLOPs per token (forward + backward), > 0.
        attention: FLOPs per token² of a causal sequence (forward + backward), >= 0.
        pad_multiple: the CP/SP multiple each sequence is padded to before the kernel (1: none).
        pad_layout: ``"stored"`` (the kernel sees ``L``) or ``"runtime"`` (``L - 1``).
        name: the preset it came from, or ``"custom"``; recorded, never used to compute.
    """

    linear: float
    attention: float
    pad_multiple: int = 1
    pad_layout: str = PAD_LAYOUT_STORED
    name: str = "custom"

    def __post_init__(self) -> None:
        if not (isinstance(self.linear, (int, float)) and math.isfinite(self.linear) and self.linear > 0):
            raise ShardError("the cost model's linear coefficient must be a positive finite number",
                             field="linear", actual=self.linear)
        if not (isinstance(self.attention, (int, float)) and math.isfinite(self.attention) and self.attention >= 0):
            raise ShardError("the cost model's attention coefficient must be a finite number >= 0",
                             field="attention", actual=self.attention)
        _positive_int("pad_multiple", self.pad_multiple)
        if self.pad_layout not in PAD_LAYOUTS:
            raise ShardError("unknown padding layout", field="pad_layout", expected=list(PAD_LAYOUTS),
                             actual=self.pad_layout)

    @classmethod
    def from_shape(cls, shape: ModelShape, *, pad_multiple: int = 1, pad_layout: str = PAD_LAYOUT_STORED,
                   recompute: bool = False, name: str = "custom") -> "CostModel":
        """The coefficients of ``shape``'s FLOP count (module doc); ``recompute``: full recomputation."""
        extra = 1.0 if recompute else 0.0
        return cls(linear=(LINEAR_FWD_BWD + extra) * shape.linear_flops_per_token(),
                   attention=(ATTENTION_FWD_BWD + extra) * shape.attention_flops_per_token2(),
                   pad_multiple=int(pad_multiple), pad_layout=pad_layout, name=name)

    @classmethod
    def parse(cls, spec: str, **options) -> "CostModel":
        """The cost model ``--cost-model`` names: a :data:`PRESETS` name (:meth:`from_preset`, with
        ``recompute``), or ``"LINEAR,ATTENTION"`` FLOP coefficients; ``pad_*`` as there.

        Raises:
            ShardError: an unknown preset, or coefficients that are not two numbers (> 0, >= 0).
        """
        if spec in PRESETS:
            return cls.from_preset(spec, **options)
        try:
            linear, attention = (float(v) for v in spec.split(","))
        except ValueError:
            raise ShardError("--cost-model is a preset or LINEAR,ATTENTION", field="cost_model",
                             expected=sorted(PRESETS) + ["LINEAR,ATTENTION"], actual=spec) from None
        options.pop("recompute", None)   # (coefficients given: they already say what a step costs)
        return cls(linear, attention, **options)

    @classmethod
    def from_preset(cls, preset: str, **options) -> "CostModel":
        """:meth:`from_shape` of a :data:`PRESETS` entry (``recompute``, ``pad_*`` as there).

        Raises:
            ShardError: an unknown preset name.
        """
        if preset not in PRESETS:
            raise ShardError(f"unknown model preset {preset!r}", field="model", expected=sorted(PRESETS),
                             actual=preset, hint="pick a preset or give the coefficients directly")
        return cls.from_shape(PRESETS[preset], name=preset + ("+recompute" if options.get("recompute") else ""),
                              **options)

    @property
    def _offset(self) -> int:
        return 1 if self.pad_layout == PAD_LAYOUT_RUNTIME else 0

    def sequence_cost(self, lengths) -> np.ndarray:
        """Cost of each stored sequence length (float64 array)."""
        k = kernel_lengths(lengths, self).astype(np.float64)
        return self.linear * k + self.attention * k * k

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping, *, path: Optional[str] = None) -> "CostModel":
        """The model a :meth:`to_dict` wrote, checked key by key (unknown keys are ignored).

        Raises:
            ShardError: a key is missing or has the wrong type or value.
        """
        if not isinstance(data, Mapping):
            raise ShardError("cost model must be an object", path=path, field="cost_model", actual=type(data).__name__)
        out = {}
        for key, kinds in (("linear", (int, float)), ("attention", (int, float)), ("pad_multiple", (int,)),
                           ("pad_layout", (str,)), ("name", (str,))):
            value = data.get(key)
            if isinstance(value, bool) or not isinstance(value, kinds):
                raise ShardError(f"cost model field {key!r} is missing or of the wrong type", path=path,
                                 field=f"cost_model.{key}", expected=[k.__name__ for k in kinds], actual=value)
            out[key] = value
        try:
            return cls(**out)
        except ShardError as exc:
            raise ShardError(exc.message, path=path, field=f"cost_model.{exc.field}", expected=exc.expected,
                             actual=exc.actual) from None


def kernel_lengths(lengths, model: CostModel) -> np.ndarray:
    """The length the attention kernel sees for each stored length (int64): padded in the model's layout.

    >>> kernel_lengths([1, 5, 8], CostModel(1.0, 1.0, pad_multiple=4)).tolist()
    [4, 8, 8]
    >>> kernel_lengths([1, 5, 8], CostModel(1.0, 1.0, pad_multiple=4, pad_layout="runtime")).tolist()
    [0, 4, 8]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    m, off = int(model.pad_multiple), model._offset
    return -(-(lengths - off) // m) * m


def _csr(lengths, offsets, what: str):
    lengths = np.ascontiguousarray(lengths)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if lengths.ndim != 1 or offsets.ndim != 1 or offsets.size == 0:
        raise ShardError(f"{what}: lengths and offsets must be one-dimensional (offsets non-empty)",
                         field="offsets", actual=(lengths.shape, offsets.shape))
    if lengths.dtype.kind not in "iu":
        raise ShardError(f"{what}: lengths must be integers", field="lengths", actual=str(lengths.dtype))
    if offsets[0] != 0 or offsets[-1] != lengths.size or np.any(np.diff(offsets) < 0):
        raise ShardError(f"{what}: offsets must rise from 0 to the number of sequences", field="offsets",
                         expected=f"0 .. {lengths.size}, non-decreasing", actual=(int(offsets[0]), int(offsets[-1])))
    if lengths.size and lengths.min() < 1:
        bad = int(np.flatnonzero(lengths < 1)[0])
        raise ShardError(f"{what}: sequence {bad} has length {int(lengths[bad])} (< 1)", field="lengths")
    return lengths, offsets


def pack_costs(seq_lengths, pack_offsets, model: CostModel, pad_to: Optional[int] = None) -> np.ndarray:
    """Cost of every pack (float64[P]) from the lengths of its sequences, in CSR form.

    Args:
        seq_lengths: stored length of every sequence, grouped by pack.
        pack_offsets: int64[P+1]; pack p holds ``seq_lengths[pack_offsets[p]:pack_offsets[p+1]]``.
        model: the cost model.
        pad_to: when packs are padded to a fixed length (``pad_to_max_length``), the padding
            tokens past the last sequence add their linear cost (they are never attended to
            by a sequence, so nothing quadratic).

    Raises:
        ShardError: malformed CSR, or a length below 1.
    """
    lengths, offsets = _csr(seq_lengths, pack_offsets, "pack costs")
    pad = -1 if pad_to is None else int(pad_to)
    return _kernels.pack_costs(lengths, offsets, float(model.linear), float(model.attention),
                               int(model.pad_multiple), model._offset, pad)


def shard_pack_costs(source, model: CostModel, pad_to: Optional[int] = None) -> np.ndarray:
    """Cost of every pack of a shard (``MMapIndexedDataset``) or a multi-shard view, from its index.

    Reads only the index arrays (packed lengths, sequence starts and their CSR pointers), never
    tokens. Sequence lengths in a shard are the stored ones, already padded by the producer;
    the model's padding is applied on top (a no-op when the multiples agree).

    Raises:
        ShardError: a source this function cannot read lengths from.
    """
    shard = getattr(source, "shard", None)
    prefixes = getattr(source, "prefixes", None)
    if shard is not None and prefixes is not None:
        parts = [shard_pack_costs(shard(k), model, pad_to) for k in range(len(prefixes))]
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.float64)
    arrays = getattr(source, "arrays", None)
    if arrays is None:
        raise ShardError(f"cannot read sequence lengths from a {type(source).__name__}", field="source",
                         hint="give an MMapIndexedDataset or a MultiShardDataset, or compute pack_costs from lengths")
    a = arrays()
    pad = -1 if pad_to is None else int(pad_to)
    return _kernels.pack_costs_from_starts(a.seq_starts, np.asarray(a.seq_offsets, dtype=np.int64),
                                           a.sequence_lengths, float(model.linear), float(model.attention),
                                           int(model.pad_multiple), model._offset, pad)


def microbatch_cost(lengths, model: CostModel, *, padded: bool = False) -> float:
    """Cost of one micro-batch of sequences: packed (THD, the sum of each sequence's cost), or
    ``padded`` (BSHD: every row at the longest kernel length, rounded to the pad multiple)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0:
        return 0.0
    if not padded:
        return float(model.sequence_cost(lengths).sum())
    width = float(kernel_lengths(lengths, model).max())
    return float(lengths.size * (model.linear * width + model.attention * width * width))
