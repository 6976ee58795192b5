//! The negative models' variants: the known-bad ways of running the
//! library (N1-N46 and N49-N54, docs/PROOFS.md), and the [`Rules`] each overrides.
//!
//! Model builds only (`--cfg loom`, `--cfg shuttle`): outside them this
//! module, [`Variant`] and every override are not compiled, and the parties
//! run [`Shipped`](super::Shipped). A variant overrides the one method of
//! the rule it breaks and otherwise runs the provided (shipped) body; a
//! model selects it with `Coordinator::set_variant` (or
//! `Prefaulter::set_variant`) before its threads start.

use super::{Rules, Shipped};

/// The production protocol, or one of the known-bad variants that the
/// negative models run (of N1-N46 and N49-N54, docs/PROOFS.md). Model builds only, as
/// this whole module: a variant overrides the [`Rules`] method of the rule
/// it breaks (below).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub enum Variant {
    /// The protocol as shipped: every rule enforced (it overrides no
    /// [`Rules`] method). The one the positive models P1-P8 check.
    #[default]
    Production,
    /// N1: upstream's design: no capture window (windows open at once,
    /// library calls are not held back).
    NoCaptureWindow,
    /// N2: shutdown unregisters without draining transfers.
    NoDrainBeforeUnregister,
    /// N3: the completion poller queries events even while a window is open.
    UngatedPoller,
    /// N4: the gather kernel gets an alias without checking registration.
    UncheckedGather,
    /// N5: shutdown ignores graphs that still reference the region.
    IgnoreLiveGraphs,
    /// N6: waiting for pinning inside a window is allowed (and hangs).
    WaitInsideWindow,
    /// N7: rollback unregisters only the chunk that failed last.
    ForgetfulRollback,
    /// N13: a rank publishes its own pin outcome (offload on) before the
    /// ranks exchanged theirs (P7).
    PublishBeforeAgreement,
    /// N9: `TransferEngine::submit` as it was before it moved inside the gate: it checks
    /// the compute stream's capture status, then records the ordering
    /// event on it and waits for it on the handler's stream, all outside
    /// the gate (check-then-act: a capture may begin in between).
    RacySubmit,
    /// N10: shutdown does not wait for pinning to settle before it
    /// unregisters (a registration in flight completes afterwards).
    ShutdownSkipsPinWait,
    /// N14: the staged backend does not join its two staging streams back
    /// into the handler's stream, so a job's completion event does not
    /// cover its chunks (P5).
    UnjoinedStaging,
    /// N16: a closing window does not hand the turn to a waiting library
    /// call, so windows opening back to back starve pinning (P6, liveness).
    WindowKeepsTurn,
    /// N17: a guard's release (a window, a job ticket, a graph token, an
    /// alias, the end of a gated call) changes the state but wakes nobody
    /// (P6, liveness: a lost wake-up).
    SilentRelease,
    /// N18: `KeyedOffloader::store` makes its keys readable when the store is
    /// submitted, not when it completed (P5).
    ReadableAtSubmit,
    /// N19: `KeyedOffloader::load` releases its keys' slots when the load is
    /// submitted, so eviction may hand a slot to a store while the load
    /// still reads it (P5).
    SlotFreedAtLoadSubmit,
    /// N20: `Offloader::shutdown` skips its own drain (polling its jobs to
    /// completion) and drops the transfer engine with jobs unreported: their
    /// completions never reach the block manager (P4, P5).
    OffloaderSkipsDrain,
    /// N21: the capture hook's `capture_end` submits the jobs it deferred
    /// before it closes its window, not after (on the closing thread, still
    /// inside the window the capture runs in).
    HookFlushesInsideWindow,
    /// N22: the capture hook's `capture_abort` (a capture whose begin
    /// failed) forgets to close the window its `capture_begin` opened.
    HookAbortKeepsWindow,
    /// N23: a rank's wait in the P7 agreement ignores the cancel of its
    /// pinning (a shutdown during the agreement), as before issue 28: it
    /// waits for a peer that never settles.
    AgreementIgnoresCancel,
    /// N25: a refused shutdown has already asked pinning to stop (the
    /// cancel set before the refusal's checks): pinning rolls back to
    /// pageable although nothing was shut down.
    RefusalCancelsPinning,
    /// N24: shutdown unregisters the chunks first and drains after: a job
    /// admitted before the shutdown copies the region once it is no longer
    /// registered (its memory stays mapped until the drain).
    UnregisterBeforeDrain,
    /// N15: `Offloader::shutdown` in its earlier order: it closes
    /// the offloader, drains and drops the transfer engine and frees its
    /// tensors, and only then asks the coordinator, which may refuse (a
    /// window open, a graph alive): the refusal comes after the teardown.
    TeardownBeforeRefusal,
    /// N26: `Offloader::submit` skips its busy-slot check: a slot job is
    /// accepted while a job in flight on one of its slots conflicts with it
    /// (a store beside any job on the slot, a load beside a store).
    SlotBusyUnchecked,
    /// N27: the runtime handle bound to this coordinator admits a gate of
    /// any coordinator (`GateBinding::admits` says yes to every gate).
    BindingAdmitsAnyGate,
    /// N28: a pre-faulter's `ensure` of a chunk returns once every slice of
    /// the chunk was taken by a worker, not once each was faulted: the
    /// registration of the chunk may run while a worker still faults it
    /// (`Prefaulter::set_variant`).
    PrefaultEnsureBeforeFaulted,
    /// N29: a pre-faulter's `ensure` does not look for its chunk among the
    /// chunks hinted before and queues it again: a hinted chunk's slices are
    /// faulted twice (`Prefaulter::set_variant`).
    PrefaultHintForgotten,
    /// N30: the capture hook's flush, refused by an engine's window, waits
    /// until no window at all is open (`Coordinator::wait_no_window`), not
    /// only until a window is requested after it began waiting: a hook
    /// window that begins meanwhile on another thread holds up the close
    /// that flushes until that window closes too.
    HookFlushWaitsForEveryWindow,
    /// N31: a chunk's registration ignores the pin holds
    /// (`Coordinator::hold_pinning`): pinning goes on during an engine's
    /// capture phase.
    PinIgnoresHold,
    /// N33: a capture hook begin refused or interrupted before its window
    /// opened does not submit the jobs deferred behind its request: they
    /// stay queued with no hook window open (until someone else flushes).
    HookRefusedBeginKeepsQueue,
    /// N34: an interruptible wait does not start a new slice after its
    /// check said to go on: from then on it calls the check on every turn
    /// of its loop without waiting (a spin that, from Python, takes the GIL
    /// each time).
    CheckWithoutNewSlice,
    /// N35: the capture hook's `capture_abort` closes its window but does
    /// not submit the deferred jobs when it was the last one open
    /// (`capture_end` still does).
    HookAbortSkipsFlush,
    /// N36: a wait for a deferred job does not refuse the thread that holds
    /// the hook window the job waits behind: that thread waits for its own
    /// close.
    WaitForOwnDeferredJob,
    /// N37: a callable run under the gate (`Coordinator::unsafe_call`,
    /// `Offloader::gated`) that panics leaves its call counted in flight:
    /// no window opens again.
    PanicUnderGateLeaks,
    /// N38: `KeyedOffloader::store` refused at submission (a capture
    /// window open) drops its placed keys but keeps the evictions the
    /// block manager made for them, as before issue 43: a key the engine
    /// was never told of as evicted is gone (P5).
    RefusedStoreKeepsEvictions,
    /// N39: the node pool publishes a slot `READABLE` on the first rank's
    /// bit, not the last (PL1).
    PublishOnAnyRank,
    /// N40: the node pool's eviction takes a slot another engine holds (PL2).
    EvictIgnoresReaders,
    /// N41: the node pool's hold does not compare the key again under the
    /// hold (PL2; reachable with a narrow epoch).
    NoRecheck,
    /// N42: the node pool claims a slot by storing the new word, not by CAS
    /// from the word read (PL3).
    ClaimByStore,
    /// N43: the node pool's sweep publishes a dead engine's unfinished write
    /// instead of freeing it (PL4).
    ReclaimPublishes,
    /// N44: the node pool's sweep clears a dead engine's marks by storing a
    /// word computed from a stale read (PL4).
    SweepStores,
    /// N45: the node pool claims and evicts outside the key's set (PL5).
    EvictAnySet,
    /// N46: the node pool skips a key after one lost claim CAS (PL5).
    GiveUpOnRace,
    /// N49: the node pool stores a key in its first set only, evicting
    /// there while its second set has room (PL5). (N47 and N48 are
    /// model-local: `model/pl1_visible_complete.rs`, `model/pl4_crash_anywhere.rs`.)
    OneSetPerKey,
    /// N50: the node pool's closer reads the owner words and then sets the
    /// pool word final, with no tentative `CLOSING` before (PL6).
    CloseWithoutTentative,
    /// N51: the node pool's join takes no notice of a closer (PL6).
    JoinIgnoresClosing,
    /// N52: the node pool's closer gives up when another closer is at work
    /// (PL6).
    CloserGivesUp,
    /// N53: the node pool's join checks the pool word by a plain load, not
    /// a read-modify-write (PL6).
    JoinLoadsWord,
    /// N54: the node pool's members (the scheduler, ranks past 0) join
    /// without looking at the pool word; the owner still does (PL6).
    MembersIgnoreClosing,
}

