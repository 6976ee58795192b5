"""Type stubs of kvoffload (the extension module kvoffload._native): the
public API, exactly. The test hooks are in ``kvoffload._testing`` (typed in
``_testing.py``), which is not part of the API."""

from os import PathLike
from contextlib import AbstractContextManager
from typing import Any, Callable, Final, Iterable, List, Optional, Sequence, Tuple, Union

from typing_extensions import Required, TypedDict, Unpack

__version__: str

#: An agreement word: this rank's region is pinned.
SETTLED_PINNED: int
#: An agreement word: this rank runs on pageable memory (the larger word:
#: an all-reduce with MAX of the ranks' words says "pageable" if any is).
SETTLED_PAGEABLE: int

# How these stubs spell things: a value fixed for the object's life is an
# attribute ``name: Final[T]`` (a getter at run time: assigning raises
# AttributeError); one that changes while the object lives (``in_flight``,
# ``is_open``) a ``@property``; a class usable in ``with`` derives from
# ``AbstractContextManager`` (``__enter__`` returns the object itself,
# ``__exit__`` never suppresses the exception); the keyword arguments a
# constructor and its ``replace`` (or two constructors) share are one
# ``TypedDict`` (``_PinArgs``), taken as ``**Unpack[...]``, with the
# defaults in its comments.

# Type aliases of these stubs only (private: the module has no such names
# at run time).

#: A block key: an int hash (group 0; negative hashes fold to their 64-bit
#: pattern) or a ``(hash, group)`` pair. Keys are reported as pairs.
_Key = Union[int, Tuple[int, int]]
#: A tensor: an object with ``data_ptr()`` (PyTorch) or
#: ``__cuda_array_interface__`` (CuPy, Numba), or a bare device address.
_TensorLike = Any
#: ``f(mine) -> every rank's word (list) or their maximum (int)``.
_AgreementTransport = Callable[[int], Union[int, Sequence[int]]]

class KvoffloadError(Exception):
    """Base of every kvoffload error. ``kind``: the Rust variant in snake
    case (e.g. ``"gpu_block_count"``); ``reason``: the inner error's variant
    (e.g. ``"already_exists"``, ``"nested_window"``) or None.

    A Rust panic inside a call is caught and raised as ``KvoffloadError``
    with kind ``"panic"`` (a bug to report; never ``PanicException``).
    Arguments Python cannot convert raise ``TypeError``, or
    ``OverflowError`` for an int out of an argument's range (a negative
    count, say); counts and sizes that convert but exceed what the process
    can have raise ``OptionsError`` or ``RegionError`` (kind ``"region"``,
    reason ``"memory_too_small"``) before anything is allocated."""

    kind: str
    reason: Optional[str]

class OptionsError(KvoffloadError, ValueError):
    """Bad arguments: options, the KV description, GPU block ids, the layout.
    Also a ``ValueError``."""

class RegionError(KvoffloadError):
    """The host region could not be created, joined or mapped."""

class ProtocolError(KvoffloadError):
    """The capture-safety protocol refused (a window open, a nested window,
    a wait that would deadlock)."""

class ShutDownError(ProtocolError):
    """The offloader is shut down (or shutting down). Whichever call met
    the shutdown (a store, a wait, a capture window, ``gated``, a second
    ``shutdown``), ``kind`` is ``"shut_down"``; ``reason`` is
    ``"shut_down"``, or ``"already_shut_down"`` for ``shutdown`` asked for
    again."""

class DriverError(KvoffloadError):
    """A CUDA driver call failed."""

    call: str
    #: The CUresult (e.g. 900), or None when no driver could be loaded.
    code: Optional[int]
    code_name: Optional[str]

class ManagerError(KvoffloadError):
    """The block manager refused (a key not stored, no slot free)."""

class TransferError(KvoffloadError):
    """The transfer engine refused a job (e.g. an unknown job id)."""

class AgreementError(KvoffloadError):
    """The ranks did not agree on the pin state (P7); ``kind`` is e.g.
    ``"transport"``, ``"bad_exchange"``, ``"timeout"``, ``"rank_died"``."""

class PoolError(KvoffloadError):
    """The node pool refused: its file (``kind`` ``"missing"``,
    ``"not_tmpfs"``, ``"untrusted"``, ``"other_boot"``, ``"timeout"``, ...),
    the engine table (``"engines_full"``, ``"not_joined"``,
    ``"already_joined"``, ``"timeout"``), ``"in_use"`` for a removal."""

class PoolStateError(PoolError):
    """A pool slot is not in the state a call needs (``kind``:
    ``"not_held"``, ``"epoch_moved"``, ``"wrong_state"``,
    ``"other_writer"``, ...), or a word is corrupt."""

