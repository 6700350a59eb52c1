"""Our C kernels for the CPU (``kernels/cpu_quant/qgemm.c``, ``kernels/cpu_decode/decode.c``):
each built on first use with the system C compiler (``$CC``, else gcc) into
``~/.cache/blitzllm/kernels`` (``BLITZ_CACHE``), the library named by a hash of its source and
flags (so a warm cache loads in milliseconds and an edit rebuilds), and loaded with ctypes.
OpenMP comes from the runtime torch has already loaded (libgomp.so.1 by soname), so our threads
and torch's are one pool. ``load`` returns None, with one warning, where the CPU lacks a flag
the kernel needs or the build fails: the caller keeps its torch path."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)
_lock = threading.Lock()
_loaded: dict = {}


def cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())


def _cache_dir() -> Path:
    from .. import envs
    root = envs.get("BLITZ_CACHE")
    return (Path(root).expanduser() if root else Path.home() / ".cache" / "blitzllm") / "kernels"


def _build(source: Path, flags: tuple) -> Path:
    cc = os.environ.get("CC", "gcc")
    key = hashlib.sha256(source.read_bytes() + " ".join((cc,) + flags).encode()).hexdigest()[:16]
    out = _cache_dir() / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        so = Path(tmp) / out.name
        r = subprocess.run([cc, *flags, str(source), "-o", str(so), "-lm"], capture_output=True, text=True)
        if r.returncode != 0:
            raise OSError(f"{cc} failed on {source.name}: {r.stderr[-2000:]}")
        os.replace(so, out)  # (atomic: a concurrent process loads a whole file or builds its own)
    return out


def load(source: Path, flags: tuple, needs: tuple, signatures: dict) -> Optional[ctypes.CDLL]:
    """The library of ``source`` (built with ``flags``; the CPU must report every flag of
    ``needs``) with each ``signatures`` name -> (argtypes, restype) declared; None if unavailable."""
    key = (source, flags)
    with _lock:
        if key in _loaded:
            return _loaded[key]
        lib = None
        missing = set(needs) - cpu_flags()
        if missing:
            log.warning("%s: this CPU lacks %s; the torch path instead", source.name, " ".join(sorted(missing)))
        else:
            try:
                lib = ctypes.CDLL(str(_build(source, flags)))
                for name, (args, res) in signatures.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, res
            except OSError as e:  # (no compiler on PATH, an unwritable cache, a failed build)
                log.warning("%s did not build (%s); the torch path instead", source.name, e)
                lib = None
        _loaded[key] = lib
        return lib
