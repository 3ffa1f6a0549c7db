"""The decoder (Llama / Qwen2) over packed tokens, every layer on the course's kernels.

A step's tokens come packed in one (T, hidden) tensor: all prompts' new tokens in a prefill step, one token per
sequence in a decode step. Per layer::

    add_rms_norm -> qkv GEMM -> rope_store_kv (q rotated; K rotated and V written into the paged pool)
      -> attention: prefill  flash_attention (nothing cached) or paged_prefill_attention (a cached prefix)
                    decode   paged_attention
    -> o GEMM -> add_rms_norm -> gate_up GEMM -> swiglu -> down GEMM

GEMMs are cuBLAS (torch), except for a lone token (a decode step at batch 1): there each projection is one
``ops.gemv`` (gate_up's with SwiGLU in its epilogue, so no swiglu launch; see :func:`project`). Everything between
them is one lessonlib kernel, or, with a :class:`Features` switch off, the plain-PyTorch way (lesson 07's tokens/s
ladder). ``lessonlib.decoder.DecoderLayer`` is lesson 05's single layer, decode only; this one, :class:`EngineLayer`,
serves both phases and many sequences of different lengths.
The three parts of a layer are separate methods (:meth:`EngineLayer.attention`, :meth:`EngineLayer.mlp`, the
norms) so that the benchmark can time each part alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lessonlib import ops, reference, sdpa
from lessonlib.engine.config import ModelConfig
from lessonlib.engine.features import Features


@dataclass
class StepContext:
    """What attention needs besides the tokens: where new K/V go and what each query may read.

    slots: (T,) int64 pool slot (block * block_size + offset) of each new token. Decode: block_table (B, max_blocks)
    int32 and seq_lens (B,) int32 (lengths including the new token). Prefill: query_starts (B + 1,) int32 and
    max_query_len, plus either ``flash_groups`` (nothing cached: one flash_attention call per group of prompts of
    equal length, given as (rows of the packed tokens, number of prompts, length)) or block_table and seq_lens for
    paged_prefill_attention (some prompt reuses a cached prefix).
    """

    is_prefill: bool
    slots: torch.Tensor
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    query_starts: torch.Tensor | None = None
    max_query_len: int = 0
    flash_groups: list | None = None
    # paged_attention's split count: its own choice on a GPU; one split in the interpreter, where every program
    # instance costs tens of milliseconds of Python whatever its size (measured: 60 ms each on this course's CPU).
    decode_splits: int | None = None
    # Decode, eager: the longest sequence (known on the host), so that gather-then-SDPA gathers no page past it.
    # None (a captured graph): the whole block table.
    max_seq_len: int | None = None


class EngineLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 features: Features = Features()):
        super().__init__()
        self.features = features
        factory = {"dtype": dtype, "device": device}
        h, d = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = config.num_heads, config.num_kv_heads, d, config.rms_norm_eps
        self.qkv_proj = nn.Linear(h, (self.heads + 2 * self.kv_heads) * d, bias=config.attention_bias, **factory)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False, **factory)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False, **factory)  # gate rows, then up
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False, **factory)
        self.input_norm = nn.Parameter(torch.ones(h, **factory))
        self.post_attention_norm = nn.Parameter(torch.ones(h, **factory))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) normed; cos, sin: (T, head_dim). Writes the new K/V into the pool; returns (T, hidden)."""
        tokens, d = x.shape[0], self.head_dim
        qkv = project(x, self.qkv_proj, self.features)
        fast = self.features
        heads = {"num_heads": self.heads, "num_kv_heads": self.kv_heads}
        if fast.fused_ops:  # one launch: q rotated (returned), k rotated and v written into the pool at the slots
            q = ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, ctx.slots, **heads,
                                  validate=False)  # slots come from the block manager
        else:
            q = reference.rope_store_kv(qkv, cos, sin, k_cache, v_cache, ctx.slots, **heads)
        if not ctx.is_prefill and fast.paged_decode:
            out = ops.paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, num_splits=ctx.decode_splits,
                                      validate=False)
        elif not ctx.is_prefill:
            out = gather_then_sdpa(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.max_seq_len)
        elif ctx.flash_groups is None and fast.flash_prefill:
            out = ops.paged_prefill_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.query_starts,
                                              ctx.max_query_len, validate=False)
        elif ctx.flash_groups is None:  # a cached prefix, the plain way: gather its pages, then masked attention
            out = reference.paged_prefill_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens,
                                                    ctx.query_starts)
        else:  # flash_attention reads the new tokens' k (rotated: from the pool) and v (qkv's own columns)
            k = k_cache.view(-1, self.kv_heads, d)[ctx.slots]
            v = qkv[:, (self.heads + self.kv_heads) * d:].view(tokens, self.kv_heads, d)
            out = self._flash_prefill(q, k, v, ctx.flash_groups)
        return project(out.reshape(tokens, self.heads * d), self.o_proj, self.features)

    def _flash_prefill(self, q, k, v, groups) -> torch.Tensor:
        """Prompts with nothing cached: causal flash_attention on their own fresh K/V, one call per prompt length."""
        if len(groups) == 1 and groups[0][0] is None:  # one length, and the packed rows are in order: no gather
            _, count, length = groups[0]
            return self._flash(q, k, v, count, length)
        out = torch.empty_like(q)
        for rows, count, length in groups:
            out[rows] = self._flash(q[rows], k[rows], v[rows], count, length)
        return out

    def _flash(self, q, k, v, count, length):
        def batched(t):  # (count * length, heads, D) -> (count, heads, length, D), a view
            return t.view(count, length, t.shape[1], t.shape[2]).transpose(1, 2)

        attend = ops.flash_attention if self.features.flash_prefill else sdpa.scaled_dot_product_attention
        out = attend(batched(q), batched(k), batched(v), causal=True)
        return out.transpose(1, 2).reshape(count * length, q.shape[1], q.shape[2])

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        act = project(x, self.gate_up_proj, self.features, activation="swiglu")
        return project(act, self.down_proj, self.features)

    def forward(self, hidden, residual, cos, sin, ctx, k_cache, v_cache):
        norm = ops.add_rms_norm if self.features.fused_ops else reference.add_rms_norm
        normed, residual = norm(hidden, residual, self.input_norm, self.eps)
        hidden = self.attention(normed, cos, sin, ctx, k_cache, v_cache)
        normed, residual = norm(hidden, residual, self.post_attention_norm, self.eps)
        return self.mlp(normed), residual