impl Rules for Variant {
    fn admits_gate(&self, bound: impl FnOnce() -> bool) -> bool {
        match self {
            // N27: every gate, the bound coordinator's or not (`bound` not
            // asked).
            Variant::BindingAdmitsAnyGate => true,
            _ => bound(),
        }
    }

    fn drain_then_unregister<R>(
        &self,
        drain: impl FnOnce(),
        settle_pinning: impl FnOnce(),
        unregister: impl FnOnce() -> R,
    ) -> R {
        match self {
            // N24: the chunks go first.
            Variant::UnregisterBeforeDrain => {
                let r = unregister();
                drain();
                settle_pinning();
                r
            }
            _ => Shipped.drain_then_unregister(drain, settle_pinning, unregister),
        }
    }

    fn roll_back_all(&self, registered: usize, mut unregister: impl FnMut(usize)) {
        match self {
            // N7: only the chunk registered last is undone.
            Variant::ForgetfulRollback => registered.checked_sub(1).into_iter().for_each(&mut unregister),
            _ => Shipped.roll_back_all(registered, unregister),
        }
    }

    fn agree_before_publishing<M>(
        &self,
        pinned: bool,
        publish_pinned: impl FnOnce(),
        agree: impl FnOnce(bool) -> M,
    ) -> M {
        // N13: offload turns on for this rank before the ranks agreed.
        if *self == Variant::PublishBeforeAgreement && pinned {
            publish_pinned();
        }
        agree(pinned)
    }

