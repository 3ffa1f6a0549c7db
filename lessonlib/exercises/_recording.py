"""The recorder behind :func:`lessonlib.exercises._observe.launch_observed`: for the length of one launch in Triton's
interpreter it wraps the interpreter's two memory primitives, ``create_masked_load`` and ``create_masked_store``,
through which every load and store passes in Triton 3.6 and 3.9 (plain, masked, block-pointer and descriptor
accesses alike: the others call these two). Each access's lanes are matched to the tensor arguments: a lane outside
its tensor is recorded, and performed only where it stays inside the memory that tensor's storage owns (a checker's
guard zone, the padding between rows), so a missing mask cannot touch the process's other memory.

Which tensor an access belongs to: the argument holding most of its active lanes (a missing mask leaves most lanes
inside), or, when none is inside any, the nearest one. Offsets are in elements from the tensor's first element.
Values are kept as raw bits (bfloat16 is a uint16 in the interpreter), so comparisons are exact, NaN included.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

import numpy as np
import torch

_BITS = {1: (torch.int8, np.int8), 2: (torch.int16, np.int16), 4: (torch.int32, np.int32), 8: (torch.int64, np.int64)}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements (in its own order, flattened) as signed integers of their width."""
    return t.detach().cpu().contiguous().reshape(-1).view(_BITS[t.element_size()][0]).numpy()


class _Region:
    """One tensor argument: where its elements sit in memory."""

    def __init__(self, name: str, t: torch.Tensor):
        self.name, self.tensor, self.base, self.itemsize = name, t, t.data_ptr(), t.element_size()
        self.extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else 0
        self.order = torch.arange(self.extent).as_strided(t.shape, t.stride()).reshape(-1).numpy()  # element -> offset
        self.inside = np.zeros(self.extent, dtype=bool)
        self.inside[self.order] = True
        storage = t.untyped_storage()
        self.owned = (storage.data_ptr(), storage.data_ptr() + storage.nbytes())  # bytes safe to touch
        self.reads, self.writes, self.visits, self.stores = [], [], [], []
        self.outside = {"reads_outside": {}, "writes_outside": {}}  # line -> [count, first, last]

    def locate(self, addresses: np.ndarray):
        """(element offsets, inside) for byte addresses."""
        delta = addresses - self.base
        offsets = np.floor_divide(delta, self.itemsize)
        ok = (delta % self.itemsize == 0) & (offsets >= 0) & (offsets < self.extent)
        ok[ok] = self.inside[offsets[ok]]
        return offsets, ok

    def owns(self, addresses: np.ndarray) -> np.ndarray:
        return (addresses >= self.owned[0]) & (addresses + self.itemsize <= self.owned[1])

    def distance(self, addresses: np.ndarray) -> int:
        end = self.base + self.extent * self.itemsize
        return int(np.min(np.maximum(self.base - addresses, addresses - end + 1).clip(min=0))) if addresses.size else 0

    def note_outside(self, kind: str, line: int, offsets: np.ndarray) -> None:
        entry = self.outside[kind].setdefault(line, [0, int(offsets.min()), int(offsets.max())])
        entry[0] += offsets.size
        entry[1], entry[2] = min(entry[1], int(offsets.min())), max(entry[2], int(offsets.max()))


