//! `kvoffload.Pool`: the node pool's protocol (docs/node-pool-design.md,
//! `kvoffload::internal::pool`) for the processes of an engine: its
//! scheduler (`PoolManager`, python/kvoffload/vllm/pool.py) and its
//! workers (`KvoffloadWorker` with `kvo_pool`).
//!
//! A `Pool` is one process's handle on a pool's words: it joins the engine
//! table once (as the owner, rank 0's worker; as another rank's worker; or
//! as the scheduler), then every call acts as that engine (its index is
//! the bit of its holds and the writer field of its claims). Keys are
//! vLLM's `OffloadKey`s: the block hash (1 - 32 bytes) then the group index
//! as 4 big-endian bytes.
//!
//! Every call is a few compare-and-swaps on the mapping, made with the GIL
//! held (microseconds; releasing the GIL would cost more). The one wait,
//! a member joining an entry its owner has not made yet, polls with a
//! deadline, releases the GIL between polls and checks Python's signals
//! (Ctrl-C raises the handler's exception). Every entry point runs inside
//! [`guarded`]: no Rust panic crosses into Python.
//!
//! Files: this one (the class), `pool_words.rs` (where the words live:
//! a pool file, or in-process words for tests), `pool_args.rs` (arguments
//! from Python, and the pool file's waits).

use std::time::Instant;

use kvoffload::internal::pool::closing::PoolWord;
use kvoffload::internal::pool::file::admin::Closed;
use kvoffload::internal::pool::file::liveness::member_of_self;
use kvoffload::internal::pool::file::{PoolFile, PoolOptions, PoolSpec};
use kvoffload::internal::pool::fingerprint::{HashingRecord, LayoutRecord};
use kvoffload::internal::pool::slot::{SlotError, MAX_ENGINES};
use kvoffload::internal::pool::sweep::{JoinError, Lease};
use kvoffload::internal::pool::table::{Lookup, Placement, PoolTable};
use kvoffload::internal::pool::words::{Geometry, Member, PoolWords};
use kvoffload::RankSlots;
use pyo3::types::{PyBytes, PyList};

use super::pool_args::*;
pub(crate) use super::pool_words::{AnyWords, LocalPool};
use super::*;

/// This process's place in the engine table, once joined.
#[derive(Clone, Copy)]
struct Joined {
    lease: Lease,
    /// 0 the scheduler, `1 + r` rank `r`'s worker.
    member: u8,
}

/// A process's handle on a node pool (see the module docs).
#[pyclass(name = "Pool", module = "kvoffload", frozen)]
pub(crate) struct PyPool {
    table: PoolTable<AnyWords>,
    /// This process's record (pid, start time, pid namespace).
    me: Member,
    name: String,
    path: Option<String>,
    joined: Mutex<Option<Joined>>,
}

impl PyPool {
    pub(crate) fn new(words: AnyWords, me: Member, name: String, path: Option<String>) -> PyPool {
        PyPool { table: PoolTable::new(words), me, name, path, joined: Mutex::new(None) }
    }

    pub(crate) fn words(&self) -> &AnyWords {
        self.table.words()
    }

    pub(crate) fn me(&self) -> Member {
        self.me
    }

    fn file(&self, py: Python<'_>, call: &str) -> PyResult<&Arc<PoolFile>> {
        match self.words() {
            AnyWords::Shm(f) => Ok(f),
            AnyWords::Local(_) => Err(errors::options(py, format!("Pool.{call}: an in-process pool has no file"))),
        }
    }

