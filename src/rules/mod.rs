//! The seam between the shipped protocol and its negative models: the
//! [`Rules`] a party runs at each place a negative model changes.
//!
//! Each negative model (N1-N38, docs/PROOFS.md) runs the library with one
//! rule broken, to show that its model catches the break. The breaks do not
//! live in the production paths: at each place a negative changes, the
//! production code calls a method of [`Rules`], named after the rule it
//! keeps, whose *provided* body is the shipped behaviour. The production code
//! hands the method the operations the rule is about (as closures: the steps
//! it orders, the fact it decides on) and the method runs them the shipped
//! way: every step, in the shipped order. A negative overrides the one method
//! it breaks and runs the same operations the bad way (steps reordered or
//! skipped, a decision taken otherwise); every other method keeps the shipped
//! body. Where a negative needs an operation the shipped rule never runs
//! (N13's early publish, N28's "every slice taken", N9's admission outside
//! the gate), the call site hands it over too, named for what it does, never
//! for the negative; the shipped body does not call it.
//!
//! Which rules run:
//!
//! - Outside model builds, [`Active`] is [`Shipped`], a zero-sized type that
//!   overrides nothing: every call is the provided body, inlined, and no
//!   negative's code is compiled.
//! - In the model builds (`--cfg loom`, `--cfg shuttle`), [`Active`] is
//!   [`negatives::Variant`], the model-build-only enum of the negatives,
//!   whose `impl Rules` overrides, per variant, the method it breaks;
//!   `Variant::Production` overrides nothing. A model selects one with
//!   `Coordinator::set_variant` (or `Prefaulter::set_variant`).
//!
//! A party finds the rules it runs through a [`Knob`] (the coordinator's,
//! shared with nothing; a runtime handle's, in its `GateBinding`) or a field
//! of type [`Active`] (the pre-fault pool's, under its lock): a `Knob` holds
//! nothing outside model builds, and the variant in them. The seam depends on
//! nothing in the crate, so every layer may call it, the runtime's included.
//!
//! The methods are grouped by the layer that calls them; each says the
//! property it keeps and the negative that breaks it.

#[cfg(any(loom, shuttle))]
pub mod negatives;

/// The rules a party runs at each place a negative model changes; the
/// provided bodies are the shipped behaviour (see the module docs). Only
/// [`Shipped`] and, in the model builds, [`negatives::Variant`] implement
/// it.
pub(crate) trait Rules {
    // ---- the runtime: which gates a handle admits (P1) ----

    /// A runtime handle admits a gate only of the coordinator bound to it:
    /// the answer is `bound` (whether `gate` is one of the bound
    /// coordinator's). N27 admits every gate.
    fn admits_gate(&self, bound: impl FnOnce() -> bool) -> bool {
        bound()
    }

    // ---- protocol: the coordinator's windows and library calls (P1, P3, P6) ----

    /// Capture windows and capture-unsafe library calls exclude each
    /// other (P1): a window opens, a library call starts, a call inside
    /// the caller's own window goes on (rather than be refused: it would
    /// wait for itself), only when `clear` says the other side is clear.
    /// N1 (upstream's design, no capture window) finds it always clear.
    fn windows_exclude_calls(&self, clear: impl FnOnce() -> bool) -> bool {
        clear()
    }

    /// A capture-unsafe call under the gate ends on unwinding too (P6):
    /// `arm` arms the guard that ends it (drops its count, hands windows
    /// the turn) should the call panic. N37 does not arm it.
    fn unwinding_call_ends(&self, arm: impl FnOnce()) {
        arm()
    }

    /// The completion poller's try at a capture-unsafe call never runs
    /// past a window (P1): it is refused when `busy` (a window open,
    /// about to open, or the caller's). N3 is never refused.
    fn poller_respects_gate(&self, busy: impl FnOnce() -> bool) -> bool {
        busy()
    }

    /// The gather kernel gets a chunk's device alias only while the chunk
    /// is registered (P3): the alias is `alias` (`None`: the chunk is not
    /// registered, none is handed out); `host_address` (the chunk's host
    /// address posing as an alias) is not run. N4 hands it out for an
    /// unregistered chunk.
    fn alias_needs_registration<A>(&self, alias: Option<A>, _host_address: impl FnOnce() -> A) -> Option<A> {
        alias
    }