class Recorder:
    """Records one launch's loads and stores on ``tensors`` ({parameter name: tensor}); ``source``: the kernel's
    file, whose line numbers name the accesses. ``poison``: source lines whose masked loads without ``other=``
    get NaN (integers: a huge value) in their unset lanes instead of the interpreter's 0."""

    def __init__(self, tensors: dict, source: str, before: dict | None = None, poison=()):
        self.tensors, self.source, self.poison = tensors, source, set(poison)
        self.before = before or {k: t.detach().clone() for k, t in tensors.items()}
        self.regions = [_Region(k, t) for k, t in tensors.items()]
        self.unset_sites: set[int] = set()
        self.seen_programs: dict[tuple, int] = {}

    def poisoned_copy(self, sites) -> "Recorder":
        return Recorder(self.tensors, self.source, self.before, sites)

    def result(self) -> dict:
        return {k: t.detach().clone() for k, t in self.tensors.items()}

    def programs(self, grid) -> list:
        import itertools

        full = tuple(grid) + (1,) * (3 - len(grid))
        return [list(p) for p in itertools.product(*(range(g) for g in full))]

    # --- the wrapped primitives ---

    def _line(self) -> int:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code.co_filename == self.source:
                return frame.f_lineno
            frame = frame.f_back
        return -1

    def _program(self, builder) -> int:
        x, y, z = builder.grid_idx
        _, gy, gz = builder.grid_dim
        return (x * gy + y) * gz + z

    def _attribute(self, addresses: np.ndarray, active: np.ndarray):
        live = addresses[active] if active.any() else addresses.reshape(-1)
        best, best_count = None, -1
        for region in self.regions:
            count = int(region.locate(live)[1].sum())
            if count > best_count:
                best, best_count = region, count
        if best is not None and best_count == 0:
            best = min(self.regions, key=lambda r: r.distance(live))
        return best

    def _access(self, builder, kind: str, ptrs, mask):
        addresses = np.asarray(ptrs.data).astype(np.int64)
        active = np.broadcast_to(np.asarray(mask.data).astype(bool), addresses.shape)
        region, line, program = self._attribute(addresses, active), self._line(), self._program(builder)
        if region is None:
            return None, active & False, line
        offsets, inside = region.locate(addresses)
        ok = active & (inside | region.owns(addresses))  # what may be performed
        stray = active & ~inside
        if stray.any():
            region.note_outside(kind, line, offsets[stray])
        if kind == "reads_outside":
            region.visits.append(np.stack([np.full(inside.sum(), program), offsets[inside]], 1))
            region.reads.append(np.stack([np.full(active.sum(), program), offsets[active]], 1))
        else:
            region.writes.append(np.stack([np.full(active.sum(), program), offsets[active]], 1))
        self.seen_programs.setdefault((program,), program)
        return region, (offsets, ok), line

    def _poison(self, interpreter, ptrs):
        element = ptrs.get_element_ty()
        np_dtype = interpreter._get_np_dtype(element)
        shape = np.asarray(ptrs.data).shape
        if element.is_floating():
            value = 0x7FC0 if np_dtype == np.uint16 else (0x7E if np_dtype == np.uint8 else np.nan)
        else:
            value = np.iinfo(np_dtype).max // 2 if np.issubdtype(np_dtype, np.integer) else 1
        return interpreter.TensorHandle(np.full(shape, value, dtype=np_dtype), element)

    @contextmanager
    def recording(self):
        from triton.runtime import interpreter

        builder = interpreter.interpreter_builder
        load, store = builder.create_masked_load, builder.create_masked_store

        def masked_load(ptrs, mask, other, *rest, **kwargs):
            region, located, line = self._access(builder, "reads_outside", ptrs, mask)
            safe = located[1] if region is not None else located
            if other is None and not np.asarray(mask.data).astype(bool).all():
                self.unset_sites.add(line)
                if line in self.poison:
                    other = self._poison(interpreter, ptrs)
            mask = interpreter.TensorHandle(np.ascontiguousarray(safe), mask.dtype)
            return load(ptrs, mask, other, *rest, **kwargs)

        def masked_store(ptrs, value, mask, *rest, **kwargs):
            region, located, line = self._access(builder, "writes_outside", ptrs, mask)
            safe = located[1] if region is not None else located
            keep = safe & region.locate(np.asarray(ptrs.data).astype(np.int64))[1] if region is not None else safe
            if keep.any():
                values = np.broadcast_to(np.asarray(value.data), keep.shape)[keep]
                width = _BITS.get(values.dtype.itemsize, (None, None))[1]
                bits = np.ascontiguousarray(values).view(width) if width else values
                region.stores.append((located[0][keep], bits))
            mask = interpreter.TensorHandle(np.ascontiguousarray(safe), mask.dtype)
            return store(ptrs, value, mask, *rest, **kwargs)

        def no_atomics(*args, **kwargs):
            raise NotImplementedError("atomics: this exercise needs none, and the checker records only tl.load and "
                                      "tl.store")

        saved = {name: builder.__dict__.get(name) for name in
                 ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")}
        builder.create_masked_load, builder.create_masked_store = masked_load, masked_store
        builder.create_atomic_rmw = builder.create_atomic_cas = no_atomics
        try:
            yield self
        finally:
            for name, value in saved.items():
                if value is None:
                    builder.__dict__.pop(name, None)
                else:
                    setattr(builder, name, value)

    # --- the record ---

    def tensor_record(self, name: str, after: torch.Tensor, record_type, outside_type):
        region = next(r for r in self.regions if r.name == name)
        t, before = region.tensor, self.before[name]
        flat = np.zeros(region.extent, dtype=_BITS[region.itemsize][1])
        flat[region.order] = _bits(before)
        written = np.zeros(region.extent, dtype=bool)
        if region.stores:
            offsets = np.concatenate([o for o, _ in region.stores])
            values = np.concatenate([v for _, v in region.stores])
            if values.dtype == flat.dtype:
                last = offsets.size - 1 - np.unique(offsets[::-1], return_index=True)[1]  # the last store wins
                flat[offsets[last]] = values[last]
            written[offsets] = True
        stored = torch.from_numpy(flat[region.order].copy()).view(t.dtype).reshape(t.shape)

        def pairs(chunks):
            if not chunks:
                return torch.zeros(0, 2, dtype=torch.int64)
            return torch.from_numpy(np.unique(np.concatenate(chunks).astype(np.int64), axis=0))

        outside = {kind: [outside_type(line, *entry) for line, entry in sorted(lines.items())]
                   for kind, lines in region.outside.items()}
        return record_type(name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                           before.cpu(), after.cpu(), stored,
                           torch.from_numpy(written[region.order].copy()).reshape(t.shape),
                           pairs(region.reads), pairs(region.writes), pairs(region.visits), **outside)
