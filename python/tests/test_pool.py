"""``kvoffload.Pool``: the node pool's protocol (docs/node-pool-design.md)
through the Python binding, on a real pool file in /dev/shm, between
processes.

- Two processes, two engines: what one publishes the other finds (a hit
  on the same slot and epoch), and the key words are the ones stored.
- A pool of another meaning is refused naming the field
  (``PoolMismatchError``, a ``ValueError``), the config, a rank's layout
  and the block hashes alike.
- A process killed (SIGKILL) while it holds one slot and writes another
  is swept by the next process: its hold gone, its write freed (never
  published), the keys storable again; nothing is swept while it lives.
- The binding's own refusals: a call before ``join``, a bad key, a member
  whose engine never joins (a bounded wait), and no Rust panic crossing.

Children are ``python -c`` processes of this interpreter, driven over a
line protocol with a deadline on every read (no sleeps).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

import kvoffload as kv
import kvoffload._testing as kt
from child_lines import ChildLines

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm")

CONFIG = dict(
    model="tiny-llama",
    kv_dtype="float16",
    tag="",
    groups=[(16, bytes(range(32)))],
    tokens_per_hash=16,
    blocks_per_chunk=1,
    bytes_per_block=4096,
    world_size=1,
    tp_size=1,
    pp_size=1,
    pcp_size=1,
    dcp_size=1,
    kv_cache_layout="NHD",
    replicated_layout=False,
)
SHAPE = dict(slots=64, ways=16, ranks=1, row_bytes=4096)


def key(i, group=0):
    """A vLLM OffloadKey: a 32-byte hash, then the group (4 bytes, big-endian)."""
    return bytes([i % 251 + 1]) * 32 + group.to_bytes(4, "big")


@pytest.fixture
def name():
    n = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield n
    try:
        kv.Pool.remove(n, dir=SHM, force=True)
    except kv.PoolError:
        pass


def open_pool(name, config=CONFIG, shape=SHAPE):
    return kv.Pool.open(name, dir=SHM, config=config, create=shape, timeout=10.0)


def publish(pool, keys, rank=0):
    """Stores ``keys`` as an engine of one rank does: claim, then the
    rank's bit (which publishes)."""
    placed = pool.claim(keys)
    assert all(p[0] == "claimed" for p in placed), placed
    slots = [p[1] for p in placed]
    epochs = [p[2] for p in placed]
    assert pool.complete_rank(slots, epochs, rank) == [True] * len(keys)
    return list(zip(slots, epochs))


CHILD = textwrap.dedent(
    """
    import sys, kvoffload as kv
    cfg = {config!r}
    pool = kv.Pool.open({name!r}, dir={dir!r}, config=cfg, create={shape!r}, timeout=10.0)
    pool.join({engine!r}, rank=0)
    sched = kv.Pool.open({name!r}, dir={dir!r}, config=cfg, timeout=10.0)
    sched.join({engine!r}, timeout=10.0)
    print("joined", pool.engine, flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "lookup":
            keys = [bytes.fromhex(a) for a in args]
            print("lookup", " ".join(f"{{k}},{{s}},{{e}}" for k, s, e, _ in sched.lookup(keys)), flush=True)
        elif cmd == "claim":
            keys = [bytes.fromhex(a) for a in args]
            print("claim", " ".join(f"{{k}},{{s}},{{e}}" for k, s, e, _ in sched.claim(keys)), flush=True)
        elif cmd == "leave":
            sched.leave(); pool.leave()
            print("left", flush=True)
    """
)


class Child:
    """A process on the pool, driven line by line."""

    def __init__(self, name, engine, config=CONFIG, shape=SHAPE):
        script = CHILD.format(config=config, name=name, dir=SHM, shape=shape, engine=engine)
        self.p = subprocess.Popen(
            [sys.executable, "-c", script],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines = ChildLines(self.p.stdout)
        self.engine = int(self.expect("joined", 30)[0])

    def expect(self, word, timeout=10.0):
        deadline = time.monotonic() + timeout
        try:
            line = self.lines.next(deadline)
        except TimeoutError:
            self.p.kill()
            raise AssertionError(f"no {word!r} from the child in {timeout} s: {self.p.stderr.read()}") from None
        if line is None:
            self.p.wait(timeout=10)
            raise AssertionError(f"the child exited ({self.p.returncode}): {self.p.stderr.read()}")
        got, *rest = line.split()
        assert got == word, line
        return rest

    def ask(self, cmd, keys, word):
        self.p.stdin.write(f"{cmd} {' '.join(k.hex() for k in keys)}\n")
        self.p.stdin.flush()
        return [(k, int(s), int(e)) for k, s, e in (x.split(",") for x in self.expect(word))]

    def kill(self):
        self.p.send_signal(signal.SIGKILL)
        self.p.wait(timeout=10)  # reaped: gone, not a zombie

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=10)
        for f in (self.p.stdin, self.p.stdout, self.p.stderr):
            f.close()


