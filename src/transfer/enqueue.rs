//! How a [`TransferEngine`] enqueues one admitted job's copies: the choice
//! of backend ([`super::select`]: what the job touches, whether it is
//! registered, whether the other direction is busy) and the gather and
//! staged paths.

use crate::protocol::{AliasGuard, ChunkReg};
use crate::runtime::{CaptureStatus, DevicePtr, DriverResult, GATHER_ENTRY_WORDS};
use crate::sync;

use super::backend::{self, Backend, BackendChoice};
use super::engine::TransferEngine;
use super::handler::Handler;
use super::layout::Expansion;
use super::ring::{Ring, Table};
use super::select::{candidates, may_stage, Situation};
use super::staged::{Plan, Staging};

impl TransferEngine {
    /// True when the other direction's handler has jobs in flight, or its
    /// last one was reported less than `duplex_linger` ago (only asked, and
    /// its queue only locked, when `h` can stage: the automatic choice
    /// stages then; see [`super::select`]). Called without `h`'s queue
    /// lock, so no two queue locks are ever held together.
    pub(super) fn other_busy(&self, h: &Handler) -> bool {
        if h.staged.is_none() || self.opts.backend != BackendChoice::Auto {
            return false;
        }
        self.handlers.iter().filter(|o| o.dir != h.dir).any(|o| {
            let other = sync::lock(&o.q);
            !other.jobs.is_empty() || other.idle_since.is_some_and(|t| t.elapsed() < self.opts.thresholds.duplex_linger)
        })
    }

    /// Enqueues the fragments with the first allowed backend.
    pub(super) fn enqueue(
        &self,
        h: &Handler,
        ring: &mut Ring,
        exp: &Expansion,
        other_busy: bool,
    ) -> (Backend, Table, DriverResult<()>) {
        let capturing = match self.rt.capture_status(h.stream) {
            Ok(CaptureStatus::None) => false,
            Ok(_) => true,
            Err(e) => return (Backend::PerFragment, Table::None, Err(e)),
        };
        let frags = &exp.fragments;
        let touched = self.touched_chunks(exp);
        let pinned = touched.as_ref().is_some_and(|t| self.all_registered(t));
        let mean_bytes = exp.bytes / frags.len().max(1) as u64;
        // The staged plan (host runs) only where staging could be chosen.
        let plan = match &h.staged {
            Some(st)
                if !capturing
                    && may_stage(self.opts.backend, &self.opts.thresholds, mean_bytes, pinned, other_busy) =>
            {
                // Runs end where a registration chunk ends: one copy may not
                // span two registrations.
                let chunk_end = |a: usize| {
                    self.chunks.locate(a).map_or(usize::MAX, |pos| {
                        let c = self.chunks.get(pos);
                        c.addr + c.len
                    })
                };
                Some(Plan::new(frags, st.half, st.entries, chunk_end))
            }
            _ => None,
        };
        let staged_run_bytes = plan.as_ref().map(Plan::mean_run_bytes);
        let sit = Situation { mean_bytes, capturing, pinned, other_busy, staged_run_bytes };
        for b in candidates(self.opts.backend, &self.opts.thresholds, sit) {
            match b {
                Backend::Staged => {
                    if let (Some(st), Some(plan)) = (&h.staged, &plan) {
                        debug_assert!(!capturing);
                        let (staging, r) = self.staged(h, st, ring, plan);
                        return (Backend::Staged, staging, r);
                    }
                }
                Backend::Gather => {
                    if let Some((staging, r)) = self.try_gather(h, ring, exp, touched.as_deref()) {
                        return (Backend::Gather, staging, r);
                    }
                }
                Backend::Batched => {
                    debug_assert!(!capturing);
                    // SAFETY: the engine's contract (TransferEngine::new)
                    // keeps every host and device range valid while jobs are
                    // in flight; the job is reported only after its
                    // completion event, recorded after these copies.
                    let r = match touched.as_ref().filter(|t| t.len() > 1) {
                        // A merged fragment may cross from one registration
                        // chunk into the next; one batched copy may not span
                        // two registrations (see `super::staged::Plan::new`).
                        Some(_) => {
                            let mut cut = Vec::with_capacity(frags.len() + self.chunks.len());
                            for f in frags {
                                self.chunks.split(*f, |_, piece| cut.push(piece));
                            }
                            unsafe { backend::batched(&*self.rt, h.dir, &cut, h.stream) }
                        }
                        None => unsafe { backend::batched(&*self.rt, h.dir, frags, h.stream) },
                    };
                    return (Backend::Batched, Table::None, r);
                }
                Backend::PerFragment => {
                    // SAFETY: as for the batched copy.
                    let r = unsafe { backend::per_fragment(&*self.rt, h.dir, frags, h.stream) };
                    return (Backend::PerFragment, Table::None, r);
                }
            }
        }
        unreachable!("candidates always end with PerFragment")
    }

    /// Positions (in `self.chunks`) of the chunks the job's host ranges
    /// touch, each once; `None` if a byte lies outside every chunk.
    fn touched_chunks(&self, exp: &Expansion) -> Option<Vec<usize>> {
        let mut seen = vec![false; self.chunks.len()];
        let mut out = Vec::new();
        for f in &exp.fragments {
            let inside = self.chunks.split(*f, |pos, _| {
                if !seen[pos] {
                    seen[pos] = true;
                    out.push(pos);
                }
            });
            if !inside {
                return None;
            }
        }
        Some(out)
    }