    fn joined(&self) -> Option<Joined> {
        *self.joined.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine index this process acts as, or a `PoolError` saying it
    /// has not joined.
    fn acting(&self, py: Python<'_>, call: &str) -> PyResult<u8> {
        self.joined().map(|j| j.lease.engine).ok_or_else(|| {
            errors::pool_other(
                py,
                format!("Pool.{call}: this process has not joined the pool {:?} (call join first)", self.name),
                "not_joined",
            )
        })
    }

    fn slots_epochs(py: Python<'_>, slots: &Bound<'_, PyAny>, epochs: &Bound<'_, PyAny>) -> PyResult<Vec<(u32, u32)>> {
        let s = parse_ids(py, "a slot", slots)?;
        let e = parse_ids(py, "an epoch", epochs)?;
        if s.len() != e.len() {
            return Err(errors::options(py, format!("{} slots and {} epochs: one epoch per slot", s.len(), e.len())));
        }
        s.into_iter()
            .zip(e)
            .map(|(s, e)| {
                let s = u32::try_from(s).map_err(|_| errors::options(py, format!("slot {s} is past 2**32")))?;
                let e = u32::try_from(e).map_err(|_| errors::options(py, format!("epoch {e} is past 2**32")))?;
                Ok((s, e))
            })
            .collect()
    }

    /// The agreement words (P7) of this process's engine for the offloader
    /// of rank `rank` (`Offloader(..., agreement=pool)`; see
    /// [`super::pool_words::agreement_slots`]).
    pub(crate) fn agreement_slots(&self, py: Python<'_>, rank: usize) -> PyResult<Arc<dyn RankSlots>> {
        let joined = self.joined().map(|j| (j.lease.engine, j.member));
        super::pool_words::agreement_slots(py, self.words(), &self.name, joined, rank)
    }

    fn slot_err(&self, py: Python<'_>, call: &str, slot: u32, epoch: u32, e: SlotError) -> PyErr {
        errors::pool_slot(py, format!("Pool.{call}: slot {slot} (epoch {epoch}) of pool {:?}: {e}", self.name), &e)
    }
}

#[pymethods]
impl PyPool {
    /// Opens pool `name` in `dir` (a tmpfs or hugetlbfs mount; default
    /// /dev/shm), waiting at most `timeout` seconds (interruptible) for a
    /// creator under way, and checks `config` (the fingerprint's config
    /// part: a `PoolMismatchError` names the first field that differs).
    /// With `create` (a dict: `slots`, `ways`, `ranks`, `row_bytes`), a
    /// pool that does not exist is created with that shape (an existing
    /// one keeps its own; its ranks must match); without it, a missing
    /// pool is a `PoolError` of kind `"missing"`.
    #[staticmethod]
    #[pyo3(signature = (name, *, config, dir = None, create = None, timeout = 30.0))]
    fn open(
        py: Python<'_>,
        name: &str,
        config: &Bound<'_, PyDict>,
        dir: Option<String>,
        create: Option<&Bound<'_, PyDict>>,
        timeout: f64,
    ) -> PyResult<PyPool> {
        guarded(py, || {
            let config = parse_config(py, config)?;
            let opts = PoolOptions::in_dir(dir.unwrap_or_else(|| kvoffload::DEFAULT_SHM_DIR.to_string()));
            let file = match create {
                Some(c) => {
                    let get = |k: &str| -> PyResult<u64> {
                        c.get_item(k)?
                            .ok_or_else(|| errors::options(py, format!("Pool.open: create has no {k:?}")))?
                            .extract()
                            .map_err(|_| errors::options(py, format!("Pool.open: create[{k:?}] must be an int >= 0")))
                    };
                    let small = |k: &str, v: u64| -> PyResult<u32> {
                        u32::try_from(v).map_err(|_| errors::options(py, format!("Pool.open: create[{k:?}] = {v}")))
                    };
                    let geometry = Geometry {
                        slots: small("slots", get("slots")?)?,
                        ways: small("ways", get("ways")?)?,
                        ranks: u8::try_from(get("ranks")?)
                            .map_err(|_| errors::options(py, "Pool.open: create['ranks'] must be 1 to 32"))?,
                        engines: MAX_ENGINES,
                    };
                    let spec = PoolSpec { geometry, row_bytes: get("row_bytes")?, config };
                    waiting(py, timeout, |w| PoolFile::open_or_create(name, &spec, &opts, w))?.0
                }
                None => {
                    let file = waiting(py, timeout, |w| PoolFile::open(name, &opts, w))?;
                    file.check_config(&config).map_err(|e| errors::pool_file(py, e))?;
                    file
                }
            };
            let me = member_of_self().map_err(|e| {
                errors::pool_other(py, format!("Pool.open: this process's record (/proc/self): {e}"), "io")
            })?;
            let path = file.path().display().to_string();
            Ok(PyPool::new(AnyWords::Shm(Arc::new(file)), me, name.to_string(), Some(path)))
        })
    }