@pytest.fixture
def children():
    made = []

    def make(*a, **kw):
        c = Child(*a, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# ---------------------------------------------------------------- two processes


def test_child_lines_serves_lines_that_arrived_in_one_write_and_the_end():
    """The reader the process tests drive their children with: two lines
    written at once are both served (``select()`` on the pipe after the
    first ``readline`` waits for the second until its deadline: CI saw it),
    then the end of the stream, then nothing blocks past a deadline."""
    import select

    script = "import sys; sys.stdout.write('noise\\nKVO answer\\n'); sys.stdout.flush(); sys.stdin.readline()"

    def child():
        return subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    p = child()
    try:
        lines = ChildLines(p.stdout)
        deadline = time.monotonic() + 30
        assert lines.next(deadline) == "noise\n"
        assert lines.next(deadline) == "KVO answer\n"
        with pytest.raises(TimeoutError):
            lines.next(time.monotonic() + 0.2)
        p.stdin.close()  # the child reads its end of input and exits
        assert lines.next(deadline) is None
    finally:
        p.kill()
        p.wait(timeout=10)
        p.stdout.close()

    # What the reader replaced, on the same child: the second line sits in
    # the text stream's buffer, and the pipe has nothing more to say.
    p = child()
    try:
        assert p.stdout.readline() == "noise\n"  # one write: both lines came in one read
        assert select.select([p.stdout], [], [], 0.5)[0] == [], "select() would wait here"
        assert p.stdout.readline() == "KVO answer\n"  # ... for a line already read
    finally:
        p.kill()
        p.wait(timeout=10)
        p.stdin.close()
        p.stdout.close()


def test_a_block_one_process_publishes_is_a_hit_in_another(name, children):
    worker = open_pool(name)
    worker.join("engine-a", rank=0)
    sched = kv.Pool.open(name, dir=SHM, config=CONFIG)
    assert sched.join("engine-a") == worker.engine
    assert (worker.slots, worker.ways, worker.ranks, worker.row_bytes) == (64, 16, 1, 4096)
    assert worker.path == f"{SHM}/kvoffload-pool-{name}.index"
    keys = [key(i) for i in range(5)]
    placed = publish(sched, keys)

    other = children(name, "engine-b")
    assert other.engine != worker.engine
    hits = other.ask("lookup", keys + [key(99)], "lookup")
    assert [h[0] for h in hits] == ["hit"] * 5 + ["miss"]
    assert [(s, e) for _, s, e in hits[:5]] == placed
    # Held by the other engine now: its bit is in each word.
    assert sched.census()["held"] == 5
    for (s, _e), k in zip(placed, keys):
        assert sched.slot_key(s) == k
    # A key the other engine stores is a hit here.
    (claimed,) = other.ask("claim", [key(42)], "claim")
    assert claimed[0] == "claimed"
    assert sched.lookup([key(42)]) == [("miss", -1, -1, False)], "being written by another engine: a miss"
    assert sched.lookup(keys[:1])[0][:3] == ("hit",) + placed[0]
    sched.release([placed[0][0]], [placed[0][1]])
    other.ask("leave", [], "left")
    c = sched.census()
    assert c["held"] == 0, "the other engine's holds ended when it left"
    assert c["writing"] == 0, "its unpublished write was reclaimed by its last member leaving"
    sched.check()
    sched.leave()
    worker.leave()


def test_an_existing_pool_keeps_its_shape(name):
    a = open_pool(name)
    b = open_pool(name, shape=dict(SHAPE, slots=128))
    assert (a.slots, b.slots) == (64, 64)
    with pytest.raises(kv.PoolError):
        open_pool(name, shape=dict(SHAPE, ranks=2))


# ---------------------------------------------------------------- refusals by field


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("kv_dtype", "bfloat16", "dtype"),
        ("model", "other-model", "model"),
        ("tag", "rev-2", "kvo_pool_tag"),
        ("blocks_per_chunk", 2, "blocks_per_chunk"),
        ("world_size", 2, "world_size"),
        ("groups", [(16, bytes(32))], "group 0 layer_names (SHA-256)"),
    ],
)
def test_a_pool_of_another_meaning_is_refused_naming_the_field(name, field, value, named):
    open_pool(name)
    other = dict(CONFIG, **{field: value})
    for make in (lambda: open_pool(name, config=other), lambda: kv.Pool.open(name, dir=SHM, config=other)):
        with pytest.raises(kv.PoolMismatchError) as e:
            make()
        assert isinstance(e.value, ValueError) and isinstance(e.value, kv.PoolError)
        assert e.value.field == named
        assert str(e.value).startswith(f"kvoffload pool '{name}'")
        assert "name another pool (kvo_pool)" in str(e.value)


