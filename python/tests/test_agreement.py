"""P7 between two processes: ranks agree through a Python transport (a
multiprocessing pipe standing in for torch.distributed), and through a
shared region's header. Simulated GPU, no PyTorch."""

import multiprocessing as mp
import os
import threading

import pytest

import kvoffload as kv
import kvoffload._testing as kt

PAGE = 4096


def pipe_transport(conn, rank, breaks):
    """An all-gather of two ranks over a pipe: send mine, receive the
    peer's. `breaks`: raise before contributing, as a broken group does."""

    def exchange(mine):
        if breaks:
            raise ConnectionError(f"rank {rank}: process group broke")
        conn.send(mine)
        peer = conn.recv()  # EOFError when the peer is gone without sending
        return [mine, peer] if rank == 0 else [peer, mine]

    return exchange


def rank_main(rank, conn, results, fail_pinning, breaks, region):
    rt = kv.Runtime("sim")
    if fail_pinning:
        kt.sim_fail_registration(rt, nth=1, code=801)
    kw = dict(kv=kv.KvAlloc(tensors=2, page_bytes=PAGE, gpu_blocks=32), runtime=rt, pin=kv.PinOptions(threads=1))
    if region is not None:
        kw["region"] = kv.RegionSpec.shared(
            region["name"], rank=rank, ranks=2, options=kv.ShmOptions(dir=region["dir"], timeout=30)
        )
    if conn is not None:
        kw["agreement"] = pipe_transport(conn, rank, breaks)
    try:
        off = kv.KeyedOffloader(64, **kw)
        out = off.wait_pinned()
        if conn is not None:
            conn.close()  # the peer's recv ends (EOF) if it still waits
        # Offload works in the agreed mode: a round trip.
        data = os.urandom(PAGE)
        kt.write_block(off, 0, 0, data)
        off.store([rank + 1], [0])
        off.wait_all()
        off.poll()
        job = off.load([rank + 1], [1])
        off.wait(job)
        off.poll()
        same = kt.read_block(off, 0, 1) == data
        chunks = off.pin_progress.chunks_done
        off.shutdown()
        err = out.agreement_error
        results.put(
            (
                rank,
                dict(
                    state=out.state.name,
                    reason=out.state.reason,
                    agreed=out.agreed,
                    error=None if err is None else (err.kind, str(err)),
                    round_trip=same,
                    chunks=chunks,
                    leaked=kt.sim_device_bytes_in_use(rt),
                ),
            )
        )
    except Exception as e:  # reported, so the test says what went wrong
        results.put((rank, dict(exception=repr(e))))


def run_two(fail_pinning=(False, False), breaks=(False, False), transport=True, region=None):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ends = ctx.Pipe() if transport else (None, None)
    procs = [
        ctx.Process(target=rank_main, args=(r, ends[r], results, fail_pinning[r], breaks[r], region)) for r in range(2)
    ]
    for p in procs:
        p.start()
    for e in ends:
        if e is not None:
            e.close()  # only the ranks hold the pipe's ends
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for r in range(2):
        assert "exception" not in got[r], got[r]
        assert got[r]["round_trip"] and got[r]["leaked"] == 0, got[r]
    return got[0], got[1]


def test_two_processes_agree_pinned():
    r0, r1 = run_two()
    assert r0["state"] == r1["state"] == "pinned"
    assert r0["agreed"] is r1["agreed"] is True


def test_one_rank_failing_makes_both_pageable():
    r0, r1 = run_two(fail_pinning=(False, True))
    assert r0["state"] == r1["state"] == "pageable"
    assert r1["reason"] == "not_supported"
    assert r0["reason"] == "peer_pageable" and r0["chunks"] == 0
    assert r0["agreed"] is r1["agreed"] is True


def test_transport_error_makes_both_pageable():
    r0, r1 = run_two(breaks=(False, True))
    assert r0["state"] == r1["state"] == "pageable"
    assert r0["agreed"] is r1["agreed"] is False
    assert r1["error"][0] == "transport" and "process group broke" in r1["error"][1]
    # Rank 0's send or recv failed once rank 1 closed its end (EOFError,
    # BrokenPipeError or ConnectionResetError, as the timing falls).
    assert r0["error"][0] == "transport" and "agreement callable raised" in r0["error"][1]
    assert r0["chunks"] == r1["chunks"] == 0


@pytest.mark.parametrize("fail", [(False, False), (True, False)])
def test_shared_region_header_agreement(tmp_path, fail):
    region = dict(name=f"agree{os.getpid()}", dir=str(tmp_path))
    r0, r1 = run_two(fail_pinning=fail, transport=False, region=region)
    want = "pageable" if any(fail) else "pinned"
    assert r0["state"] == r1["state"] == want
    assert os.listdir(tmp_path) == []  # the region file is gone


# ---- issue 43, item 7: the agreement callable and this rank's own shutdown ----

LIMIT = 20.0  # s: a wait still blocked then would block until shutdown


def one_rank(agreement):
    rt = kv.Runtime("sim")
    kw = dict(kv=kv.KvAlloc(tensors=2, page_bytes=PAGE, gpu_blocks=32), runtime=rt, pin=kv.PinOptions(threads=1))
    return rt, kv.KeyedOffloader(64, agreement=agreement, **kw)


def test_wait_pinned_inside_the_agreement_callable_is_refused():
    """Pinning ends only once the callable returned: its own offloader's
    wait_pinned inside it is refused (ProtocolError, would_deadlock), as
    waits inside gated() are, instead of blocking until shutdown."""
    box, seen, finished = [], [], threading.Event()

    def agree(mine):
        try:
            box[0].wait_pinned()
            seen.append("returned")
        except kv.ProtocolError as e:
            seen.append(e)
        finally:
            finished.set()
        return [mine]

    rt, off = one_rank(agree)
    box.append(off)
    try:
        off.start()
        if not finished.wait(LIMIT):
            off.shutdown()  # ends the blocked wait
            pytest.fail(f"wait_pinned inside the agreement callable still blocked after {LIMIT} s")
        (err,) = seen
        assert isinstance(err, kv.ProtocolError) and err.reason == "would_deadlock", err
        assert "agreement callable" in str(err)
        # Outside the callable the wait works, and the agreement held.
        out = off.wait_pinned()
        assert out.state == "pinned" and out.agreed is True
    finally:
        box.clear()
        if not off.is_shut_down:
            off.shutdown()
    assert kt.sim_registered_ranges(rt) == 0


def test_a_ranks_own_shutdown_during_the_agreement_is_its_own_reason():
    """A shutdown while the callable runs ends this rank pageable for its
    own reason ("cancelled"), not as if a peer had fallen back
    ("peer_pageable")."""
    entered, release = threading.Event(), threading.Event()

    def agree(mine):
        entered.set()
        release.wait(LIMIT)
        return [mine]

    rt, off = one_rank(agree)
    try:
        off.start()
        assert entered.wait(LIMIT)
        off.shutdown()
        state = off.pin_progress.state
        assert state == "pageable" and state.reason == "cancelled", (state, state.reason)
    finally:
        release.set()
    assert kt.sim_registered_ranges(rt) == 0