    fn agreement_heeds_cancel(&self, cancelled: bool) -> bool {
        // N23: the wait goes on whatever the cancel says.
        cancelled && *self != Variant::AgreementIgnoresCancel
    }

    fn ensure_takes_hint<J>(&self, find: impl FnOnce() -> Option<J>) -> Option<J> {
        match self {
            // N29: the chunk hinted before is not looked for.
            Variant::PrefaultHintForgotten => None,
            _ => find(),
        }
    }

    fn ensure_waits_for_faulting(&self, unfaulted: impl FnOnce() -> bool, untaken: impl FnOnce() -> bool) -> bool {
        match self {
            // N28: done once every slice was taken by a worker, some maybe
            // still being faulted.
            Variant::PrefaultEnsureBeforeFaulted => untaken(),
            _ => unfaulted(),
        }
    }

    fn accept_inside_gate<T, R, A: Fn(T) -> R>(
        &self,
        accept: A,
        admit: impl FnOnce() -> Result<T, R>,
        admit_in_gate: impl FnOnce(&A) -> R,
    ) -> R {
        match self {
            // N9: the submit as it was before it moved inside the gate: the
            // check and the record outside it.
            Variant::RacySubmit => match admit() {
                Ok(ticket) => accept(ticket),
                Err(refused) => refused,
            },
            _ => Shipped.accept_inside_gate(accept, admit, admit_in_gate),
        }
    }

    fn join_staging_streams(&self, used: &[usize], join: impl FnMut(&usize)) {
        match self {
            // N14: no stream is joined back.
            Variant::UnjoinedStaging => {}
            _ => Shipped.join_staging_streams(used, join),
        }
    }

    fn windows_exclude_calls(&self, clear: impl FnOnce() -> bool) -> bool {
        // N1: no capture window holds anything back (`clear` not asked).
        *self == Variant::NoCaptureWindow || clear()
    }

    fn unwinding_call_ends(&self, arm: impl FnOnce()) {
        match self {
            // N37: the guard stays unarmed: an unwinding call stays counted.
            Variant::PanicUnderGateLeaks => {}
            _ => Shipped.unwinding_call_ends(arm),
        }
    }

    fn poller_respects_gate(&self, busy: impl FnOnce() -> bool) -> bool {
        // N3: the poller goes on whatever the windows (`busy` not asked).
        *self != Variant::UngatedPoller && busy()
    }