class PoolMismatchError(PoolError, ValueError):
    """The pool holds KV of another meaning than this engine's: the first
    fingerprint field that differs. Also a ``ValueError``."""

    field: str
    pool_value: str
    engine_value: str

#: A pool key: vLLM's ``OffloadKey`` (1 - 32 hash bytes, then the group
#: index as 4 big-endian bytes).
_PoolKey = bytes
#: A lookup's outcome: ``("hit", slot, epoch, fresh)``, ``("pending", -1,
#: -1, False)`` or ``("miss", -1, -1, False)``.
_PoolLookup = Tuple[str, int, int, bool]
#: A claim's outcome: ``("claimed", slot, epoch, evicted_key or None)``,
#: ``("present", -1, -1, None)`` or ``("skipped", -1, -1, None)``.
_PoolPlacement = Tuple[str, int, int, Optional[bytes]]

class _PoolShape(TypedDict):
    slots: int
    ways: int
    ranks: int
    #: Bytes of a row on one rank.
    row_bytes: int

class _PoolConfig(TypedDict):
    """The fingerprint's config part (``kvoffload.vllm.pool_config`` makes
    it from vLLM's ``OffloadingConfig``)."""

    model: str
    kv_dtype: str
    tag: str
    #: Per KV-cache group: (tokens per block, SHA-256 of its layer names).
    groups: Sequence[Tuple[int, bytes]]
    tokens_per_hash: int
    blocks_per_chunk: int
    bytes_per_block: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    kv_cache_layout: str
    replicated_layout: bool

class Pool:
    """A process's handle on a node pool (docs/node-pool-design.md): the
    index of a host KV pool shared by the engines of a node, in a file
    ``kvoffload-pool-<name>.index`` of a tmpfs directory. A process joins
    once (rank 0's worker claims the engine's entry; the other ranks and the
    scheduler register with it), then every call acts as that engine.
    Every wait is bounded (``timeout``) and interrupted by Python's signals
    (the handler's exception is raised). A rank's worker passes its ``Pool``
    as its offloader's ``agreement``: the engine's ranks agree on the pin
    state through the entry's words, which the owner resets at its claim."""

    @staticmethod
    def open(
        name: str,
        *,
        config: _PoolConfig,
        dir: Optional[str] = None,
        create: Optional[_PoolShape] = None,
        timeout: float = 30.0,
    ) -> "Pool":
        """Opens pool ``name`` (default directory /dev/shm), or, with
        ``create``, creates it if absent; refuses a pool whose config part
        differs (``PoolMismatchError``)."""
    @staticmethod
    def remove(name: str, *, dir: Optional[str] = None, force: bool = False) -> List[str]:
        """``kvoffload pool rm``: the paths removed; ``PoolError`` (kind
        ``"in_use"``) while an engine lives, unless ``force``."""
    def ensure_layout(self, rank: int, page_sizes: Sequence[int], timeout: float = 30.0) -> bool: ...
    def ensure_hashing(
        self, algorithm: str, none_hash: bytes, python: Optional[Tuple[int, int]] = None, timeout: float = 30.0
    ) -> bool: ...
    name: Final[str]
    #: The index file (None for an in-process pool of kvoffload._testing).
    path: Final[Optional[str]]
    slots: Final[int]
    ways: Final[int]
    ranks: Final[int]
    engines: Final[int]
    #: Bytes of a row on one rank (None for an in-process pool).
    row_bytes: Final[Optional[int]]
    pid: Final[int]
    #: The engine index this process acts as (None before ``join``).
    @property
    def engine(self) -> Optional[int]: ...
    #: 0 the scheduler, ``1 + r`` rank ``r``'s worker (None before ``join``).
    @property
    def member(self) -> Optional[int]: ...
    def join(self, engine_id: str, rank: Optional[int] = None, timeout: float = 30.0) -> int:
        """Joins engine ``engine_id`` as rank ``rank``'s worker (0: the
        owner, which claims the entry) or as its scheduler (None); returns
        the engine index. The owner's join meeting a pool being removed
        raises ``PoolError`` of kind ``"closing"``: open the pool again."""
    def leave(self) -> None: ...
    def close_if_unused(self, timeout: float = 10.0) -> Optional[List[str]]:
        """After ``leave``: removes the pool if no engine is registered on it
        (``kvo_pool_keep: false``); the paths removed, or None when it stays
        (an engine uses it, or another process removes it)."""
    def sweep(self) -> List[int]:
        """Sweeps every dead engine's marks; the entries freed."""
    def lookup(self, keys: Iterable[_PoolKey]) -> List[_PoolLookup]: ...
    def claim(self, keys: Iterable[_PoolKey]) -> List[_PoolPlacement]: ...
    def release(self, slots: Sequence[int], epochs: Sequence[int]) -> None: ...
    def check_held(self, slots: Sequence[int], epochs: Sequence[int]) -> None: ...
    def check_writing(self, slots: Sequence[int], epochs: Sequence[int]) -> None: ...
    def complete_rank(self, slots: Sequence[int], epochs: Sequence[int], rank: int) -> List[bool]: ...
    def abandon(self, slots: Sequence[int], epochs: Sequence[int]) -> List[bool]: ...
    def touch(self, slots: Sequence[int]) -> None: ...
    def census(self) -> dict:
        """``{"free", "writing", "readable", "held", "corrupt"}`` slot counts."""
    def check(self) -> None: ...
    def slot_key(self, slot: int) -> Optional[bytes]: ...
    def slot_word(self, slot: int) -> int: ...