def project(x: torch.Tensor, linear: nn.Linear, features: Features, activation: str | None = None) -> torch.Tensor:
    """``linear(x)``, then the activation (``"swiglu"``: the weight holds gate rows then up rows). A lone token goes
    through ``ops.gemv`` (the activation in its epilogue, its weights read while the previous kernel ends); more
    tokens through cuBLAS, then swiglu, since each row of a gemv reads the whole weight again."""
    if x.shape[0] == 1 and features.gemv:
        return ops.gemv(x, linear.weight, linear.bias, activation=activation)
    y = linear(x)
    if activation == "swiglu":  # two strided (T, I) views of y: swiglu reads them in place
        return (ops.swiglu if features.fused_ops else reference.swiglu)(*y.chunk(2, dim=-1))
    return y


def gather_then_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, max_seq_len: int | None = None) -> torch.Tensor:
    """Decode attention without a paged kernel (lesson 03's "gather pages, then SDPA"): each sequence's pages copied
    into contiguous K/V, then PyTorch's SDPA with the keys past each sequence's length masked out.

    q: (B, H, D); k_cache, v_cache: (num_blocks, block_size, Hkv, D); block_table: (B, max_blocks) int32; seq_lens:
    (B,) int32; max_seq_len: gather only the pages up to it (None: the whole table, as a captured graph must).
    Returns (B, H, D). No host sync: it can be captured in a CUDA graph.
    """
    batch, block_size = q.shape[0], k_cache.shape[1]
    if max_seq_len is not None:
        block_table = block_table[:, : -(-max_seq_len // block_size)]
    keys = block_table.shape[1] * block_size

    def gather(cache):  # (B, Hkv, keys, D): the copy a paged kernel never makes
        return cache[block_table.long()].reshape(batch, keys, cache.shape[2], cache.shape[3]).transpose(1, 2)

    visible = torch.arange(keys, device=q.device)[None, :] < seq_lens[:, None]  # (B, keys)
    out = F.scaled_dot_product_attention(q[:, :, None], gather(k_cache), gather(v_cache),
                                         attn_mask=visible[:, None, None], enable_gqa=q.shape[1] != k_cache.shape[2])
    return out[:, :, 0]


class Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
                 features: Features = Features()):
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.config, self.features = config, features
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(EngineLayer(config, dtype, device, features) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size, **factory))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        # RoPE angles for every position the engine serves, computed once (float64, rounded to the model's dtype).
        cos, sin = reference.rope_cos_sin(torch.arange(max_positions, device=device), config.head_dim,
                                          config.rope_theta, dtype=dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.requires_grad_(False)  # a serving model: no autograd graph, and the inference-only ops accept its weights

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,); k_caches, v_caches: (layers, blocks, block_size, Hkv, D). Returns the final
        normed hidden states, (T, hidden)."""
        hidden = self.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)  # the first add_rms_norm adds nothing: residual = embeddings
        cos, sin = self.cos[positions], self.sin[positions]
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, cos, sin, ctx, k_caches[i], v_caches[i])
        norm = ops.add_rms_norm if self.features.fused_ops else reference.add_rms_norm
        normed, _ = norm(hidden, residual, self.norm, self.config.rms_norm_eps)
        return normed

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.lm_head, self.features).float()

    # --- weights -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, path: str | Path) -> None:
        """Copy a Hugging Face checkpoint's tensors (safetensors, one file or sharded) into this model, fusing
        q/k/v and gate/up into one matrix each. Every parameter must be covered exactly once."""
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            [p.name for p in sorted(path.glob("*.safetensors"))]
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        loaded: set[str] = set()
        for name in files:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    target = self._target(key)
                    if target is None:
                        continue
                    param, rows = target
                    tensor = f.get_tensor(key)
                    (param if rows is None else param[rows]).copy_(tensor)
                    loaded.add(key)
        if self.config.tie_word_embeddings and "lm_head.weight" not in loaded:
            self.lm_head.weight = self.embed_tokens.weight
            loaded.add("lm_head.weight")
        missing = sorted(set(self._expected_keys()) - loaded)
        if missing:
            raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")

    def _expected_keys(self):
        yield from ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
        for i in range(self.config.num_layers):
            base = f"model.layers.{i}."
            yield from (base + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                           "self_attn.o_proj.weight", "mlp.down_proj.weight")
                        + tuple(f"self_attn.{p}_proj.weight" for p in "qkv") + ("mlp.gate_proj.weight", "mlp.up_proj.weight"))
            if self.config.attention_bias:
                yield from (base + f"self_attn.{p}_proj.bias" for p in "qkv")

    def _target(self, key: str):
        """The parameter (and row range, for fused matrices) a checkpoint tensor goes to; None to skip it."""
        c = self.config
        if key == "model.embed_tokens.weight":
            return self.embed_tokens.weight, None
        if key == "model.norm.weight":
            return self.norm, None
        if key == "lm_head.weight":
            return self.lm_head.weight, None
        if not key.startswith("model.layers."):
            return None  # e.g. rotary_emb.inv_freq in old checkpoints: recomputed here
        index, rest = key[len("model.layers."):].split(".", 1)
        layer = self.layers[int(index)]
        q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        fused = {"self_attn.q_proj": (layer.qkv_proj, slice(0, q_rows)),
                 "self_attn.k_proj": (layer.qkv_proj, slice(q_rows, q_rows + kv_rows)),
                 "self_attn.v_proj": (layer.qkv_proj, slice(q_rows + kv_rows, q_rows + 2 * kv_rows)),
                 "mlp.gate_proj": (layer.gate_up_proj, slice(0, c.intermediate_size)),
                 "mlp.up_proj": (layer.gate_up_proj, slice(c.intermediate_size, 2 * c.intermediate_size))}
        module, kind = rest.rsplit(".", 1)
        if module in fused:
            linear, rows = fused[module]
            return getattr(linear, kind), rows
        simple = {"self_attn.o_proj": layer.o_proj, "mlp.down_proj": layer.down_proj}
        if module in simple:
            return getattr(simple[module], kind), None
        norms = {"input_layernorm": layer.input_norm, "post_attention_layernorm": layer.post_attention_norm}
        if module in norms and kind == "weight":
            return norms[module], None
        return None