def test_the_design_message_for_another_dtype(name):
    open_pool(name, config=dict(CONFIG, kv_dtype="bfloat16"))
    with pytest.raises(kv.PoolMismatchError) as e:
        open_pool(name)
    assert (e.value.field, e.value.pool_value, e.value.engine_value) == ("dtype", "bfloat16", "float16")
    assert "holds KV of dtype 'bfloat16'; this engine's is 'float16'" in str(e.value)
    assert f"kvoffload pool rm {name}" in str(e.value)


def test_layout_and_hashing_parts_are_filled_once_then_compared(name):
    p = open_pool(name)
    assert p.ensure_layout(0, [2048, 2048]) is True
    assert p.ensure_layout(0, [2048, 2048]) is False
    with pytest.raises(kv.PoolMismatchError) as e:
        p.ensure_layout(0, [2048, 4096])
    assert e.value.field == "rank 0 tensor 1 page_size_bytes"
    h = bytes(range(32))
    assert p.ensure_hashing("sha256_cbor", h) is True
    assert p.ensure_hashing("sha256_cbor", h) is False
    with pytest.raises(kv.PoolMismatchError) as e:
        p.ensure_hashing("sha256_cbor", bytes(32))
    assert e.value.field == "NONE_HASH"
    with pytest.raises(kv.PoolMismatchError) as e:
        p.ensure_hashing("sha256", h, (3, 11))
    assert e.value.field == "hash algorithm"


def test_a_missing_pool_and_a_bad_name_are_refused(name):
    with pytest.raises(kv.PoolError) as e:
        kv.Pool.open(name, dir=SHM, config=CONFIG, timeout=1.0)
    assert e.value.kind == "missing"
    with pytest.raises(kv.OptionsError):
        kv.Pool.open("a/b", dir=SHM, config=CONFIG, create=SHAPE)
    with pytest.raises(kv.PoolError) as e:
        kv.Pool.open(name, dir="/", config=CONFIG, create=SHAPE)
    assert e.value.kind == "not_tmpfs"
    with pytest.raises(kv.OptionsError, match="kv_dtype"):
        kv.Pool.open(name, dir=SHM, config={k: v for k, v in CONFIG.items() if k != "kv_dtype"}, create=SHAPE)


# ---------------------------------------------------------------- a killed process


