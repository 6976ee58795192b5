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
    assert set(kt.__all__) == {
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
    }
    assert kt.SimHold.__module__ == "kvoffload._testing"


def test_the_testing_hooks_check_their_object():
    rt = kv.Runtime("sim")
    off = kv.Offloader(16, tensors=1, page_bytes=PAGE, gpu_blocks=8, runtime=rt, pin=kv.PinOptions(threads=1))
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
    off = kv.Offloader(16, tensors=1, page_bytes=PAGE, gpu_blocks=8, runtime=rt, pin=kv.PinOptions(threads=1), start=True)
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
    off = kv.Offloader(16, tensors=1, page_bytes=PAGE, gpu_blocks=8, runtime=rt, transfer=kv.TransferOptions(backend="batched"), start=True)
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
    off = kv.Offloader(16, tensors=1, page_bytes=PAGE, gpu_blocks=8, runtime=rt, pin=kv.PinOptions(threads=1), start=True)
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
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        cls = getattr(kv, node.name)
        if issubclass(cls, BaseException):
            continue  # attributes set on instances; BaseException's own
        have = {n for n in dir(cls) if not n.startswith("_")}
        assert stub_members(node) == have, node.name