    // ---- protocol: the coordinator's wake-ups and turns (P6) ----

    /// A guard's release (a window, a job ticket, a graph token, an
    /// alias, the end of a gated call) wakes every waiter: `wake` runs
    /// after the state changed. N17 forgets it.
    fn release_wakes(&self, wake: impl FnOnce()) {
        wake()
    }

    /// A closing window hands the turn to a waiting library call, so
    /// windows back to back cannot starve pinning: `hand` runs. N16 keeps
    /// the turn.
    fn closing_window_hands_turn(&self, hand: impl FnOnce()) {
        hand()
    }

    /// An interruptible wait whose check said to go on starts a new slice
    /// (the check is called at most once per slice): `start` runs. N34
    /// starts none, so the check runs on every turn of the loop.
    fn interrupt_check_starts_slice(&self, start: impl FnOnce()) {
        start()
    }

    // ---- protocol: the coordinator's pinning (P2, P6) ----

    /// A chunk's registration waits while pinning is held back (an
    /// engine's capture phase): the answer is `held`. N31 ignores the
    /// holds.
    fn registration_heeds_hold(&self, held: impl FnOnce() -> bool) -> bool {
        held()
    }

    /// A wait for pinning inside the caller's own window, pinning not
    /// final, is refused with a typed error (it would never return under
    /// Interleave): refused when `inside`. N6 waits (and hangs).
    fn refuses_pin_wait_in_own_window(&self, inside: impl FnOnce() -> bool) -> bool {
        inside()
    }

    // ---- protocol: the coordinator's shutdown steps (P4) ----

    /// A refused shutdown changes nothing: pinning is asked to stop only
    /// once shutdown is accepted, so `cancel_early` (the cancel, before
    /// the refusal's checks) is not run. N25 runs it.
    fn refusal_changes_nothing(&self, _cancel_early: impl FnOnce()) {}

    /// Shutdown is refused while a registered graph lives (it may be
    /// replayed and read the region): refused when `live`. N5 ignores
    /// the graphs.
    fn shutdown_refuses_live_graphs(&self, live: impl FnOnce() -> bool) -> bool {
        live()
    }

    /// The drain waits for every admitted job's ticket before anything is
    /// unregistered: `wait` (the wait, on the coordinator's guard `g`)
    /// runs and its guard is returned. N2 does not wait.
    fn drain_waits_for_jobs<G>(&self, g: G, wait: impl FnOnce(G) -> G) -> G {
        wait(g)
    }

    /// The drain waits for pinning to settle before anything is
    /// unregistered (a registration in flight completes first): `wait`
    /// runs on `g` as for [`Rules::drain_waits_for_jobs`]. N10 does not
    /// wait.
    fn drain_waits_for_pinning<G>(&self, g: G, wait: impl FnOnce(G) -> G) -> G {
        wait(g)
    }

    // ---- protocol: the shutdown order (P4) ----

    /// Shutdown drains the admitted jobs and lets pinning settle before it
    /// unregisters any chunk: `drain`, `settle_pinning`, then `unregister`
    /// (whose result is returned). N24 unregisters first.
    fn drain_then_unregister<R>(
        &self,
        drain: impl FnOnce(),
        settle_pinning: impl FnOnce(),
        unregister: impl FnOnce() -> R,
    ) -> R {
        drain();
        settle_pinning();
        unregister()
    }

    // ---- pin: rollback (P8), the ranks' agreement (P7) ----

    /// A rollback unregisters every chunk registered so far, the last
    /// first: `unregister(j)` for `j` in `registered - 1 ..= 0`. N7 undoes
    /// only the last one.
    fn roll_back_all(&self, registered: usize, unregister: impl FnMut(usize)) {
        (0..registered).rev().for_each(unregister);
    }

    /// Nothing of a rank's own pinning is published before the ranks
    /// agreed: `agree` gets this rank's outcome (`pinned`) and its result is
    /// returned; `publish_pinned` (this rank's "pinned", published on its
    /// own) is not run. N13 runs it first when `pinned`.
    fn agree_before_publishing<M>(
        &self,
        pinned: bool,
        _publish_pinned: impl FnOnce(),
        agree: impl FnOnce(bool) -> M,
    ) -> M {
        agree(pinned)
    }