class Runtime:
    """The GPU an offloader runs on: ``"cuda"`` (the device's primary
    context, shared with PyTorch), ``"sim"`` (the simulated GPU), or
    ``"auto"`` (CUDA where a device is visible). One runtime can serve
    several offloaders."""

    def __init__(self, backend: str = "auto", device: int = 0) -> None: ...
    backend: Final[str]
    #: The CUDA device (0 on the simulated GPU); an engine's tensors must be
    #: on it.
    device: Final[int]
    def describe(self) -> str: ...

class PinState:
    """``name``: ``"pending"``, ``"pinning"``, ``"pinned"`` or
    ``"pageable"`` (compares equal to that string)."""

    name: str
    done: Optional[int]
    total: Optional[int]
    #: Why a region is pageable: e.g. ``"not_supported"``,
    #: ``"peer_pageable"``, ``"cancelled"``, ``"out_of_memory"``.
    reason: Optional[str]
    message: Optional[str]
    is_final: Final[bool]

class PinProgress:
    state: PinState
    chunks_done: int
    chunks_total: int
    bytes_total: int

class PinOutcome:
    state: PinState
    #: None when no agreement was needed; False when it failed.
    agreed: Optional[bool]
    #: Why the agreement failed (not raised); this rank runs pageable.
    agreement_error: Optional[AgreementError]

class StoreSubmitted:
    """What ``KeyedOffloader.store`` submitted (the library's
    ``StoreSubmitted``). ``job``: the job that writes the ``stored`` keys
    (readable once ``poll`` reports it), None when nothing needed storing.
    ``skipped`` and ``evicted`` are disjoint (a store never evicts a key of
    its own batch), and ``evicted`` names every key the store evicted."""

    job: Optional[int]
    stored: List[Tuple[int, int]]
    #: ``(key, reason)``; reason ``"already_stored"``, ``"store_pending"``
    #: or ``"below_threshold"``.
    skipped: List[Tuple[Tuple[int, int], str]]
    evicted: List[Tuple[int, int]]

class Completion:
    job: int
    direction: str  # "store" or "load"
    #: The handler that ran it: "store", "load" or "load_expedited".
    lane: str
    keys: List[Tuple[int, int]]
    bytes: int
    seconds: float
    #: Of ``seconds``, queued behind a capture hook window (0: not deferred).
    deferred_seconds: float
    #: Device time of the job's copies (CUDA's event timer): from the moment
    #: its stream started it (after the compute work it is ordered after and
    #: the lane's earlier jobs) to its completion. What a rate is computed
    #: from (``bytes / device_seconds``); ``seconds`` also holds the waits
    #: and the polling delay. None when it could not be timed (a failed job).
    device_seconds: Optional[float]
    backend: str  # "per-fragment", "batched", "gather" or "staged"
    error: Optional[DriverError]
    ok: Final[bool]

class CaptureWindow(AbstractContextManager["CaptureWindow"]):
    """``with off.capture_window(): ...``: no library thread makes a
    capture-unsafe driver call while it is open; with the default policy it
    opens once pinning is final (entering waits, the GIL released; Ctrl-C
    stops the wait with ``KeyboardInterrupt`` and the window never opens).

    A window left open (entered, never exited, on any thread) closes when
    the object is dropped; when it held the last reference to an offloader
    already dropped, that offloader then shuts down."""

    @property
    def is_open(self) -> bool: ...
    @property
    def chunks_waited(self) -> int: ...

