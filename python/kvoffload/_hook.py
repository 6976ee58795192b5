"""The capture hook's Python half: every CUDA graph capture in the process
runs inside a capture window of each live offloader, with no change to the
code that captures.

:func:`install` replaces ``capture_begin`` and ``capture_end`` of
``torch.cuda.CUDAGraph`` (every capture path of vLLM 0.33 and
``torch.cuda.graph`` goes through them; torch's own capture start hooks
run after the capture began, too late) with wrappers::

    begin:  off.capture_begin() for each offloader; try: original begin
            except: off.capture_abort() for each; raise
    end:    try: original end  finally: off.capture_end() for each that
            the graph's begin opened

The Rust side (``Offloader.capture_begin`` / ``capture_end`` /
``capture_abort``, src/offloader/hook.rs) opens the window under the
Interleave rules (it waits at most for the registration in progress),
counts nested begins per thread, and defers jobs submitted while a window
is open, submitting them in order when the last window closes.

One patch per class and process, reference-counted over the offloaders
installed on it; :meth:`Installed.remove` (the worker's shutdown) restores
the originals when the last offloader goes, if they are still ours, and
otherwise (someone wrapped them after us) turns our wrappers into
pass-throughs. A graph dropped between begin and end closes the windows
its begin opened (when dropped on the thread that began it; the depth is
per thread).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional

log = logging.getLogger("kvoffload.hook")

_lock = threading.RLock()
# class -> its live patch
_patches: Dict[type, "_Patch"] = {}


class _Patch:
    def __init__(self, cls: type):
        self.cls = cls
        self.orig_begin = cls.__dict__.get("capture_begin", None) or cls.capture_begin
        self.orig_end = cls.__dict__.get("capture_end", None) or cls.capture_end
        self.had_own = ("capture_begin" in cls.__dict__, "capture_end" in cls.__dict__)
        self.offloaders: List[Any] = []
        self.active = True
        # id(graph) -> (offloaders its begin opened, thread id, finalizer)
        self.open: Dict[int, tuple] = {}
        patch = self

        def capture_begin(graph, *args, **kwargs):
            if not patch.active:
                return patch.orig_begin(graph, *args, **kwargs)
            with _lock:
                offs = list(patch.offloaders)
            opened: List[Any] = []
            try:
                for off in offs:
                    off.capture_begin()
                    opened.append(off)
                result = patch.orig_begin(graph, *args, **kwargs)
            except BaseException:
                patch._close(opened, "capture_abort")
                raise
            if opened:
                key = id(graph)
                try:
                    fin = weakref.finalize(graph, patch._dropped, key)
                    fin.atexit = False
                except TypeError:  # not weak-referenceable: no drop guard
                    fin = None
                with _lock:
                    patch.open[key] = (opened, threading.get_ident(), fin)
            return result

        def capture_end(graph, *args, **kwargs):
            with _lock:
                entry = patch.open.pop(id(graph), None)
            if entry is not None and entry[2] is not None:
                entry[2].detach()
            try:
                return patch.orig_end(graph, *args, **kwargs)
            finally:
                if entry is not None:
                    patch._close(entry[0], "capture_end")

        capture_begin.__wrapped__ = self.orig_begin  # type: ignore[attr-defined]
        capture_end.__wrapped__ = self.orig_end  # type: ignore[attr-defined]
        capture_begin.__kvoffload_hook__ = True  # type: ignore[attr-defined]
        capture_end.__kvoffload_hook__ = True  # type: ignore[attr-defined]
        self.begin = capture_begin
        self.end = capture_end
        cls.capture_begin = capture_begin
        cls.capture_end = capture_end

    @staticmethod
    def _close(offs: List[Any], call: str) -> None:
        """``call`` on each offloader, newest first; the first error raised
        after all were called (an error of the framework's own call, if
        any, propagates instead: this runs in its ``finally``)."""
        first: Optional[BaseException] = None
        for off in reversed(offs):
            try:
                getattr(off, call)()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                if first is None:
                    first = e
        if first is not None:
            raise first

    def _dropped(self, key: int) -> None:
        with _lock:
            entry = self.open.pop(key, None)
        if entry is None:
            return
        offs, thread, _ = entry
        if thread != threading.get_ident():
            log.error(
                "kvoffload: a CUDA graph was dropped during its capture on another thread; its capture "
                "windows stay open until that thread's depth returns to 0"
            )
            return
        try:
            self._close(offs, "capture_end")
        except Exception as e:  # a finalizer must not raise
            log.error("kvoffload: closing the windows of a dropped graph failed: %s", e)

    def ours(self) -> bool:
        return self.cls.__dict__.get("capture_begin") is self.begin and self.cls.__dict__.get("capture_end") is self.end

    def unpatch(self) -> None:
        if self.ours():
            for name, orig, had in (
                ("capture_begin", self.orig_begin, self.had_own[0]),
                ("capture_end", self.orig_end, self.had_own[1]),
            ):
                if had:
                    setattr(self.cls, name, orig)
                else:
                    delattr(self.cls, name)
        # Wrapped again after us: whoever wrapped calls our wrappers, which
        # from now on only pass through (windows already open still close).
        self.active = False


class Installed:
    """One offloader's place in the patch of ``cls``; :meth:`remove` once."""

    def __init__(self, patch: _Patch, offloader: Any):
        self._patch: Optional[_Patch] = patch
        self._off = offloader

    @property
    def installed(self) -> bool:
        return self._patch is not None

    def remove(self) -> None:
        with _lock:
            p = self._patch
            if p is None:
                return
            self._patch = None
            p.offloaders.remove(self._off)
            if not p.offloaders:
                p.unpatch()
                if _patches.get(p.cls) is p:
                    del _patches[p.cls]


def _default_class() -> type:
    import torch

    return torch.cuda.CUDAGraph


def install(offloader: Any, cls: Optional[type] = None) -> Installed:
    """Makes every capture through ``cls`` (default ``torch.cuda.CUDAGraph``)
    run inside a capture window of ``offloader`` until the returned handle's
    ``remove()``."""
    cls = _default_class() if cls is None else cls
    with _lock:
        p = _patches.get(cls)
        if p is None or not p.ours():
            if p is not None:
                # Wrapped after us, meanwhile: that patch stays for the
                # offloaders on it; this one is a new layer on top.
                pass
            p = _Patch(cls)
            _patches[cls] = p
        p.offloaders.append(offloader)
        return Installed(p, offloader)


def installed_count(cls: Optional[type] = None) -> int:
    """Offloaders on the live patch of ``cls`` (0: not patched)."""
    cls = _default_class() if cls is None else cls
    with _lock:
        p = _patches.get(cls)
        return len(p.offloaders) if p is not None else 0
