//! P7 on a node pool with real processes: the two ranks of an engine, two
//! processes on one pool file and its rows' persistent region in a private
//! /dev/shm directory, each an `Offloader` on the simulated GPU, agree on
//! the pin state through their engine entry's agreement words
//! (`EngineSlots`, `OffloaderOptions::agreement_slots`):
//!
//! - both pin: both end pinned, agreed;
//! - rank 1 registered, then killed before it settled, while rank 0 waits:
//!   rank 0 ends pageable at once (`RankDied`), far within its timeout;
//!   a rank that never comes ends rank 0 pageable at its timeout;
//! - a later tenure of the same entry: the last tenure's words (rank 1
//!   pageable) are reset by the new owner's claim, and the new ranks both
//!   end pinned (without the reset rank 0 would find its word taken and end
//!   pageable: see `src/pool/agreement.rs`'s unit test of the same rule,
//!   which fails with the reset removed).
//!
//! Rank 0 is the test (the entry's owner); rank 1 a child re-executing this
//! binary (`agree_child`; role and `dir|mode` in the environment), which
//! prints `kvo-agree ...` lines and blocks on stdin until the parent closes
//! it or kills it. Nothing sleeps to synchronise: every wait is a poll with
//! a deadline.

#![cfg(not(any(loom, shuttle)))]

mod pool_common;
mod region_common;

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvoffload::internal::pool::agreement::EngineSlots;
use kvoffload::internal::pool::engines::{worker, OwnerState, OwnerWord};
use kvoffload::internal::pool::file::liveness::member_of_self;
use kvoffload::internal::pool::file::{region_name, PoolFile, PoolOptions, Wait};
use kvoffload::internal::pool::sweep::Lease;
use kvoffload::internal::pool::table::PoolTable;
use kvoffload::internal::pool::words::PoolWords;
use kvoffload::internal::protocol::agreement::{
    abandoned_by, AgreementError, SETTLED_PAGEABLE, SETTLED_PINNED, UNSETTLED,
};
use kvoffload::{
    shared, Code, KvAlloc, Offloader, OffloaderOptions, PageableReason, PinOutcome, PinState, RegionSpec, Request,
    ShmOptions, SimFault, SimRuntime,
};
use pool_common::{spec, ChildLines, ShmDir};
use region_common::{block_on_stdin, child_role, poll_until, ChildGuard};

/// Long enough for anything that should happen on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(60);
/// The pool's name in the test's directory.
const POOL: &str = "agree";
/// The engine's id (both ranks give it).
const ID: [u64; 4] = [0x46; 4];

fn kv() -> KvAlloc {
    KvAlloc { tensors: 2, page_bytes: 4096, gpu_blocks: 8, block_factor: 1 }
}

/// Opens (rank 0: creates) the pool in `dir`.
fn open_pool(dir: &Path) -> PoolFile {
    PoolFile::open_or_create(POOL, &spec(), &PoolOptions::in_dir(dir), Wait::new(PATIENCE)).unwrap().0
}

/// Rank `rank`'s offloader on the pool's rows, its ranks agreeing through
/// entry `lease.engine`'s words within `timeout`.
fn offloader(dir: &Path, pool: &PoolFile, lease: Lease, rank: usize, sim: SimRuntime, timeout: Duration) -> Offloader {
    let mut opts = OffloaderOptions::with_host_blocks(pool.geometry().slots as usize);
    opts.region = RegionSpec::Persistent {
        name: region_name(POOL),
        rank,
        ranks: 2,
        options: ShmOptions::new().dir(dir).timeout(PATIENCE),
    };
    let words: Arc<dyn PoolWords> = pool.shared_words();
    opts.agreement_slots = Some(Arc::new(EngineSlots::new(words, lease.engine).unwrap()));
    opts.agreement_timeout = Some(timeout);
    Offloader::with_allocated_tensors(shared(sim), kv(), opts).unwrap()
}

/// What a rank's pinning ended in, as one line.
fn outcome(o: &PinOutcome) -> String {
    format!("{:?} {:?}", o.state, o.agreement)
}

// ---------------------------------------------------------------- rank 1

