"""The public surface: what ``kvoffload`` exports is what its stubs say,
the test hooks live in ``kvoffload._testing`` only, and the Python names
are the Rust ones. Simulated GPU, no PyTorch."""

import ast
import inspect
import pathlib

import pytest

import kvoffload as kv
import kvoffload._testing as kt

PAGE = 4096
STUB = pathlib.Path(kv.__file__).with_name("__init__.pyi")


def public_classes():
    return [getattr(kv, n) for n in kv.__all__ if inspect.isclass(getattr(kv, n))]


def test_no_test_hooks_on_the_public_classes():
    for cls in [kv.Offloader, kv.Runtime] + public_classes():
        hooks = [n for n in dir(cls) if n.endswith("_for_test")]
        assert hooks == [], f"{cls.__name__} carries test hooks {hooks}"
    # The hooks' own class is not exported either.
    assert not hasattr(kv, "SimHold") and "SimHold" not in kv.__all__


def test_the_testing_module_imports_and_says_what_it_is():
    import kvoffload._testing as again

    assert again is kt
    assert "FOR TESTS ONLY" in kt.__doc__ and "NOT PART OF THE API" in kt.__doc__
    for name in kt.__all__:
        assert callable(getattr(kt, name)), name
    # The list is the module's own: every public name it defines (its
    # functions and SimHold), nothing it only imports.
    defined = {n for n, v in vars(kt).items() if not n.startswith("_") and getattr(v, "__module__", None) == kt.__name__}
    assert set(kt.__all__) == defined and len(kt.__all__) == len(defined)
    assert {"SimHold", "activity", "sim_hold", "error_table"} <= defined
    assert kt.SimHold.__module__ == "kvoffload._testing"


def test_the_testing_hooks_check_their_object():
    rt = kv.Runtime("sim")
    off = kv.KeyedOffloader(16, kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=8), runtime=rt, pin=kv.PinOptions(threads=1))
    with pytest.raises(TypeError):
        kt.sim_registered_ranges(off)  # a Runtime, not an Offloader
    with pytest.raises(TypeError):
        kt.read_block(rt, 0, 0)
    with pytest.raises(kv.OptionsError, match="point"):
        kt.sim_hold(rt, "nowhere")
    assert kt.activity(off)["windows_open"] == 0
    off.shutdown()
    assert kt.sim_device_bytes_in_use(rt) == 0


def test_store_returns_store_submitted():
    rt = kv.Runtime("sim")
    off = kv.KeyedOffloader(16, kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=8), runtime=rt, pin=kv.PinOptions(threads=1), start=True)
    off.wait_pinned()
    res = off.store([1, 2], [0, 1])
    assert type(res) is kv.StoreSubmitted
    assert res.job is not None and res.stored == [(1, 0), (2, 0)]
    assert repr(res).startswith("StoreSubmitted(job=")
    off.wait_all()
    off.poll()
    again = off.store([1], [0])
    assert type(again) is kv.StoreSubmitted and again.job is None
    # The Rust name only: no second name for the same class.
    assert not hasattr(kv, "StoreResult")
    off.shutdown()


def test_backend_means_one_thing_per_object():
    """``Runtime.backend`` is the runtime ("sim"/"cuda"), ``Completion.backend``
    the copy path; the offloader itself has no ``backend``."""
    rt = kv.Runtime("sim")
    off = kv.KeyedOffloader(16, kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=8), runtime=rt, transfer=kv.TransferOptions(backend="batched"), start=True)
    off.wait_pinned()
    assert not hasattr(off, "backend")
    assert off.runtime.backend == "sim"
    off.store([1], [0])
    off.wait_all()
    assert [c.backend for c in off.poll()] == ["batched"]
    off.shutdown()


def test_lookup_names_the_rust_variants():
    """``"hit"``, ``"miss"``, ``"hit_pending"``: ``Lookup::{Hit, Miss, HitPending}``."""
    rt = kv.Runtime("sim")
    off = kv.KeyedOffloader(16, kv=kv.KvAlloc(tensors=1, page_bytes=PAGE, gpu_blocks=8), runtime=rt, pin=kv.PinOptions(threads=1), start=True)
    off.wait_pinned()
    with kt.sim_hold(rt, "device_op") as hold:
        off.store([1], [0])
        hold.wait_entered()  # the store's copy is held on the device
        assert off.lookup([1, 2]) == ["hit_pending", "miss"]
    off.wait_all()
    off.poll()
    assert off.lookup([1, 2]) == ["hit", "miss"]
    off.shutdown()


def stub_members(node):
    names = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            names.add(n.target.id)
        elif isinstance(n, ast.Assign):
            names.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith("_")}


