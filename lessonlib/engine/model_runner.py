"""Runs a step: turns the scheduled sequences into the model's packed inputs, owns the KV pools, and replays decode
steps from CUDA graphs.

The pools hold one extra block past those the block manager hands out: the *padding block*. A decode step replayed
from a graph captured for 8 sequences but run for 5 pads the batch with 3 rows whose K/V go to the padding block
and whose attention reads one token of it; no sequence's block is ever written by a padding row.
"""

from __future__ import annotations

import torch

from lessonlib import runtime
from lessonlib.engine.model import Model, StepContext
from lessonlib.engine.sequence import Sequence


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a captured graph (nano-vllm's buckets): 1, 2, 4, 8, then every 16, up to max_num_seqs.
    A batch runs in the smallest bucket that holds it; at most 15 padding rows at large batch sizes."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes) | {max_num_seqs})


class ModelRunner:
    def __init__(self, model: Model, num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int,
                 enforce_eager: bool):
        config = model.config
        self.model, self.block_size = model, block_size
        device, dtype = model.norm.device, model.norm.dtype
        self.device = device
        self.pad_block = num_blocks
        shape = (config.num_layers, num_blocks + 1, block_size, config.num_kv_heads, config.head_dim)
        self.k_caches = torch.zeros(shape, dtype=dtype, device=device)
        self.v_caches = torch.zeros(shape, dtype=dtype, device=device)
        self.max_blocks = -(-max_model_len // block_size)  # block-table width of every decode step
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if not enforce_eager and runtime.on_gpu():
            self._capture(max_num_seqs)

    # --- prefill -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute every sequence's uncached tokens; return the logits of each one's last token, (B, vocab)."""
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
        return self.model.logits(hidden[last])

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
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One new token per sequence: feed each one's last token; return (B, vocab) logits."""
        batch = len(seqs)
        bucket = next((b for b in sorted(self.graphs) if b >= batch), None)
        rows = bucket or batch
        pad = rows - batch
        bs = self.block_size
        positions = [len(seq) - 1 for seq in seqs] + [0] * pad
        ids = [seq.last_token for seq in seqs] + [0] * pad
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)] + [self.pad_block * bs] * pad
        lens = [len(seq) for seq in seqs] + [1] * pad
        table = self._table(seqs, width=self.max_blocks, rows=rows)
        if bucket is None:
            ctx = StepContext(False, self._tensor(slots, torch.int64), table, self._tensor(lens, torch.int32),
                              decode_splits=None if runtime.on_gpu() else 1)
            hidden = self.model(self._tensor(ids, torch.int64), self._tensor(positions, torch.int64), ctx,
                                self.k_caches, self.v_caches)
            return self.model.logits(hidden)
        static = self._static
        for name, values, dtype in (("input_ids", ids, torch.int64), ("positions", positions, torch.int64),
                                    ("slots", slots, torch.int64), ("seq_lens", lens, torch.int32)):
            static[name][:rows].copy_(torch.tensor(values, dtype=dtype), non_blocking=True)
        static["block_table"][:rows].copy_(table, non_blocking=True)
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits[:batch]

    def _capture(self, max_num_seqs: int) -> None:
        """One graph per batch-size bucket, largest first, all sharing one memory pool (the buckets run one at a
        time, so their intermediates can share memory). Captured with every row pointing at the padding block."""
        rows, device = max_num_seqs, self.device
        self._static = static = {
            "input_ids": torch.zeros(rows, dtype=torch.int64, device=device),
            "positions": torch.zeros(rows, dtype=torch.int64, device=device),
            "slots": torch.full((rows,), self.pad_block * self.block_size, dtype=torch.int64, device=device),
            "seq_lens": torch.ones(rows, dtype=torch.int32, device=device),
            "block_table": torch.full((rows, self.max_blocks), self.pad_block, dtype=torch.int32, device=device),
        }
        pool = None
        with torch.inference_mode():
            for batch in reversed(graph_batch_sizes(max_num_seqs)):
                ctx = StepContext(False, static["slots"][:batch], static["block_table"][:batch], static["seq_lens"][:batch])

                def step():
                    hidden = self.model(static["input_ids"][:batch], static["positions"][:batch], ctx,
                                        self.k_caches, self.v_caches)
                    return self.model.logits(hidden)

                step()  # compiles the kernels for this shape outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = step()
                pool = graph.pool()
                self.graphs[batch] = (graph, logits)
        torch.cuda.synchronize()

    # --- helpers -----------------------------------------------------------------------------------------------
    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _table(self, seqs: list[Sequence], width: int, rows: int | None = None) -> torch.Tensor:
        """(rows, width) int32 block tables; entries past a sequence's blocks (never read) and padding rows point
        at the padding block."""
        table = torch.full((rows or len(seqs), width), self.pad_block, dtype=torch.int32)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        return table.to(self.device, non_blocking=True)
