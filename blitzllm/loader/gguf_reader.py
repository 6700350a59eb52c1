"""A lean GGUF (v2/v3) reader: metadata and tensor locations in one pass over the header,
tensor bytes memory-mapped. gguf-py's reader builds a numpy view per array element (seconds
for a 49k-token vocabulary); here the tokenizer's arrays (``tokenizer.ggml.*``) are skipped by
their length prefixes, only their counts kept. Dequantization still uses gguf-py's codecs.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple          # GGUF order (ne0 first), as gguf-py reports it
    tensor_type: int
    offset: int           # absolute offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path):
        self.path = str(path)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = self._mm
        if bytes(buf[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported (need 2 or newer)")
        self._buf = memoryview(buf)
        pos = 24
        self.fields: dict = {}
        for _ in range(n_kv):
            key, pos = self._str(pos)
            (vtype,), pos = struct.unpack_from("<I", self._buf, pos), pos + 4
            self.fields[key], pos = self._value(vtype, pos, keep=not key.startswith("tokenizer.ggml."))
        infos = []
        for _ in range(n_tensors):
            name, pos = self._str(pos)
            (nd,), pos = struct.unpack_from("<I", self._buf, pos), pos + 4
            dims = struct.unpack_from(f"<{nd}Q", self._buf, pos)
            pos += 8 * nd
            ttype, off = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            infos.append((name, tuple(int(d) for d in dims), ttype, off))
        align = int(self.fields.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
        from gguf.constants import GGML_QUANT_SIZES
        self.tensors = []
        for name, dims, ttype, off in infos:
            block, tsize = GGML_QUANT_SIZES[ttype]
            n = int(np.prod(dims))
            self.tensors.append(GGUFTensor(name, dims, ttype, data_start + off, n // block * tsize))

    def _str(self, pos):
        (n,) = struct.unpack_from("<Q", self._buf, pos)
        return bytes(self._buf[pos + 8:pos + 8 + n]).decode("utf-8", errors="replace"), pos + 8 + n

    def _value(self, vtype, pos, keep=True):
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype]
            return struct.unpack_from(fmt, self._buf, pos)[0], pos + struct.calcsize(fmt)
        if vtype == _STRING:
            return self._str(pos)
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", self._buf, pos)
            pos += 12
            if etype in _SCALARS:
                size = struct.calcsize(_SCALARS[etype])
                vals = list(np.frombuffer(self._buf, dtype=np.dtype(_SCALARS[etype]), count=count, offset=pos)) \
                    if keep else count
                return vals, pos + size * count
            out = [] if keep else count
            for _ in range(count):
                v, pos = self._value(etype, pos, keep)
                if keep:
                    out.append(v)
            return out, pos
        raise ValueError(f"unknown GGUF value type {vtype}")

    def tensor_data(self, t: GGUFTensor) -> np.ndarray:
        """Raw bytes of one tensor shaped for gguf-py's dequantize (rows of bytes)."""
        raw = self._mm[t.offset:t.offset + t.nbytes]
        rows = int(np.prod(t.shape[1:])) if len(t.shape) > 1 else 1
        return raw.reshape(rows, -1)
