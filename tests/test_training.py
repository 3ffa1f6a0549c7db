"""A training step of a tiny decoder built from lessonlib's ops only (add_rms_norm, apply_rope, flash_attention,
FusedGatedMLP's swiglu): its loss and every parameter's gradient match the same model built from
lessonlib.reference, within the tolerance rule (against float64, yardstick: the reference in the same dtype)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lessonlib import ops, reference
from lessonlib.testing import check_close, rms_statistic_units, tolerance
from tests.conftest import DEVICE


class TinyDecoder(nn.Module):
    """Embedding, one pre-norm decoder layer (causal GQA attention with RoPE, gated MLP), final norm, LM head."""

    def __init__(self, vocab=50, hidden=32, heads=4, kv_heads=2, head_dim=16, intermediate=48):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.input_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.post_attention_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.final_norm = nn.Parameter(1 + 0.1 * torch.randn(hidden))
        self.mlp = reference.GatedMLP(hidden, intermediate)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.taps = None  # a dict: the three norms' outputs are kept there, with their gradients (term_magnitudes)

    def forward(self, tokens, fused: bool):
        lib = ops if fused else reference
        attention = ops.flash_attention if fused else reference.attention
        batch, seq = tokens.shape
        x = self.embed(tokens)
        cos, sin = reference.rope_cos_sin(torch.arange(seq, device=tokens.device), self.head_dim, dtype=x.dtype)
        normed, residual = self._tap("input_norm", *lib.add_rms_norm(x, torch.zeros_like(x), self.input_norm))
        q, k, v = self.qkv_proj(normed).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.view(batch, seq, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = lib.apply_rope(q, k, cos, sin)
        attn = attention(q, k, v, causal=True).transpose(1, 2).reshape(batch, seq, -1)
        normed, residual = self._tap("post_attention_norm",
                                     *lib.add_rms_norm(self.o_proj(attn), residual, self.post_attention_norm))
        mlp = ops.FusedGatedMLP(self.mlp) if fused else self.mlp
        normed, _ = self._tap("final_norm", *lib.add_rms_norm(mlp(normed), residual, self.final_norm))
        return self.lm_head(normed), mlp

    def _tap(self, name, normed, residual):
        if self.taps is not None:
            normed.retain_grad()
            self.taps[name] = normed
        return normed, residual


def loss_and_grads(model, tokens, targets, fused):
    logits, mlp = model(tokens, fused)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    if fused:  # FusedGatedMLP trains one stacked (2I, H) weight: split its gradient into gate's and up's
        grads["mlp.gate_proj.weight"], grads["mlp.up_proj.weight"] = mlp.gate_up_proj.weight.grad.chunk(2)
    return logits, loss, grads


def term_magnitudes(model, tokens, targets):
    """The float64 truth's gradients, and for each parameter the largest magnitude of its gradient's terms
    (testing.check_close's magnitude). A weight's gradient is a sum over the 14 tokens of products with random signs
    (a linear layer's dW = dY^T X, a norm's d(weight) = sum of d(out) * n, the embedding's a sum over a token's
    occurrences): it cancels, and the roundings, the fused path's and the reference's at other steps, are those of
    the partial sums, up to sum |terms| (measured with max|dW| instead: d mlp.up_proj.weight at 0.79 of its
    float32 tolerance in one run)."""
    kept = {}

    def keep(module, inputs, output):
        output.retain_grad()
        kept[module] = (inputs[0], output)

    hooks = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    model.taps = {}
    logits, loss, grads = loss_and_grads(model, tokens, targets, fused=False)
    for hook in hooks:
        hook.remove()
    terms = {}
    for name, module in model.named_modules():
        if module not in kept:
            continue
        inputs, output = kept[module]
        if isinstance(module, nn.Embedding):  # rows of the table: d(out) summed over a token's occurrences
            sums = torch.zeros_like(module.weight).index_add_(0, inputs.flatten(), output.grad.abs().flatten(0, 1))
        else:
            sums = output.grad.abs().flatten(0, -2).T @ inputs.abs().flatten(0, -2)
        terms[f"{name}.weight"] = sums.max().item()
    for name, normed in model.taps.items():  # n = normed / weight
        n = normed.detach() / getattr(model, name).detach()
        terms[name] = (normed.grad.abs() * n.abs()).flatten(0, -2).sum(0).max().item()
    normed, _ = kept[model.lm_head]
    terms["logits"] = (normed.abs() @ model.lm_head.weight.abs().T).max().item()
    return logits, loss, grads, terms


def norm_offsets(hidden: int) -> float:
    """The float32 share the fused path's three add_rms_norm statistics add, relative to a value's terms: each rstd
    is off by up to rms_statistic_units (a draw of its own, not the reference's), on everything after it in the
    forward and, through its backward, on every gradient before it."""
    return 3 * rms_statistic_units(hidden) * torch.finfo(torch.float32).eps


def test_training_step_of_a_decoder_built_from_lessonlib_ops_matches_the_reference(dtype):
    from lessonlib.ops.flash_attention import flash_attention_dtypes

    if dtype not in flash_attention_dtypes():
        pytest.skip(f"flash_attention refuses {dtype} here (on a GPU tl.dot would run float32 as TF32)")
    model = TinyDecoder().to(DEVICE)
    tokens = torch.randint(0, 50, (2, 7), device=DEVICE)
    targets = torch.randint(0, 50, (2, 7), device=DEVICE)
    truth_logits, truth_loss, truth, terms = term_magnitudes(copy.deepcopy(model).double(), tokens, targets)
    low_logits, _, low = loss_and_grads(copy.deepcopy(model).to(dtype), tokens, targets, fused=False)
    logits, loss, ours = loss_and_grads(copy.deepcopy(model).to(dtype), tokens, targets, fused=True)
    offsets = norm_offsets(model.input_norm.numel())
    check_close("logits", logits, truth_logits.detach(), low_logits.detach(),
                allowance=offsets * terms["logits"])
    # The loss is one number: "twice the reference's error" would rest on a single, possibly lucky, sample. Bound it
    # through the logits instead: each row's cross-entropy moves by at most sum_j |softmax_j - onehot_j| <= 2 times
    # the largest logit error, and the loss is a mean of rows.
    bound = 2 * tolerance(truth_logits.detach(), low_logits.detach(), dtype)
    assert abs(loss.item() - truth_loss.item()) <= bound, (loss.item(), truth_loss.item(), bound)
    assert set(ours) >= set(truth)
    for name in truth:
        if ours[name] is None:
            raise AssertionError(f"no gradient reached {name}")
        check_close(f"d {name}", ours[name], truth[name], low[name], terms[name], offsets * terms[name])
