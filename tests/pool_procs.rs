//! The node pool's crash recovery (design 3.6, 4: PL4 with real processes):
//! an engine that is a child process, on a real pool file in /dev/shm, is
//! killed with SIGKILL at a named step of the protocol; the parent, engine
//! B, sweeps and checks that the dead engine's entry is `FREE`, that no
//! slot carries its bit or writer index (I4), that nothing it was writing
//! became readable (I1: the slot is `FREE`, a lookup misses, and every
//! `READABLE` slot's rows hold its key's bytes on every rank), that B's
//! holds are intact (I2) and that `PoolTable::check` holds (I5); then B
//! stores and loads keys in every set. The same for a sweeper killed at
//! each `SweepStep` of its sweep of another dead engine, and for an engine
//! killed in its own leave. Then the oracle's cases on entries: a member's
//! pid alive with another start time (reused: swept), a zombie (swept), an
//! engine of another pid namespace (judged by its member locks: kept while
//! it runs, swept once killed); and the owner word's process (a
//! claimer, a sweeper) whose pid means nothing here, as one of another pid
//! namespace: judged by its entry lock, kept while it runs. And a closer
//! (`pool::closing`) killed while it decides (the next joiner undoes its
//! word) or while it removes (the next opener finishes the removal and
//! makes a fresh pool). Every check is
//! shown failing on a state broken on purpose (the last ones by the pid
//! alone, the rule before the locks).
//!
//! A child re-executes this binary (`procs_child`; role and `dir|step` in
//! the environment), prints `kvo-step <step> engine <e>` when it reaches
//! its step and blocks on stdin; the parent waits for that line with a
//! deadline and kills it. Nothing sleeps to synchronise. Each test has its
//! own directory, removed when it ends (passing or not); its children are
//! killed and reaped then too.

#![cfg(not(any(loom, shuttle)))]

#[path = "pool_procs/pid_only.rs"]
mod pid_only;
mod pool_common;
mod region_common;
#[path = "pool_procs/world.rs"]
mod world;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::time::Duration;

use kvoffload::internal::pool::closing::{Close, Closer, PoolWord};
use kvoffload::internal::pool::engines::{worker, MembersWord, OwnerState, OwnerWord, SCHEDULER};
use kvoffload::internal::pool::error::LiveEntry;
use kvoffload::internal::pool::file::liveness::{member_of_self, proc_stat};
use kvoffload::internal::pool::file::{PoolFile, PoolOptions, PoolSpec, Wait};
use kvoffload::internal::pool::slot::SlotWord;
use kvoffload::internal::pool::sweep::{JoinError, SweepStep};
use kvoffload::internal::pool::table::PoolTable;
use kvoffload::internal::pool::words::{EntryRole, Key, Member, PoolWords};
use pid_only::PidOnly;
use pool_common::ChildLines;
use region_common::{block_on_stdin, child_role, poll_until, ChildGuard};
use world::{join, key, Engine, Rows, World, GEOMETRY, POOL, ROW_WORDS};

/// Long enough for anything that should happen on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(20);

/// The child engine's id.
const A_ID: [u64; 4] = [0xA; 4];

// ---------------------------------------------------------------- children

/// The entry of every child (does nothing when run as a test).
#[test]
fn procs_child() {
    if let Some((role, arg)) = child_role() {
        let (dir, step) = arg.split_once('|').unwrap();
        let pool = PoolFile::open(POOL, &PoolOptions::in_dir(dir), Wait::new(PATIENCE)).unwrap();
        let rows = Rows::open(Path::new(dir));
        let me = member_of_self().unwrap();
        match role.as_str() {
            "engine" => engine_child(&pool, &rows, &me, step),
            "sweeper" => sweeper_child(&pool, &me, step),
            "closer" => closer_child(&pool, step),
            other => panic!("unknown role {other}"),
        }
    }
}

/// Says that this process reached `step` (as engine `e`) and blocks until
/// it is killed (or its stdin closes: then it returns, and exits).
fn reached(step: &str, e: u8) {
    use std::io::Write;
    println!("kvo-step {step} engine {e}");
    let _ = std::io::stdout().flush();
    block_on_stdin();
}

