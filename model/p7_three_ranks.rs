//! P7c three ranks, none silent: a rank that gives up on a peer races that
//! peer settling and deciding. A word, once final (settled pinned or
//! pageable, or given up), never changes; every rank ends in the same mode,
//! the mode of the final words; every rank ends.
//!
//! Threads (4): three ranks, each running the production agreement
//! (`agree`) over three shared words (`LocalSlots`, the in-process twin of
//! the region header's words, behind a model-local watch: see `Watched`);
//! the model's main thread, which cancels the ranks that end by a cancel at
//! whatever moment loom picks and joins all three. No simulated GPU: the
//! agreement is the only code under test (`model/p7_ranks_agree.rs` drives
//! it through `pin_all_agreed`). Preemption bound 3, 2 in ci/test (`B`).
//!
//! How a rank gives up, with no clock: by a cancel (what a shutdown or
//! `cancel_pinning` does; the rank's `cancelled()` reads a flag the main
//! thread sets, so loom places the give-up before, between or after any of
//! the peers' steps), or by a timeout of zero (`agree`'s `start.elapsed() >=
//! timeout` holds at its first round: it gives up at its first look that
//! finds a word unsettled, while the peers are anywhere).
//!
//! A waiting rank does not spin: its `cancelled()` waits until a word was
//! written or the cancel set since its last call (`Progress`). With two
//! ranks spinning on a third, loom's scheduler alternates between the two
//! for ever (loom issue 53: "exceeded maximum number of branches"). A
//! round that finds the words as the last one did changes nothing (the
//! waiting ranks have no timeout; the rank with the zero timeout does not
//! wait), so the wait loses no outcome; a wait for a write that never comes
//! would be loom's deadlock, a failure of (c).
//!
//! Scenarios: rank 0 cancelled, ranks 1 and 2 waiting (no timeout), all
//! pinned; the same with rank 2 pageable; rank 0 cancelled, rank 1 timing
//! out, rank 2 waiting, all pinned (two give-ups racing each other and a
//! settle).
//!
//! Checked:
//! (a) every write and every read of a word goes through `Watched`, which
//!     keeps the value each word was last written with: a write or read
//!     that finds a final word changed panics ("changed after it was
//!     final"); at the end, the word each rank settled itself is still its
//!     word;
//! (b) every rank ends in the same mode (an error is pageable), and that
//!     mode is the final words' (Pinned only if every final word is
//!     settled pinned); a rank's error names the words the final words say
//!     (`Cancelled`/`Timeout`: the ranks it gave up, whose words are "given
//!     up by it"; `Abandoned`: given-up words);
//! (c) every rank returns, and no word is unsettled after they did (a wait
//!     that went on would be loom's deadlock, or a spin to its branch
//!     bound).
//!
//! Why it holds (src/protocol/agreement.rs, rules 1-4): a rank settles its
//! own word, and gives a peer's up, only by compare-and-swap from unsettled;
//! a give-up that loses the race to the peer's settle fails and leaves the
//! peer's outcome, a settle that loses to the give-up fails and the rank
//! ends pageable. So each word is written once, every rank decides from the
//! same final words, and a final word with one given up makes every rank
//! pageable.
//!
//! Negative N32: the give-up writes "given up" with a plain store (the
//! rank's check that the word was unsettled is its earlier read): it
//! overwrites a word that its peer settled after that read; caught as
//! "changed after it was final".

#![cfg(any(loom, shuttle))]

#[path = "common/mod.rs"]
mod common;

use std::time::Duration;

use common::{models, Bounds};
use kvoffload::internal::protocol::agreement::{
    abandoned_by, abandoner, agree, LocalSlots, OffloadMode, RankSlots, SETTLED_PAGEABLE, SETTLED_PINNED, UNSETTLED,
};
use kvoffload::internal::sync::atomic::{AtomicBool, Ordering};
use kvoffload::internal::sync::{self, thread, Arc, Condvar, Mutex};
use kvoffload::AgreementError;

/// Every write of a word, and the cancel, counted: what a waiting rank's
/// cancel check waits for (see `scenario`).
struct Progress {
    count: Mutex<usize>,
    cv: Condvar,
}

impl Progress {
    fn bump(&self) {
        *sync::lock(&self.count) += 1;
        self.cv.notify_all();
    }

    /// Waits until something happened since this rank's last call
    /// (`seen`), then remembers it.
    fn wait_past(&self, seen: &std::cell::Cell<usize>) {
        let mut n = sync::lock(&self.count);
        while *n == seen.get() {
            n = sync::wait(&self.cv, n);
        }
        seen.set(*n);
    }
}