    /// A rank's wait in the agreement ends when its own pinning is
    /// cancelled (a shutdown during the agreement): the answer is
    /// `cancelled`. N23 ignores it.
    fn agreement_heeds_cancel(&self, cancelled: bool) -> bool {
        cancelled
    }

    // ---- pin: the pre-fault pool (F1) ----

    /// An `ensure` of a chunk hinted before takes the hint's job: the
    /// job is `find`'s (`None`: not hinted, a new one is queued). N29
    /// forgets the hint.
    fn ensure_takes_hint<J>(&self, find: impl FnOnce() -> Option<J>) -> Option<J> {
        find()
    }

    /// An `ensure` waits until every slice of its chunk was faulted: the
    /// chunk is unfinished while `unfaulted` says so; `untaken` (some slice
    /// still queued, not yet taken by a worker) is not asked. N28 waits only
    /// while `untaken`.
    fn ensure_waits_for_faulting(&self, unfaulted: impl FnOnce() -> bool, _untaken: impl FnOnce() -> bool) -> bool {
        unfaulted()
    }

    // ---- transfer: submission (P1), the staged backend (P5) ----

    /// A job's submission checks the compute stream and records its
    /// ordering event inside the coordinator's gate: `admit_in_gate` runs
    /// `accept` (the check, the record, the enqueue) on the ticket inside
    /// the gate and its result is returned; `admit` (a ticket with no gate)
    /// is not run. N9 admits with `admit` and accepts outside the gate
    /// (check-then-act), a refusal of `admit` being the result.
    fn accept_inside_gate<T, R, A: Fn(T) -> R>(
        &self,
        accept: A,
        _admit: impl FnOnce() -> Result<T, R>,
        admit_in_gate: impl FnOnce(&A) -> R,
    ) -> R {
        admit_in_gate(&accept)
    }

    /// A staged job's completion event covers its staging streams: each
    /// stream `b` the job used is joined back (`join(b)`) before the event
    /// is recorded. N14 joins none.
    fn join_staging_streams(&self, used: &[usize], join: impl FnMut(&usize)) {
        used.iter().for_each(join);
    }

    // ---- offloader: the capture hook (P1, P6) ----

    /// A capture hook's abort closes the window its begin opened: `close`
    /// runs and its result is returned. N22 keeps the window open.
    fn abort_closes_window<E>(&self, close: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        close()
    }

    /// A hook's close submits the deferred jobs only once its window is
    /// closed (on the closing thread, outside every window), so
    /// `flush_early` (the flush on the hook's guard `g`, inside the window)
    /// is not run and `g` is returned as it is. N21 runs it.
    fn hook_flushes_after_close<G>(&self, g: G, _flush_early: impl FnOnce(G) -> G) -> G {
        g
    }

    /// A hook's close, an abort's (`abort`) as an end's, submits the
    /// deferred jobs when it closed the last hook window: `flush` runs and
    /// its result is returned. N35 skips it for an abort.
    fn hook_close_flushes<E>(&self, _abort: bool, flush: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        flush()
    }

    /// A hook begin refused or interrupted before its window opened
    /// submits the jobs deferred behind its request (as a close would,
    /// never waiting): `flush` runs. N33 leaves them queued.
    fn refused_begin_flushes(&self, flush: impl FnOnce()) {
        flush()
    }

    /// The hook's flush, refused by an engine's window, waits for that
    /// window only until a window is requested after it began waiting (a
    /// hook window that begins meanwhile takes the rest over): `wait` gets
    /// `Some(since)` (the coordinator's request count when it began) and
    /// its result is returned. N30 passes `None`: it waits until no window
    /// at all is open.
    fn flush_wait_ends_at_request<S, R>(&self, since: S, wait: impl FnOnce(Option<S>) -> R) -> R {
        wait(Some(since))
    }