    /// True when every chunk in `touched` has completed registration (a
    /// snapshot: it only steers the choice between copy backends, which are
    /// safe on any memory; the gather kernel checks again under guard).
    fn all_registered(&self, touched: &[usize]) -> bool {
        touched.iter().all(|&pos| {
            matches!(self.coord.pinning().chunk_reg(self.chunks.get(pos).index), Some(ChunkReg::Registered { .. }))
        })
    }

    /// The gather path: an alias guard for every chunk the job touches
    /// (none -> `None`, the caller falls back), the descriptor table
    /// encoded from those aliases, uploaded and launched; the guards are
    /// dropped once the launches are enqueued (an unregister then waits for
    /// the device: docs/driver-rules.md, row "Unregister waits for the
    /// device").
    fn try_gather(
        &self,
        h: &Handler,
        ring: &mut Ring,
        exp: &Expansion,
        touched: Option<&[usize]>,
    ) -> Option<(Table, DriverResult<()>)> {
        let table = h.table?;
        let touched = touched?;
        // One guard per chunk the job touches; `alias[pos]` is the device
        // address of that chunk's first byte while its guard is held.
        let mut guards: Vec<AliasGuard> = Vec::with_capacity(touched.len());
        let mut alias: Vec<DevicePtr> = vec![DevicePtr::NULL; self.chunks.len()];
        for &pos in touched {
            let c = self.chunks.get(pos);
            match self.coord.acquire_alias(c.addr, c.len) {
                Some(g) => {
                    alias[pos] = g.device;
                    guards.push(g);
                }
                None => {
                    tracing::debug!(chunk = c.index, "gather refused: chunk not registered; falling back");
                    return None;
                }
            }
        }
        // Every piece lies in a touched chunk (same split as touched_chunks).
        // The table is built and launched a table-full at a time, so the
        // GPU copies the first fragments while the host encodes the next
        // ones. The capacity covers every entry (a fragment gains one entry
        // per chunk boundary it crosses), so the buffer never moves while
        // the stream may still read an earlier piece.
        let per = table.entries.max(1) * GATHER_ENTRY_WORDS;
        let cap = (exp.fragments.len() + self.chunks.len()) * GATHER_ENTRY_WORDS;
        // In the pinned ring when it has room (a handler without a ring has
        // a zero-capacity one, which never does), else on the heap.
        let mut staging = match (h.ring, ring.alloc(cap)) {
            (Some((addr, _)), Some(start)) => {
                // SAFETY: `start + cap` is within the ring's words, so the
                // offset stays inside the one allocation at `addr`.
                Table::Pinned { ptr: unsafe { (addr as *mut u64).add(start) }, start, cap, len: 0 }
            }
            _ => Table::Heap(Vec::with_capacity(cap)),
        };
        let mut launched = 0;
        let mut r = Ok(());
        for f in &exp.fragments {
            self.chunks.split(*f, |pos, piece| {
                let host = alias[pos].offset(piece.host - self.chunks.get(pos).addr);
                staging.push(backend::entry(h.dir, piece, host));
            });
            if r.is_ok() && staging.len() - launched >= per {
                // SAFETY: as below, for the piece `launched..launched+per`.
                r = unsafe { backend::gather(&*self.rt, table, staging.words(launched, launched + per), h.stream) };
                launched += per;
            }
        }
        // SAFETY: `staging` (a heap vector that never grows past its
        // capacity, or this job's range of the pinned ring) moves into the
        // job and lives, unchanged, until it is reported, after its
        // completion event; every host address in the table is the alias of
        // a chunk whose guard is held until the launches are enqueued
        // (unregistering then waits for the device); host and device ranges
        // are valid by the engine's contract.
        if r.is_ok() && staging.len() > launched {
            r = unsafe { backend::gather(&*self.rt, table, staging.words(launched, staging.len()), h.stream) };
        }
        drop(guards);
        Some((staging, r))
    }

    /// The staged path: the plan's entries encoded into the pinned ring (or
    /// the heap), then chunk after chunk on the handler's two streams
    /// ([`super::staged`]).
    fn staged(&self, h: &Handler, st: &Staging, ring: &mut Ring, plan: &Plan) -> (Table, DriverResult<()>) {
        let cap = plan.pieces.len() * GATHER_ENTRY_WORDS;
        let mut table = match (h.ring, ring.alloc(cap)) {
            (Some((addr, _)), Some(start)) => {
                // SAFETY: `start + cap` is within the ring's words, so the
                // offset stays inside the one allocation at `addr`.
                Table::Pinned { ptr: unsafe { (addr as *mut u64).add(start) }, start, cap, len: 0 }
            }
            _ => Table::Heap(Vec::with_capacity(cap)),
        };
        let first = st.first_stream();
        for e in st.entries(h.dir, plan, first) {
            table.push(e);
        }
        // SAFETY: `table` moves into the job and lives, unchanged, until
        // the job is reported, after its completion event (recorded on the
        // handler's stream after it joined both staging streams); the
        // kernels touch device memory only (the job's pages, the handler's
        // staging buffers) and the table (in the ring, which lives until
        // the engine is dropped); host ranges are valid by the engine's
        // contract.
        let r = unsafe {
            st.enqueue(
                &*self.rt,
                &self.coord,
                h.dir,
                plan,
                table.words(0, table.len()),
                first,
                h.stream,
                h.after_compute,
            )
        };
        (table, r)
    }
}
