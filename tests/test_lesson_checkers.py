"""Lessons 02, 03 and 06's checkers: each passes a right answer and fails the classic wrong ones, saying why."""

import pytest
import torch

from lessonlib import kv_memory
from lessonlib.exercises import (ExerciseFailed, check_free_sequence, check_key_tile_bound, check_online_softmax_update,
                                 check_physical_slot)


def update(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    correction = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * correction + p.sum(dim=1), acc * correction[:, None] + p @ values


def update_without_rescaling(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(dim=1), acc + p @ values


def update_rescaling_only_the_sum(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    correction = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * correction + p.sum(dim=1), acc + p @ values


def test_online_softmax_update_checker():
    check_online_softmax_update(update)
    with pytest.raises(ExerciseFailed, match="rescale the old sum"):
        check_online_softmax_update(update_without_rescaling)
    with pytest.raises(ExerciseFailed, match="rescale acc"):
        check_online_softmax_update(update_rescaling_only_the_sum)


def test_key_tile_bound_checker():
    check_key_tile_bound(lambda start_m, block_m, n_q, n_kv: max(0, min(n_kv, min(start_m + block_m, n_q) + n_kv - n_q)))
    with pytest.raises(ExerciseFailed, match="last real query"):  # ignores the partial last tile and Nq != Nkv
        check_key_tile_bound(lambda start_m, block_m, n_q, n_kv: min(n_kv, start_m + block_m))
    with pytest.raises(ExerciseFailed, match="not implemented"):
        check_key_tile_bound(lambda *args: (_ for _ in ()).throw(NotImplementedError()))


def test_physical_slot_checker():
    check_physical_slot(lambda p, table, b: (table[p // b], p % b))
    with pytest.raises(ExerciseFailed, match="logical block"):
        check_physical_slot(lambda p, table, b: (p // b, p % b))  # forgot the table


def free_in_place(table, ref_counts, free_blocks):
    if any(ref_counts[b] == 0 for b in table):
        raise ValueError("double free")
    for b in table:
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            free_blocks.append(b)


def free_everything(table, ref_counts, free_blocks):
    for b in table:
        ref_counts[b] = 0
        free_blocks.append(b)


def free_then_complain(table, ref_counts, free_blocks):
    for b in table:
        if ref_counts[b] == 0:
            raise ValueError("double free")
        ref_counts[b] -= 1
        if ref_counts[b] == 0:
            free_blocks.append(b)


def test_free_sequence_checker():
    check_free_sequence(free_in_place)
    with pytest.raises(ExerciseFailed):
        check_free_sequence(free_everything)  # shared blocks must stay in use
    with pytest.raises(ExerciseFailed, match="check every block first"):
        check_free_sequence(free_then_complain)


def test_reservation_counts_whole_blocks_and_slabs():
    lengths = torch.tensor([1, 16, 17, 100])
    result = kv_memory.reservation(lengths, max_len=64, block_size=16)
    assert result.used_tokens == 1 + 16 + 17 + 64  # 100 is capped at max_len
    assert result.paged_tokens == 16 * (1 + 1 + 2 + 4)
    assert result.contiguous_tokens == 4 * 64
    assert 0 < result.paged_waste < result.contiguous_waste < 1
    with pytest.raises(ValueError):
        kv_memory.reservation(lengths, max_len=64, block_size=0)
    assert kv_memory.kv_bytes_per_token() == 128 * 1024  # Llama-3-8B, bf16


def test_refresh_static_inputs_checker():
    from lessonlib.exercises import check_refresh_static_inputs

    def in_place(static, new):
        for name, tensor in new.items():
            static[name].copy_(tensor)

    def rebinds(static, new):
        static.update(new)

    check_refresh_static_inputs(in_place)
    with pytest.raises(ExerciseFailed, match="in place"):
        check_refresh_static_inputs(rebinds)