class PinHold(AbstractContextManager["PinHold"]):
    """What ``off.hold_pinning()`` returns: no chunk registration starts
    while it is held (the one in flight completes; pre-faulting goes on),
    so an engine's capture phase never waits for one. ``release()``
    (idempotent) or leaving its ``with`` block lets pinning go on."""

    def release(self) -> None: ...
    @property
    def is_held(self) -> bool: ...

class _KvSpecArgs(TypedDict, total=False):
    """``KvSpec``'s keyword arguments (after ``tensors``)."""

    gpu_blocks: Optional[int]  # default None
    page_bytes: Optional[int]  # default None
    block_factor: int  # default 1
    compute_stream: Any  # default None

class KvSpec:
    """The engine's KV tensors (Rust's ``KvSpec``), one KV cache description
    given to an offloader as ``kv=``. ``tensors``: a list of the engine's
    tensors (objects with ``data_ptr()``, PyTorch, or
    ``__cuda_array_interface__``, CuPy and Numba; or bare device addresses),
    one per layer or K and V each, each contiguous, block ``b`` at
    ``address + b * page_bytes``, kept alive by the offloader until
    shutdown; ``gpu_blocks``: blocks in each (None: the first dimension);
    ``page_bytes``: bytes of one block of every tensor (None: each tensor's
    size over ``gpu_blocks``; a bare address needs it); ``block_factor``: GPU
    blocks per host block; ``compute_stream``: the engine's compute stream,
    which jobs are ordered after (an int handle such as
    ``torch.cuda.current_stream().cuda_stream``, or an object with
    ``.cuda_stream``, kept as its handle; None: the legacy default stream).
    On the simulated GPU the tensors are CPU tensors (``device.type ==
    "cpu"``, with ``untyped_storage()``): each one's storage range is
    adopted once as simulated device memory (tensors sharing a backing
    allocation share the adoption) and released at shutdown;
    ``compute_stream`` is then a stream of the sim
    (``kvoffload._testing.sim_stream``) or None (a stream of its own).

    ``tensors`` may be given by position, the rest by keyword. The list, its
    entries' kinds and the numbers' types are checked when it is built
    (``OptionsError``, as ``PinOptions`` is), each tensor's device,
    contiguity and size when the offloader reads it. Immutable; compares by
    value (tensor objects by identity); ``replace(**changes)``; its
    ``repr`` reads back with ``eval`` when the tensors are addresses."""

    def __init__(self, tensors: Sequence[_TensorLike], **args: Unpack[_KvSpecArgs]) -> None: ...
    def replace(self, tensors: Sequence[_TensorLike] = ..., **changes: Unpack[_KvSpecArgs]) -> "KvSpec": ...
    tensors: Final[List[_TensorLike]]
    gpu_blocks: Final[Optional[int]]
    page_bytes: Final[Optional[int]]
    block_factor: Final[int]
    #: The stream's raw handle (None: the default).
    compute_stream: Final[Optional[int]]

class KvAlloc:
    """KV tensors the offloader allocates itself and frees at shutdown
    (Rust's ``KvAlloc``), for engines and tests that bring none, given as
    ``kv=``: ``tensors`` of ``gpu_blocks`` blocks of ``page_bytes`` each,
    ``block_factor`` GPU blocks per host block. Keyword arguments only;
    ``tensors``, ``page_bytes`` and ``gpu_blocks`` must be given. Built and
    checked as ``PinOptions`` is; the counts' limits are checked when the
    offloader is built, before anything is allocated."""

    def __init__(self, *, tensors: int, page_bytes: int, gpu_blocks: int, block_factor: int = 1) -> None: ...
    def replace(
        self, *, tensors: int = ..., page_bytes: int = ..., gpu_blocks: int = ..., block_factor: int = ...
    ) -> "KvAlloc": ...
    tensors: Final[int]
    page_bytes: Final[int]
    gpu_blocks: Final[int]
    block_factor: Final[int]

class _PinArgs(TypedDict, total=False):
    """``PinOptions``' keyword arguments (the defaults: see its docstring)."""

    threads: Optional[int]  # default None
    max_chunk_bytes: Optional[int]  # default None
    prefault: str  # default "populate"
    huge_pages: str  # default "auto"
    lookahead_bytes: Optional[int]  # default None
    huge_fallback_mbps: Optional[int]  # default None
    prefault_nice: Optional[int]  # default None
    policy: str  # default "after_pinning"