    /// A wait for a deferred job is refused to the thread that holds the
    /// hook window the job waits behind (it would wait for its own
    /// close): refused when `own`. N36 waits.
    fn refuses_wait_for_own_deferred(&self, own: impl FnOnce() -> bool) -> bool {
        own()
    }

    // ---- offloader: jobs, keys and slots (P5) ----

    /// A slot job is refused while a job in flight conflicts with it on
    /// one of its slots: `check` runs and its result is returned. N26
    /// skips it.
    fn checks_busy_slots<E>(&self, check: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        check()
    }

    /// A store's keys become readable when the store completed, not when
    /// it was submitted: `mark_readable_now` is not run. N18 runs it at
    /// submission.
    fn readable_at_completion(&self, _mark_readable_now: impl FnOnce()) {}

    /// A load's keys keep their slots until the load is reported:
    /// `free_now` (the release at submission) is not run. N19 runs it.
    fn slots_held_until_load_done(&self, _free_now: impl FnOnce()) {}

    /// A store refused at submission changes nothing: `undo` takes its
    /// evictions back with its placed keys (on `book`); `drop_placed`
    /// (the placed keys dropped, the evictions kept) is not run. N38 runs
    /// `drop_placed` instead.
    fn refused_store_undoes_evictions<B>(&self, book: B, undo: impl FnOnce(B), _drop_placed: impl FnOnce(B)) {
        undo(book)
    }

    // ---- offloader: its shutdown order (P4) ----

    /// The offloader's shutdown asks the coordinator (which may refuse)
    /// before it tears anything down: `refuse` (the hook quiesced, the
    /// coordinator closed) and, once it accepted, `teardown` (the drain,
    /// the transfer engine dropped); `refuse_late` (the coordinator asked
    /// after the teardown, the offloader's tensors freed on a refusal) is
    /// not run. N15 runs `teardown`, then `refuse_late`.
    fn refuses_before_teardown<E>(
        &self,
        refuse: impl FnOnce() -> Result<(), E>,
        teardown: impl FnOnce() -> Result<(), E>,
        _refuse_late: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        refuse()?;
        teardown()
    }

    /// The offloader's shutdown polls its jobs to completion (each
    /// reported to the block manager) before it drops the transfer
    /// engine: `drain` runs and its result is returned. N20 skips it.
    fn offloader_drains<E>(&self, drain: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        drain()
    }

    // ---- the node pool's index (PL1-PL5, src/pool/) ----

    /// A slot is published `READABLE` only by the CAS that completes its
    /// last rank (PL1): the answer is `every_rank` (whether this rank's
    /// bit completes the mask). N39 publishes on any rank's bit.
    fn publishes_when_complete(&self, every_rank: bool) -> bool {
        every_rank
    }

    /// A hold compares the slot's key again once its bit is set (PL2):
    /// `recheck` says whether it still matches. N41 does not compare again.
    fn hold_rechecks_key(&self, recheck: impl FnOnce() -> bool) -> bool {
        recheck()
    }

    /// Eviction takes only a slot no engine holds (PL2): the answer is
    /// `unheld`. N40 takes a held one too.
    fn evicts_only_unheld(&self, unheld: bool) -> bool {
        unheld
    }

    /// A claim is a compare-and-swap from the word its decision read (PL3):
    /// `cas` runs; `store` (the word set whatever it is now) does not. N42
    /// runs `store`.
    fn claims_by_cas<R>(&self, cas: impl FnOnce() -> R, _store: impl FnOnce() -> R) -> R {
        cas()
    }

    /// A claim that lost its CAS decides again on the word found, so a set
    /// with a claimable slot never skips the key (PL5): true. N46 gives up.
    fn retries_lost_claim(&self) -> bool {
        true
    }

    /// A key is stored in either of its two sets, the emptier first, and
    /// looked up in both (PL5: a key with a `FREE` slot in either set is
    /// stored without evicting): true. N49 answers false: its first set
    /// only, as the pool did before two-choice hashing.
    fn claims_in_two_sets(&self) -> bool {
        true
    }

    /// A joiner reads the pool word after its claim, by a read-modify-write,
    /// and leaves if a closer is at work (PL6, `pool::closing` rule 1):
    /// true. N51 answers false: the join takes no notice of a close.
    fn joins_check_closing(&self) -> bool {
        true
    }