    /// Removes pool `name` from `dir` (`kvoffload pool rm`): its data
    /// files, header file and index, each only if it still names the file
    /// checked (trusted, inode-checked). Refused (`PoolError` of kind
    /// `"in_use"`, naming the live engines' pids) while an engine lives,
    /// unless `force` (running engines keep their mappings). Returns the
    /// paths removed.
    #[staticmethod]
    #[pyo3(signature = (name, *, dir = None, force = false))]
    fn remove(py: Python<'_>, name: &str, dir: Option<String>, force: bool) -> PyResult<Vec<String>> {
        guarded(py, || {
            let dir = std::path::PathBuf::from(dir.unwrap_or_else(|| kvoffload::DEFAULT_SHM_DIR.to_string()));
            let removed = py
                .detach(|| kvoffload::internal::pool::file::remove(&dir, name, force))
                .map_err(|e| errors::pool_file(py, e))?;
            Ok(removed.files.iter().map(|p| p.display().to_string()).collect())
        })
    }

    /// A worker's check of its rank's layout (design 1.3): fills rank
    /// `rank`'s layout part with `page_sizes` (its canonical tensors'
    /// `page_size_bytes`, in order) if unset, else compares
    /// (`PoolMismatchError`). Whether this call filled it.
    #[pyo3(signature = (rank, page_sizes, timeout = 30.0))]
    fn ensure_layout(&self, py: Python<'_>, rank: u8, page_sizes: Vec<u64>, timeout: f64) -> PyResult<bool> {
        guarded(py, || {
            let file = self.file(py, "ensure_layout")?;
            let record = LayoutRecord { page_sizes };
            waiting(py, timeout, |w| file.ensure_layout(rank, &record, w))
        })
    }

    /// A scheduler's check of the block hashes (design 1.2, 1.3): fills
    /// the hashing part (`algorithm`, `none_hash`, Python's `(major,
    /// minor)` where the algorithm pickles, else None) if unset, else
    /// compares (`PoolMismatchError`). Whether this call filled it.
    #[pyo3(signature = (algorithm, none_hash, python = None, timeout = 30.0))]
    fn ensure_hashing(
        &self,
        py: Python<'_>,
        algorithm: &str,
        none_hash: Vec<u8>,
        python: Option<(u8, u8)>,
        timeout: f64,
    ) -> PyResult<bool> {
        guarded(py, || {
            let file = self.file(py, "ensure_hashing")?;
            let record = HashingRecord::new(algorithm, &none_hash, python).map_err(|e| errors::pool_file(py, e))?;
            waiting(py, timeout, |w| file.ensure_hashing(&record, w))
        })
    }

    /// Bytes of a row on one rank (None for an in-process pool).
    #[getter]
    fn row_bytes(&self) -> Option<u64> {
        match self.words() {
            AnyWords::Shm(f) => Some(f.row_bytes()),
            AnyWords::Local(_) => None,
        }
    }

    /// The pool's name.
    #[getter]
    fn name(&self) -> String {
        self.name.clone()
    }

    /// The pool's index file (None for an in-process pool).
    #[getter]
    fn path(&self) -> Option<String> {
        self.path.clone()
    }

    /// Slots (rows of the data, records of the index).
    #[getter]
    fn slots(&self) -> u32 {
        self.table.geometry().slots
    }

    /// Slots per set.
    #[getter]
    fn ways(&self) -> u32 {
        self.table.geometry().ways
    }

    /// Ranks of every engine on the pool.
    #[getter]
    fn ranks(&self) -> u8 {
        self.table.geometry().ranks
    }

    /// Engine entries.
    #[getter]
    fn engines(&self) -> u8 {
        self.table.geometry().engines
    }

    /// The engine index this process acts as (None before `join`).
    #[getter]
    fn engine(&self) -> Option<u8> {
        self.joined().map(|j| j.lease.engine)
    }

    /// This process's member index (0 the scheduler, `1 + r` rank `r`'s
    /// worker), None before `join`.
    #[getter]
    fn member(&self) -> Option<u8> {
        self.joined().map(|j| j.member)
    }

    /// This process's pid as the pool records it.
    #[getter]
    fn pid(&self) -> u32 {
        self.me.pid
    }