/// A `SweepStep` as the steps are named here (`Taken`, `Slot6`).
fn step_name(s: SweepStep) -> String {
    match s {
        SweepStep::Slot(n) => format!("Slot{n}"),
        other => format!("{other:?}"),
    }
}

/// Engine A: joins, does what leads to `step`, and stops there.
fn engine_child(pool: &PoolFile, rows: &Rows, me: &Member, step: &str) {
    let words = pool.words();
    if step == "owner-claimed" {
        // join_owner's first step alone: the owner's hold (its entry
        // lock), then the owner CAS of a FREE entry, its member bit not set
        // yet.
        for e in 0..GEOMETRY.engines {
            let raw = words.owner_load(e);
            let o = OwnerWord::decode(raw);
            if o.state == OwnerState::Free && words.hold_entry(e, EntryRole::Owner) {
                let live = OwnerWord {
                    state: OwnerState::Live,
                    generation: OwnerWord::next_generation(o.generation),
                    pid: me.pid,
                };
                if words.owner_cas(e, raw, live.encode()).is_ok() {
                    return reached(step, e);
                }
            }
        }
        panic!("no FREE entry");
    }
    let lease = join(words, me, A_ID, step != "joined");
    let a = Engine::new(words, lease, rows);
    let e = a.e();
    let k = key(b'A', 0, 0);
    match step {
        "joined" => {}
        "claimed" => {
            a.claim(&k);
        }
        "rank0" => {
            let (slot, epoch) = a.claim(&k);
            assert!(!a.complete(slot, epoch, &k, 0));
            // Rank 1 has copied half its row.
            rows.write(slot, 1, &k, epoch, ROW_WORDS / 2);
        }
        "published" => {
            a.store(&k).unwrap().expect("claimed");
        }
        "holding" => {
            a.load(&key(b'B', 0, 0)).unwrap();
            a.load(&key(b'B', 1, 1)).unwrap();
        }
        "releasing" => {
            let (s0, e0, _) = a.load(&key(b'B', 0, 0)).unwrap();
            a.load(&key(b'B', 1, 1)).unwrap();
            a.table.release(e, s0, e0).unwrap();
        }
        "busy" | "busy-exit" => busy(&a),
        s if s.starts_with("leave-") => {
            busy(&a);
            a.table.leave(lease, SCHEDULER, me).unwrap();
            a.table.leave(lease, worker(1), me).unwrap();
            let stop = &s["leave-".len()..];
            let ended = a
                .table
                .leave_observed(lease, worker(0), me, &mut |s| {
                    if step_name(s) == stop {
                        reached(step, e);
                    }
                    true
                })
                .unwrap();
            panic!("the leave went on past {stop} (ended: {ended})");
        }
        other => panic!("unknown step {other}"),
    }
    reached(step, e);
}

/// A's marks of every kind: `A(0,0)` published and held by A; B's `B(0,0)`
/// held (B holds it too) and `B(3,1)` held by A alone; `A(1,0)` half
/// written (rank 0 complete, rank 1 half its row); `A(2,0)` claimed.
fn busy(a: &Engine<'_>) {
    let k0 = key(b'A', 0, 0);
    a.store(&k0).unwrap().expect("claimed");
    a.load(&k0).unwrap();
    a.load(&key(b'B', 0, 0)).unwrap();
    a.load(&key(b'B', 3, 1)).unwrap();
    let k1 = key(b'A', 1, 0);
    let (slot, epoch) = a.claim(&k1);
    assert!(!a.complete(slot, epoch, &k1, 0));
    a.rows.write(slot, 1, &k1, epoch, ROW_WORDS / 2);
    a.claim(&key(b'A', 2, 0));
}

/// The keys [`busy`] leaves half-written.
fn busy_half() -> [Key; 2] {
    [key(b'A', 1, 0), key(b'A', 2, 0)]
}