class PinOptions:
    """Pinning (Rust's ``PinOptions``). Keyword arguments only; a field left
    out (or None for a numeric one) keeps the default. An unknown field, a
    wrong type or a value out of range raises ``OptionsError`` (kind
    ``"options"``; Rust's limits kind ``"pin"``). Immutable; compares by
    value; ``replace(**changes)`` returns a changed copy.

    ``threads``: pre-fault threads (default three in four of the cores, at
    most 1024); ``max_chunk_bytes``: bytes per registration call (default
    256 MiB, at most 64 GiB); ``prefault``: ``"populate"``, ``"touch"`` or
    ``"off"``; ``huge_pages``: ``"auto"``, ``"on"`` or ``"off"``;
    ``lookahead_bytes``: bytes pre-faulted ahead of the chunk being
    registered (None: the whole region, 0: the next chunk only);
    ``huge_fallback_mbps``: 4 KiB pages for the rest of an anonymous region
    once faulting huge pages runs below this many MB/s per thread while the
    kernel stalls in reclaim or compaction (default 1000, 0: never);
    ``prefault_nice``: niceness the pre-fault threads raise themselves to,
    so that they take the cores the engine leaves idle (default 10, 0: the
    process's own, at most 19); ``policy``: when capture windows may open
    while pinning runs, ``"after_pinning"`` (once pinning is final) or
    ``"interleave"`` (between chunks)."""

    def __init__(self, **args: Unpack[_PinArgs]) -> None: ...
    def replace(self, **changes: Unpack[_PinArgs]) -> "PinOptions": ...
    threads: Final[int]
    max_chunk_bytes: Final[int]
    prefault: Final[str]
    huge_pages: Final[str]
    lookahead_bytes: Final[Optional[int]]
    huge_fallback_mbps: Final[int]
    prefault_nice: Final[int]
    policy: Final[str]

class _TransferArgs(TypedDict, total=False):
    """``TransferOptions``' keyword arguments."""

    backend: str  # default "auto"
    staging_bytes: Optional[int]  # default None
    duplex_linger: Optional[float]  # default None
    expedited_lane: bool  # default False

class TransferOptions:
    """Copies (Rust's ``TransferOptions``; ``duplex_linger`` is its
    ``thresholds.duplex_linger``), built and checked as ``PinOptions`` is.

    ``backend``: ``"auto"`` (by fragment size, pin state and whether the
    other direction is busy), or one forced: ``"per-fragment"``,
    ``"batched"``, ``"gather"`` (a kernel reading pinned host memory) or
    ``"staged"`` (a kernel packs the job into device staging memory, the
    copy engine moves it; what auto picks while loads and stores run at
    once). ``staging_bytes``: device staging memory per direction (default
    32 MiB; 0: no staged backend). ``duplex_linger``: seconds the other
    direction still counts as busy after its last job (default 0.02).
    ``expedited_lane``: a third lane, with a stream of its own, for the
    loads submitted with ``expedited=True`` (``load_slots``,
    ``load_slot_job``), never behind the regular loads (vLLM's expedited
    loads); ``Completion.lane`` says which lane ran a job."""

    def __init__(self, **args: Unpack[_TransferArgs]) -> None: ...
    def replace(self, **changes: Unpack[_TransferArgs]) -> "TransferOptions": ...
    backend: Final[str]
    staging_bytes: Final[int]
    duplex_linger: Final[float]
    expedited_lane: Final[bool]

class _ShmArgs(TypedDict, total=False):
    """``ShmOptions``' keyword arguments."""

    dir: Optional[Union[str, PathLike]]  # default None
    timeout: float  # default 60.0
    check_memory: bool  # default True
    allow_group: Optional[Union[int, str]]  # default None

class ShmOptions:
    """A shared region's options (Rust's ``ShmOptions``), built and checked
    as ``PinOptions`` is.

    ``dir``: directory of the region's files (default ``/dev/shm``; any
    tmpfs, e.g. one mounted ``huge=always``); ``timeout``: seconds creating
    or joining may wait for the other ranks (default 60); ``check_memory``:
    False skips the check that the region (a joiner: its share) fits in the
    memory this process can get (an escape hatch); ``allow_group``: a gid,
    or a group name (looked up now, kept as its gid), whose members' ranks
    may share the region (files get that group and mode 0660; joiners
    accept files of that group)."""

    def __init__(self, **args: Unpack[_ShmArgs]) -> None: ...
    def replace(self, **changes: Unpack[_ShmArgs]) -> "ShmOptions": ...
    dir: Final[str]
    timeout: Final[float]
    check_memory: Final[bool]
    allow_group: Final[Optional[int]]

