"""kvoffload: offload LLM KV-cache blocks between GPU memory and a pinned
host region, with capture safety proved by the loom model checker.

An engine holds one of two classes, as in the Rust library:
:class:`KeyedOffloader` (the offloader's block manager places the engine's
keys in host blocks) or :class:`Offloader`, the slot-addressed core (the
engine picks host slots and job ids: ``store_slots``, ``load_slots``,
``store_slot_job``, ``load_slot_job``, ``wait_jobs``)::

    import kvoffload
    kv = kvoffload.KvSpec(kv_tensors,  # one per layer; kept alive until shutdown
                          compute_stream=torch.cuda.current_stream().cuda_stream)
    off = kvoffload.KeyedOffloader(4096, kv=kv, pin=kvoffload.PinOptions(policy="interleave"))
    off.start()                        # pin in the background
    with off.capture_window(), torch.cuda.graph(g):
        ...                            # capture: no library thread disturbs it
    res = off.store(keys, gpu_blocks)  # keys: ints or (hash, group) pairs
    off.wait_all(); off.poll()
    job = off.load(keys, other_blocks); off.wait(job); off.poll()
    off.shutdown()

Tensors are given as objects with ``data_ptr()`` (PyTorch) or
``__cuda_array_interface__`` (CuPy, Numba), so the package never imports
PyTorch. See ``kvoffload/__init__.pyi`` for every signature.

``kvoffload._testing`` holds the hooks of the package's own tests; it is
not part of the API.
"""

from ._native import (
    SETTLED_PAGEABLE,
    SETTLED_PINNED,
    _OffloaderBase,
    AgreementError,
    CaptureWindow,
    Completion,
    DriverError,
    KeyedOffloader,
    KvAlloc,
    KvoffloadError,
    KvSpec,
    ManagerError,
    Offloader,
    OptionsError,
    PinOptions,
    PinHold,
    PinOutcome,
    PinProgress,
    PinState,
    Pool,
    PoolError,
    PoolMismatchError,
    PoolStateError,
    ProtocolError,
    RegionError,
    RegionSpec,
    Runtime,
    ShmOptions,
    ShutDownError,
    StoreSubmitted,
    TransferError,
    TransferOptions,
    cuda_driver_present,
    enable_logging,
)

__version__ = "0.1.0"

__all__ = [
    "SETTLED_PAGEABLE",
    "SETTLED_PINNED",
    "AgreementError",
    "CaptureWindow",
    "Completion",
    "DriverError",
    "KeyedOffloader",
    "KvAlloc",
    "KvoffloadError",
    "KvSpec",
    "ManagerError",
    "PinHold",
    "Offloader",
    "OptionsError",
    "PinOptions",
    "PinOutcome",
    "PinProgress",
    "PinState",
    "Pool",
    "PoolError",
    "PoolMismatchError",
    "PoolStateError",
    "ProtocolError",
    "RegionError",
    "RegionSpec",
    "Runtime",
    "ShmOptions",
    "ShutDownError",
    "StoreSubmitted",
    "TransferError",
    "TransferOptions",
    "cuda_driver_present",
    "enable_logging",
    "torch_agreement",
]


def torch_agreement(group=None):
    """An agreement transport over ``torch.distributed`` (P7 across nodes).

    Returns ``f(mine) -> int``: an all-reduce with MAX of this rank's settled
    word over ``group`` (a pageable rank makes every rank pageable). The
    tensor is a CPU tensor, so the group must be a gloo group: pass one made
    with ``torch.distributed.new_group(backend="gloo")`` on every rank (with
    ``group=None`` the default group is used when it is gloo, and otherwise
    a gloo group is made here, which is itself a collective call: make it on
    every rank in the same order). The callable runs once, on a daemon thread
    of its own; the process group's timeout bounds it (``agreement_timeout``
    does not).
    """
    import torch
    import torch.distributed as dist

    if group is None and dist.get_backend() != "gloo":
        group = dist.new_group(backend="gloo")

    def exchange(mine: int) -> int:
        t = torch.tensor([int(mine)], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    return exchange