def test_a_killed_process_is_swept_its_hold_gone_its_write_freed(name, children):
    worker = open_pool(name)
    worker.join("engine-a", rank=0)
    sched = kv.Pool.open(name, dir=SHM, config=CONFIG)
    sched.join("engine-a")
    held_key, written_key = key(1), key(2)
    ((slot, epoch),) = publish(sched, [held_key])

    victim = children(name, "engine-b")
    assert victim.ask("lookup", [held_key], "lookup") == [("hit", slot, epoch)]
    ((kind, wslot, wepoch),) = victim.ask("claim", [written_key], "claim")
    assert kind == "claimed"
    c = sched.census()
    assert (c["held"], c["writing"]) == (1, 1)
    # While it lives, nothing is swept and its marks stay.
    assert sched.sweep() == []
    assert sched.census()["held"] == 1
    assert sched.lookup([written_key])[0][0] == "miss", "being written by another engine"

    victim.kill()
    assert sched.sweep() == [victim.engine]
    c = sched.census()
    assert (c["held"], c["writing"], c["readable"]) == (0, 0, 1), c
    assert (sched.slot_word(wslot) >> 32) & 3 == 0, "the dead engine's write was freed, never published"
    # Its key is storable again, the held one still a hit.
    assert sched.claim([written_key])[0][0] == "claimed"
    assert sched.lookup([held_key])[0][:3] == ("hit", slot, epoch)
    # Its entry is free again: a new engine gets it.
    again = open_pool(name)
    assert again.join("engine-c", rank=0) == victim.engine
    sched.check()


def test_the_sweep_runs_again_at_the_next_join(name, children):
    """Design 3 "Join": rank 0's worker sweeps dead entries before it claims one."""
    victim = children(name, "engine-b")
    k = key(5)
    ((_, s, e),) = victim.ask("claim", [k], "claim")
    victim.kill()
    worker = open_pool(name)
    worker.join("engine-a", rank=0)
    assert worker.census()["writing"] == 0
    assert (worker.slot_word(s) >> 32) & 3 == 0


# ---------------------------------------------------------------- the binding's refusals


def test_calls_before_join_and_bad_arguments_are_refused():
    p = kt.local_pool(32, ways=16)
    with pytest.raises(kv.PoolError) as e:
        p.lookup([key(1)])
    assert e.value.kind == "not_joined"
    assert p.engine is None and p.member is None
    p.join("e", rank=0)
    with pytest.raises(kv.PoolError) as e:
        p.join("e", rank=0)
    assert e.value.kind == "already_joined"
    for bad in (b"", b"1234", bytes(37), "str-key", 7):
        with pytest.raises(kv.OptionsError):
            p.lookup([bad])
    with pytest.raises(kv.OptionsError):
        p.release([1, 2], [1])
    with pytest.raises(kv.OptionsError):
        kt.local_pool_attach(p).join("e", rank=1)  # a pool of one rank
    with pytest.raises(kv.PoolStateError) as e:
        p.release([0], [0])
    assert e.value.kind == "wrong_state"
    with pytest.raises(kv.PoolStateError) as e:
        p.check_writing([999], [0])
    assert e.value.kind == "invariant"


def test_a_member_waits_for_its_engine_boundedly():
    p = kt.local_pool(32, ways=16)
    t0 = time.monotonic()
    with pytest.raises(kv.PoolError) as e:
        p.join("nobody", timeout=0.2)
    assert e.value.kind == "timeout"
    assert 0.2 <= time.monotonic() - t0 < 5
    assert "no live engine entry" in str(e.value)


def test_a_member_wait_is_interrupted_by_a_signal():
    p = kt.local_pool(32, ways=16)

    def handler(signum, frame):
        raise KeyboardInterrupt("test")

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match="test"):
            p.join("nobody", timeout=30.0)
        assert time.monotonic() - t0 < 5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_local_pools_sweep_a_killed_member_engine():
    """The in-process words and oracle the vLLM tests use: an engine whose
    every member is dead is swept, one with a live member is not."""
    a = kt.local_pool(32, ways=16, ranks=2)
    a.join("a", rank=0)
    a1 = kt.local_pool_attach(a)
    a1.join("a", rank=1)
    b = kt.local_pool_attach(a)
    b.join("b", rank=0)
    b.claim([key(3)])
    (h,) = a1.claim([key(4)])
    a.complete_rank([h[1]], [h[2]], 0)
    a1.complete_rank([h[1]], [h[2]], 1)
    b.lookup([key(4)])
    sweeper = kt.local_pool_attach(a)
    kt.local_pool_kill(a)
    assert sweeper.sweep() == [], "engine a has a live member (rank 1)"
    kt.local_pool_kill(b)
    assert sweeper.sweep() == [b.engine]
    c = sweeper.census()
    assert (c["writing"], c["held"], c["readable"]) == (0, 0, 1)


# ---------------------------------------------------------------- closing (kvo_pool_keep false)