class RegionSpec:
    """Where the host blocks live (Rust's ``RegionSpec``): private memory of
    this process (``RegionSpec.anonymous()``, also ``RegionSpec()``, the
    default; always checked against the memory the process can get), or a
    region shared by the ``ranks`` processes of one node
    (``RegionSpec.shared(name, rank=..., ranks=..., options=ShmOptions())``:
    files named after ``name`` in ``options.dir``, created by rank 0, joined
    by the others, unlinked once every rank mapped them). Checked when
    built, as ``PinOptions`` is (``OptionsError``): ``name`` one file name
    (not empty, at most 200 bytes, no ``/`` or NUL), ``ranks`` 1 to 32,
    ``rank`` below ``ranks``; compares by value.

    ``RegionSpec.persistent(...)`` (the same arguments) is a node pool's
    rows: shared by the engines of a node across launches, created by the
    first process to come, opened by every later one, never unlinked by an
    offloader (``kvoffload pool rm`` removes it); more than one rank needs
    the offloader's ``agreement``: the :class:`Pool` of the engine, joined
    as this rank's worker (the ranks agree through their engine entry's
    words), or a transport."""

    def __init__(self) -> None: ...
    @staticmethod
    def anonymous() -> "RegionSpec": ...
    @staticmethod
    def shared(
        name: str, *, rank: int = 0, ranks: int = 1, options: Optional[ShmOptions] = None
    ) -> "RegionSpec": ...
    @staticmethod
    def persistent(
        name: str, *, rank: int = 0, ranks: int = 1, options: Optional[ShmOptions] = None
    ) -> "RegionSpec": ...
    #: ``"anonymous"``, ``"shared"`` or ``"persistent"``.
    kind: Final[str]
    name: Final[Optional[str]]
    rank: Final[int]
    ranks: Final[int]
    options: Final[Optional[ShmOptions]]

class _OffloaderArgs(TypedDict, total=False):
    """The keyword arguments both constructors take (see
    :class:`_OffloaderBase`); each class's own, ``kv_groups`` or
    ``eviction``, is in its ``__init__``."""

    kv: Required[Union[KvSpec, KvAlloc]]
    runtime: Optional[Runtime]  # default None
    region: Optional[RegionSpec]  # default None
    pin: Optional[PinOptions]  # default None
    transfer: Optional[TransferOptions]  # default None
    agreement: Optional[Union[_AgreementTransport, "Pool"]]  # default None
    agreement_timeout: Optional[float]  # default 120.0
    start: bool  # default False

