"""Test hooks of kvoffload: FOR TESTS ONLY, NOT PART OF THE API.

Nothing here is covered by the package's compatibility promise: the names,
signatures and behaviour may change in any release, and an engine must not
call them. They exist so that kvoffload's own tests (``python/tests``) can
look inside the simulated GPU and the offloader::

    import kvoffload
    from kvoffload import _testing

    rt = kvoffload.Runtime("sim")
    off = kvoffload.Offloader(64, kv=kvoffload.KvAlloc(tensors=2, page_bytes=4096, gpu_blocks=32), runtime=rt)
    _testing.write_block(off, 0, 0, bytes(4096))
    with _testing.sim_hold(rt, "register") as hold:
        off.start()
        hold.wait_entered()          # a registration is in flight, held
    off.shutdown()
    assert _testing.sim_device_bytes_in_use(rt) == 0

Each function takes the object it looks into. The names follow the Rust
library's: ``sim_`` stands for ``kvoffload::runtime::sim`` (``sim_hold`` is
``SimRuntime::hold`` and returns a :class:`SimHold`, ``sim::Hold``),
``activity`` is ``kvoffload::internal::offloader::activity``. The ``sim_`` functions need a
``Runtime("sim")`` (``OptionsError`` otherwise).

Host memory as device memory (issue 21: vLLM's KV cache is CPU tensors when
no GPU exists): :func:`sim_adopt` makes host memory the caller owns
simulated device memory in place (``SimRuntime::adopt_host_memory``, which
is no CUDA driver call: it exists only on the simulated GPU), and device
work on the address it returns reads and writes those bytes. Streams and
graphs of the simulated GPU are numbers here (:func:`sim_stream`,
:func:`sim_end_capture`); a number that names none is an ``OptionsError``,
a driver's refusal a ``DriverError`` with its ``code``::

    buf = (ctypes.c_uint8 * 4096)()
    d = _testing.sim_adopt(rt, ctypes.addressof(buf), 4096)
    s = _testing.sim_stream(rt)
    _testing.sim_begin_capture(rt, s, "global")
    _testing.sim_memset(rt, d, 7, 4096, s)
    g = _testing.sim_end_capture(rt, s)
    _testing.sim_graph_launch(rt, g, s)
    _testing.sim_wait_idle(rt)            # now every byte of buf is 7
    _testing.sim_release_adopted(rt, d)
"""

from typing import Any, Dict, List, Tuple

from . import Offloader, Pool, Runtime
from ._native import _testing as _hooks

# Every public name this module defines, and only those
# (python/tests/test_api.py checks it against the module's definitions).
__all__ = [
    "SimHold",
    "activity",
    "read_block",
    "sim_device_bytes_in_use",
    "sim_fail_registration",
    "sim_hold",
    "sim_registered_ranges",
    "write_block",
    "sim_adopt",
    "sim_release_adopted",
    "sim_adopted_ranges",
    "sim_stream",
    "sim_stream_destroy",
    "sim_begin_capture",
    "sim_end_capture",
    "sim_graph_launch",
    "sim_graph_destroy",
    "sim_memset",
    "sim_launch_spin",
    "sim_wait_idle",
    "sim_refusals",
    "error_table",
    "local_pool",
    "local_pool_attach",
    "local_pool_kill",
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


def error_table() -> List[Tuple[str, BaseException]]:
    """``(rust_path, exception)`` for a sample of every error variant an
    offloader call can raise (e.g. ``"OffloaderError::Transfer(JobFailed)"``),
    each as the Python exception it becomes (``errors::samples``)."""
    return _hooks.error_table()


def write_block(off: Offloader, tensor: int, gpu_block: int, data: bytes) -> None:
    """Writes ``data`` (exactly one page of tensor ``tensor``) into GPU
    block ``gpu_block``, with a synchronous copy."""
    _hooks.write_block(off, tensor, gpu_block, data)


def read_block(off: Offloader, tensor: int, gpu_block: int) -> bytes:
    """The bytes of GPU block ``gpu_block`` of tensor ``tensor``, read with
    a synchronous copy."""
    return _hooks.read_block(off, tensor, gpu_block)


#: The owners of adopted memory, kept alive until released:
#: (id(runtime), device address) -> (runtime, owner).
_adopted: Dict[Tuple[int, int], Tuple[Runtime, Any]] = {}


def _host_address(obj: Any) -> int:
    """The address of the memory `obj` names: an int, an object with
    ``data_ptr()`` (a torch tensor) or a writable ``__array_interface__``
    (a numpy array)."""
    if isinstance(obj, bool):
        raise TypeError("sim_adopt: a bool is not an address")
    if isinstance(obj, int):
        return obj
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):
        device = getattr(obj, "device", None)
        if device is not None and getattr(device, "type", "cpu") != "cpu":
            raise ValueError(f"sim_adopt: a tensor on {device} is not host memory")
        return int(data_ptr())
    ai = getattr(obj, "__array_interface__", None)
    if isinstance(ai, dict) and isinstance(ai.get("data"), tuple):
        addr, readonly = ai["data"]
        if readonly:
            raise ValueError("sim_adopt: the array is read-only; device work would write it")
        return int(addr)
    raise TypeError(
        "sim_adopt: give an int address or an object with data_ptr() or __array_interface__, "
        f"not {type(obj).__name__}"
    )