/// Rank 1's process (does nothing when run as a test): joins the engine,
/// and in mode `agree` (or `fail`: its first registration fails, so it
/// settles pageable) pins and agrees, prints the outcome, and waits for
/// stdin to close before it shuts down and leaves; in mode `joined` it
/// stops once joined (the parent kills it).
#[test]
fn agree_child() {
    let Some((_, arg)) = child_role() else { return };
    let (dir, mode) = arg.split_once('|').unwrap();
    let dir = Path::new(dir);
    let pool = PoolFile::open(POOL, &PoolOptions::in_dir(dir), Wait::new(PATIENCE)).unwrap();
    let me = member_of_self().unwrap();
    let table = PoolTable::new(pool.words());
    let mut lease = None;
    assert!(
        poll_until(PATIENCE, || {
            lease = table.join_member(worker(1), &me, &ID).unwrap();
            lease.is_some()
        }),
        "no entry of the engine"
    );
    let lease = lease.unwrap();
    say(&format!("joined {}", lease.engine));
    if mode == "joined" {
        block_on_stdin();
        return;
    }
    let sim = SimRuntime::new();
    if mode == "fail" {
        sim.inject(SimFault::Register { nth: 1, code: Code::NOT_SUPPORTED });
    }
    let off = offloader(dir, &pool, lease, 1, sim, PATIENCE);
    let o = off.wait_pinned(Request::new()).unwrap();
    say(&format!("outcome {}", outcome(&o)));
    block_on_stdin();
    off.shutdown(Request::new(), &mut drop).unwrap();
    table.leave(lease, worker(1), &me).unwrap();
}

fn say(line: &str) {
    println!("kvo-agree {line}");
    let _ = std::io::stdout().flush();
}

// ---------------------------------------------------------------- rank 0

/// Rank 1 in a child process.
struct Rank1 {
    guard: ChildGuard,
    lines: ChildLines,
}

impl Rank1 {
    fn spawn(dir: &Path, mode: &str) -> Rank1 {
        let arg = format!("{}|{mode}", dir.display());
        let mut guard = ChildGuard::spawn_piped("agree_child", "rank1", &arg);
        let lines = ChildLines::new(guard.child.as_mut().unwrap().stdout.take().unwrap());
        Rank1 { guard, lines }
    }

    /// The rest of its next `kvo-agree <what> ` line (bounded wait).
    fn expect(&self, what: &str) -> String {
        let line = self.lines.expect("kvo-agree ", PATIENCE);
        line.strip_prefix(&format!("kvo-agree {what} ")).unwrap_or_else(|| panic!("expected {what}: {line}")).into()
    }

    /// Closes its stdin: it shuts down, leaves and exits, successfully.
    fn finish(mut self) {
        let status = self.guard.wait();
        assert!(status.success(), "rank 1 failed: {status:?} (its stderr is above)");
    }
}

/// Rank 0 (this process) joins as the engine's owner.
fn join_owner(pool: &PoolFile) -> Lease {
    PoolTable::new(pool.words()).join_owner(worker(0), &member_of_self().unwrap(), &ID).unwrap()
}

fn agreement_words(pool: &PoolFile, e: u8) -> [u32; 2] {
    [pool.words().agreement_load(e, 0), pool.words().agreement_load(e, 1)]
}

/// What a tenure of the engine saw: its lease, rank 0's outcome, rank 1's
/// (as its line), the agreement words once the owner joined and once both
/// ranks decided.
struct Tenure {
    lease: Lease,
    mine: PinOutcome,
    theirs: String,
    joined: [u32; 2],
    decided: [u32; 2],
}

/// One tenure of the engine where both ranks pin (rank 1's first
/// registration failing when `rank1_fails`), then both ranks shut down and
/// leave (the entry is `FREE` after).
fn tenure(dir: &Path, pool: &PoolFile, rank1_fails: bool) -> Tenure {
    let lease = join_owner(pool);
    let joined = agreement_words(pool, lease.engine);
    let rank1 = Rank1::spawn(dir, if rank1_fails { "fail" } else { "agree" });
    assert_eq!(rank1.expect("joined"), lease.engine.to_string());
    let off = offloader(dir, pool, lease, 0, SimRuntime::new(), PATIENCE);
    let mine = off.wait_pinned(Request::new()).unwrap();
    let theirs = rank1.expect("outcome");
    let decided = agreement_words(pool, lease.engine);
    off.shutdown(Request::new(), &mut drop).unwrap();
    rank1.finish();
    PoolTable::new(pool.words()).leave(lease, worker(0), &member_of_self().unwrap()).unwrap();
    let o = OwnerWord::decode(pool.words().owner_load(lease.engine));
    assert_eq!(o.state, OwnerState::Free, "both ranks left: {o:?}");
    Tenure { lease, mine, theirs, joined, decided }
}

