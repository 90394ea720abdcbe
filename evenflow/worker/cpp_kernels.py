"""Small C++ kernels for CPU steps, compiled once per machine by inductor's C++ toolchain.

The toolchain is the one ``torch.compile`` uses (its compiler, ISA flags and ATen headers), and it caches
the built library under inductor's cache directory, so a kernel costs seconds at its first start-up on a
machine and a library load after. It is reached through ``torch._inductor.codecache.CppCodeCache``, a
private API: where it fails (no compiler, an API a torch release moved) the caller keeps its PyTorch path.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("evenflow.worker.cpp_kernels")

# Whether a process may use AMX tiles, and loading their configuration: the first source of the kernels that
# use them (load_cpp_sources).
AMX_TILES_SOURCE = Path(__file__).with_name("amx_tiles.cpp")

_loaded: dict[tuple[Path, ...], ctypes.CDLL | None] = {}


def load_cpp(source: Path, purpose: str, bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """The library built from ``source`` (once per process) with ``bind`` having set its functions'
    argument types, or None if it does not build or lacks a function ``bind`` names; ``purpose`` names what
    it serves in the log line that says which path runs."""
    return load_cpp_sources([source], purpose, bind)


def load_cpp_sources(sources: list[Path], purpose: str, bind: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """``load_cpp`` of one translation unit made of ``sources`` in order: a later file calls the functions of
    the ones before it (each keeps its helpers in an anonymous namespace, so their names must not clash)."""
    key = tuple(sources)
    if key in _loaded:
        return _loaded[key]
    try:
        from torch._inductor.codecache import CppCodeCache

        start = time.perf_counter()
        lib = CppCodeCache.load("\n".join(source.read_text() for source in sources))
        bind(lib)
        log.info("%s: the C++ kernel (built or loaded in %.1f s)", purpose, time.perf_counter() - start)
    except Exception as e:  # no C++ compiler, an inductor API that moved, a stale build: PyTorch's ops serve
        lib = None
        log.warning("%s stays PyTorch's: the C++ kernel did not build (%s: %s)", purpose, type(e).__name__, e)
    _loaded[key] = lib
    return lib