/// The ranks' words (`LocalSlots`, the production's in-process words),
/// watched: every access goes through here, and the value each word was
/// last written with is kept beside it.
///
/// The record is the model's bookkeeping, not the agreement's: a std mutex
/// (no schedule point, so loom and shuttle explore only the words' own
/// accesses; both run one model thread at a time, so it is never
/// contended). An access and its record are one step for the checker: it
/// switches threads only at the words' atomics.
struct Watched {
    words: LocalSlots,
    #[allow(clippy::disallowed_types)]
    record: std::sync::Mutex<Record>,
    progress: Progress,
    /// N32: a give-up (a compare-and-swap to a "given up by" word) is a
    /// plain store.
    give_up_by_store: bool,
}

struct Record {
    /// The value each word was last written with.
    last: Vec<u32>,
    /// The word each rank settled itself (its own compare-and-swap from
    /// unsettled to pinned or pageable succeeded).
    own: Vec<Option<u32>>,
}

fn is_final(w: u32) -> bool {
    w != UNSETTLED
}

impl Watched {
    fn new(ranks: usize, give_up_by_store: bool) -> Self {
        Watched {
            words: LocalSlots::new(ranks),
            #[allow(clippy::disallowed_types)]
            record: std::sync::Mutex::new(Record { last: vec![UNSETTLED; ranks], own: vec![None; ranks] }),
            progress: Progress { count: Mutex::new(0), cv: Condvar::new() },
            give_up_by_store,
        }
    }

    #[allow(clippy::disallowed_types)]
    fn record(&self) -> std::sync::MutexGuard<'_, Record> {
        self.record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Word `rank` was just written with `v` (property (a): a final word
    /// is never written with another value).
    fn wrote(&self, rank: usize, v: u32) {
        let prev = std::mem::replace(&mut self.record().last[rank], v);
        assert!(!is_final(prev) || prev == v, "rank {rank}'s word changed after it was final: {prev:#x} then {v:#x}");
        self.progress.bump();
    }

    /// Word `rank` was just read as `v` (property (a): a final word never
    /// reads as another final value). A read may still find a word
    /// unsettled after it was written: loom takes SeqCst loads for
    /// acquire ones (loom issue 180), so a load may read an older value
    /// than the last write; harmless to the agreement (a rank that reads a
    /// settled word as unsettled waits on, or gives it up by a
    /// compare-and-swap that fails), and no change of the word.
    fn saw(&self, rank: usize, v: u32) {
        let last = self.record().last[rank];
        assert!(
            !is_final(last) || !is_final(v) || last == v,
            "rank {rank}'s word changed after it was final: written {last:#x}, read {v:#x}"
        );
    }

    fn own(&self, rank: usize) -> Option<u32> {
        self.record().own[rank]
    }
}

impl RankSlots for Watched {
    fn ranks(&self) -> usize {
        self.words.ranks()
    }

    fn load(&self, rank: usize) -> u32 {
        let v = self.words.load(rank);
        self.saw(rank, v);
        v
    }

    fn store(&self, rank: usize, value: u32) {
        self.words.store(rank, value);
        self.wrote(rank, value);
    }

