"""Runs a step: turns the scheduled sequences into the model's packed inputs, owns the KV pools, and replays decode
steps, and the prefill of a lone prompt, from CUDA graphs.

The pools hold one extra block past those the block manager hands out: the *padding block*. A decode step replayed
from a graph captured for 8 sequences but run for 5 pads the batch with 3 rows whose K/V go to the padding block
and whose attention reads one token of it; a prompt of 100 tokens prefilled by the graph of 128 gets 28 padding
rows after its own, whose K/V go to the padding block too. No sequence's block is ever written by a padding row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lessonlib import ops, runtime
from lessonlib.engine.features import Features
from lessonlib.engine.model import Model, StepContext
from lessonlib.engine.sequence import Sequence


@dataclass
class StepOutput:
    """What a step hands the sampler: each row's logits (B, vocab) float32, and the greedy token of each row (B,)
    int64, computed on the GPU with the logits (inside the captured graph at decode)."""

    logits: torch.Tensor
    greedy: torch.Tensor


def greedy(logits: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Each row's argmax. On a GPU ``ops.argmax``, which spreads a row over the GPU (PyTorch's argmax reads a row
    with one thread block: 40 us for Llama 3's 128,256 logits on the H200); in the interpreter PyTorch's, the same
    indices (tests/ops/test_argmax.py) without a Triton program per row at milliseconds each. ``fused`` False (the
    engine's fused_ops feature off): PyTorch's everywhere."""
    return ops.argmax(logits) if fused and runtime.on_gpu() else logits.argmax(dim=-1)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a captured graph (nano-vllm's buckets): 1, 2, 4, 8, then every 16, up to max_num_seqs.
    A batch runs in the smallest bucket that holds it; at most 15 padding rows at large batch sizes."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


MAX_PREFILL_GRAPH_TOKENS = 2048  # longer lone prompts prefill eagerly: their launches are a small part of their time


class DecodeInputs:
    """A decode step's integer inputs, written on the host into one page-locked buffer and sent to the GPU in one
    copy (its int64 part: token ids, positions, cache slots; its int32 part: sequence lengths, block tables; each a
    view of the same bytes). The device buffer is what the captured graphs read, so a replay needs no other input.

    Rows past the batch are padding: token 0 at position 0, its K/V written to the padding block, attending to
    one token of it. Reusing the host buffer each step is safe because every step ends by reading its sampled
    tokens back to the host, which waits for the step's copies too.
    """

    def __init__(self, rows: int, max_blocks: int, pad_block: int, block_size: int, device: torch.device):
        pinned = device.type == "cuda"
        self.rows, self.max_blocks, self.pad_block, self.block_size = rows, max_blocks, pad_block, block_size
        int64_bytes, int32_bytes = 3 * rows * 8, rows * (1 + max_blocks) * 4
        self.host = torch.zeros(int64_bytes + int32_bytes, dtype=torch.uint8, pin_memory=pinned)
        self.device_buffer = torch.zeros_like(self.host, device=device)
        self.host_ints, self.host_int32 = self._split(self.host, int64_bytes)
        self.device_ints, self.device_int32 = self._split(self.device_buffer, int64_bytes)
        self.ids, self.positions, self.slots = self.host_ints.numpy()
        int32 = self.host_int32.numpy()
        self.lens, self.table = int32[:rows], int32[rows:].reshape(rows, max_blocks)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._pad(rows)
        self._send()

    def _split(self, buffer: torch.Tensor, int64_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (3, rows) int64 and the flat int32 views of one byte buffer."""
        return buffer[:int64_bytes].view(torch.int64).view(3, self.rows), buffer[int64_bytes:].view(torch.int32)

    def views(self, rows: int) -> dict[str, torch.Tensor]:
        """The first ``rows`` rows of the device buffers, by StepContext's names."""
        if rows not in self._views:
            self._views[rows] = self._make_views(rows)
        return self._views[rows]

    def _make_views(self, rows: int) -> dict[str, torch.Tensor]:
        ints, int32 = self.device_ints, self.device_int32
        return {"input_ids": ints[0, :rows], "positions": ints[1, :rows], "slots": ints[2, :rows],
                "seq_lens": int32[:rows], "block_table": int32[self.rows:].view(self.rows, self.max_blocks)[:rows]}

    def fill(self, seqs: list[Sequence], rows: int) -> dict[str, torch.Tensor]:
        """Write each sequence's last token, its position and slot, its length and block table (rows past the batch:
        padding); send them; return the device views of the first ``rows`` rows."""
        bs, n = self.block_size, len(seqs)
        self._pad(rows)
        lengths = [len(seq.token_ids) for seq in seqs]
        self.ids[:n] = [seq.token_ids[-1] for seq in seqs]
        self.lens[:n] = lengths
        self.positions[:n] = [length - 1 for length in lengths]
        self.slots[:n] = [seq.block_table[(length - 1) // bs] * bs + (length - 1) % bs for seq, length in zip(seqs, lengths)]
        for row, seq in zip(self.table, seqs):
            row[:len(seq.block_table)] = seq.block_table
        self._send()
        return self.views(rows)

    def _pad(self, rows: int) -> None:
        self.ids[:rows] = 0
        self.positions[:rows] = 0
        self.slots[:rows] = self.pad_block * self.block_size
        self.lens[:rows] = 1
        self.table[:rows] = self.pad_block  # entries past a sequence's blocks are never read

    def _send(self) -> None:
        self.device_buffer.copy_(self.host, non_blocking=True)


class PrefillGraphs:
    """The prefill of one prompt with nothing cached, replayed from a CUDA graph per bucket of prompt lengths (16,
    32, 64, ... up to ``max_tokens``), each captured the first time a prompt of its bucket comes. Eager, a prefill
    launches every kernel of every layer from Python (about 180 for a 16-layer model: 23 ms on session 7's device
    host for 128 tokens); replayed, it is one launch.

    A prompt of n tokens runs padded to its bucket. The padding rows come after the prompt's (token 0 at position 0,
    K/V written to the padding block), so under causal attention no prompt token sees one, every layer's other
    kernels work row by row, and only the prompt's last row is read for logits: the prompt's K/V and logits are
    those of the unpadded prefill, up to rounding (a GEMM over more rows may use another cuBLAS kernel). With
    ``capture`` False (no GPU) the same padded step runs eagerly, which is how the interpreter tests it.
    """

    def __init__(self, runner: "ModelRunner", max_tokens: int, capture: bool):
        self.runner, self.capture = runner, capture
        self.buckets = [16]
        while self.buckets[-1] < max_tokens:
            self.buckets.append(2 * self.buckets[-1])
        rows, device = self.buckets[-1], runner.device
        pinned = device.type == "cuda"
        self.host = torch.zeros(3 * rows + 1, dtype=torch.int64, pin_memory=pinned)  # ids, positions, slots, last
        self.device_buffer = torch.zeros_like(self.host, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self.pool = None

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds ``num_tokens``; None past the largest (that prompt runs eagerly)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def run(self, seq: Sequence, bucket: int) -> StepOutput:
        if self.capture and bucket not in self.graphs:
            self._capture(bucket)
        n, bs = len(seq), self.runner.block_size
        self._fill(bucket, seq.token_ids, range(n), [seq.block_table[p // bs] * bs + p % bs for p in range(n)])
        if not self.capture:
            return self._step(bucket)
        graph, out = self.graphs[bucket]
        graph.replay()
        return out

    def _fill(self, bucket: int, ids, positions, slots) -> None:
        """Write the prompt's rows, then padding rows up to ``bucket``, and the last prompt row's index; send."""
        rows, n = self.buckets[-1], len(ids)
        host = self.host.numpy()
        host_ids, host_positions, host_slots = host[:rows], host[rows:2 * rows], host[2 * rows:3 * rows]
        host_ids[:n], host_positions[:n], host_slots[:n] = ids, positions, slots
        host_ids[n:bucket], host_positions[n:bucket] = 0, 0
        host_slots[n:bucket] = self.runner.pad_block * self.runner.block_size
        host[-1] = n - 1
        self.device_buffer.copy_(self.host, non_blocking=True)

    def _step(self, bucket: int) -> StepOutput:
        rows, runner = self.buckets[-1], self.runner
        ids, positions, slots = (self.device_buffer[i * rows:i * rows + bucket] for i in range(3))
        ctx = StepContext(True, slots, max_query_len=bucket, flash_groups=[(None, 1, bucket)])
        hidden = runner.model(ids, positions, ctx, runner.k_caches, runner.v_caches)
        logits = runner.model.logits(hidden[self.device_buffer[-1:]])
        return StepOutput(logits, greedy(logits, runner.fused))

    def _capture(self, bucket: int) -> None:
        """Capture ``bucket``'s graph with every row padding (the warm-up run compiles its kernels and writes only
        the padding block); its buckets share one memory pool, as the decode graphs do."""
        self._fill(bucket, [0], [0], [self.runner.pad_block * self.runner.block_size])
        self._step(bucket)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._step(bucket)
        self.pool = graph.pool()
        self.graphs[bucket] = (graph, out)


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 features: Features = Features()):
        config = model.config
        self.model, self.block_size, self.fused = model, block_size, features.fused_ops
        device, dtype = model.norm.device, model.norm.dtype
        self.device = device
        self.pad_block = num_blocks
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k_caches = torch.zeros(shape, dtype=dtype, device=device)
        self.v_caches = torch.zeros(shape, dtype=dtype, device=device)
        self.max_blocks = -(-max_model_len // block_size)  # block-table width of every decode step
        self.inputs = DecodeInputs(max_num_seqs, self.max_blocks, self.pad_block, block_size, device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        self.prefill_graphs: PrefillGraphs | None = None
        if features.cuda_graphs and runtime.on_gpu():
            self._capture(max_num_seqs)
            self.prefill_graphs = PrefillGraphs(self, min(max_model_len, MAX_PREFILL_GRAPH_TOKENS), capture=True)

    # --- prefill -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> StepOutput:
        """Compute every sequence's uncached tokens; return the logits of each one's last token, (B, vocab), and
        its greedy token."""
        lone = seqs[0] if len(seqs) == 1 and not seqs[0].num_cached_tokens else None
        bucket = lone and self.prefill_graphs and self.prefill_graphs.bucket(len(lone))
        if bucket:
            return self.prefill_graphs.run(lone, bucket)
        bs = self.block_size
        ids, positions, slots, starts, lens = [], [], [], [0], []
        for seq in seqs:
            start, n = seq.num_cached_tokens, len(seq)
            ids += seq.token_ids[start:]
            positions += range(start, n)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, n)]
            starts.append(starts[-1] + n - start)
            lens.append(n)
        ctx = StepContext(True, self._tensor(slots, torch.int64), max_query_len=max(b - a for a, b in zip(starts, starts[1:])))
        if any(seq.num_cached_tokens for seq in seqs):  # a cached prefix to read through the block table
            ctx.block_table = self._table(seqs, width=max(len(seq.block_table) for seq in seqs))
            ctx.seq_lens = self._tensor(lens, torch.int32)
            ctx.query_starts = self._tensor(starts, torch.int32)
        else:
            ctx.flash_groups = self._flash_groups(lens, starts)
        hidden = self.model(self._tensor(ids, torch.int64), self._tensor(positions, torch.int64), ctx,
                            self.k_caches, self.v_caches)
        last = self._tensor([end - 1 for end in starts[1:]], torch.int64)
        logits = self.model.logits(hidden[last])
        return StepOutput(logits, greedy(logits, self.fused))

    def _flash_groups(self, lens: list[int], starts: list[int]) -> list:
        """Prompts of equal length batched into one flash_attention call each."""
        by_length: dict[int, list[int]] = {}
        for i, n in enumerate(lens):
            by_length.setdefault(n, []).append(i)
        if len(by_length) == 1:
            return [(None, len(lens), lens[0])]  # the packed rows are already (count, length) in order
        groups = []
        for n, members in by_length.items():
            rows = torch.cat([torch.arange(starts[i], starts[i] + n) for i in members]).to(self.device)
            groups.append((rows, len(members), n))
        return groups

    # --- decode ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> StepOutput:
        """One new token per sequence: feed each one's last token; return (B, vocab) logits and greedy tokens."""
        batch = len(seqs)
        bucket = next((b for b in sorted(self.graphs) if b >= batch), None)
        inputs = self.inputs.fill(seqs, rows=bucket or batch)
        if bucket is None:
            ctx = StepContext(False, inputs["slots"], inputs["block_table"], inputs["seq_lens"],
                              decode_splits=None if runtime.on_gpu() else 1,
                              max_seq_len=max(len(seq.token_ids) for seq in seqs))
            logits = self.model.logits(self.model(inputs["input_ids"], inputs["positions"], ctx, self.k_caches,
                                                  self.v_caches))
            return StepOutput(logits, greedy(logits, self.fused))
        graph, out = self.graphs[bucket]
        graph.replay()
        return StepOutput(out.logits[:batch], out.greedy[:batch])

    def _capture(self, max_num_seqs: int) -> None:
        """One graph per batch-size bucket, largest first, all sharing one memory pool (the buckets run one at a
        time, so their intermediates can share memory). Each reads its inputs from the first rows of
        ``self.inputs``' device buffers; captured with every row pointing at the padding block."""
        pool = None
        with torch.inference_mode():
            for batch in reversed(graph_batch_sizes(max_num_seqs)):
                inputs = self.inputs.views(batch)
                ctx = StepContext(False, inputs["slots"], inputs["block_table"], inputs["seq_lens"])

                def step():
                    hidden = self.model(inputs["input_ids"], inputs["positions"], ctx, self.k_caches, self.v_caches)
                    logits = self.model.logits(hidden)
                    return StepOutput(logits, greedy(logits, self.fused))

                step()  # compiles the kernels for this shape outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = step()
                pool = graph.pool()
                self.graphs[batch] = (graph, out)
        torch.cuda.synchronize()

    # --- helpers -----------------------------------------------------------------------------------------------
    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _table(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        """(len(seqs), width) int32 block tables for a prefill step; entries past a sequence's blocks (never read)
        point at the padding block."""
        table = torch.full((len(seqs), width), self.pad_block, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        return table.to(self.device, non_blocking=True)
