"""The decoder (Llama, Qwen2, Qwen3, Mistral) over packed tokens, every layer on the course's kernels.

A step's tokens come packed in one (T, hidden) tensor: all prompts' new tokens in a prefill step, one token per
sequence in a decode step. Per layer::

    add_rms_norm -> qkv GEMM -> [Qwen3: q_norm, k_norm per head]
      -> rope_store_kv (q rotated; K rotated and V written into the paged pool)
      -> attention: prefill  flash_attention (nothing cached) or paged_prefill_attention (a cached prefix)
                    decode   paged_attention
    -> o GEMM -> add_rms_norm -> gate_up GEMM -> swiglu -> down GEMM

GEMMs are cuBLAS (torch), except for a lone token (a decode step at batch 1): there each projection is one
``ops.gemv`` (gate_up's with SwiGLU in its epilogue, so no swiglu launch; see :func:`project`). Everything between
them is one lessonlib kernel, or, with a :class:`Features` switch off, the plain-PyTorch way (lesson 07's tokens/s
ladder). With ``Features.fused_decode_layer`` a batch-1 decode step runs each layer in six kernels instead
(:meth:`EngineLayer.fused_decode`: the norms, RoPE, the K/V write and the residual adds folded into the projections,
``ops.decode_gemv``). ``lessonlib.decoder.DecoderLayer`` is lesson 05's single layer, decode only; this one,
:class:`EngineLayer`, serves both phases and many sequences of different lengths.
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
        self.o_proj = nn.Linear(self.heads * d, h, bias=config.output_bias, **factory)
        self.gate_up_proj = nn.Linear(h, 2 * config.intermediate_size, bias=False, **factory)  # gate rows, then up
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False, **factory)
        self.input_norm = nn.Parameter(torch.ones(h, **factory))
        self.post_attention_norm = nn.Parameter(torch.ones(h, **factory))
        # Qwen3: one RMSNorm weight of size head_dim for every head of q, one for every head of k
        self.q_norm = nn.Parameter(torch.ones(d, **factory)) if config.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d, **factory)) if config.qk_norm else None

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext,
                  k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """x: (T, hidden) normed; cos, sin: (T, head_dim). Writes the new K/V into the pool; returns (T, hidden)."""
        tokens, d = x.shape[0], self.head_dim
        qkv = project(x, self.qkv_proj, self.features)
        fast = self.features
        if self.q_norm is not None:
            self._normalize_heads(qkv)
        heads = {"num_heads": self.heads, "num_kv_heads": self.kv_heads}
        if fast.fused_ops:  # one launch: q rotated (returned), k rotated and v written into the pool at the slots
            q = ops.rope_store_kv(qkv, cos, sin, k_cache, v_cache, ctx.slots, **heads,
                                  validate=False)  # slots come from the block manager
        else:
            q = reference.rope_store_kv(qkv, cos, sin, k_cache, v_cache, ctx.slots, **heads)
        if not ctx.is_prefill:
            out = self.decode_attention(q, ctx, k_cache, v_cache)
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

    def decode_attention(self, q: torch.Tensor, ctx: StepContext, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> torch.Tensor:
        """q: (B, H, D), one token per sequence, its K/V already in the pool. Returns (B, H, D)."""
        if self.features.paged_decode:
            return ops.paged_attention(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens,
                                       num_splits=ctx.decode_splits, validate=False)
        return gather_then_sdpa(q, k_cache, v_cache, ctx.block_table, ctx.seq_lens, ctx.max_seq_len)

    def fused_decode(self, stream: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: StepContext,
                     k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """:meth:`forward` for one decode token (Features.fused_decode_layer) in six kernels, on the residual stream
        (1, hidden), updated in place: the same rounding points as forward (ops.decode_gemv's docstring)."""
        q = ops.decode_qkv_rope_store_kv(stream, self.qkv_proj.weight, self.qkv_proj.bias, self.input_norm, cos, sin,
                                         k_cache, v_cache, ctx.slots, num_heads=self.heads,
                                         num_kv_heads=self.kv_heads, eps=self.eps,
                                         validate=False)  # K1; slots come from the block manager
        out = self.decode_attention(q, ctx, k_cache, v_cache)  # K2, K3
        ops.decode_gemv(out.reshape(1, -1), self.o_proj.weight, self.o_proj.bias, residual=stream)  # K4
        act = ops.decode_gemv(stream, self.gate_up_proj.weight, norm_weight=self.post_attention_norm, eps=self.eps,
                              activation="swiglu")  # K5
        ops.decode_gemv(act, self.down_proj.weight, residual=stream)  # K6

    def _normalize_heads(self, qkv: torch.Tensor) -> None:
        """Qwen3's q_norm and k_norm, in place on qkv's q and k columns: RMSNorm over each head's head_dim values,
        before RoPE. add_rms_norm with a zero residual is that RMSNorm (x + 0 is x exactly): no kernel of its own."""
        norm = ops.add_rms_norm if self.features.fused_ops else reference.add_rms_norm
        q_cols, k_cols = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for cols, weight in ((slice(0, q_cols), self.q_norm), (slice(q_cols, q_cols + k_cols), self.k_norm)):
            heads = qkv[:, cols].reshape(-1, self.head_dim)  # (T * heads, D), a copy
            qkv[:, cols] = norm(heads, torch.zeros_like(heads), weight, self.eps)[0].view(qkv.shape[0], -1)

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
        config.check_max_model_len(max_positions)  # before any weight is allocated
        factory = {"dtype": dtype, "device": device}
        self.config, self.features = config, features
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **factory)
        self.layers = nn.ModuleList(EngineLayer(config, dtype, device, features) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size, **factory))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **factory)
        # RoPE angles for every position the engine serves, computed once (float64, rounded to the model's dtype),
        # with the checkpoint's scaling (llama3) applied here: the kernels only read these tables.
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * config.rope_inverse_frequencies()
        angles = torch.cat((angles, angles), dim=-1).to(device)  # (positions, D): both halves share a frequency
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.requires_grad_(False)  # a serving model: no autograd graph, and the inference-only ops accept its weights

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext,
                k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (T,); k_caches, v_caches: (layers, blocks, block_size, Hkv, D). Returns the final
        normed hidden states, (T, hidden)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.cos[positions], self.sin[positions]
        if self.features.fuses_decode_layer and not ctx.is_prefill and hidden.shape[0] == 1 and not self.config.qk_norm:
            for i, layer in enumerate(self.layers):  # hidden is the residual stream, updated in place
                layer.fused_decode(hidden, cos, sin, ctx, k_caches[i], v_caches[i])
            return ops.add_rms_norm(hidden, torch.zeros_like(hidden), self.norm, self.config.rms_norm_eps)[0]
        residual = torch.zeros_like(hidden)  # the first add_rms_norm adds nothing: residual = embeddings
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
        q/k/v and gate/up into one matrix each. Every tensor is matched by name and shape before any is copied:
        unexpected, missing or mis-shaped tensors are refused together, in one ValueError that lists them."""
        from safetensors import safe_open

        path = Path(path)
        index = path / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
            [p.name for p in sorted(path.glob("*.safetensors"))]
        if not files:
            raise FileNotFoundError(f"{path}: no *.safetensors weights")
        targets = self.checkpoint_targets()
        shapes = {}
        for name in files:
            with safe_open(str(path / name), framework="pt") as f:
                shapes.update((key, tuple(f.get_slice(key).get_shape())) for key in f.keys())
        if self.config.tie_word_embeddings:  # a saved copy of the tied head: transformers ties it to the embedding
            shapes.pop("lm_head.weight", None)
        check_checkpoint(path, shapes, {key: tuple(param[rows].shape) for key, (param, rows) in targets.items()})
        for name in files:
            with safe_open(str(path / name), framework="pt") as f:
                for key in f.keys():
                    if key in targets:
                        param, rows = targets[key]
                        param[rows].copy_(f.get_tensor(key))  # shapes checked above: no silent broadcast
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def checkpoint_targets(self) -> dict[str, tuple[torch.Tensor, slice]]:
        """Each checkpoint tensor's name -> the parameter it goes to and the rows it fills (fused matrices hold
        q, k, v and gate, up one after the other; ``slice(None)``: all of it)."""
        c, everything = self.config, slice(None)
        targets = {"model.embed_tokens.weight": (self.embed_tokens.weight, everything),
                   "model.norm.weight": (self.norm, everything)}
        if not c.tie_word_embeddings:
            targets["lm_head.weight"] = (self.lm_head.weight, everything)
        q_rows, kv_rows, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        for i, layer in enumerate(self.layers):
            base = f"model.layers.{i}."
            fused = {"self_attn.q_proj": (layer.qkv_proj, slice(0, q_rows)),
                     "self_attn.k_proj": (layer.qkv_proj, slice(q_rows, q_rows + kv_rows)),
                     "self_attn.v_proj": (layer.qkv_proj, slice(q_rows + kv_rows, q_rows + 2 * kv_rows)),
                     "self_attn.o_proj": (layer.o_proj, everything),
                     "mlp.gate_proj": (layer.gate_up_proj, slice(0, inter)),
                     "mlp.up_proj": (layer.gate_up_proj, slice(inter, 2 * inter)),
                     "mlp.down_proj": (layer.down_proj, everything)}
            for module, (linear, rows) in fused.items():
                targets[base + module + ".weight"] = (linear.weight, rows)
                if linear.bias is not None:
                    targets[base + module + ".bias"] = (linear.bias, rows)
            norms = {"input_layernorm": layer.input_norm, "post_attention_layernorm": layer.post_attention_norm,
                     "self_attn.q_norm": layer.q_norm, "self_attn.k_norm": layer.k_norm}
            targets.update((base + name + ".weight", (weight, everything)) for name, weight in norms.items()
                           if weight is not None)
        return targets


# Checkpoint tensors the engine recomputes: old checkpoints' RoPE frequencies.
IGNORED_TENSORS = ("rotary_emb.inv_freq",)


def check_checkpoint(path: Path, found: dict[str, tuple], expected: dict[str, tuple]) -> None:
    """One ValueError listing every unexpected, missing and mis-shaped tensor of a checkpoint. found, expected:
    tensor name -> shape."""
    unexpected = [k for k in found if k not in expected and not k.endswith(IGNORED_TENSORS)]
    missing = [k for k in expected if k not in found]
    misshaped = [f"{k} {list(found[k])} (the model's: {list(shape)})" for k, shape in expected.items()
                 if k in found and tuple(found[k]) != shape]
    problems = [f"{len(names)} {what}: {', '.join(names[:8])}{', ...' if len(names) > 8 else ''}"
                for what, names in (("unexpected tensors", unexpected), ("missing tensors", missing),
                                    ("mis-shaped tensors", misshaped)) if names]
    if problems:
        raise ValueError(f"{path}: the checkpoint does not match the model its config.json describes: "
                         + "; ".join(problems))