def test_the_stubs_say_exactly_the_public_surface():
    tree = ast.parse(STUB.read_text())
    assert stub_members(tree) == set(kv.__all__)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}

    def members(node):
        """The stub's members of a class and of its bases in the stub
        (``Offloader`` and ``KeyedOffloader`` inherit ``_OffloaderBase``'s)."""
        inherited = [members(classes[b.id]) for b in node.bases if isinstance(b, ast.Name) and b.id in classes]
        return stub_members(node).union(*inherited)

    for node in classes.values():
        if node.name.startswith("_") and not hasattr(kv, node.name):
            # A type of the stubs only: the keyword arguments' TypedDicts.
            assert any(isinstance(b, ast.Name) and b.id == "TypedDict" for b in node.bases), node.name
            continue
        cls = getattr(kv, node.name)
        if issubclass(cls, BaseException):
            continue  # attributes set on instances; BaseException's own
        have = {n for n in dir(cls) if not n.startswith("_")}
        assert members(node) == have, node.name
    assert kv.Offloader.__mro__[1] is kv._OffloaderBase and kv.KeyedOffloader.__mro__[1] is kv._OffloaderBase


def test_the_constructors_take_option_objects_and_their_own_arguments():
    """Issue 30: a short constructor with option objects, the KV cache one
    of them (``kv=``: ``KvSpec`` or ``KvAlloc``, as in Rust), each class
    with its own argument (``kv_groups``, ``eviction``); the stubs say the
    same signature."""
    tree = ast.parse(STUB.read_text())
    stub = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def stub_args(name):
        """The names ``__init__`` takes: its parameters, then the keys of
        the ``TypedDict`` its ``**args: Unpack[...]`` names."""
        init = next(f for f in stub[name].body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
        args = [a.arg for a in init.args.args[1:] + init.args.kwonlyargs]
        if init.args.kwarg is not None:
            unpack = init.args.kwarg.annotation
            assert isinstance(unpack, ast.Subscript) and unpack.value.id == "Unpack", ast.dump(unpack)
            args += [f.target.id for f in stub[unpack.slice.id].body if isinstance(f, ast.AnnAssign)]
        return args

    shared = ["host_blocks", "kv", "runtime", "region", "pin", "transfer", "agreement", "agreement_timeout", "start"]
    for cls, own in ((kv.Offloader, "kv_groups"), (kv.KeyedOffloader, "eviction")):
        sig = inspect.signature(cls).parameters.values()
        params = [p.name for p in sig if p.kind is not p.VAR_KEYWORD]
        # host_blocks by position, the rest by keyword (in any order).
        assert params[0] == "host_blocks" and all(p.kind is p.KEYWORD_ONLY for p in list(sig)[1:] if p.kind is not p.VAR_KEYWORD)
        assert sorted(params) == sorted(stub_args(cls.__name__)), cls.__name__
        assert sorted(params) == sorted(shared + [own]) and len(params) <= 12, params
    # The KV classes' fields are Rust's (KvSpec: the tensors' Python
    # shape, with page_bytes given once for all of them).
    assert stub_args("KvAlloc") == ["tensors", "page_bytes", "gpu_blocks", "block_factor"]
    assert stub_args("KvSpec") == ["tensors", "gpu_blocks", "page_bytes", "block_factor", "compute_stream"]


#: Issue 30: every Rust error variant an offloader call raises becomes one
#: Python class, with ``kind`` the OffloaderError variant in snake case and
#: ``reason`` the inner error's variant (the driver's code name for driver
#: errors; the ProtocolError variant under a protocol refusal).
ERRORS = {
    "OffloaderError::Options": (kv.OptionsError, "options", None),
    "OffloaderError::Layout(NoGroups)": (kv.OptionsError, "layout", "no_groups"),
    "OffloaderError::Region(ZeroSize)": (kv.RegionError, "region", "zero_size"),
    "OffloaderError::Pin(ZeroSize)": (kv.OptionsError, "pin", "zero_size"),
    "OffloaderError::Pin(TooLarge)": (kv.OptionsError, "pin", "too_large"),
    "OffloaderError::Pin(OutOfRange)": (kv.OptionsError, "pin", "out_of_range"),
    "OffloaderError::Pin(Region)": (kv.RegionError, "pin", "region"),
    "OffloaderError::Pin(Protocol)": (kv.ProtocolError, "pin", "nested_window"),
    "OffloaderError::Protocol(NestedWindow)": (kv.ProtocolError, "protocol", "nested_window"),
    # ShutDownError: kind "shut_down" whichever variant (issue 43).
    "OffloaderError::Protocol(ShutDown)": (kv.ShutDownError, "shut_down", "shut_down"),
    "OffloaderError::Protocol(AlreadyShutDown)": (kv.ShutDownError, "shut_down", "already_shut_down"),
    "OffloaderError::Driver": (kv.DriverError, "driver", "cuda_error_invalid_value"),
    "OffloaderError::Manager(ZeroCapacity)": (kv.ManagerError, "manager", "zero_capacity"),
    "OffloaderError::GpuBlockCount": (kv.OptionsError, "gpu_block_count", None),
    "OffloaderError::SlotJobShape": (kv.OptionsError, "slot_job_shape", None),
    "OffloaderError::SlotBusy": (kv.TransferError, "slot_busy", None),
    "OffloaderError::KeyedCore": (kv.OptionsError, "keyed_core", None),
    "OffloaderError::NotStored": (kv.ManagerError, "not_stored", None),
    "OffloaderError::UnknownJob": (kv.TransferError, "unknown_job", None),
    "OffloaderError::HookNotOpen": (kv.ProtocolError, "hook_not_open", None),
    "OffloaderError::ShutDown": (kv.ShutDownError, "shut_down", "shut_down"),
    "OffloaderError::Shutdown(Refused)": (kv.ProtocolError, "shutdown", "nested_window"),
    "OffloaderError::Shutdown(Unregister)": (kv.DriverError, "shutdown", "cuda_error_invalid_value"),
    "OffloaderError::PinnerPanicked": (kv.KvoffloadError, "pinner_panicked", None),
    "OffloaderError::Transfer(Layout)": (kv.OptionsError, "transfer", "layout"),
    "OffloaderError::Transfer(GroupCount)": (kv.OptionsError, "transfer", "group_count"),
    "OffloaderError::Transfer(GpuBlockOutOfRange)": (kv.OptionsError, "transfer", "gpu_block_out_of_range"),
    "OffloaderError::Transfer(HostBlockOutOfRange)": (kv.OptionsError, "transfer", "host_block_out_of_range"),
    "OffloaderError::Transfer(RepeatedGpuBlock)": (kv.OptionsError, "transfer", "repeated_gpu_block"),
    "OffloaderError::Transfer(RepeatedHostBlock)": (kv.OptionsError, "transfer", "repeated_host_block"),
    "OffloaderError::Transfer(BlockCountMismatch)": (kv.OptionsError, "transfer", "block_count_mismatch"),
    "OffloaderError::Transfer(FirstSubTooLarge)": (kv.OptionsError, "transfer", "first_sub_too_large"),
    "OffloaderError::Transfer(HostCountMismatch)": (kv.OptionsError, "transfer", "host_count_mismatch"),
    "OffloaderError::Transfer(EmptyJob)": (kv.OptionsError, "transfer", "empty_job"),
    "OffloaderError::Transfer(JobIdReused)": (kv.TransferError, "transfer", "job_id_reused"),
    "OffloaderError::Transfer(ShutDown)": (kv.ShutDownError, "shut_down", "shut_down"),
    "OffloaderError::Transfer(ComputeCapturing)": (kv.TransferError, "transfer", "compute_capturing"),
    "OffloaderError::Transfer(CaptureWindowOpen)": (kv.TransferError, "transfer", "capture_window_open"),
    "OffloaderError::Transfer(NoExpeditedLane)": (kv.TransferError, "transfer", "no_expedited_lane"),
    "OffloaderError::Transfer(UnknownJob)": (kv.TransferError, "transfer", "unknown_job"),
    "OffloaderError::Transfer(JobFailed)": (kv.TransferError, "transfer", "job_failed"),
    "OffloaderError::Transfer(Protocol)": (kv.ProtocolError, "transfer", "nested_window"),
    "OffloaderError::Transfer(Driver)": (kv.DriverError, "transfer", "cuda_error_invalid_value"),
}


def test_every_rust_error_variant_maps_to_one_class_kind_and_reason():
    seen = {}
    for path, e in kt.error_table():
        # Protocol(ShutDown) under Transfer is the one row sharing a path.
        if path in seen and path == "OffloaderError::Transfer(Protocol)":
            assert type(e) is kv.ShutDownError and e.reason == "shut_down", (path, e)
            continue
        assert path not in seen, f"{path} twice"
        seen[path] = e
    assert sorted(seen) == sorted(ERRORS), "the Rust samples and this table differ"
    for path, (cls, kind, reason) in ERRORS.items():
        e = seen[path]
        assert type(e) is cls, f"{path}: {type(e).__name__}, expected {cls.__name__}"
        assert (e.kind, e.reason) == (kind, reason), f"{path}: kind {e.kind!r}, reason {e.reason!r}"
        assert isinstance(e, kv.KvoffloadError)
    # A failed job keeps the driver's call and code (issue 30: TransferError,
    # as kvoffload._slotworker raises it, not DriverError).
    failed = seen["OffloaderError::Transfer(JobFailed)"]
    assert (failed.call, failed.code, failed.code_name) == ("cuMemcpyAsync", 1, "CUDA_ERROR_INVALID_VALUE")