    /// A member's join (the scheduler, a rank past 0) checks the pool word
    /// after its bit as the owner's does after its claim, and a member
    /// polling a pool being removed is refused (PL6, `pool::closing`
    /// rule 1): true. N54 answers false: a member registers with the
    /// owner's entry whatever the word says, so it stays on a pool removed
    /// between the owner's claim and its own check.
    fn members_check_closing(&self) -> bool {
        true
    }

    /// The join's check reads the pool word by a read-modify-write (PL6,
    /// `pool::closing` rule 1): true. N53 answers false: a plain load,
    /// which nothing orders against a closer's CAS (the store-buffer
    /// pattern: the joiner misses the close while the closer misses the
    /// claim).
    fn join_reads_word_by_rmw(&self) -> bool {
        true
    }

    /// A closer marks the pool word `CLOSING` before it reads the owner
    /// words, and decides only then (PL6, `pool::closing` rule 2): true.
    /// N50 answers false: it reads the owner words, then sets the word
    /// final.
    fn closes_tentatively(&self) -> bool {
        true
    }

    /// A closer that finds another at work waits for it and tries again
    /// (PL6, `pool::closing` rule 4): true. N52 answers false: it gives up,
    /// as if the other would remove the pool.
    fn waits_for_closer(&self) -> bool {
        true
    }

    /// A key is claimed and evicted only within its two sets (PL5): the
    /// answer is `own` (the sets' slots). N45 answers `any` (every slot).
    fn evicts_within_set<S>(&self, own: S, _any: S) -> S {
        own
    }

    /// A sweep frees a dead engine's unfinished write (PL4): the answer is
    /// `free` (the slot `FREE`, its partial bytes unnamed). N43 answers
    /// `publish` (the slot `READABLE`).
    fn sweep_frees_dead_writes<W>(&self, free: W, _publish: W) -> W {
        free
    }

    /// A sweep clears a dead engine's marks by CAS on the word it read, so
    /// a live engine's bit set meanwhile stays (PL4): `cas` runs; `store`
    /// (the word computed from a stale read, set whatever it is now) does
    /// not. N44 runs `store`.
    fn sweeps_by_cas<R>(&self, cas: impl FnOnce() -> R, _store: impl FnOnce() -> R) -> R {
        cas()
    }
}

/// The shipped rules: every method's provided body (see the module docs).
/// Zero-sized; outside model builds the only [`Rules`] there are.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Shipped;

impl Rules for Shipped {}

/// The rules the parties run in this build: [`Shipped`] outside model
/// builds.
#[cfg(not(any(loom, shuttle)))]
pub(crate) type Active = Shipped;

/// The rules the parties run in this build: in the model builds the
/// negative a model selected ([`negatives::Variant`], `Production` unless
/// set).
#[cfg(any(loom, shuttle))]
pub(crate) type Active = negatives::Variant;

/// Where a party keeps the rules it runs, readable without its lock:
/// nothing outside model builds ([`Knob::rules`] is [`Shipped`]); in them,
/// the variant a model selected, behind std's mutex (loom and shuttle do
/// not schedule it, so reading the knob adds no interleaving to a model:
/// a model explores the library's schedule points, not the knob's). A clone
/// shares the knob (a runtime handle's clones share its binding's).
#[derive(Clone, Debug, Default)]
pub(crate) struct Knob {
    #[cfg(any(loom, shuttle))]
    #[allow(clippy::disallowed_types)]
    variant: std::sync::Arc<std::sync::Mutex<negatives::Variant>>,
}

impl Knob {
    /// The rules to run now.
    #[cfg(not(any(loom, shuttle)))]
    #[inline(always)]
    pub(crate) fn rules(&self) -> Active {
        Shipped
    }

    /// The rules to run now: the variant last set.
    #[cfg(any(loom, shuttle))]
    pub(crate) fn rules(&self) -> Active {
        *self.variant.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Selects variant `v` (a model, before its threads start).
    #[cfg(any(loom, shuttle))]
    pub(crate) fn set(&self, v: negatives::Variant) {
        *self.variant.lock().unwrap_or_else(|p| p.into_inner()) = v;
    }
}