    fn alias_needs_registration<A>(&self, alias: Option<A>, host_address: impl FnOnce() -> A) -> Option<A> {
        match self {
            // N4: an unregistered chunk's host address, as if registered.
            Variant::UncheckedGather => alias.or_else(|| Some(host_address())),
            _ => Shipped.alias_needs_registration(alias, host_address),
        }
    }

    fn release_wakes(&self, wake: impl FnOnce()) {
        match self {
            // N17: the state changes, nobody is woken.
            Variant::SilentRelease => {}
            _ => Shipped.release_wakes(wake),
        }
    }

    fn closing_window_hands_turn(&self, hand: impl FnOnce()) {
        match self {
            // N16: the window keeps the turn.
            Variant::WindowKeepsTurn => {}
            _ => Shipped.closing_window_hands_turn(hand),
        }
    }

    fn interrupt_check_starts_slice(&self, start: impl FnOnce()) {
        match self {
            // N34: no new slice: the check runs on every turn, unwaited.
            Variant::CheckWithoutNewSlice => {}
            _ => Shipped.interrupt_check_starts_slice(start),
        }
    }

    fn registration_heeds_hold(&self, held: impl FnOnce() -> bool) -> bool {
        // N31: the holds are not asked.
        *self != Variant::PinIgnoresHold && held()
    }

    fn refuses_pin_wait_in_own_window(&self, inside: impl FnOnce() -> bool) -> bool {
        // N6: the wait goes ahead inside the window.
        *self != Variant::WaitInsideWindow && inside()
    }

    fn refusal_changes_nothing(&self, cancel_early: impl FnOnce()) {
        // N25: pinning asked to stop before the refusal's checks.
        if *self == Variant::RefusalCancelsPinning {
            cancel_early();
        }
    }

    fn shutdown_refuses_live_graphs(&self, live: impl FnOnce() -> bool) -> bool {
        // N5: the live graphs are not asked.
        *self != Variant::IgnoreLiveGraphs && live()
    }

    fn drain_waits_for_jobs<G>(&self, g: G, wait: impl FnOnce(G) -> G) -> G {
        match self {
            // N2: the jobs in flight are not waited for.
            Variant::NoDrainBeforeUnregister => g,
            _ => Shipped.drain_waits_for_jobs(g, wait),
        }
    }

    fn drain_waits_for_pinning<G>(&self, g: G, wait: impl FnOnce(G) -> G) -> G {
        match self {
            // N10: pinning is not waited for.
            Variant::ShutdownSkipsPinWait => g,
            _ => Shipped.drain_waits_for_pinning(g, wait),
        }
    }

    fn abort_closes_window<E>(&self, close: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        match self {
            // N22: the window stays open for good.
            Variant::HookAbortKeepsWindow => Ok(()),
            _ => Shipped.abort_closes_window(close),
        }
    }

    fn hook_flushes_after_close<G>(&self, g: G, flush_early: impl FnOnce(G) -> G) -> G {
        match self {
            // N21: the deferred jobs go before the window closes.
            Variant::HookFlushesInsideWindow => flush_early(g),
            _ => Shipped.hook_flushes_after_close(g, flush_early),
        }
    }

    fn hook_close_flushes<E>(&self, abort: bool, flush: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        match self {
            // N35: an abort leaves the queue as it is.
            Variant::HookAbortSkipsFlush if abort => Ok(()),
            _ => Shipped.hook_close_flushes(abort, flush),
        }
    }

    fn refused_begin_flushes(&self, flush: impl FnOnce()) {
        match self {
            // N33: the deferred jobs stay queued.
            Variant::HookRefusedBeginKeepsQueue => {}
            _ => Shipped.refused_begin_flushes(flush),
        }
    }

    fn flush_wait_ends_at_request<S, R>(&self, since: S, wait: impl FnOnce(Option<S>) -> R) -> R {
        match self {
            // N30: the wait ends only once no window at all is open.
            Variant::HookFlushWaitsForEveryWindow => wait(None),
            _ => Shipped.flush_wait_ends_at_request(since, wait),
        }
    }

    fn refuses_wait_for_own_deferred(&self, own: impl FnOnce() -> bool) -> bool {
        // N36: the holder of the window waits for its own close.
        *self != Variant::WaitForOwnDeferredJob && own()
    }

    fn checks_busy_slots<E>(&self, check: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        match self {
            // N26: no busy-slot check.
            Variant::SlotBusyUnchecked => Ok(()),
            _ => Shipped.checks_busy_slots(check),
        }
    }

