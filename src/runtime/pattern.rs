//! The bytes a KV block must hold in `kvoffload run` and in tests that need
//! checkable data: a pure function of a key, so any range of a block can be
//! written or checked without keeping copies.
//!
//! Part of the runtime's contract: the runtime's pattern kernels
//! ([`super::Kernel::PatternFill`], [`super::Kernel::PatternCheck`]) write
//! and check exactly these contents, on the real GPU (PTX) and on the
//! simulated one, which calls these functions.
//!
//! Word `i` (little-endian `u64`) of the contents of `key` is
//! `mix(mix(key) ^ i)`, with `mix` splitmix64's finaliser. A range that ends
//! inside a word holds that word's prefix.

/// splitmix64: a fast, well-mixed 64-bit function of its input.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Word `index` of the contents of `key`.
pub fn word(key: u64, index: u64) -> u64 {
    mix(mix(key) ^ index)
}

/// Fills `buf` with the contents of block `key` (8-byte words of
/// `mix(key, word index)`; a tail shorter than a word gets its prefix).
pub fn fill(key: u64, buf: &mut [u8]) {
    fill_from(key, 0, buf);
}

/// Fills `buf` with words `first_word, first_word + 1, ...` of the contents
/// of `key`; a tail shorter than a word gets the prefix of the next word.
/// `fill_from(key, n, &mut b[8 * n..])` writes what `fill(key, b)` writes
/// there.
pub fn fill_from(key: u64, first_word: u64, buf: &mut [u8]) {
    let seed = mix(key);
    let mut words = buf.chunks_exact_mut(8);
    let mut i = first_word;
    for c in &mut words {
        c.copy_from_slice(&mix(seed ^ i).to_le_bytes());
        i = i.wrapping_add(1);
    }
    let tail = words.into_remainder();
    let n = tail.len();
    tail.copy_from_slice(&mix(seed ^ i).to_le_bytes()[..n]);
}

/// Offset of the first byte of `buf` that differs from block `key`'s
/// contents, or None when all match.
pub fn first_mismatch(key: u64, buf: &[u8]) -> Option<usize> {
    first_mismatch_from(key, 0, buf)
}

/// Like [`first_mismatch`], for `buf` holding words `first_word, ...`.
pub fn first_mismatch_from(key: u64, first_word: u64, buf: &[u8]) -> Option<usize> {
    let seed = mix(key);
    for (i, c) in buf.chunks(8).enumerate() {
        let w = mix(seed ^ first_word.wrapping_add(i as u64)).to_le_bytes();
        if c != &w[..c.len()] {
            let j = c.iter().zip(w.iter()).position(|(a, b)| a != b).unwrap_or(0);
            return Some(i * 8 + j);
        }
    }
    None
}

/// Number of 8-byte words of `buf` (a final shorter piece counts as one
/// word) that differ from words `first_word, ...` of the contents of `key`.
pub fn mismatched_words(key: u64, first_word: u64, buf: &[u8]) -> u64 {
    let seed = mix(key);
    let mut words = buf.chunks_exact(8);
    let mut i = first_word;
    let mut bad = 0;
    for c in &mut words {
        let got = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        bad += u64::from(got != mix(seed ^ i));
        i = i.wrapping_add(1);
    }
    let tail = words.remainder();
    if tail != &mix(seed ^ i).to_le_bytes()[..tail.len()] {
        bad += 1;
    }
    bad
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_and_check_agree_and_keys_differ() {
        for len in [0usize, 1, 7, 8, 9, 4096, 4099] {
            let mut a = vec![0u8; len];
            fill(42, &mut a);
            assert_eq!(first_mismatch(42, &a), None, "len {len}");
            assert_eq!(mismatched_words(42, 0, &a), 0, "len {len}");
            if len > 8 {
                assert!(first_mismatch(43, &a).is_some());
                a[len - 1] ^= 1;
                assert_eq!(first_mismatch(42, &a), Some(len - 1));
                assert_eq!(mismatched_words(42, 0, &a), 1);
                a[0] ^= 0x80;
                assert_eq!(mismatched_words(42, 0, &a), 2);
            }
        }
    }

    #[test]
    fn ranges_of_a_block_are_the_block() {
        let mut whole = vec![0u8; 4099];
        fill(7, &mut whole);
        for start_word in [0usize, 1, 100, 511, 512] {
            let from = start_word * 8;
            let mut part = vec![0u8; whole.len() - from];
            fill_from(7, start_word as u64, &mut part);
            assert_eq!(part, whole[from..], "from word {start_word}");
            assert_eq!(first_mismatch_from(7, start_word as u64, &part), None);
        }
        for i in 0..512u64 {
            let at = i as usize * 8;
            assert_eq!(word(7, i).to_le_bytes(), whole[at..at + 8]);
        }
    }

    #[test]
    fn the_tail_is_the_prefix_of_the_next_word() {
        let mut a = [0u8; 11];
        fill_from(9, 5, &mut a);
        assert_eq!(a[..8], word(9, 5).to_le_bytes());
        assert_eq!(a[8..], word(9, 6).to_le_bytes()[..3]);
    }
}