/// A sweeper (a joining engine's first step, design 3.6): sweeps every
/// dead entry and stops at `step`.
fn sweeper_child(pool: &PoolFile, me: &Member, step: &str) {
    let t = PoolTable::new(pool.words());
    let freed = t
        .sweep_dead(me, &mut |s| {
            if step_name(s) == step {
                reached(step, u8::MAX);
            }
            true
        })
        .unwrap();
    panic!("the sweep went on past {step} (freed {freed:?})");
}

/// A closer (`pool rm`; `--force` for `Decided`, as engine B is
/// registered): closes the pool and stops at `step` (`Tentative`:
/// `CLOSING(me)`, deciding; `Decided`: `REMOVING(me)`, no file removed yet).
fn closer_child(pool: &PoolFile, step: &str) {
    let force = step == "Decided";
    let closed = pool
        .close_and_remove_observed(force, Wait::new(PATIENCE), &mut |s| {
            if format!("{s:?}") == step {
                reached(step, u8::MAX);
            }
        })
        .unwrap();
    panic!("the close went on past {step}: {closed:?}");
}

// ---------------------------------------------------------------- parent

/// A child process, its stdout read with deadlines.
struct Proc {
    guard: ChildGuard,
    lines: ChildLines,
    pid: u32,
}

impl Proc {
    fn spawn(w: &World, role: &str, step: &str) -> Proc {
        let arg = format!("{}|{step}", w.dir.path().display());
        let mut guard = ChildGuard::spawn_piped("procs_child", role, &arg);
        let child = guard.child.as_mut().unwrap();
        let pid = child.id();
        let lines = ChildLines::new(child.stdout.take().unwrap());
        Proc { guard, lines, pid }
    }

    /// Waits (bounded) for the child to reach `step`; its engine index.
    fn at(&self, step: &str) -> u8 {
        let line = self.lines.expect("kvo-step ", PATIENCE);
        let rest = line.strip_prefix(&format!("kvo-step {step} engine ")).unwrap_or_else(|| panic!("{line}"));
        rest.parse().unwrap()
    }

    /// SIGKILL, reaped.
    fn kill(mut self) {
        let status = self.guard.kill9();
        assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    }

    /// The member record this child registered.
    fn member(&self, w: &World, e: u8) -> Member {
        let m = w.words().member_load(e, worker(0));
        assert_eq!(m.pid, self.pid);
        m
    }
}

fn assert_none(broken: Vec<String>, what: &str) {
    assert!(broken.is_empty(), "{what}: {broken:#?}");
}

/// Engine A (a child) stops at `step`; `at_step` checks the words show the
/// step. While A lives nothing is swept; killed, exactly its entry is
/// swept, as the checks say, and the survivor goes on.
fn crash_engine(tag: &str, step: &str, half: &[Key], at_step: impl Fn(&World, u8, &Proc)) {
    let w = World::new(tag);
    let a = Proc::spawn(&w, "engine", step);
    let e = a.at(step);
    at_step(&w, e, &a);
    let before = w.marks(e);
    assert_eq!(w.sweep(), [] as [u8; 0], "swept while it lives");
    assert_eq!(w.marks(e), before, "its marks kept while it lives");
    a.kill();
    assert_eq!(w.sweep(), [e], "exactly the dead engine is swept");
    assert_none(w.swept(e, &before, half), "after the sweep");
    w.survive();
}

fn live_by(w: &World, e: u8, pid: u32) {
    let o = w.owner(e);
    assert_eq!((o.state, o.pid), (OwnerState::Live, pid), "{o:?}");
}

#[test]
fn killed_between_its_owner_claim_and_its_member_bit() {
    crash_engine("owner-claimed", "owner-claimed", &[], |w, e, a| {
        live_by(w, e, a.pid);
        assert_eq!(w.members(e).mask, 0);
    });
}

#[test]
fn killed_after_join_with_its_owner_registered_and_no_other_member() {
    crash_engine("joined", "joined", &[], |w, e, a| {
        live_by(w, e, a.pid);
        assert_eq!(w.members(e).mask, 1 << worker(0));
    });
}

