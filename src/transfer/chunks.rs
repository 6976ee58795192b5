//! The coordinator's registration chunks, as the engine looks them up: by
//! host address, in O(1) when they are equal and back to back (the usual
//! row-aligned chunks), by binary search otherwise.

use crate::protocol::Coordinator;
use crate::runtime::Fragment;

/// One chunk: its host range and its index in the coordinator.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct ChunkSpan {
    pub addr: usize,
    pub len: usize,
    pub index: usize,
}

/// The chunks sorted by address.
#[derive(Clone, Debug, Default)]
pub(crate) struct Chunks {
    spans: Vec<ChunkSpan>,
    /// `(base, len)` when every chunk but the last is `len` long and they
    /// follow each other from `base` without gaps.
    uniform: Option<(usize, usize)>,
}

impl Chunks {
    /// A snapshot of `coord`'s chunks (their ranges never change).
    pub fn of(coord: &Coordinator) -> Self {
        Self::new(
            (0..coord.pinning().chunk_count())
                .map(|i| {
                    let (addr, len) = coord.pinning().chunk_range(i);
                    ChunkSpan { addr, len, index: i }
                })
                .collect(),
        )
    }

    pub fn new(mut spans: Vec<ChunkSpan>) -> Self {
        spans.retain(|c| c.len > 0);
        spans.sort_by_key(|c| c.addr);
        let uniform = spans.first().map(|f| (f.addr, f.len)).filter(|&(base, len)| {
            spans.iter().enumerate().all(|(i, c)| c.addr == base + i * len && (c.len == len || i + 1 == spans.len()))
        });
        Chunks { spans, uniform }
    }

    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Chunk at position `pos` (by address).
    pub fn get(&self, pos: usize) -> ChunkSpan {
        self.spans[pos]
    }

    /// Position of the chunk holding byte `addr`, if any.
    pub fn locate(&self, addr: usize) -> Option<usize> {
        let pos = match self.uniform {
            Some((base, len)) => addr.checked_sub(base)? / len,
            None => self.spans.partition_point(|c| c.addr <= addr).checked_sub(1)?,
        };
        let c = self.spans.get(pos)?;
        (addr >= c.addr && addr - c.addr < c.len).then_some(pos)
    }

    /// Calls `f(pos, piece)` for `frag` cut at chunk boundaries; false (and
    /// stops) when a byte lies outside every chunk.
    pub fn split(&self, frag: Fragment, mut f: impl FnMut(usize, Fragment)) -> bool {
        let mut rest = frag;
        while rest.bytes > 0 {
            let Some(pos) = self.locate(rest.host) else {
                return false;
            };
            let c = self.spans[pos];
            let take = rest.bytes.min(c.addr + c.len - rest.host);
            f(pos, Fragment { bytes: take, ..rest });
            rest = Fragment { host: rest.host + take, device: rest.device.offset(take), bytes: rest.bytes - take };
        }
        true
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::runtime::DevicePtr;

    fn span(addr: usize, len: usize, index: usize) -> ChunkSpan {
        ChunkSpan { addr, len, index }
    }

    #[test]
    fn uniform_and_irregular_lookups_agree() {
        let uniform = Chunks::new(vec![span(1000, 100, 0), span(1100, 100, 1), span(1200, 50, 2)]);
        assert!(uniform.uniform.is_some());
        let gappy = Chunks::new(vec![span(1200, 50, 2), span(1000, 100, 0), span(1105, 95, 1)]);
        assert!(gappy.uniform.is_none());
        for a in 900..1300 {
            let u = uniform.locate(a);
            let want = if (1000..1250).contains(&a) { Some((a - 1000) / 100) } else { None };
            assert_eq!(u, want, "{a}");
            let g = gappy.locate(a);
            let want = match a {
                1000..=1099 => Some(0),
                1105..=1199 => Some(1),
                1200..=1249 => Some(2),
                _ => None,
            };
            assert_eq!(g, want, "{a}");
        }
    }

    #[test]
    fn split_cuts_at_boundaries_and_refuses_gaps() {
        let c = Chunks::new(vec![span(0, 100, 0), span(100, 100, 1), span(300, 100, 2)]);
        let mut got = Vec::new();
        assert!(c.split(Fragment { host: 50, device: DevicePtr(5000), bytes: 120 }, |p, f| got.push((p, f))));
        assert_eq!(
            got,
            vec![
                (0, Fragment { host: 50, device: DevicePtr(5000), bytes: 50 }),
                (1, Fragment { host: 100, device: DevicePtr(5050), bytes: 70 })
            ]
        );
        assert!(!c.split(Fragment { host: 150, device: DevicePtr(0), bytes: 100 }, |_, _| {}));
    }
}