class _OffloaderBase:
    """What :class:`Offloader` and :class:`KeyedOffloader` share (not
    constructible itself): KV-cache offload between GPU memory and a
    pinned host region.

    ``kv`` describes the KV cache: a :class:`KvSpec` (the engine's tensors
    and compute stream) or a :class:`KvAlloc` (tensors the offloader
    allocates).

    Two classes, as in the Rust library: :class:`Offloader`, the
    slot-addressed core (the engine picks host slots ``0..host_blocks`` and
    job ids: ``store_slots``, ``load_slots``, ``store_slot_job``,
    ``load_slot_job``, ``wait_jobs``), and :class:`KeyedOffloader` (the
    offloader's block manager picks host blocks for the engine's keys:
    ``lookup``, ``store``, ``load``, ``stored_blocks``). Each lacks the
    other's methods (AttributeError). Each constructor takes its own
    argument besides the shared ones: ``kv_groups`` (``Offloader``): how
    many of the tensors, in order, each KV cache group has (None: one
    group); ``eviction`` (``KeyedOffloader``): ``"lru"`` or ``"arc"``. The
    other class's argument is refused (``OptionsError``, naming the class
    that takes it).

    GPU blocks named in a store must not be written, and those named in a
    load neither read nor written, by the engine until ``poll`` reports the
    job or ``wait`` returns for it.

    The rest is in option objects with the Rust library's names:
    ``runtime`` (None: ``Runtime("auto")``, device 0), ``region``
    (``RegionSpec``; None: anonymous), ``pin`` (``PinOptions``), ``transfer``
    (``TransferOptions``); None gives their defaults, anything but the
    class raises ``OptionsError``, as does an unknown keyword argument (the
    flat ones before issue 30, ``pin_threads=``, ``tensors=``, ``stream=``
    and the like, are refused naming the option that replaced them).
    ``agreement``: the ranks' agreement transport
    (``torch_agreement``), or a :class:`Pool` this process joined as the
    region's rank's worker (``Pool.join(engine_id, rank=...)``): the ranks
    of a persistent region (a node pool's rows) agree through their engine
    entry's words (refused, ``OptionsError``, before the pool is joined or
    when it is joined as another member); ``agreement_timeout``: seconds a
    rank waits for its peers through a shared region's header or a pool's
    words (None: no limit); it does not bound the ``agreement`` callable,
    nor this rank's wait for it: the transport's own timeout (the process
    group's) does, and a shutdown ends the wait at once; ``start``: start
    pinning at once.

    The ``agreement`` callable runs once, on a daemon thread of its own
    (``kvo-agree-callable``). A shutdown does not wait for it: the callable
    may still run after ``shutdown`` returned, and at interpreter exit its
    thread ends as any daemon thread does; no other thread of kvoffload
    enters Python after ``shutdown`` returned or once the interpreter began
    to exit. Inside the callable, ``wait_pinned`` of its own offloader
    raises ``ProtocolError`` (reason ``"would_deadlock"``): pinning ends
    only once the callable returned. A shutdown while the callable runs
    ends this rank pageable with reason ``"cancelled"``.

    Ctrl-C (``SIGINT``, or any signal whose handler raises) during a wait
    (joining or creating a shared region, ``wait_pinned`` and the ranks'
    agreement in it, entering a capture window, ``wait``, ``wait_all``) on
    the main thread raises ``KeyboardInterrupt`` (the handler's exception)
    within about 50 ms and leaves nothing behind: no region file, no window
    request; pinning and jobs go on, and the offloader stays usable.
    """

    #: The runtime (GPU) it runs on; ``runtime.backend`` is ``"cuda"`` or
    #: ``"sim"`` (the copy path a job took is ``Completion.backend``).
    runtime: Final[Runtime]
    tensor_addresses: Final[List[int]]
    page_bytes: Final[List[int]]
    gpu_blocks: Final[int]
    block_factor: Final[int]
    region_bytes: Final[int]
    host_blocks: Final[int]
    def start(self) -> None: ...
    #: Pinning now: ``state`` (a :class:`PinState`) and how far it got.
    @property
    def pin_progress(self) -> PinProgress: ...
    #: Waits until pinning is final (and agreed, where ranks agree),
    #: starting it if needed. Inside the ``agreement`` callable raises
    #: ``ProtocolError`` (reason ``"would_deadlock"``).
    def wait_pinned(self) -> PinOutcome: ...
    #: Holds pinning back until the hold is released (an engine's capture
    #: phase): no registration starts meanwhile. Holds nest; shutdown is
    #: never held up; ``wait_pinned`` on the holding thread raises
    #: ``ProtocolError`` (reason ``"would_deadlock"``).
    def hold_pinning(self) -> PinHold: ...
    def capture_window(self) -> CaptureWindow: ...
    #: Runs ``f()`` at a moment no capture window is open (windows wait for
    #: it). Ctrl-C stops the wait for windows to close (``f`` not run);
    #: inside ``f``, opening a capture window or hook window, or a nested
    #: ``gated``, raises ``ProtocolError`` (reason ``"would_deadlock"``).
    def gated(self, f: Callable[[], Any]) -> Any: ...
    #: The capture hook (``kvoffload.vllm``'s wrapper of
    #: ``torch.cuda.CUDAGraph.capture_begin/capture_end`` calls these on the
    #: capturing thread): ``capture_begin`` opens this thread's hook window
    #: (nested begins only count; it waits at most for the registration in
    #: progress), ``capture_end`` closes it and submits the jobs deferred
    #: meanwhile, ``capture_abort`` is ``capture_end`` for a failed begin;
    #: ``ProtocolError`` (kind ``"hook_not_open"``) at depth 0. Ctrl-C stops
    #: ``capture_begin``'s wait with nothing opened (depth unchanged), and
    #: ``capture_end``'s / ``capture_abort``'s wait for another thread's
    #: capture window (a deferred job it refuses) with the hook window
    #: closed all the same and the jobs not yet submitted left deferred, in
    #: order, for the next ``poll``, wait, submission or ``capture_end``.
    def capture_begin(self) -> None: ...
    def capture_end(self) -> None: ...
    def capture_abort(self) -> None: ...
    @property
    def capture_depth(self) -> int: ...
    @property
    def deferred_jobs(self) -> int: ...
    def poll(self) -> List[Completion]: ...
    #: Returns once ``job`` completed (``TransferError``, kind ``"transfer"``,
    #: reason ``"job_failed"``, if it failed), whichever thread's ``wait`` or
    #: ``poll`` took its completion, also after a ``poll`` returned it (the
    #: last 65536 jobs ``poll`` returned are remembered); ``TransferError``
    #: kind ``"unknown_job"`` for an id never submitted. Safe from any
    #: number of threads. Ctrl-C stops it (the job goes on).
    def wait(self, job: int) -> None: ...
    def wait_all(self) -> None: ...
    @property
    def in_flight(self) -> int: ...
    #: Drains the jobs in flight, stops pinning, frees. Ctrl-C during the
    #: drain raises KeyboardInterrupt with nothing shut down.
    def shutdown(self) -> None: ...
    @property
    def is_shut_down(self) -> bool: ...