#[test]
fn killed_after_a_claim_with_no_rank_bit() {
    let k = key(b'A', 0, 0);
    crash_engine("claimed", "claimed", &[k], |w, e, _| {
        let s = w.slot_of(&k).unwrap();
        assert_eq!(w.word(s), SlotWord::writing(e, w.word(s).epoch(), 0));
    });
}

#[test]
fn killed_after_rank_0s_bit_with_rank_1_half_written() {
    let k = key(b'A', 0, 0);
    crash_engine("rank0", "rank0", &[k], |w, e, _| {
        let s = w.slot_of(&k).unwrap();
        let epoch = w.word(s).epoch();
        assert_eq!(w.word(s), SlotWord::writing(e, epoch, 0b1));
        assert!(w.rows.holds(s, 0, &k, epoch) && !w.rows.holds(s, 1, &k, epoch));
    });
}

#[test]
fn killed_after_publishing() {
    let k = key(b'A', 0, 0);
    crash_engine("published", "published", &[], |w, _, _| {
        let s = w.slot_of(&k).unwrap();
        assert_eq!(w.word(s), SlotWord::readable(w.word(s).epoch(), 0));
    });
}

#[test]
fn killed_holding_readable_slots() {
    crash_engine("holding", "holding", &[], |w, e, _| {
        let (s0, s1) = (w.slot_of(&key(b'B', 0, 0)).unwrap(), w.slot_of(&key(b'B', 1, 1)).unwrap());
        assert_eq!(w.word(s0).payload(), 1 << e | 1 << w.b.engine, "held by both");
        assert_eq!(w.word(s1).payload(), 1 << e);
    });
}

#[test]
fn killed_between_two_releases() {
    crash_engine("releasing", "releasing", &[], |w, e, _| {
        let (s0, s1) = (w.slot_of(&key(b'B', 0, 0)).unwrap(), w.slot_of(&key(b'B', 1, 1)).unwrap());
        assert_eq!(w.word(s0).payload(), 1 << w.b.engine, "released");
        assert_eq!(w.word(s1).payload(), 1 << e, "not yet");
    });
}

/// A leaves (its scheduler, rank 1's worker, then its owner, the last) with
/// marks left, and is killed at `stop` of the last leaver's reclaim.
fn crash_in_leave(stop: &str) {
    crash_engine(&format!("leave-{stop}"), &format!("leave-{stop}"), &busy_half(), |w, e, a| {
        let o = w.owner(e);
        assert_eq!((o.state, o.pid), (OwnerState::Reclaiming, a.pid), "{o:?}");
        assert_eq!(w.members(e).mask, 0, "every member left");
    });
}

#[test]
fn killed_in_its_leave_with_the_entry_taken() {
    crash_in_leave("Taken");
}

#[test]
fn killed_in_its_leave_half_way_through_the_slots() {
    crash_in_leave("Slot6");
}

/// Engine D (a child) gets marks of every kind and is killed unswept; a
/// sweeper (another child) stops at `stop` of its sweep of D (`Slot` +
/// `at_mark`: after D's marks up to that one) and is killed there; the
/// parent finishes the sweep.
fn crash_sweeper(stop: &str, at_mark: Option<usize>) {
    let w = World::new(&format!("sweeper-{stop}"));
    let d = Proc::spawn(&w, "engine", "busy");
    let e = d.at("busy");
    d.kill();
    let before = w.marks(e);
    assert_eq!(before.len(), 5, "{before:?}");
    let members = w.members(e);
    let step = match at_mark {
        Some(i) => format!("{stop}{}", before[i].0),
        None => stop.to_string(),
    };
    let s = Proc::spawn(&w, "sweeper", &step);
    s.at(&step);
    // Where the sweeper is.
    let o = w.owner(e);
    assert_eq!((o.state, o.pid), (OwnerState::Reclaiming, s.pid), "{o:?}");
    let m = w.members(e);
    let sealed = MembersWord { mask: members.mask, generation: MembersWord::next_generation(members.generation) };
    match stop {
        "Taken" => assert_eq!(m, members, "not sealed yet"),
        "Sealed" | "Slot" => assert_eq!(m, sealed),
        "Cleared" => assert_eq!(m, MembersWord { mask: 0, ..sealed }),
        _ => unreachable!(),
    }
    let done = match (stop, at_mark) {
        ("Slot", Some(i)) => i + 1,
        ("Cleared", _) => before.len(),
        _ => 0,
    };
    let now = w.marks(e);
    assert_eq!(now, before[done..], "marks reclaimed up to the step");
    // A live sweeper's entry is not taken over.
    assert_eq!(w.sweep(), [] as [u8; 0], "taken from a live sweeper");
    assert_eq!(w.owner(e), o);
    assert_eq!(w.marks(e), now);
    s.kill();
    assert_eq!(w.sweep(), [e], "the dead sweeper's sweep is finished");
    assert_none(w.swept(e, &before, &busy_half()), "after the sweep");
    w.survive();
}

