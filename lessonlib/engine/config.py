"""What the engine reads from a Hugging Face checkpoint folder's config.json, checked before anything is built.

Every field that changes the math is either implemented or refused here, by name: a checkpoint the engine loads
computes what transformers computes, or it does not load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Architectures whose layers the engine implements: one pre-norm decoder (RMSNorm, RoPE with rotate_half,
# grouped-query attention, SwiGLU MLP) and its variations. Qwen2 adds biases to the q, k and v projections; Qwen3
# RMS-normalises each head of q and k before RoPE and may have a head size other than hidden / heads; Mistral is
# Llama's layer with a sliding window (served only where the window covers every position).
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "MistralForCausalLM": "mistral"}
ROPE_TYPES = ("default", "llama3")  # the rotary embeddings implemented; "linear", "dynamic", "yarn", ... are refused
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama", "qwen2", "qwen3" or "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool  # biases on q, k, v (Qwen2; Llama's and Qwen3's attention_bias)
    tie_word_embeddings: bool  # the output head reuses the embedding matrix
    eos_token_ids: tuple[int, ...]
    output_bias: bool = False  # a bias on o_proj too (Llama's and Qwen3's attention_bias; never Qwen2's)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: tuple[tuple[str, float], ...] = ()  # llama3's (name, value) pairs; () for the default RoPE
    sliding_window: int | None = None  # Mistral's window; None: every key is visible

    @classmethod
    def from_folder(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json: expected a Hugging Face checkpoint folder "
                                    "(config.json, *.safetensors, tokenizer files)")
        raw = json.loads((path / "config.json").read_text())
        return cls.from_dict(raw, generation=_read_json(path / "generation_config.json"))

    @classmethod
    def from_dict(cls, raw: dict, generation: dict | None = None) -> "ModelConfig":
        found = raw.get("architectures") or [raw.get("model_type", "?")]
        if found[0] not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {found[0]!r}: this engine runs "
                             f"{', '.join(sorted(ARCHITECTURES))}")
        family = ARCHITECTURES[found[0]]
        rope = _rope_parameters(raw)
        _refuse_unimplemented(raw)
        heads = raw["num_attention_heads"]
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        # Qwen2's q, k, v always have biases; Llama's and Qwen3's attention_bias adds them to q, k, v and o; Mistral
        # has none.
        bias = family == "qwen2" or (family in ("llama", "qwen3") and bool(raw.get("attention_bias")))
        return cls(
            architecture=family,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            attention_bias=bias,
            output_bias=bias and family != "qwen2",
            qk_norm=family == "qwen3",
            rope_scaling=tuple((k, float(rope[k])) for k in LLAMA3_ROPE_KEYS) if _rope_type(rope) == "llama3" else (),
            sliding_window=raw.get("sliding_window") if family == "mistral" else None,
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=eos,
        )

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse to serve sequences longer than a sliding window: the engine's attention sees every key."""
        if self.sliding_window is not None and self.sliding_window < max_model_len:
            raise ValueError(f"sliding_window={self.sliding_window} is smaller than max_model_len={max_model_len}: "
                             "the engine does not implement sliding-window attention; pass max_model_len <= "
                             f"{self.sliding_window}")

    def rope_inverse_frequencies(self):
        """RoPE's D/2 inverse frequencies in float64, with llama3's scaling applied (the formula of transformers'
        ``_compute_llama3_parameters``): wavelengths shorter than original_max / high_freq_factor are kept, those
        longer than original_max / low_freq_factor divided by ``factor``, the ones between interpolated."""
        import torch

        d = self.head_dim
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        if not self.rope_scaling:
            return inv_freq
        s = dict(self.rope_scaling)
        old_len, low, high = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / s["factor"], inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / s["factor"] + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)

    def weight_bytes(self, element_size: int) -> int:
        """Bytes of the weights: what one decode step must read at least once."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        layer = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return element_size * (self.num_layers * layer + self.vocab_size * h + head + h)


def _rope_type(rope: dict) -> str:
    return rope.get("rope_type", rope.get("type", "default"))


def _rope_parameters(raw: dict) -> dict:
    """The RoPE settings, checked. transformers 5 writes them under "rope_parameters" (rope_theta included); 4.x
    wrote "rope_theta" at the top and the scaling under "rope_scaling"."""
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    rope_type = _rope_type(rope)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope_type!r}: the engine implements {', '.join(ROPE_TYPES)}")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in rope]
    if rope_type == "llama3" and missing:
        raise ValueError(f"RoPE type 'llama3' needs {', '.join(missing)} in rope_parameters (or rope_scaling)")
    if rope_type == "llama3" and rope["high_freq_factor"] <= rope["low_freq_factor"]:
        raise ValueError("RoPE type 'llama3' needs high_freq_factor > low_freq_factor, got "
                         f"{rope['high_freq_factor']} and {rope['low_freq_factor']}")
    for where in (raw, rope):
        if where.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"unsupported: partial_rotary_factor={where['partial_rotary_factor']} (the engine "
                             "rotates the whole head)")
    return rope


def _refuse_unimplemented(raw: dict) -> None:
    """A ValueError naming the first config field whose math the engine does not implement."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act={act!r}: the engine's MLP is SwiGLU (silu)")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported: mlp_bias=true (biases on gate, up and down projections)")
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or ()):
        raise ValueError("unsupported: sliding-window attention (use_sliding_window=true or sliding_attention "
                         "layers)")
    if raw.get("quantization_config"):
        raise ValueError("unsupported: quantization_config (the engine loads unquantized weights)")


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