class Offloader(_OffloaderBase, AbstractContextManager["Offloader"]):
    """The slot-addressed core (the Rust library's ``Offloader``): the
    engine picks host slots and job ids. See :class:`_OffloaderBase`."""

    def __init__(
        self, host_blocks: int, *, kv_groups: Optional[Sequence[int]] = None, **args: Unpack[_OffloaderArgs]
    ) -> None: ...
    #: Slot jobs: ``job`` is the engine's id, never
    #: used before (``TransferError``, kind ``"transfer"``, reason
    #: ``"job_id_reused"``); GPU block ``i`` is sub-block
    #: ``(first_sub + i) % block_factor`` of slot
    #: ``slots[(first_sub + i) // block_factor]``. A store on a slot of a job
    #: not yet reported, or a load on a slot of a store not yet reported,
    #: raises ``TransferError`` (kind ``"slot_busy"``). Id lists may be any
    #: iterable of ints or an array with ``tolist()``.
    def store_slots(
        self, job: int, gpu_blocks: Iterable[int], slots: Iterable[int], first_sub: int = 0
    ) -> None: ...
    #: ``expedited``: on the expedited lane's own stream, never behind a
    #: regular load (needs ``TransferOptions(expedited_lane=True)``; ``TransferError``,
    #: reason ``"no_expedited_lane"``, otherwise).
    def load_slots(
        self,
        job: int,
        gpu_blocks: Iterable[int],
        slots: Iterable[int],
        first_sub: int = 0,
        *,
        expedited: bool = False,
    ) -> None: ...
    #: Over every KV cache group (vLLM's spec pair): ``gpu_blocks`` and
    #: ``slots`` group after group, ``group_sizes`` and ``first_subs`` one per
    #: group (``OptionsError``, kind ``"slot_job_shape"``, otherwise).
    def store_slot_job(
        self,
        job: int,
        gpu_blocks: Iterable[int],
        group_sizes: Iterable[int],
        slots: Iterable[int],
        first_subs: Iterable[int],
    ) -> None: ...
    def load_slot_job(
        self,
        job: int,
        gpu_blocks: Iterable[int],
        group_sizes: Iterable[int],
        slots: Iterable[int],
        first_subs: Iterable[int],
        *,
        expedited: bool = False,
    ) -> None: ...
    #: Waits for each of ``jobs`` in flight; others skipped, failures left
    #: to ``poll`` (vLLM's ``wait``). Ctrl-C stops it (the jobs go on).
    def wait_jobs(self, jobs: Iterable[int]) -> None: ...

class KeyedOffloader(_OffloaderBase, AbstractContextManager["KeyedOffloader"]):
    """Keyed offload (the Rust library's ``KeyedOffloader``): the block
    manager places the engine's keys in host blocks. See
    :class:`_OffloaderBase`."""

    def __init__(self, host_blocks: int, *, eviction: str = "lru", **args: Unpack[_OffloaderArgs]) -> None: ...
    #: Per key: ``"hit"`` (readable), ``"miss"`` or ``"hit_pending"``
    #: (stored, its store not complete yet).
    def lookup(self, keys: Iterable[_Key]) -> List[str]: ...
    def store(self, keys: Iterable[_Key], gpu_blocks: Iterable[int]) -> StoreSubmitted:
        """Stores ``keys`` from ``gpu_blocks`` (``block_factor`` per key).
        The contract: a call that raises changes nothing (no key evicted,
        no slot taken: a store refused inside a capture window or for an
        out-of-range GPU block keeps every stored key); ``skipped`` and
        ``evicted`` of one call are disjoint and ``evicted`` names every key
        evicted; a key in ``stored`` is loadable once ``poll`` reports its
        job, until a later store reports it in ``evicted`` (or ``poll``
        reports its store failed)."""
    def load(self, keys: Iterable[_Key], gpu_blocks: Iterable[int]) -> int:
        """Loads ``keys`` (each readable) into ``gpu_blocks``; returns the
        job id. Their slots are not evicted until ``poll`` reports it. A
        call that raises changes nothing."""
    @property
    def stored_blocks(self) -> int: ...

def enable_logging(filter: str = "info") -> bool:
    """Sends the library's tracing events to stderr, filtered like RUST_LOG
    (``"info"``, ``"warn,kvoffload=debug"``). False when a subscriber was
    already set; a filter that does not parse raises ``OptionsError``
    naming the first directive that does not."""
def cuda_driver_present() -> bool: ...
def torch_agreement(group: Any = None) -> _AgreementTransport: ...