    fn compare_exchange(&self, rank: usize, current: u32, new: u32) -> Result<u32, u32> {
        if self.give_up_by_store && abandoner(new).is_some() {
            // N32: the give-up trusts the rank's earlier read of the word.
            self.store(rank, new);
            return Ok(current);
        }
        let r = self.words.compare_exchange(rank, current, new);
        match r {
            Ok(_) => {
                self.wrote(rank, new);
                if current == UNSETTLED && (new == SETTLED_PINNED || new == SETTLED_PAGEABLE) {
                    self.record().own[rank] = Some(new);
                }
            }
            Err(found) => self.saw(rank, found),
        }
        r
    }
}

/// How a rank's wait ends, besides every rank settling.
#[derive(Copy, Clone, PartialEq, Debug)]
enum Ends {
    /// It does not: no timeout, never cancelled.
    Waits,
    /// Its pinning is cancelled (a shutdown) at whatever moment loom picks.
    Cancelled,
    /// A timeout of zero: it gives up at its first look that finds a word
    /// unsettled.
    TimesOut,
}

#[derive(Copy, Clone, Debug)]
struct Rank {
    pinned: bool,
    ends: Ends,
}

const fn rank(pinned: bool, ends: Ends) -> Rank {
    Rank { pinned, ends }
}

fn scenario(ranks: [Rank; 3], give_up_by_store: bool) {
    let words = Arc::new(Watched::new(ranks.len(), give_up_by_store));
    let cancel = Arc::new(AtomicBool::new(false));
    let handles: Vec<_> = ranks
        .iter()
        .enumerate()
        .map(|(r, &spec)| {
            let (words, cancel) = (words.clone(), cancel.clone());
            thread::spawn(move || {
                let timeout = (spec.ends == Ends::TimesOut).then_some(Duration::ZERO);
                let seen = std::cell::Cell::new(0);
                let cancelled = || {
                    if spec.ends == Ends::TimesOut {
                        // It gives up at this round: no wait.
                        return false;
                    }
                    // A round that finds the words as the last one did
                    // changes nothing: wait for a write or the cancel
                    // instead of spinning (two ranks spinning on a third
                    // is loom issue 53: its scheduler alternates between
                    // them for ever).
                    words.progress.wait_past(&seen);
                    spec.ends == Ends::Cancelled && cancel.load(Ordering::SeqCst)
                };
                agree(words.as_ref(), r, spec.pinned, timeout, &cancelled)
            })
        })
        .collect();
    if ranks.iter().any(|s| s.ends == Ends::Cancelled) {
        // The shutdown, at any moment: before a rank settled, between the
        // peers' settles, during a wait, after every rank decided.
        cancel.store(true, Ordering::SeqCst);
        words.progress.bump();
    }
    // (c) every rank ends.
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let end: Vec<u32> = (0..ranks.len()).map(|r| words.load(r)).collect();
    for (r, &w) in end.iter().enumerate() {
        assert!(is_final(w), "rank {r}'s word is unsettled after every rank returned: {end:#x?}");
        // (a) what a rank settled itself is its word for good.
        if let Some(mine) = words.own(r) {
            assert_eq!(w, mine, "rank {r}'s word changed after it was final: it settled {mine:#x}, it ends {w:#x}");
        }
    }
    // (b) one mode, the final words'.
    let words_say = if end.iter().all(|&w| w == SETTLED_PINNED) { OffloadMode::Pinned } else { OffloadMode::Pageable };
    for (r, res) in results.iter().enumerate() {
        let mode = match res {
            Ok(m) => *m,
            Err(_) => OffloadMode::Pageable,
        };
        assert_eq!(mode, words_say, "rank {r} ended {res:?}, the final words {end:#x?} say {words_say:?}: {results:?}");
        // Its error names what the final words say.
        match res {
            Ok(_) => {}
            Err(AgreementError::Cancelled { waiting }) if ranks[r].ends == Ends::Cancelled => {
                assert!(!waiting.is_empty(), "rank {r} reports a cancel that gave no word up");
                for &p in waiting {
                    assert_eq!(end[p], abandoned_by(r), "rank {r} reports it gave rank {p} up: words {end:#x?}");
                }
            }
            Err(AgreementError::Timeout { waiting, .. }) if ranks[r].ends == Ends::TimesOut => {
                assert!(!waiting.is_empty(), "rank {r} reports a timeout that gave no word up");
                for &p in waiting {
                    assert_eq!(end[p], abandoned_by(r), "rank {r} reports it gave rank {p} up: words {end:#x?}");
                }
            }
            Err(AgreementError::Abandoned { by, ranks: given_up }) => {
                assert!(end.iter().any(|&w| abandoner(w) == Some(*by)), "rank {r}: {res:?}, words {end:#x?}");
                assert!(!given_up.is_empty(), "rank {r}: {res:?} names no rank");
                for &p in given_up {
                    assert!(abandoner(end[p]).is_some(), "rank {r}: {res:?}, but words {end:#x?}");
                }
            }
            Err(e) => panic!("rank {r} ({:?}) returned {e:?}", ranks[r].ends),
        }
    }
}

/// Full bound 3 (about 130 s on 2 cores for the three scenarios), 2 in
/// ci/test (about 4 s).
const B: Bounds = Bounds { property: "P7", threads: 4, preemptions: 3, ci: None }.ci_at(2);

/// Rank 0 cancelled at any moment, ranks 1 and 2 waiting; all pinned.
const ONE_GIVES_UP: [Rank; 3] = [rank(true, Ends::Cancelled), rank(true, Ends::Waits), rank(true, Ends::Waits)];

models! {
    p7_three_ranks_one_gives_up_while_the_others_settle:
        check("p7_three_ranks_one_gives_up", B, || scenario(ONE_GIVES_UP, false));
    p7_three_ranks_one_gives_up_one_pageable:
        check("p7_three_ranks_one_pageable", B,
            || scenario([rank(true, Ends::Cancelled), rank(true, Ends::Waits), rank(false, Ends::Waits)], false));
    p7_three_ranks_two_give_up_while_one_settles:
        check("p7_three_ranks_two_give_up", B,
            || scenario([rank(true, Ends::Cancelled), rank(true, Ends::TimesOut), rank(true, Ends::Waits)], false));
    negative_n32_p7_give_up_overwrites_a_settled_word:
        negative("n32_give_up_overwrites_settled_word", Bounds { property: "N32", preemptions: 2, ..B },
            "changed after it was final", || scenario(ONE_GIVES_UP, true));
}