#[test]
fn a_sweeper_killed_with_the_entry_taken() {
    crash_sweeper("Taken", None);
}

#[test]
fn a_sweeper_killed_with_the_members_sealed() {
    crash_sweeper("Sealed", None);
}

#[test]
fn a_sweeper_killed_after_the_first_mark() {
    crash_sweeper("Slot", Some(0));
}

#[test]
fn a_sweeper_killed_half_way_through_the_marks() {
    crash_sweeper("Slot", Some(2));
}

#[test]
fn a_sweeper_killed_with_the_members_cleared() {
    crash_sweeper("Cleared", None);
}

// ---------------------------------------------------------------- the oracle on entries

/// Sets the record of every member of entry `e` to `f` of it.
fn forge(w: &World, e: u8, f: impl Fn(Member) -> Member) {
    for m in [SCHEDULER, worker(0), worker(1)] {
        let r = w.words().member_load(e, m);
        w.words().member_store(e, m, &f(r));
    }
}

#[test]
fn a_live_pid_with_another_start_time_is_swept_and_with_its_own_is_not() {
    let w = World::new("reused");
    let a = Proc::spawn(&w, "engine", "busy");
    let e = a.at("busy");
    let before = w.marks(e);
    let own = a.member(&w, e);
    assert_eq!(w.sweep(), [] as [u8; 0], "its own start time: alive");
    // The same pid, started at another time: another process (pid reuse).
    forge(&w, e, |r| Member { start: r.start + 1, ..r });
    assert!(proc_stat(a.pid).unwrap().is_some_and(|s| s.start == own.start), "the child still runs");
    assert_eq!(w.sweep(), [e]);
    assert_none(w.swept(e, &before, &busy_half()), "after the sweep");
    w.survive();
    a.kill();
    assert_eq!(w.sweep(), [] as [u8; 0]);
}

#[test]
fn a_zombie_engine_is_swept() {
    let w = World::new("zombie");
    let mut a = Proc::spawn(&w, "engine", "busy-exit");
    let e = a.at("busy-exit");
    let before = w.marks(e);
    assert_eq!(w.sweep(), [] as [u8; 0], "alive");
    // Its stdin closes: it returns and exits, and is not reaped.
    drop(a.guard.child.as_mut().unwrap().stdin.take());
    let pid = a.pid;
    assert!(
        poll_until(PATIENCE, || proc_stat(pid).unwrap().is_some_and(|s| s.state == 'Z')),
        "the child did not become a zombie"
    );
    assert_eq!(w.sweep(), [e], "a zombie is gone");
    assert_none(w.swept(e, &before, &busy_half()), "after the sweep");
    w.survive();
    let status = a.guard.wait();
    assert!(status.success(), "{status:?}");
}

/// Engine A (a child) at work, every member record of it naming another
/// pid namespace (a container sharing the tmpfs, whose records ours cannot
/// read); the parent sweeps with `sweep` while A runs and once it is killed.
fn foreign_members(tag: &str, sweep: impl Fn(&World) -> Vec<u8>) {
    let w = World::new(tag);
    let a = Proc::spawn(&w, "engine", "busy");
    let e = a.at("busy");
    let before = w.marks(e);
    forge(&w, e, |r| Member { pidns: r.pidns ^ 1, ..r });
    assert_eq!(sweep(&w), [] as [u8; 0], "a live engine of another pid namespace swept");
    assert_eq!((w.owner(e).state, w.marks(e)), (OwnerState::Live, before.clone()));
    assert_eq!(w.pool.engines().live.len(), 2, "pool ls counts it live (and B)");
    a.kill();
    assert_eq!(sweep(&w), [e], "a dead engine of another pid namespace kept for good");
    assert_none(w.swept(e, &before, &busy_half()), "after the sweep");
    w.survive();
}

