"""Lesson 01's int8-weights table (``measured.print_int8_weights``): its times are the recorded run's, its bytes
those each way must move, its ratios the times' ratios, and its lines fit a 100-character output."""

import copy

from lessonlib import measured, results
from lessonlib.results import Impl, Op


def test_rows_are_the_recorded_times_and_the_bytes_each_way_moves():
    extras = results.load("fusion-extras-h200")
    rows = measured.int8_weight_rows(extras)
    assert [r["M"] for r in rows] == sorted(r["shape"]["M"] for r in extras.select(op=Op.DEQUANT_MATMUL,
                                                                                   impl=Impl.LESSONLIB))
    for row in rows:
        m, n, k = row["M"], row["N"], row["K"]
        for impl in measured.INT8_IMPLS:
            assert row["us"][impl] == extras.one(op=Op.DEQUANT_MATMUL, impl=impl, M=m, N=n, K=k)["us"]
        assert row["bytes_16bit"] == 2 * (m * k + n * k + m * n)  # x, W and y in 16 bits
        assert row["bytes_int8"] == m * k * 2 + n * k + n * 2 + m * n * 2  # W in int8, plus one scale per row
        assert row["intensity"] == 2 * m * n * k / row["bytes_16bit"]


def test_the_printed_ratios_follow_the_records(capsys):
    extras = results.load("fusion-extras-h200")
    measured.print_int8_weights(extras)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 100, lines
    row = next(line for line in lines if line.split()[0] == "2048")
    want = extras.one(op=Op.DEQUANT_MATMUL, impl=Impl.LINEAR_16BIT, M=2048, N=14336, K=4096)["us"] / extras.one(
        op=Op.DEQUANT_MATMUL, impl=Impl.LESSONLIB, M=2048, N=14336, K=4096)["us"]
    assert row.split()[-2] == f"{want:.2f}x", row  # the F.linear/int8 column, not the eager/int8 one beside it
    planted = copy.deepcopy(extras)  # the int8 kernel made twice as fast at M=2048: the ratio printed must move
    for r in planted.records:
        if r["op"] == Op.DEQUANT_MATMUL and r["impl"] == Impl.LESSONLIB and r["shape"]["M"] == 2048:
            r["us"] /= 2
    measured.print_int8_weights(planted)
    row = next(line for line in capsys.readouterr().out.splitlines() if line.split()[0] == "2048")
    assert row.split()[-2] == f"{2 * want:.2f}x", row