    fn readable_at_completion(&self, mark_readable_now: impl FnOnce()) {
        // N18: the keys readable at submission.
        if *self == Variant::ReadableAtSubmit {
            mark_readable_now();
        }
    }

    fn slots_held_until_load_done(&self, free_now: impl FnOnce()) {
        // N19: the slots released at submission.
        if *self == Variant::SlotFreedAtLoadSubmit {
            free_now();
        }
    }

    fn refused_store_undoes_evictions<B>(&self, book: B, undo: impl FnOnce(B), drop_placed: impl FnOnce(B)) {
        match self {
            // N38: the refusal as before issue 43: the placed keys dropped,
            // the evictions kept.
            Variant::RefusedStoreKeepsEvictions => drop_placed(book),
            _ => Shipped.refused_store_undoes_evictions(book, undo, drop_placed),
        }
    }

    fn refuses_before_teardown<E>(
        &self,
        refuse: impl FnOnce() -> Result<(), E>,
        teardown: impl FnOnce() -> Result<(), E>,
        refuse_late: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        match self {
            // N15: the earlier order: the teardown first, the refusal after.
            Variant::TeardownBeforeRefusal => {
                teardown()?;
                refuse_late()
            }
            _ => Shipped.refuses_before_teardown(refuse, teardown, refuse_late),
        }
    }

    fn offloader_drains<E>(&self, drain: impl FnOnce() -> Result<(), E>) -> Result<(), E> {
        match self {
            // N20: the engine dropped with its jobs unreported.
            Variant::OffloaderSkipsDrain => Ok(()),
            _ => Shipped.offloader_drains(drain),
        }
    }
    fn publishes_when_complete(&self, every_rank: bool) -> bool {
        // N39: any rank's bit publishes.
        matches!(self, Variant::PublishOnAnyRank) || every_rank
    }

    fn hold_rechecks_key(&self, recheck: impl FnOnce() -> bool) -> bool {
        match self {
            // N41: the hold trusts the match it saw before its bit.
            Variant::NoRecheck => true,
            _ => Shipped.hold_rechecks_key(recheck),
        }
    }

    fn evicts_only_unheld(&self, unheld: bool) -> bool {
        // N40: a held slot is taken too.
        matches!(self, Variant::EvictIgnoresReaders) || unheld
    }

    fn claims_by_cas<R>(&self, cas: impl FnOnce() -> R, store: impl FnOnce() -> R) -> R {
        match self {
            // N42: the word set whatever it became since the decision.
            Variant::ClaimByStore => store(),
            _ => Shipped.claims_by_cas(cas, store),
        }
    }

    fn retries_lost_claim(&self) -> bool {
        // N46: one lost CAS and the key is skipped.
        !matches!(self, Variant::GiveUpOnRace)
    }

    fn claims_in_two_sets(&self) -> bool {
        // N49: the first set only.
        !matches!(self, Variant::OneSetPerKey)
    }

    fn joins_check_closing(&self) -> bool {
        // N51: a join goes on whatever the pool word says.
        !matches!(self, Variant::JoinIgnoresClosing)
    }

    fn members_check_closing(&self) -> bool {
        // N54: a member goes on whatever the pool word says.
        !matches!(self, Variant::MembersIgnoreClosing)
    }

    fn join_reads_word_by_rmw(&self) -> bool {
        // N53: a load, not ordered against the closer's CAS.
        !matches!(self, Variant::JoinLoadsWord)
    }

    fn closes_tentatively(&self) -> bool {
        // N50: scan, then decide.
        !matches!(self, Variant::CloseWithoutTentative)
    }

    fn waits_for_closer(&self) -> bool {
        // N52: another closer at work ends this close.
        !matches!(self, Variant::CloserGivesUp)
    }

    fn evicts_within_set<S>(&self, own: S, any: S) -> S {
        match self {
            // N45: every slot of the pool.
            Variant::EvictAnySet => any,
            _ => Shipped.evicts_within_set(own, any),
        }
    }

    fn sweep_frees_dead_writes<W>(&self, free: W, publish: W) -> W {
        match self {
            // N43: the dead writer's slot published.
            Variant::ReclaimPublishes => publish,
            _ => Shipped.sweep_frees_dead_writes(free, publish),
        }
    }

    fn sweeps_by_cas<R>(&self, cas: impl FnOnce() -> R, store: impl FnOnce() -> R) -> R {
        match self {
            // N44: the stale word stored.
            Variant::SweepStores => store(),
            _ => Shipped.sweeps_by_cas(cas, store),
        }
    }
}
