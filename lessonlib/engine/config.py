"""What the engine reads from a Hugging Face checkpoint folder's config.json, checked before anything is built."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# Architectures whose layers the engine implements. Both are the same pre-norm decoder (RMSNorm, RoPE with
# rotate_half, grouped-query attention, SwiGLU MLP); Qwen2 adds biases to the q, k and v projections.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" or "qwen2"
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
    attention_bias: bool  # biases on q, k, v (Qwen2)
    tie_word_embeddings: bool  # the output head reuses the embedding matrix
    eos_token_ids: tuple[int, ...]

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
        # transformers 5 writes rope settings under "rope_parameters"; 4.x wrote "rope_theta" and "rope_scaling".
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported RoPE type {rope_type!r}: the engine implements the default rotary "
                             "embedding only (no 'llama3', 'yarn' or 'dynamic' scaling)")
        if raw.get("use_sliding_window"):
            raise ValueError("unsupported: sliding-window attention (use_sliding_window=true)")
        heads = raw["num_attention_heads"]
        eos = (generation or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        return cls(
            architecture=ARCHITECTURES[found[0]],
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
            attention_bias=raw.get("attention_bias", ARCHITECTURES[found[0]] == "qwen2"),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            eos_token_ids=eos,
        )

    def weight_bytes(self, element_size: int) -> int:
        """Bytes of the weights: what one decode step must read at least once."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        layer = h * (self.num_heads + 2 * self.num_kv_heads) * d + self.num_heads * d * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return element_size * (self.num_layers * layer + self.vocab_size * h + head + h)


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None