/// Rule 8 of `pool::sweep`: a member its record cannot judge is judged by
/// its entry's member locks: kept while it runs, swept once killed (before
/// the locks, a dead engine of another container kept its entry and holds
/// until a process of its own namespace swept it: for good, once that
/// container was gone).
#[test]
fn an_engine_of_another_pid_namespace_is_kept_while_it_runs_and_swept_once_killed() {
    foreign_members("foreign", World::sweep);
}

/// The negative: without the member locks (a foreign member never judged),
/// the killed engine's entry is kept.
#[test]
#[should_panic(expected = "a dead engine of another pid namespace kept for good")]
fn without_member_locks_a_dead_engine_of_another_namespace_is_kept_for_good() {
    foreign_members("neg-foreign", sweep_by_pid_alone);
}

// ---------------------------------------------------------------- the owner word's process

/// A pid that names no process here (a child, reaped): what the owner word
/// shows of a process of another pid namespace (a container sharing the
/// tmpfs), whose pid means nothing in ours.
fn absent_pid() -> u32 {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    assert_eq!(proc_stat(pid).unwrap(), None, "pid {pid} reused already");
    pid
}

/// Entry `e`'s owner word, its pid made `pid` (the rest kept).
fn rename_owner(w: &World, e: u8, pid: u32) -> OwnerWord {
    let raw = w.words().owner_load(e);
    let o = OwnerWord { pid, ..OwnerWord::decode(raw) };
    w.words().owner_cas(e, raw, o.encode()).unwrap();
    o
}

/// The parent's sweep with the owner word judged by its pid alone (the
/// rule before the entry locks: the negatives' sweep).
fn sweep_by_pid_alone(w: &World) -> Vec<u8> {
    PoolTable::new(PidOnly(w.words())).sweep_dead(&w.me, &mut |_| true).unwrap()
}

/// A sweeper S (a child) stopped after D's first mark, its owner word
/// showing a pid of another namespace; the sweep of `words` by the parent.
fn foreign_sweeper(tag: &str, sweep: impl Fn(&World) -> Vec<u8>) {
    let w = World::new(tag);
    let d = Proc::spawn(&w, "engine", "busy");
    let e = d.at("busy");
    d.kill();
    let before = w.marks(e);
    let step = format!("Slot{}", before[0].0);
    let s = Proc::spawn(&w, "sweeper", &step);
    s.at(&step);
    let o = rename_owner(&w, e, absent_pid());
    let now = w.marks(e);
    assert_eq!(sweep(&w), [] as [u8; 0], "taken from a live sweeper of another pid namespace");
    assert_eq!((w.owner(e), w.marks(e)), (o, now));
    // `pool ls` shows it at work, and `pool rm` counts it in use.
    let counts = w.pool.engines();
    assert_eq!(counts.sweeping, [LiveEntry { index: e, pids: vec![o.pid] }]);
    assert_eq!(counts.dead, 0);
    s.kill();
    let counts = w.pool.engines();
    assert_eq!((counts.sweeping, counts.dead), (vec![], 1), "a dead sweeper's entry is dead");
    assert_eq!(w.sweep(), [e], "the dead sweeper's sweep is finished");
    assert_none(w.swept(e, &before, &busy_half()), "after the sweep");
    w.survive();
}

/// Rule 7 of `pool::sweep`: a sweeper is judged by its entry lock, held
/// from before its take until the entry is free: whatever pid its owner
/// word shows, it is not taken over while it runs.
#[test]
fn a_sweeper_whose_pid_means_nothing_here_is_not_taken_over_while_it_runs() {
    foreign_sweeper("foreign-sweeper", World::sweep);
}

