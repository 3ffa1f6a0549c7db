"""A tiny Qwen2-architecture (or Llama, Llama 3, Qwen3, Mistral) language model, built here with nothing downloaded:
a byte-level BPE tokenizer trained on a few paragraphs of this course, and random weights saved as safetensors. It
loads in vLLM and in Hugging Face transformers alike, which is all lesson 06 needs: the text it writes is nonsense,
the serving machinery is real.

    path = tiny_model.build()          # once; later calls reuse the folder
    path = tiny_model.build(architecture="llama")   # the same, as a LlamaForCausalLM (lesson 07's engine loads all)
    LLM(model=str(path), ...)          # vLLM
    AutoModelForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from lessonlib import runtime

# The tokenizer's training text: the course's own vocabulary, so prompts about attention tokenize into few pieces.
CORPUS = """\
Attention reads every key and value of a sequence for every query. The score matrix grows with the square of the
sequence length, so FlashAttention computes it tile by tile and keeps a running maximum and a running sum: the
online softmax. Decode reads the whole KV cache to produce one token, so its speed is the speed of memory.
A paged KV cache stores keys and values in fixed-size blocks. A block table maps each sequence's logical blocks to
physical blocks in a shared pool, as an operating system maps virtual pages to physical frames. Blocks are
allocated as a sequence grows and returned to the pool when it finishes; sequences that share a prompt share its
blocks, and a shared block is copied before it is written. vLLM schedules many requests at once, batches their
decode steps, and runs paged attention over their block tables. Operator fusion keeps intermediate values in
registers instead of writing them to memory; CUDA graphs replay a recorded sequence of kernel launches.
The quick brown fox jumps over the lazy dog. Hello, my name is Ada. The capital of France is Paris.
The future of AI is open, fast and efficient. Once upon a time there was a small model that learned to serve.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, the format of Qwen2's template, on the special tokens above (for LLM.chat).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


ARCHITECTURES = ("qwen2", "llama", "llama3", "qwen3", "mistral")
# What each architecture adds to the shared sizes. The three later ones serve 4,096 positions (lesson 07's long
# prompts) and carry what makes their family different: llama3's RoPE scaling (its original context set short, so
# that the scaled, interpolated and kept frequencies all occur at the head size of 32), Qwen3's head size other
# than hidden / heads (64, not 32) with q_norm and k_norm, Mistral with no sliding window (as 7B v0.3).
FAMILY_SETTINGS = {
    "qwen2": {}, "llama": {},
    "llama3": {"max_position_embeddings": 4096,
               "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "qwen3": {"max_position_embeddings": 4096, "head_dim": 64, "attention_bias": False, "use_sliding_window": False},
    "mistral": {"max_position_embeddings": 4096, "sliding_window": None},
}


def default_path(architecture: str = "qwen2") -> Path:
    return runtime.scratch_dir() / f"tiny-{architecture}"


def build(path: str | Path | None = None, *, vocab_size: int = 512, hidden_size: int = 128, num_layers: int = 2,
          num_heads: int = 4, num_kv_heads: int = 2, seed: int = 0, overwrite: bool = False,
          architecture: str = "qwen2") -> Path:
    """Write the tokenizer, config and weights to ``path`` (default: the course's scratch folder) and return it.

    Head size is hidden_size / num_heads (32 by default); num_heads / num_kv_heads is the GQA group (2).
    Weights are drawn with a wider spread than a real initialisation (std 0.2 instead of 0.02) so that the next
    token is decided by clear margins: greedy decoding then means the same thing in every engine and dtype check.
    ``architecture="llama"`` writes a LlamaForCausalLM of the same sizes (no biases; Qwen2 has biases on q, k, v);
    "llama3", "qwen3" and "mistral" add what :data:`FAMILY_SETTINGS` says, and RMSNorm weights drawn around 1 instead
    of all ones, so that a norm weight loaded into the wrong place changes the tokens.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import transformers
    from transformers import PreTrainedTokenizerFast

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}")
    path = Path(path) if path is not None else default_path(architecture)
    if (path / "model.safetensors").exists() and not overwrite:
        return path
    # Written into a folder of its own, then renamed into place: another process (a second notebook, a test run in
    # parallel) never reads a half-written model.
    final = path
    final.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([CORPUS], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)

    name = {"qwen2": "Qwen2", "llama": "Llama", "llama3": "Llama", "qwen3": "Qwen3", "mistral": "Mistral"}[architecture]
    settings = {"max_position_embeddings": 2048, **FAMILY_SETTINGS[architecture]}
    config = getattr(transformers, f"{name}Config")(
        vocab_size=bpe.get_vocab_size(), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **settings,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config).to(torch.float32)
    if FAMILY_SETTINGS[architecture]:  # the first two keep their all-ones norms: recorded runs stay comparable
        with torch.no_grad():
            for key, weight in model.named_parameters():
                if key.endswith("norm.weight"):
                    weight.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id,
                                                             "do_sample": False}))
    return _move_into_place(path, final, overwrite)


def _move_into_place(built: Path, final: Path, overwrite: bool) -> Path:
    """Rename the finished folder ``built`` to ``final``. A folder already there is moved aside and deleted when
    ``overwrite`` or when it holds no weights (a build that died half-way); a complete one that another process moved
    there first is kept, and ``built`` dropped."""
    built.chmod(0o755)  # mkdtemp's folder is private to its owner; the model is not
    if final.exists() and (overwrite or not (final / "model.safetensors").exists()):
        aside = Path(tempfile.mkdtemp(prefix=f".{final.name}-old-", dir=final.parent))
        try:
            final.rename(aside / final.name)  # a rename, so no reader ever sees it half deleted
        except OSError:  # another process moved it first
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        built.rename(final)
    except OSError:  # another process's build got there first
        shutil.rmtree(built, ignore_errors=True)
        if not (final / "model.safetensors").exists():
            raise
    return final