    /// Joins the engine `engine_id` (vLLM's, the same in every process of
    /// the engine): `rank=0` is rank 0's worker, which sweeps dead entries
    /// and claims a free entry (the owner); another rank's worker, or the
    /// scheduler (`rank=None`), registers with the live entry whose owner
    /// wrote `engine_id`, waiting for it at most `timeout` seconds
    /// (interruptible). Returns the engine index. Once per `Pool`. A pool
    /// being removed is raised with kind "closing" (for every member):
    /// open the name again.
    #[pyo3(signature = (engine_id, rank = None, timeout = 30.0))]
    fn join(&self, py: Python<'_>, engine_id: &str, rank: Option<u32>, timeout: f64) -> PyResult<u8> {
        guarded(py, || {
            if let Some(j) = self.joined() {
                return Err(errors::pool_other(
                    py,
                    format!("Pool.join: this process already joined pool {:?} as engine {}", self.name, j.lease.engine),
                    "already_joined",
                ));
            }
            let ranks = u32::from(self.table.geometry().ranks);
            let member = match rank {
                None => 0u8,
                Some(r) if r < ranks => (1 + r) as u8,
                Some(r) => {
                    return Err(errors::options(py, format!("Pool.join: rank {r} of a pool of {ranks} ranks")));
                }
            };
            let id = engine_digest(py, engine_id)?;
            let deadline = seconds(py, "timeout", Some(timeout))?.map(|d| Instant::now() + d);
            let lease = if member == 1 {
                // A tentative close met (`pool::closing` rule 1): the join
                // was left; tried again once the closer decided. A removal
                // is raised (kind "closing"): open the pool again.
                let mut pause = Duration::from_millis(1);
                loop {
                    match self.table.join_owner(member, &self.me, &id) {
                        Ok(lease) => break lease,
                        Err(JoinError::Closing { word })
                            if !PoolWord::decode(word).is_removing() && deadline.is_none_or(|d| Instant::now() < d) => {
                        }
                        Err(e) => return Err(errors::pool_join(py, &self.name, e)),
                    }
                    py.detach(|| std::thread::sleep(pause));
                    py.check_signals()?;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
            } else {
                let mut pause = Duration::from_millis(1);
                loop {
                    // A tentative close met: the join was left, polled
                    // again; a removal is raised (kind "closing"), as the
                    // owner's is.
                    match self.table.join_member(member, &self.me, &id) {
                        Ok(Some(lease)) => break lease,
                        Ok(None) => {}
                        Err(JoinError::Closing { word }) if !PoolWord::decode(word).is_removing() => {}
                        Err(e) => return Err(errors::pool_join(py, &self.name, e)),
                    }
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(errors::pool_other(
                            py,
                            format!(
                                "Pool.join: pool {:?}: no live engine entry for engine_id {engine_id:?} after \
                                 {timeout} s (its rank 0 worker joins first)",
                                self.name
                            ),
                            "timeout",
                        ));
                    }
                    // Poll again after a pause (the GIL released), and let a
                    // signal handler raise meanwhile.
                    py.detach(|| std::thread::sleep(pause));
                    py.check_signals()?;
                    pause = (pause * 2).min(Duration::from_millis(20));
                }
            };
            *self.joined.lock().unwrap_or_else(|p| p.into_inner()) = Some(Joined { lease, member });
            Ok(lease.engine)
        })
    }