/// The negative: judged by the pid alone (the pool before its entry
/// locks), the live sweeper's entry is taken over.
#[test]
#[should_panic(expected = "taken from a live sweeper of another pid namespace")]
fn the_pid_alone_takes_over_a_live_sweeper_of_another_namespace() {
    foreign_sweeper("neg-foreign-sweeper", sweep_by_pid_alone);
}

/// Engine A (a child) stopped between its owner claim and its member bit,
/// its owner word showing a pid of another namespace; the parent sweeps.
fn foreign_claimer(tag: &str, sweep: impl Fn(&World) -> Vec<u8>) {
    let w = World::new(tag);
    let a = Proc::spawn(&w, "engine", "owner-claimed");
    let e = a.at("owner-claimed");
    let o = rename_owner(&w, e, absent_pid());
    assert_eq!(w.members(e).mask, 0);
    assert_eq!(sweep(&w), [] as [u8; 0], "a live claimer of another pid namespace swept");
    assert_eq!(w.owner(e), o);
    a.kill();
    assert_eq!(w.sweep(), [e], "the dead claimer's entry is swept");
    w.survive();
}

/// Rule 7 for the owner: a claimer is judged by its entry lock until its
/// member record is in the mask.
#[test]
fn a_claimer_whose_pid_means_nothing_here_keeps_its_entry_while_it_runs() {
    foreign_claimer("foreign-claimer", World::sweep);
}

/// The negative: judged by the pid alone, the live claimer's entry is swept
/// (and would be given to another engine beside it).
#[test]
#[should_panic(expected = "a live claimer of another pid namespace swept")]
fn the_pid_alone_sweeps_a_live_claimer_of_another_namespace() {
    foreign_claimer("neg-foreign-claimer", sweep_by_pid_alone);
}

// ---------------------------------------------------------------- the checks fail

/// The sweep's check catches a dead writer's slot published instead of
/// freed (a half-written row made visible): by its rows, by a lookup, and
/// by the word the sweep should have left.
#[test]
fn the_checks_catch_a_half_written_slot_made_readable() {
    let w = World::new("neg-half");
    let k = key(b'A', 0, 0);
    let a = Proc::spawn(&w, "engine", "rank0");
    let e = a.at("rank0");
    let before = w.marks(e);
    a.kill();
    let s = w.slot_of(&k).unwrap();
    let cur = w.word(s);
    // The bad sweep: WRITING(dead, e, rank 0) -> READABLE(e).
    assert!(w.words().slot_cas(s as usize, cur.encode(), SlotWord::readable(cur.epoch(), 0).encode()).is_ok());
    assert_eq!(w.sweep(), [e]);
    let broken = w.swept(e, &before, &[k]);
    for want in ["rank 1's row is not", "(I1)", "half-written key", "expected SlotWord { state: Free"] {
        assert!(broken.iter().any(|b| b.contains(want)), "{want:?} not in {broken:#?}");
    }
}

/// The checks catch a dead engine left unswept (its entry not `FREE`, its
/// write not freed), pass once it is swept.
#[test]
fn the_checks_catch_a_dead_engine_left_unswept() {
    let w = World::new("neg-unswept");
    let k = key(b'A', 0, 0);
    let a = Proc::spawn(&w, "engine", "claimed");
    let e = a.at("claimed");
    let before = w.marks(e);
    a.kill();
    let broken = w.swept(e, &before, &[k]);
    assert!(broken.iter().any(|b| b.contains("not FREE")), "{broken:#?}");
    assert!(broken.iter().any(|b| b.contains("expected SlotWord { state: Free")), "{broken:#?}");
    assert_eq!(w.sweep(), [e]);
    assert_none(w.swept(e, &before, &[k]), "swept");
}

