//! The bytes a KV block must hold: a pure function of the block's key, so
//! every load can be checked byte for byte without keeping copies.

/// splitmix64: a fast, well-mixed 64-bit function of its input.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` with the contents of block `key` (8-byte words of
/// `mix(key, word index)`; a tail shorter than a word gets its prefix).
pub fn fill(key: u64, buf: &mut [u8]) {
    let seed = mix(key);
    let len = buf.len();
    let mut chunks = buf.chunks_exact_mut(8);
    for (i, c) in (&mut chunks).enumerate() {
        c.copy_from_slice(&mix(seed ^ i as u64).to_le_bytes());
    }
    let rem = chunks.into_remainder();
    if !rem.is_empty() {
        let w = mix(seed ^ (len / 8) as u64).to_le_bytes();
        let n = rem.len();
        rem.copy_from_slice(&w[..n]);
    }
}

/// Offset of the first byte of `buf` that differs from block `key`'s
/// contents, or None when all match.
pub fn first_mismatch(key: u64, buf: &[u8]) -> Option<usize> {
    let seed = mix(key);
    for (i, c) in buf.chunks(8).enumerate() {
        let w = mix(seed ^ i as u64).to_le_bytes();
        if c != &w[..c.len()] {
            let j = c.iter().zip(w.iter()).position(|(a, b)| a != b).unwrap_or(0);
            return Some(i * 8 + j);
        }
    }
    None
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
            if len > 8 {
                assert!(first_mismatch(43, &a).is_some());
                a[len - 1] ^= 1;
                assert_eq!(first_mismatch(42, &a), Some(len - 1));
            }
        }
    }
}