def sim_adopt(runtime: Runtime, tensor_or_address: Any, nbytes: int) -> int:
    """Makes ``nbytes`` of host memory simulated device memory, in place,
    and returns its device address (not the host address): copies,
    memsets, kernels and graph replays on ``[address, address + nbytes)``
    read and write the host bytes; an access past the end faults as past an
    allocation. It does not count in :func:`sim_device_bytes_in_use`.

    ``tensor_or_address``: an int address, or an object with ``data_ptr()``
    (a CPU torch tensor) or ``__array_interface__`` (a writable numpy
    array); an object is kept alive until :func:`sim_release_adopted`. The
    caller keeps the memory valid until then (an int address: it is the
    caller's to keep) and does not touch it while device work on it is
    queued (:func:`sim_wait_idle` first). ``DriverError`` (code 1,
    INVALID_VALUE) for a null or empty range, or one overlapping another
    adoption or registered host memory."""
    addr = _host_address(tensor_or_address)
    ptr = _hooks.sim_adopt(runtime, addr, nbytes)
    if not isinstance(tensor_or_address, int):
        _adopted[id(runtime), ptr] = (runtime, tensor_or_address)
    return ptr


def sim_release_adopted(runtime: Runtime, ptr: int) -> None:
    """Ends the adoption at device address ``ptr`` (from :func:`sim_adopt`):
    waits until the device is idle (queued work on it still runs, as
    ``mem_free`` waits), then the simulated GPU never touches the memory
    again, and the object owning it is let go. ``DriverError`` (code 1)
    when ``ptr`` is not an adoption."""
    _hooks.sim_release_adopted(runtime, ptr)
    _adopted.pop((id(runtime), ptr), None)


def sim_adopted_ranges(runtime: Runtime) -> int:
    """Host ranges adopted and not released."""
    return _hooks.sim_adopted_ranges(runtime)


def sim_stream(runtime: Runtime) -> int:
    """A new stream of the simulated GPU, as its number."""
    return _hooks.sim_stream(runtime)


def sim_stream_destroy(runtime: Runtime, stream: int) -> None:
    """Destroys ``stream`` (its queued work still runs)."""
    _hooks.sim_stream_destroy(runtime, stream)


def sim_begin_capture(runtime: Runtime, stream: int, mode: str = "global") -> None:
    """Begins a capture on ``stream`` in ``mode`` (``"global"``,
    ``"thread_local"`` or ``"relaxed"``), as ``cuStreamBeginCapture``:
    blocks while a host registration runs; ``DriverError`` when the stream
    captures already."""
    _hooks.sim_begin_capture(runtime, stream, mode)


def sim_end_capture(runtime: Runtime, stream: int) -> int:
    """Ends the capture on ``stream`` and returns the graph's number;
    ``DriverError`` with the driver's code when the capture was invalidated
    (901) or fails otherwise."""
    return _hooks.sim_end_capture(runtime, stream)


def sim_graph_launch(runtime: Runtime, graph: int, stream: int) -> None:
    """Replays ``graph`` on ``stream``."""
    _hooks.sim_graph_launch(runtime, graph, stream)


def sim_graph_destroy(runtime: Runtime, graph: int) -> None:
    """Destroys ``graph``."""
    _hooks.sim_graph_destroy(runtime, graph)


def sim_memset(runtime: Runtime, ptr: int, value: int, nbytes: int, stream: int) -> None:
    """Enqueues (or, inside a capture, records) a memset of ``nbytes``
    bytes of ``value`` at device address ``ptr`` on ``stream``;
    ``DriverError`` (code 1) past the end of the memory."""
    _hooks.sim_memset(runtime, ptr, value, nbytes, stream)


def sim_launch_spin(runtime: Runtime, stream: int) -> None:
    """Enqueues (or records) a kernel that touches no memory."""
    _hooks.sim_launch_spin(runtime, stream)


def sim_wait_idle(runtime: Runtime) -> None:
    """Blocks until every stream's work has run (an observer: no driver
    call, never refused)."""
    _hooks.sim_wait_idle(runtime)


def sim_refusals(runtime: Runtime) -> List[Dict[str, str]]:
    """Every call the capture rules refused so far, oldest first: dicts of
    ``call`` (the driver entry point, e.g. ``"cuMemHostRegister"``) and
    ``reason`` (the rule that refused it)."""
    return _hooks.sim_refusals(runtime)


def local_pool(slots: int, ways: int = 16, ranks: int = 1, engines: int = 32, processes: int = 64) -> Pool:
    """An in-process :class:`kvoffload.Pool` (no file): its words are
    atomics shared by the pools :func:`local_pool_attach` makes, each a
    "process" of its own whose death :func:`local_pool_kill` decides."""
    return _hooks.local_pool(slots, ways, ranks, engines, processes)


def local_pool_attach(pool: Pool) -> Pool:
    """Another "process" on ``pool``'s in-process words."""
    return _hooks.local_pool_attach(pool)


def local_pool_kill(pool: Pool) -> None:
    """``pool``'s "process" is dead from now on (the liveness oracle says
    gone; a sweep reclaims its engine's marks)."""
    _hooks.local_pool_kill(pool)