/// The invariants catch a mark of a `FREE` entry (I4), a lost hold of B
/// (I2) and a key outside its set (I5).
#[test]
fn the_invariants_catch_a_stale_mark_a_lost_hold_and_a_misplaced_key() {
    let w = World::new("neg-marks");
    assert_none(w.invariants(), "a fresh world");
    let words = w.words();
    // B(1,1) (slot 5) held by entry 3, which is FREE.
    let s = w.slot_of(&key(b'B', 1, 1)).unwrap();
    let cur = w.word(s);
    assert!(words.slot_cas(s as usize, cur.encode(), SlotWord::readable(cur.epoch(), 1 << 3).encode()).is_ok());
    // B's hold of B(0,0) dropped behind its back.
    let (_, h, epoch) = w.holds[0];
    let cur = w.word(h);
    assert!(words.slot_cas(h as usize, cur.encode(), SlotWord::readable(epoch, 0).encode()).is_ok());
    let broken = w.invariants();
    assert!(broken.iter().any(|b| b.contains("marks engine 3, whose entry is Free (I4)")), "{broken:#?}");
    assert!(broken.iter().any(|b| b.contains("(I2)")), "{broken:#?}");
    // A key of set 2 in set 1's slot.
    words.key_store(s as usize, &key(b'B', 2, 1));
    let broken = w.invariants();
    assert!(broken.iter().any(|b| b.contains("a key outside its set")), "{broken:#?}");
}

// ---------------------------------------------------------------- closing

/// A closer (`pool rm`, or the last engine leaving a pool not kept) killed
/// while it decides (`CLOSING`, tentative): while it lives, an engine's
/// join is refused (it left its entry) and another close is told it is
/// busy; killed, its closer lock is free, and the next joiner undoes its
/// word and joins the pool as it was (nothing was removed).
#[test]
fn a_closer_killed_while_it_decides_is_undone_by_the_next_joiner() {
    let w = World::new("closer-tentative");
    let c = Proc::spawn(&w, "closer", "Tentative");
    c.at("Tentative");
    let t = PoolTable::new(w.words());
    let deciding = Closer { pid: c.pid, removing: false };
    assert_eq!(t.closer(), Some(deciding));
    let refused = t.join_owner(worker(0), &w.me, &[0xC; 4]);
    assert!(matches!(refused, Err(JoinError::Closing { .. })), "joined while a closer decides: {refused:?}");
    assert_eq!(t.close(&w.me, false, &mut |_| true), Ok(Close::Busy(deciding)));
    c.kill();
    let lease = t.join_owner(worker(0), &w.me, &[0xC; 4]).unwrap();
    assert_eq!(w.pool.pool_word(), PoolWord::READY, "undone");
    t.leave(lease, worker(0), &w.me).unwrap();
    w.survive();
}

/// A remover killed midway (`REMOVING`, with engine B gone over by
/// `--force`, no file removed yet): while it lives, another close is told
/// the pool is being removed; killed, the next engine to open the pool
/// finishes the removal (the old index file and its rows' region) and makes
/// a fresh pool, which B's old mapping does not see.
#[test]
fn a_remover_killed_midway_is_finished_by_the_next_opener_which_makes_a_fresh_pool() {
    use std::os::unix::fs::MetadataExt;
    let w = World::new("closer-removing");
    let c = Proc::spawn(&w, "closer", "Decided");
    c.at("Decided");
    let t = PoolTable::new(w.words());
    let removing = Closer { pid: c.pid, removing: true };
    assert_eq!(t.closer(), Some(removing));
    assert_eq!(t.close(&w.me, false, &mut |_| true), Ok(Close::Busy(removing)));
    let old = std::fs::metadata(w.pool.path()).unwrap().ino();
    c.kill();
    let spec = PoolSpec { geometry: GEOMETRY, ..pool_common::spec() };
    let (fresh, created) = PoolFile::open_or_create(POOL, &spec, &w.dir.opts(), Wait::new(PATIENCE)).unwrap();
    assert!(created, "a fresh pool");
    assert_ne!(std::fs::metadata(fresh.path()).unwrap().ino(), old, "another index file");
    assert_eq!(fresh.pool_word(), PoolWord::READY);
    assert_eq!(fresh.slot_counts().readable, 0, "none of the old pool's keys");
    assert!(w.pool.pool_word().is_removing(), "the old file stays removed, for B's mapping");
}
