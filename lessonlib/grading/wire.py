"""What passes between the judge and a submission's runner (:mod:`~lessonlib.grading.judge`): plain data only. A
frame is a JSON header and the raw bytes of the tensors it names; the reader checks every tensor's dtype, shape and
size and caps the frame, so that nothing but numbers, strings, lists, tuples, dicts and tensors can come back from a
submission (no pickle, no object of the submission's: an always-equal object arrives as the float it claims to be,
or not at all)."""

from __future__ import annotations

import json
import os
import select
import struct
import time

import torch

HEADER_CAP = 4 << 20  # bytes of one frame's JSON
PAYLOAD_CAP = 64 << 20  # bytes of one frame's tensors (the exercises' calls move kilobytes)
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                                        torch.int8, torch.int16, torch.int32, torch.int64,
                                                        torch.uint8, torch.bool)}


class WireError(Exception):
    """A frame that is not plain data, too large, or late."""


def encode(value, buffers: list, depth: int = 0):
    """``value`` as JSON-able data; each tensor's bytes appended to ``buffers``. Subclasses of int, float and str
    are sent as the plain value they hold; any other object as ``{"__object__": its type's name}``. Kinds are told
    by the object's real type, not ``isinstance`` (which asks the object's own ``__class__``)."""
    if depth > 32:
        raise WireError("nested too deeply")
    kind = type(value)
    if value is None or kind is bool:
        return value
    if issubclass(kind, int) and not issubclass(kind, bool):
        return {"__int__": int.__repr__(value)}
    if issubclass(kind, float):
        return {"__float__": float.__repr__(value)}
    if issubclass(kind, str):
        return str.__str__(value)[:100_000]
    if kind is torch.Tensor:
        tensor = value.detach().to("cpu").contiguous()
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
            return {"__object__": f"tensor of {tensor.dtype}"}
        buffers.append(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        return {"__tensor__": [str(tensor.dtype).removeprefix("torch."), list(tensor.shape), len(buffers) - 1]}
    if type(value) in (list, tuple):
        items = [encode(v, buffers, depth + 1) for v in list.__iter__(list(value))]
        return items if type(value) is list else {"__tuple__": items}
    if type(value) is dict and all(type(k) is str for k in dict.keys(value)):
        return {"__dict__": {k: encode(v, buffers, depth + 1) for k, v in dict.items(value)}}
    return {"__object__": type(value).__name__[:100]}


class Foreign:
    """What the judge sees of an object that is not plain data: its type's name, and nothing it can run."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"<a {self.name} object>"


def decode(data, buffers: list[bytes], depth: int = 0):
    """The inverse of :func:`encode`, checking everything: a JSON value that is not one :func:`encode` writes raises
    :class:`WireError`."""
    if depth > 32:
        raise WireError("nested too deeply")
    if data is None or type(data) in (bool, str):
        return data
    if type(data) is list:
        return [decode(v, buffers, depth + 1) for v in data]
    if type(data) is not dict or len(data) != 1:
        raise WireError("not plain data")
    (kind, body), = data.items()
    if kind == "__int__" and type(body) is str and len(body) < 5000:
        return int(body)
    if kind == "__float__" and type(body) is str and len(body) < 100:
        return float(body)
    if kind == "__tuple__" and type(body) is list:
        return tuple(decode(v, buffers, depth + 1) for v in body)
    if kind == "__dict__" and type(body) is dict:
        return {k: decode(v, buffers, depth + 1) for k, v in body.items()}
    if kind == "__object__" and type(body) is str:
        return Foreign(body[:100])
    if kind == "__tensor__" and type(body) is list and len(body) == 3:
        dtype, shape, index = body
        if (dtype not in DTYPES or type(shape) is not list or not all(type(s) is int and 0 <= s < 2**40 for s in shape)
                or type(index) is not int or not 0 <= index < len(buffers)):
            raise WireError("a tensor that is not well formed")
        raw = buffers[index]
        count = 1
        for s in shape:
            count *= s
        if count * DTYPES[dtype].itemsize != len(raw):
            raise WireError(f"a tensor of {len(raw)} bytes for shape {shape} of {dtype}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(DTYPES[dtype]).reshape(shape).clone()
    raise WireError("not plain data")


def send(fd: int, header: dict, buffers: list[bytes] = ()) -> None:
    body = json.dumps({**header, "sizes": [len(b) for b in buffers]}).encode()
    data = struct.pack("<QQ", len(body), sum(len(b) for b in buffers)) + body + b"".join(buffers)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int, deadline: float) -> bytes:
    chunks, got = [], 0
    while got < size:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise WireError("no answer in time")
        chunk = os.read(fd, min(size - got, 1 << 20))
        if not chunk:
            raise WireError("the other side closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def receive(fd: int, timeout: float) -> tuple[dict, list[bytes]]:
    """One frame: (header, tensor buffers), within ``timeout`` seconds and the caps."""
    deadline = time.monotonic() + timeout
    head, payload = struct.unpack("<QQ", _read_exactly(fd, 16, deadline))
    if head > HEADER_CAP or payload > PAYLOAD_CAP:
        raise WireError(f"a frame of {head + payload:,} bytes")
    header = json.loads(_read_exactly(fd, head, deadline))
    raw = _read_exactly(fd, payload, deadline) if payload else b""
    sizes = header.get("sizes") if type(header) is dict else None
    if type(sizes) is not list or not all(type(s) is int and s >= 0 for s in sizes) or sum(sizes) != payload:
        raise WireError("a frame whose sizes do not add up")
    buffers, at = [], 0
    for size in sizes:
        buffers.append(raw[at: at + size])
        at += size
    return header, buffers


class Lines:
    """The validated runner's outcomes as the judge reads them (:mod:`~lessonlib.grading.validated`): one JSON line
    per check in the order asked, each checked for its form and capped; by ``deadline`` or not at all (``fd`` < 0:
    none)."""

    def __init__(self, fd: int, deadline: float):
        self.fd, self.deadline, self.buffer, self.closed = fd, deadline, b"", fd < 0

    def _line(self) -> bytes | None:
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if self.closed or left <= 0 or len(self.buffer) > 1 << 20:
                return None
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                self.closed = True
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line

    def outcome(self, index: int) -> dict:
        while (line := self._line()) is not None:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if (type(entry) is dict and entry.get("index") == index and entry.get("status") in ("ok", "error")
                    and all(type(entry.get(k)) is str for k in ("stdout", "ename", "evalue"))):
                return {"index": index, "status": entry["status"], "stdout": entry["stdout"][-20_000:],
                        "ename": entry["ename"][:100], "evalue": entry["evalue"][:4000]}
        return {"index": index, "status": "error", "stdout": "", "ename": "ExerciseFailed",
                "evalue": "not graded: the check of your validated code stopped before this one (see the notes)"}