def test_the_last_engine_to_leave_a_pool_not_kept_removes_it(name):
    """``Pool.close_if_unused`` after ``leave`` (``kvo_pool_keep: false``):
    None while another engine is registered, the pool's files once none is;
    refused while this process is still joined; a late joiner of the removed
    pool (its owner, or a member polling for its entry) is refused with kind
    ``"closing"``, and opening the name again makes a fresh pool."""
    a, b = open_pool(name), open_pool(name)
    a.join("engine-a", rank=0)
    b.join("engine-b", rank=0)
    publish(a, [key(1)])
    with pytest.raises(kv.PoolError) as e:
        a.close_if_unused()
    assert e.value.kind == "still_joined"
    a.leave()
    assert a.close_if_unused() is None, "engine b is registered"
    assert os.path.exists(f"{SHM}/kvoffload-pool-{name}.index")
    b.leave()
    removed = b.close_if_unused()
    assert removed == [f"{SHM}/kvoffload-pool-{name}.index"], removed
    assert not os.path.exists(f"{SHM}/kvoffload-pool-{name}.index")
    with pytest.raises(kv.PoolError) as e:
        a.join("engine-a", rank=0)
    assert e.value.kind == "closing" and "being removed" in str(e.value)
    # A scheduler (or a rank past 0) polling the removed pool for its
    # engine's entry is told so at once, not left to its timeout.
    with pytest.raises(kv.PoolError) as e:
        a.join("engine-a", timeout=30)
    assert e.value.kind == "closing" and "being removed" in str(e.value)
    fresh = open_pool(name)
    fresh.join("engine-c", rank=0)
    assert fresh.lookup([key(1)]) == [("miss", -1, -1, False)], "a fresh pool"
    fresh.leave()


# ---------------------------------------------------------------- the rows' region


def test_a_persistent_region_outlives_its_offloader(name):
    """``RegionSpec.persistent``: the pool's rows. What one offloader stored
    in a slot, a later one on the same region loads byte for byte; the
    region is removed with the pool (``Pool.remove``)."""
    region = kv.RegionSpec.persistent(f"pool-{name}", options=kv.ShmOptions(dir=SHM))
    assert region.kind == "persistent" and region.name == f"pool-{name}"
    assert repr(region).startswith(f"kvoffload.RegionSpec.persistent('pool-{name}'")
    assert region != kv.RegionSpec.shared(f"pool-{name}", options=kv.ShmOptions(dir=SHM))
    alloc = dict(tensors=2, page_bytes=4096, gpu_blocks=8)
    page = bytes(range(256)) * 16

    first = kv.Offloader(4, kv=kv.KvAlloc(**alloc), runtime=kv.Runtime("sim"), region=region)
    for t in range(2):
        kt.write_block(first, t, 3, page[t:] + page[:t])
    first.store_slots(1, [3], [2])
    first.wait_jobs([1])
    assert [c.error for c in first.poll()] == [None]
    first.shutdown()

    second = kv.Offloader(4, kv=kv.KvAlloc(**alloc), runtime=kv.Runtime("sim"), region=region)
    second.load_slots(1, [5], [2])
    second.wait_jobs([1])
    assert [c.error for c in second.poll()] == [None]
    for t in range(2):
        assert kt.read_block(second, t, 5) == page[t:] + page[:t]
    second.shutdown()
    open_pool(name)  # so that Pool.remove finds the pool and removes its rows too
    removed = kv.Pool.remove(name, dir=SHM)
    assert f"{SHM}/kvoffload-pool-{name}" in removed


def test_a_persistent_region_of_two_ranks_needs_agreement_words_or_a_transport(name):
    region = kv.RegionSpec.persistent(f"pool-{name}", rank=0, ranks=2, options=kv.ShmOptions(dir=SHM))
    with pytest.raises(kv.OptionsError, match=r"needs agreement words .* or an agreement transport"):
        kv.Offloader(4, kv=kv.KvAlloc(tensors=1, page_bytes=4096, gpu_blocks=4), runtime=kv.Runtime("sim"), region=region)


TWO_RANKS = dict(SHAPE, ranks=2)
TWO_RANKS_CONFIG = dict(CONFIG, world_size=2, tp_size=2)