#[test]
fn two_rank_processes_on_one_pool_agree_pinned() {
    let dir = ShmDir::new("agree-pinned");
    let pool = open_pool(dir.path());
    let t = tenure(dir.path(), &pool, false);
    assert_eq!(t.mine.state, PinState::Pinned, "{:?}", t.mine);
    assert_eq!(t.mine.agreement, Some(Ok(())));
    assert_eq!(t.theirs, outcome(&t.mine), "rank 1 ended as rank 0 did");
    assert_eq!((t.joined, t.decided), ([UNSETTLED; 2], [SETTLED_PINNED; 2]));
}

#[test]
fn a_rank_killed_before_it_settled_ends_the_survivor_pageable_at_once() {
    let dir = ShmDir::new("agree-killed");
    let pool = open_pool(dir.path());
    let lease = join_owner(&pool);
    let e = lease.engine;
    let mut rank1 = Rank1::spawn(dir.path(), "joined");
    assert_eq!(rank1.expect("joined"), e.to_string());
    // A timeout far past what the test waits: the death, not the timeout,
    // ends the wait.
    let timeout = Duration::from_secs(600);
    let off = offloader(dir.path(), &pool, lease, 0, SimRuntime::new(), timeout);
    off.start().unwrap();
    assert!(
        poll_until(PATIENCE, || pool.words().agreement_load(e, 0) != UNSETTLED),
        "rank 0 never settled its own word"
    );
    assert_eq!(agreement_words(&pool, e), [SETTLED_PINNED, UNSETTLED], "rank 0 waits for rank 1");
    assert!(!off.pin_progress().state.is_final(), "rank 0 decided without rank 1");
    let status = rank1.guard.kill9();
    assert_eq!(status.signal(), Some(libc::SIGKILL));
    let killed = Instant::now();
    let o = off.wait_pinned(Request::new()).unwrap();
    let waited = killed.elapsed();
    assert!(waited < PATIENCE, "ended {waited:?} after the kill, not at once");
    assert_eq!(o.state, PinState::Pageable(PageableReason::PeerPageable), "{o:?}");
    assert_eq!(o.agreement, Some(Err(AgreementError::RankDied { rank: 1 })));
    assert_eq!(agreement_words(&pool, e), [SETTLED_PINNED, abandoned_by(0)], "rank 1's word given up");
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn a_rank_that_never_comes_ends_the_survivor_pageable_at_its_timeout() {
    let dir = ShmDir::new("agree-absent");
    let pool = open_pool(dir.path());
    let lease = join_owner(&pool);
    let timeout = Duration::from_millis(300);
    let off = offloader(dir.path(), &pool, lease, 0, SimRuntime::new(), timeout);
    let t0 = Instant::now();
    let o = off.wait_pinned(Request::new()).unwrap();
    assert!(t0.elapsed() >= timeout, "gave up before its timeout");
    assert_eq!(o.state, PinState::Pageable(PageableReason::PeerPageable), "{o:?}");
    assert_eq!(o.agreement, Some(Err(AgreementError::Timeout { millis: 300, waiting: vec![1] })));
    assert_eq!(agreement_words(&pool, lease.engine), [SETTLED_PINNED, abandoned_by(0)]);
    off.shutdown(Request::new(), &mut drop).unwrap();
}

#[test]
fn a_later_tenure_of_the_entry_agrees_on_fresh_words_not_the_last_outcome() {
    let dir = ShmDir::new("agree-tenures");
    let pool = open_pool(dir.path());
    // Tenure 1: rank 1 cannot pin, so both end pageable; its words stay.
    let first = tenure(dir.path(), &pool, true);
    assert_eq!(first.mine.state, PinState::Pageable(PageableReason::PeerPageable), "{:?}", first.mine);
    assert_eq!(first.mine.agreement, Some(Ok(())));
    assert!(first.theirs.starts_with("Pageable(NotSupported) Some(Ok(()))"), "{}", first.theirs);
    assert_eq!(first.decided, [SETTLED_PINNED, SETTLED_PAGEABLE]);
    assert_eq!(agreement_words(&pool, first.lease.engine), first.decided, "left as the tenure ended");
    // Tenure 2, on the same entry: both pin and agree pinned, on words
    // its owner reset (not the last tenure's outcome).
    let second = tenure(dir.path(), &pool, false);
    assert_eq!(second.lease.engine, first.lease.engine, "the same entry");
    assert_ne!(second.lease.generation, first.lease.generation, "a new tenure");
    assert_eq!(second.mine.state, PinState::Pinned, "{:?}", second.mine);
    assert_eq!(second.mine.agreement, Some(Ok(())));
    assert_eq!(second.theirs, outcome(&second.mine));
    assert_eq!((second.joined, second.decided), ([UNSETTLED; 2], [SETTLED_PINNED; 2]));
}