    /// Leaves the engine table: this process's member bit is cleared; the
    /// last member to leave reclaims the entry's marks (its holds and
    /// unfinished writes) and frees it. Idempotent.
    fn leave(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            let j = self.joined.lock().unwrap_or_else(|p| p.into_inner()).take();
            let Some(j) = j else { return Ok(()) };
            self.table.leave(j.lease, j.member, &self.me).map_err(|e| errors::pool_join(py, &self.name, e))
        })
    }

    /// Removes the pool if no engine is registered on it any more
    /// (`kvo_pool_keep: false`: the last engine to leave removes it), by the
    /// closing protocol (`pool::closing`): a joiner at the same time either
    /// keeps it or opens a fresh one. Call after `leave`. Returns the paths
    /// removed, or None when the pool stays (an engine is registered) or
    /// another process removes it; waits at most `timeout` seconds for
    /// another closer deciding.
    #[pyo3(signature = (timeout = 10.0))]
    fn close_if_unused(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<Vec<String>>> {
        guarded(py, || {
            if self.joined().is_some() {
                return Err(errors::pool_other(
                    py,
                    format!("Pool.close_if_unused: pool {:?}: this process is still joined (leave first)", self.name),
                    "still_joined",
                ));
            }
            let file = self.file(py, "close_if_unused")?.clone();
            // Interruptible: a worker's shutdown answers Ctrl-C here.
            let closed = waiting(py, timeout, |wait| file.close_and_remove(false, wait))?;
            Ok(match closed {
                // Files already gone: another closer removed them.
                Closed::Removed(r) if r.files.is_empty() => None,
                Closed::Removed(r) => Some(r.files.iter().map(|p| p.display().to_string()).collect()),
                Closed::InUse(_) | Closed::ByAnother(_) => None,
            })
        })
    }

    /// Sweeps every dead engine entry (design 3.6): their holds are
    /// cleared, their unfinished writes freed (never published), the
    /// entries freed. Returns the entries freed.
    fn sweep(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        guarded(py, || {
            let freed = self
                .table
                .sweep_dead(&self.me, &mut |_| true)
                .map_err(|e| errors::pool_slot(py, format!("Pool.sweep: pool {:?}: {e}", self.name), &e))?;
            // As ints (a Vec<u8> would be bytes in Python).
            Ok(freed.into_iter().map(u32::from).collect())
        })
    }

    /// Looks each key up and holds it where readable (design 3.1): per key
    /// `("hit", slot, epoch, fresh)` (held by this engine now; `fresh` when
    /// this call set the engine's bit, false when the engine held it
    /// already), `("pending", -1, -1, False)` (being written by this
    /// engine) or `("miss", -1, -1, False)`.
    fn lookup<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        guarded(py, || {
            let engine = self.acting(py, "lookup")?;
            let keys = parse_keys_of(py, keys)?;
            let out = PyList::empty(py);
            for k in &keys {
                let r = self
                    .table
                    .lookup(engine, k)
                    .map_err(|e| errors::pool_slot(py, format!("Pool.lookup: pool {:?}: {e}", self.name), &e))?;
                match r {
                    Lookup::Hit { slot, epoch, fresh } => {
                        out.append(("hit", i64::from(slot), i64::from(epoch), fresh))?
                    }
                    Lookup::Pending => out.append(("pending", -1i64, -1i64, false))?,
                    Lookup::Miss => out.append(("miss", -1i64, -1i64, false))?,
                }
            }
            Ok(out)
        })
    }

    /// Claims a slot for each key (design 3.3, 3.5): per key
    /// `("claimed", slot, epoch, evicted)` (this engine writes the slot at
    /// that epoch; `evicted` the key whose readable slot the claim took, or
    /// None), `("present", -1, -1, None)` (readable or being written
    /// already) or `("skipped", -1, -1, None)` (neither of its two sets
    /// has a claimable slot: every slot held or being written).
    fn claim<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
        guarded(py, || {
            let engine = self.acting(py, "claim")?;
            let keys = parse_keys_of(py, keys)?;
            let out = PyList::empty(py);
            let none = py.None();
            for k in &keys {
                let r = self
                    .table
                    .claim(engine, k)
                    .map_err(|e| errors::pool_slot(py, format!("Pool.claim: pool {:?}: {e}", self.name), &e))?;
                match r {
                    Placement::Claimed { slot, epoch, evicted } => {
                        let ev: Py<PyAny> = match evicted {
                            Some(k) => PyBytes::new(py, &key_bytes(&k)).into_any().unbind(),
                            None => none.clone_ref(py),
                        };
                        out.append(("claimed", i64::from(slot), i64::from(epoch), ev))?
                    }
                    Placement::Present => out.append(("present", -1i64, -1i64, none.clone_ref(py)))?,
                    Placement::Skipped => out.append(("skipped", -1i64, -1i64, none.clone_ref(py)))?,
                }
            }
            Ok(out)
        })
    }

    /// Ends this engine's hold of each slot at its epoch (its bit cleared:
    /// the engine's last private hold of it ended).
    fn release(&self, py: Python<'_>, slots: &Bound<'_, PyAny>, epochs: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let engine = self.acting(py, "release")?;
            for (s, e) in Self::slots_epochs(py, slots, epochs)? {
                self.table.release(engine, s, e).map_err(|x| self.slot_err(py, "release", s, e, x))?;
            }
            Ok(())
        })
    }

    /// Before a load is submitted (design 3.2): raises `PoolStateError`
    /// unless every slot is readable at its epoch and held by this engine.
    fn check_held(&self, py: Python<'_>, slots: &Bound<'_, PyAny>, epochs: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let engine = self.acting(py, "check_held")?;
            for (s, e) in Self::slots_epochs(py, slots, epochs)? {
                self.table.check_held(engine, s, e).map_err(|x| self.slot_err(py, "check_held", s, e, x))?;
            }
            Ok(())
        })
    }

    /// Before a store is submitted (design 3.3): raises `PoolStateError`
    /// unless every slot is being written by this engine at its epoch.
    fn check_writing(&self, py: Python<'_>, slots: &Bound<'_, PyAny>, epochs: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            let engine = self.acting(py, "check_writing")?;
            for (s, e) in Self::slots_epochs(py, slots, epochs)? {
                self.table.check_writing(engine, s, e).map_err(|x| self.slot_err(py, "check_writing", s, e, x))?;
            }
            Ok(())
        })
    }

    /// Rank `rank`'s bytes of each slot are complete (design 3.3 step 2):
    /// its bit is set; the last rank's publishes the slot. Returns, per
    /// slot, whether this call published it.
    fn complete_rank(
        &self,
        py: Python<'_>,
        slots: &Bound<'_, PyAny>,
        epochs: &Bound<'_, PyAny>,
        rank: u8,
    ) -> PyResult<Vec<bool>> {
        guarded(py, || {
            let engine = self.acting(py, "complete_rank")?;
            let mut out = Vec::new();
            for (s, e) in Self::slots_epochs(py, slots, epochs)? {
                out.push(
                    self.table
                        .complete_rank(engine, s, e, rank)
                        .map_err(|x| self.slot_err(py, "complete_rank", s, e, x))?,
                );
            }
            Ok(out)
        })
    }

    /// Abandons this engine's write of each slot at its epoch (back to
    /// free, its partial bytes never visible); a slot already readable at
    /// that epoch stays so. Returns, per slot, whether it was abandoned.
    fn abandon(&self, py: Python<'_>, slots: &Bound<'_, PyAny>, epochs: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        guarded(py, || {
            let engine = self.acting(py, "abandon")?;
            let mut out = Vec::new();
            for (s, e) in Self::slots_epochs(py, slots, epochs)? {
                out.push(self.table.abandon(engine, s, e).map_err(|x| self.slot_err(py, "abandon", s, e, x))?);
            }
            Ok(out)
        })
    }

    /// Marks each slot recently used (its CLOCK bit: a second chance).
    fn touch(&self, py: Python<'_>, slots: &Bound<'_, PyAny>) -> PyResult<()> {
        guarded(py, || {
            for s in parse_ids(py, "a slot", slots)? {
                if let Ok(s) = u32::try_from(s) {
                    self.table.touch(s);
                }
            }
            Ok(())
        })
    }

    /// Slots by state: `{"free", "writing", "readable", "held", "corrupt"}`
    /// (`held`: readable slots some engine holds, counted in `readable`).
    fn census<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        guarded(py, || {
            let c = self.table.census();
            let d = PyDict::new(py);
            d.set_item("free", c.free)?;
            d.set_item("writing", c.writing)?;
            d.set_item("readable", c.readable)?;
            d.set_item("held", c.held)?;
            d.set_item("corrupt", c.corrupt)?;
            Ok(d)
        })
    }

    /// The invariants of a quiescent pool (design 3.9): raises
    /// `PoolStateError` naming the first slot that breaks one.
    fn check(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            self.table.check().map_err(|(slot, e)| {
                errors::pool_slot(py, format!("Pool.check: pool {:?}: slot {slot}: {e}", self.name), &e)
            })
        })
    }

    /// The key `slot` holds (vLLM's `OffloadKey` form), None for a free
    /// slot (tests, `pool ls`; not stable unless the caller holds it).
    fn slot_key<'py>(&self, py: Python<'py>, slot: u32) -> PyResult<Option<Bound<'py, PyBytes>>> {
        guarded(py, || {
            if slot >= self.table.geometry().slots {
                return Err(errors::options(py, format!("slot {slot} of a pool of {} slots", self.slots())));
            }
            let w = self.table.words().slot_load(slot as usize);
            if (w >> 32) & 3 == 0 {
                return Ok(None);
            }
            Ok(Some(PyBytes::new(py, &key_bytes(&self.table.words().key_load(slot as usize)))))
        })
    }

    /// The raw state word of `slot` (tests, `pool ls`).
    fn slot_word(&self, py: Python<'_>, slot: u32) -> PyResult<u64> {
        guarded(py, || {
            if slot >= self.table.geometry().slots {
                return Err(errors::options(py, format!("slot {slot} of a pool of {} slots", self.slots())));
            }
            Ok(self.table.words().slot_load(slot as usize))
        })
    }

    fn __repr__(&self) -> String {
        let g = self.table.geometry();
        let who = match self.joined() {
            Some(j) => format!("engine {} member {}", j.lease.engine, j.member),
            None => "not joined".into(),
        };
        format!(
            "kvoffload.Pool({:?}: {} slots of {} ways, {} ranks, {} engines; {who})",
            self.name, g.slots, g.ways, g.ranks, g.engines
        )
    }
}