def rank_offloader(name, rank, pool, **kw):
    """Rank ``rank`` of two on the pool's rows, its ranks agreeing through
    ``pool`` (joined as this rank's worker)."""
    region = kv.RegionSpec.persistent(f"pool-{name}", rank=rank, ranks=2, options=kv.ShmOptions(dir=SHM, timeout=30))
    return kv.Offloader(
        TWO_RANKS["slots"],
        kv=kv.KvAlloc(tensors=2, page_bytes=4096, gpu_blocks=8),
        runtime=kv.Runtime("sim"),
        region=region,
        pin=kv.PinOptions(threads=1),
        agreement=pool,
        **kw,
    )


def test_two_ranks_agree_through_their_engine_entry(name):
    """``agreement=pool``: the two ranks of an engine (here two offloaders
    of one process, each its own simulated GPU and its own ``Pool``) agree
    on the pin state through their entry's words: both pinned; a later
    tenure of the entry agrees again, on words its owner reset."""
    for tenure in range(2):
        pools = [open_pool(name, TWO_RANKS_CONFIG, TWO_RANKS) for _ in range(2)]
        engine = pools[0].join(f"engine-{tenure}", rank=0)
        assert pools[1].join(f"engine-{tenure}", rank=1) == engine
        offs = [rank_offloader(name, r, pools[r], start=True) for r in range(2)]
        try:
            outcomes = [o.wait_pinned() for o in offs]
            assert [(o.state.name, o.agreed) for o in outcomes] == [("pinned", True)] * 2, outcomes
        finally:
            for o in offs:
                o.shutdown()
            for p in pools:
                p.leave()
        assert engine == 0, "the one entry, each tenure"


def test_one_rank_pageable_makes_both_pageable_through_the_pool(name):
    pools = [open_pool(name, TWO_RANKS_CONFIG, TWO_RANKS) for _ in range(2)]
    pools[0].join("e", rank=0)
    pools[1].join("e", rank=1)
    rt = kv.Runtime("sim")
    kt.sim_fail_registration(rt, nth=1, code=801)
    offs = [rank_offloader(name, 0, pools[0], start=True)]
    region = kv.RegionSpec.persistent(f"pool-{name}", rank=1, ranks=2, options=kv.ShmOptions(dir=SHM, timeout=30))
    offs.append(
        kv.Offloader(
            TWO_RANKS["slots"],
            kv=kv.KvAlloc(tensors=2, page_bytes=4096, gpu_blocks=8),
            runtime=rt,
            region=region,
            agreement=pools[1],
            start=True,
        )
    )
    try:
        r0, r1 = [o.wait_pinned() for o in offs]
        assert (r0.state.name, r0.state.reason, r0.agreed) == ("pageable", "peer_pageable", True)
        assert (r1.state.name, r1.state.reason, r1.agreed) == ("pageable", "not_supported", True)
    finally:
        for o in offs:
            o.shutdown()
        for p in pools:
            p.leave()


def test_agreement_through_a_pool_needs_it_joined_as_this_rank(name):
    """``agreement=pool`` is refused (``OptionsError``) before the pool is
    joined, when joined as another rank's worker or as the scheduler, and
    when the pool's ranks are not the region's."""
    owner = open_pool(name, TWO_RANKS_CONFIG, TWO_RANKS)
    with pytest.raises(kv.OptionsError, match="has not joined it; join it as rank 0's worker first"):
        rank_offloader(name, 0, owner)
    owner.join("e", rank=0)
    with pytest.raises(kv.OptionsError, match="joined it as rank 0's worker, not as rank 1's worker"):
        rank_offloader(name, 1, owner)
    sched = open_pool(name, TWO_RANKS_CONFIG, TWO_RANKS)
    sched.join("e")
    with pytest.raises(kv.OptionsError, match="joined it as the scheduler, not as rank 0's worker"):
        rank_offloader(name, 0, sched)
    with pytest.raises(kv.OptionsError, match="a callable, .* or a kvoffload.Pool joined as this rank's worker"):
        rank_offloader(name, 0, "pool")
    # A pool of one rank for a region of two (the Rust check).
    one = kt.local_pool(16, ways=16, ranks=1)
    one.join("solo", rank=0)
    with pytest.raises(kv.OptionsError, match="holds the words of 1 ranks; the region has 2"):
        rank_offloader(name, 0, one)
    sched.leave()
    owner.leave()
