"""Test hooks of kvoffload: FOR TESTS ONLY, NOT PART OF THE API.

Nothing here is covered by the package's compatibility promise: the names,
signatures and behaviour may change in any release, and an engine must not
call them. They exist so that kvoffload's own tests (``python/tests``) can
look inside the simulated GPU and the offloader::

    import kvoffload
    from kvoffload import _testing

    rt = kvoffload.Runtime("sim")
    off = kvoffload.Offloader(64, tensors=2, page_bytes=4096, gpu_blocks=32, runtime=rt)
    _testing.write_block(off, 0, 0, bytes(4096))
    with _testing.sim_hold(rt, "register") as hold:
        off.start()
        hold.wait_entered()          # a registration is in flight, held
    off.shutdown()
    assert _testing.sim_device_bytes_in_use(rt) == 0

Each function takes the object it looks into. The names follow the Rust
library's: ``sim_`` stands for ``kvoffload::runtime::sim`` (``sim_hold`` is
``SimRuntime::hold`` and returns a :class:`SimHold`, ``sim::Hold``),
``activity`` is ``Offloader::activity``. The ``sim_`` functions need a
``Runtime("sim")`` (``OptionsError`` otherwise).
"""

from typing import Dict

from . import Offloader, Runtime
from ._native import _testing as _hooks

__all__ = [
    "SimHold",
    "activity",
    "read_block",
    "sim_device_bytes_in_use",
    "sim_fail_registration",
    "sim_hold",
    "sim_registered_ranges",
    "write_block",
]

#: A hold point of the simulated GPU, armed by :func:`sim_hold`: the next
#: call that reaches it stops there until ``release()`` (or the end of a
#: ``with`` block); ``wait_entered()`` blocks until a call has reached it.
SimHold = _hooks.SimHold


def sim_device_bytes_in_use(runtime: Runtime) -> int:
    """Device bytes allocated on the simulated GPU and not freed."""
    return _hooks.sim_device_bytes_in_use(runtime)


def sim_registered_ranges(runtime: Runtime) -> int:
    """Host ranges registered with the simulated GPU now."""
    return _hooks.sim_registered_ranges(runtime)


def sim_fail_registration(runtime: Runtime, nth: int = 1, code: int = 801) -> None:
    """Makes the ``nth`` host registration from now (1: the next) fail with
    CUresult ``code`` (801: not supported)."""
    _hooks.sim_fail_registration(runtime, nth, code)


def sim_hold(runtime: Runtime, point: str = "device_op") -> SimHold:
    """Arms a hold point: the next call that reaches ``point``
    (``"register"``: inside a host registration; ``"device_op"``: an
    operation executing on the device) stops there until the returned hold
    is released (or dropped, or its ``with`` block ends)."""
    return _hooks.sim_hold(runtime, point)


def activity(off: Offloader) -> Dict[str, int]:
    """What the offloader's coordinator has open, in flight or waiting now:
    ``windows_open``, ``windows_waiting``, ``calls_in_flight``,
    ``calls_waiting``, ``pin_waiters``, ``jobs_in_flight``, ``graphs_live``,
    ``alias_users``, ``unregisters_waiting``."""
    return _hooks.activity(off)


def write_block(off: Offloader, tensor: int, gpu_block: int, data: bytes) -> None:
    """Writes ``data`` (exactly one page of tensor ``tensor``) into GPU
    block ``gpu_block``, with a synchronous copy."""
    _hooks.write_block(off, tensor, gpu_block, data)


def read_block(off: Offloader, tensor: int, gpu_block: int) -> bytes:
    """The bytes of GPU block ``gpu_block`` of tensor ``tensor``, read with
    a synchronous copy."""
    return _hooks.read_block(off, tensor, gpu_block)
