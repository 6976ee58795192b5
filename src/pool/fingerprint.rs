//! The pool's fingerprint (design 1.3): what its bytes mean, in three
//! parts, each compared field by field so that a refusal names the field.
//!
//! | part | record | filled by | checked by |
//! |---|---|---|---|
//! | config | [`ConfigRecord`]: model, KV dtype, tag, groups (tokens per block, SHA-256 of the layer names), tokens per hash, blocks per chunk, bytes per block per rank, world/tp/pp/pcp/dcp sizes, KV-cache layout, replicated layout | the creator, before `READY` | every process at open |
//! | layout (one per rank) | [`LayoutRecord`]: the rank's canonical tensors' page sizes, in order | that rank's first worker | that rank's workers |
//! | hashing | [`HashingRecord`]: hash algorithm, `NONE_HASH`, Python major.minor when the algorithm pickles | the first scheduler | schedulers |
//!
//! Each part is a state word and a record of fixed size in the index file
//! (`super::file`). The state word goes `UNSET -> FILLING(pid) -> SET` by
//! CAS ([`PartWord`]); the record is written once, between the two, by the
//! process that won the first CAS, and read only after `SET` is seen
//! (Acquire). A `FILLING` part whose filler is gone is reset to `UNSET`
//! (its generation moved on) and filled again.
//!
//! Records are stored as `u64` words ([`ConfigRecord::encode`]), strings as
//! bounded byte records ([`FixedStr`], a longer one refused with
//! [`PoolError::TooLong`]).

use super::error::PoolError;

/// KV-cache groups a config records.
pub const MAX_GROUPS: usize = 16;
/// Canonical tensors a rank's layout records.
pub const MAX_TENSORS: usize = 256;
/// Bytes of a model name.
pub const MODEL_BYTES: usize = 256;
/// Bytes of a tag (`kvo_pool_tag`).
pub const TAG_BYTES: usize = 128;
/// Bytes of a short name (dtype, KV-cache layout, hash algorithm).
pub const SHORT_BYTES: usize = 32;

/// A string of at most `N` bytes (`N` a multiple of 8), stored as a length
/// word and `N / 8` words.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct FixedStr<const N: usize> {
    len: usize,
    bytes: [u8; N],
}

impl<const N: usize> FixedStr<N> {
    const WORDS: usize = 1 + N / 8;

    /// `s`, or [`PoolError::TooLong`] naming `field`.
    pub fn new(field: &'static str, s: &str) -> Result<Self, PoolError> {
        if s.len() > N {
            return Err(PoolError::TooLong { field, len: s.len(), max: N });
        }
        let mut bytes = [0u8; N];
        bytes[..s.len()].copy_from_slice(s.as_bytes());
        Ok(FixedStr { len: s.len(), bytes })
    }

    /// The string (lossy where a corrupt record holds invalid UTF-8).
    pub fn as_str(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.bytes[..self.len])
    }

    fn put(&self, w: &mut Vec<u64>) {
        w.push(self.len as u64);
        w.extend(self.bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().expect("N is a multiple of 8"))));
    }

    fn take(r: &mut Reader<'_>, field: &str) -> Result<Self, String> {
        let len = r.word();
        if len > N as u64 {
            return Err(format!("{field}'s length is {len}, past its {N} bytes"));
        }
        let mut bytes = [0u8; N];
        for c in bytes.chunks_mut(8) {
            c.copy_from_slice(&r.word().to_le_bytes());
        }
        Ok(FixedStr { len: len as usize, bytes })
    }
}

impl<const N: usize> std::fmt::Debug for FixedStr<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.as_str())
    }
}

/// Reads words off a record in order.
struct Reader<'a> {
    words: &'a [u64],
    at: usize,
}

impl Reader<'_> {
    fn word(&mut self) -> u64 {
        let w = self.words.get(self.at).copied().unwrap_or(0);
        self.at += 1;
        w
    }
    fn u32(&mut self, field: &str) -> Result<u32, String> {
        let w = self.word();
        u32::try_from(w).map_err(|_| format!("{field} is {w}, past 32 bits"))
    }
}

fn digest_words(d: &[u8; 32], w: &mut Vec<u64>) {
    w.extend(d.chunks(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))));
}

fn take_digest(r: &mut Reader<'_>) -> [u8; 32] {
    let mut d = [0u8; 32];
    for c in d.chunks_mut(8) {
        c.copy_from_slice(&r.word().to_le_bytes());
    }
    d
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One KV-cache group of the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupRecord {
    /// Tokens per block of the group (vLLM's `block_size` for it).
    pub tokens_per_block: u32,
    /// SHA-256 of the group's layer names (how the engine joins them is
    /// the engine's rule; equal names give equal digests).
    pub layer_names_sha256: [u8; 32],
}

/// The config part (design 1.3): what every process of an engine knows
/// from `OffloadingConfig`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigRecord {
    /// The model's name.
    pub model: FixedStr<MODEL_BYTES>,
    /// The KV cache's dtype (`bfloat16`, ...).
    pub kv_dtype: FixedStr<SHORT_BYTES>,
    /// `kvo_pool_tag`: what the rest cannot see (a checkpoint revision).
    pub tag: FixedStr<TAG_BYTES>,
    /// The KV-cache groups (at most [`MAX_GROUPS`]).
    pub groups: Vec<GroupRecord>,
    /// Tokens per block hash.
    pub tokens_per_hash: u32,
    /// Blocks per offloaded chunk (a row).
    pub blocks_per_chunk: u32,
    /// `worker_kv_bytes_per_block`: bytes of one block on one rank.
    pub bytes_per_block: u64,
    /// The engine's world size.
    pub world_size: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline-parallel size.
    pub pp_size: u32,
    /// Prefill context-parallel size.
    pub pcp_size: u32,
    /// Decode context-parallel size.
    pub dcp_size: u32,
    /// vLLM's KV-cache layout (`NHD`, `HND`).
    pub kv_cache_layout: FixedStr<SHORT_BYTES>,
    /// `OffloadingConfig.replicated_layout`.
    pub replicated_layout: bool,
}

/// Words of an encoded [`ConfigRecord`].
pub const CONFIG_WORDS: usize = FixedStr::<MODEL_BYTES>::WORDS
    + 2 * FixedStr::<SHORT_BYTES>::WORDS
    + FixedStr::<TAG_BYTES>::WORDS
    + 1
    + MAX_GROUPS * 5
    + 9;

impl ConfigRecord {
    /// Refuses more groups than a record holds.
    pub fn check(&self) -> Result<(), PoolError> {
        if self.groups.len() > MAX_GROUPS {
            return Err(PoolError::TooMany { what: "KV-cache groups", count: self.groups.len(), max: MAX_GROUPS });
        }
        Ok(())
    }

    /// The record as [`CONFIG_WORDS`] words (groups past [`MAX_GROUPS`]
    /// are refused by [`ConfigRecord::check`] first).
    pub fn encode(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(CONFIG_WORDS);
        self.model.put(&mut w);
        self.kv_dtype.put(&mut w);
        self.tag.put(&mut w);
        w.push(self.groups.len() as u64);
        for g in (0..MAX_GROUPS).map(|i| self.groups.get(i)) {
            let g = g.copied().unwrap_or(GroupRecord { tokens_per_block: 0, layer_names_sha256: [0; 32] });
            w.push(u64::from(g.tokens_per_block));
            digest_words(&g.layer_names_sha256, &mut w);
        }
        w.push(u64::from(self.tokens_per_hash));
        w.push(u64::from(self.blocks_per_chunk));
        w.push(self.bytes_per_block);
        for s in [self.world_size, self.tp_size, self.pp_size, self.pcp_size, self.dcp_size] {
            w.push(u64::from(s));
        }
        self.kv_cache_layout.put(&mut w);
        w.push(u64::from(self.replicated_layout));
        debug_assert_eq!(w.len(), CONFIG_WORDS);
        w
    }

    /// The record of `words`, or what is corrupt in them.
    pub fn decode(words: &[u64]) -> Result<ConfigRecord, String> {
        let r = &mut Reader { words, at: 0 };
        let model = FixedStr::take(r, "model")?;
        let kv_dtype = FixedStr::take(r, "dtype")?;
        let tag = FixedStr::take(r, "kvo_pool_tag")?;
        let count = r.word();
        if count > MAX_GROUPS as u64 {
            return Err(format!("{count} groups, past {MAX_GROUPS}"));
        }
        let mut groups = Vec::with_capacity(count as usize);
        for i in 0..MAX_GROUPS {
            let g = GroupRecord { tokens_per_block: r.u32("tokens_per_block")?, layer_names_sha256: take_digest(r) };
            if (i as u64) < count {
                groups.push(g);
            }
        }
        let tokens_per_hash = r.u32("tokens_per_hash")?;
        let blocks_per_chunk = r.u32("blocks_per_chunk")?;
        let bytes_per_block = r.word();
        let world_size = r.u32("world_size")?;
        let tp_size = r.u32("tp_size")?;
        let pp_size = r.u32("pp_size")?;
        let pcp_size = r.u32("pcp_size")?;
        let dcp_size = r.u32("dcp_size")?;
        let kv_cache_layout = FixedStr::take(r, "kv_cache_layout")?;
        let replicated_layout = match r.word() {
            0 => false,
            1 => true,
            w => return Err(format!("replicated_layout is {w}, not 0 or 1")),
        };
        Ok(ConfigRecord {
            model,
            kv_dtype,
            tag,
            groups,
            tokens_per_hash,
            blocks_per_chunk,
            bytes_per_block,
            world_size,
            tp_size,
            pp_size,
            pcp_size,
            dcp_size,
            kv_cache_layout,
            replicated_layout,
        })
    }

    /// Every field by name and value, in order (the groups' count before
    /// the groups, so that two lists of one length name the same fields).
    pub fn fields(&self) -> Vec<(String, String)> {
        let mut f = vec![
            ("model".into(), self.model.as_str().into_owned()),
            ("dtype".into(), self.kv_dtype.as_str().into_owned()),
            ("kvo_pool_tag".into(), self.tag.as_str().into_owned()),
            ("groups".into(), self.groups.len().to_string()),
        ];
        for (i, g) in self.groups.iter().enumerate() {
            f.push((format!("group {i} tokens_per_block"), g.tokens_per_block.to_string()));
            f.push((format!("group {i} layer_names (SHA-256)"), hex(&g.layer_names_sha256)));
        }
        let n = |name: &str, v: u64| (name.to_string(), v.to_string());
        f.push(n("tokens_per_hash", self.tokens_per_hash.into()));
        f.push(n("blocks_per_chunk", self.blocks_per_chunk.into()));
        f.push(n("worker_kv_bytes_per_block", self.bytes_per_block));
        f.push(n("world_size", self.world_size.into()));
        f.push(n("tp_size", self.tp_size.into()));
        f.push(n("pp_size", self.pp_size.into()));
        f.push(n("pcp_size", self.pcp_size.into()));
        f.push(n("dcp_size", self.dcp_size.into()));
        f.push(("kv_cache_layout".into(), self.kv_cache_layout.as_str().into_owned()));
        f.push(("replicated_layout".into(), self.replicated_layout.to_string()));
        f
    }
}

/// A rank's layout part: its canonical tensors' page sizes, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutRecord {
    /// `page_size_bytes` of each tensor (at most [`MAX_TENSORS`]).
    pub page_sizes: Vec<u64>,
}

/// Words of an encoded [`LayoutRecord`].
pub const LAYOUT_WORDS: usize = 1 + MAX_TENSORS;

impl LayoutRecord {
    /// Refuses more tensors than a record holds.
    pub fn check(&self) -> Result<(), PoolError> {
        if self.page_sizes.len() > MAX_TENSORS {
            return Err(PoolError::TooMany { what: "KV tensors", count: self.page_sizes.len(), max: MAX_TENSORS });
        }
        Ok(())
    }

    /// The record as [`LAYOUT_WORDS`] words.
    pub fn encode(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(LAYOUT_WORDS);
        w.push(self.page_sizes.len() as u64);
        w.extend((0..MAX_TENSORS).map(|i| self.page_sizes.get(i).copied().unwrap_or(0)));
        w
    }

    /// The record of `words`, or what is corrupt in them.
    pub fn decode(words: &[u64]) -> Result<LayoutRecord, String> {
        let r = &mut Reader { words, at: 0 };
        let count = r.word();
        if count > MAX_TENSORS as u64 {
            return Err(format!("{count} tensors, past {MAX_TENSORS}"));
        }
        let all: Vec<u64> = (0..MAX_TENSORS).map(|_| r.word()).collect();
        Ok(LayoutRecord { page_sizes: all[..count as usize].to_vec() })
    }

    /// Every field by name and value (rank `rank`'s).
    pub fn fields(&self, rank: u8) -> Vec<(String, String)> {
        let mut f = vec![(format!("rank {rank} tensor count"), self.page_sizes.len().to_string())];
        for (i, p) in self.page_sizes.iter().enumerate() {
            f.push((format!("rank {rank} tensor {i} page_size_bytes"), p.to_string()));
        }
        f
    }
}

/// The hashing part: what makes two engines' block hashes equal (design 1.2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HashingRecord {
    /// `prefix_caching_hash_algo` (`sha256`, `sha256_cbor`, `xxhash`, ...).
    pub algorithm: FixedStr<SHORT_BYTES>,
    /// `NONE_HASH`'s bytes (16 or 32; at most 32).
    none_hash: Vec<u8>,
    /// Python's major and minor version, when the algorithm pickles.
    pub python: Option<(u8, u8)>,
}

/// Words of an encoded [`HashingRecord`].
pub const HASHING_WORDS: usize = FixedStr::<SHORT_BYTES>::WORDS + 1 + 4 + 1;

impl HashingRecord {
    /// A hashing record; a `NONE_HASH` longer than 32 bytes is refused.
    pub fn new(algorithm: &str, none_hash: &[u8], python: Option<(u8, u8)>) -> Result<HashingRecord, PoolError> {
        if none_hash.len() > 32 {
            return Err(PoolError::TooLong { field: "NONE_HASH", len: none_hash.len(), max: 32 });
        }
        Ok(HashingRecord {
            algorithm: FixedStr::new("hash algorithm", algorithm)?,
            none_hash: none_hash.to_vec(),
            python,
        })
    }

    /// `NONE_HASH`'s bytes.
    pub fn none_hash(&self) -> &[u8] {
        &self.none_hash
    }

    /// The record as [`HASHING_WORDS`] words.
    pub fn encode(&self) -> Vec<u64> {
        let mut w = Vec::with_capacity(HASHING_WORDS);
        self.algorithm.put(&mut w);
        w.push(self.none_hash.len() as u64);
        let mut d = [0u8; 32];
        d[..self.none_hash.len()].copy_from_slice(&self.none_hash);
        digest_words(&d, &mut w);
        w.push(match self.python {
            None => 0,
            Some((major, minor)) => (1 << 16) | (u64::from(major) << 8) | u64::from(minor),
        });
        w
    }

    /// The record of `words`, or what is corrupt in them.
    pub fn decode(words: &[u64]) -> Result<HashingRecord, String> {
        let r = &mut Reader { words, at: 0 };
        let algorithm = FixedStr::take(r, "hash algorithm")?;
        let len = r.word();
        if len > 32 {
            return Err(format!("NONE_HASH's length is {len}, past 32"));
        }
        let d = take_digest(r);
        let python = match r.word() {
            0 => None,
            w if w >> 16 == 1 => Some(((w >> 8) as u8, w as u8)),
            w => return Err(format!("Python version word {w:#x} is not one this version writes")),
        };
        Ok(HashingRecord { algorithm, none_hash: d[..len as usize].to_vec(), python })
    }

    /// Every field by name and value.
    pub fn fields(&self) -> Vec<(String, String)> {
        vec![
            ("hash algorithm".into(), self.algorithm.as_str().into_owned()),
            ("NONE_HASH".into(), hex(&self.none_hash)),
            (
                "Python version".into(),
                match self.python {
                    Some((a, b)) => format!("{a}.{b}"),
                    None => "none (the algorithm does not pickle)".into(),
                },
            ),
        ]
    }
}

/// The first field whose values differ: `(field, pool's, engine's)`.
pub fn first_difference(pool: &[(String, String)], engine: &[(String, String)]) -> Option<(String, String, String)> {
    for (p, e) in pool.iter().zip(engine) {
        if p != e {
            return Some((p.0.clone(), p.1.clone(), e.1.clone()));
        }
    }
    if pool.len() != engine.len() {
        // Only when counts differ, which come first and differ already.
        let name = |l: &[(String, String)]| l.get(pool.len().min(engine.len())).map(|f| f.0.clone());
        let field = name(pool).or_else(|| name(engine)).unwrap_or_default();
        return Some((field, "(none)".into(), "(none)".into()));
    }
    None
}

/// A part's state (bits 62-63 of its word).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartState {
    /// Nobody has filled it.
    Unset,
    /// A process (the word's pid) is writing the record.
    Filling,
    /// The record is written: read it after an Acquire load of the word.
    Set,
    /// Code 3: never written by this version.
    Invalid,
}

/// A part's state word: 0-31 the filler's pid (in `FILLING`), 32-61 a
/// generation (30 bits: moves on at every reset), 62-63 the state. Zero is
/// `UNSET` at generation 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartWord {
    /// The state.
    pub state: PartState,
    /// The generation.
    pub generation: u32,
    /// The filler's pid in `FILLING`, else 0.
    pub pid: u32,
}

const GEN30: u64 = (1 << 30) - 1;

impl PartWord {
    /// Decodes a raw word.
    pub fn decode(raw: u64) -> PartWord {
        let state = match raw >> 62 {
            0 => PartState::Unset,
            1 => PartState::Filling,
            2 => PartState::Set,
            _ => PartState::Invalid,
        };
        PartWord { state, generation: ((raw >> 32) & GEN30) as u32, pid: raw as u32 }
    }

    /// Encodes the word.
    pub fn encode(self) -> u64 {
        let s: u64 = match self.state {
            PartState::Unset => 0,
            PartState::Filling => 1,
            PartState::Set => 2,
            PartState::Invalid => 3,
        };
        (s << 62) | ((u64::from(self.generation) & GEN30) << 32) | u64::from(self.pid)
    }

    /// The generation after `g` (modulo 2^30).
    pub fn next_generation(g: u32) -> u32 {
        ((u64::from(g) + 1) & GEN30) as u32
    }
}

#[cfg(all(test, not(any(loom, shuttle))))]
mod tests {
    use super::*;

    fn config() -> ConfigRecord {
        ConfigRecord {
            model: FixedStr::new("model", "meta-llama/Llama-3.1-8B").unwrap(),
            kv_dtype: FixedStr::new("dtype", "bfloat16").unwrap(),
            tag: FixedStr::new("kvo_pool_tag", "").unwrap(),
            groups: vec![GroupRecord { tokens_per_block: 16, layer_names_sha256: [7; 32] }],
            tokens_per_hash: 16,
            blocks_per_chunk: 8,
            bytes_per_block: 131072,
            world_size: 2,
            tp_size: 2,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            kv_cache_layout: FixedStr::new("kv_cache_layout", "NHD").unwrap(),
            replicated_layout: false,
        }
    }

    #[test]
    fn records_round_trip() {
        let c = config();
        let w = c.encode();
        assert_eq!(w.len(), CONFIG_WORDS);
        assert_eq!(ConfigRecord::decode(&w).unwrap(), c);
        let l = LayoutRecord { page_sizes: vec![4096, 8192, 1] };
        assert_eq!(LayoutRecord::decode(&l.encode()).unwrap(), l);
        let h = HashingRecord::new("sha256", &[1; 32], Some((3, 12))).unwrap();
        assert_eq!(h.encode().len(), HASHING_WORDS);
        assert_eq!(HashingRecord::decode(&h.encode()).unwrap(), h);
        let h = HashingRecord::new("xxhash", &[2; 16], None).unwrap();
        assert_eq!(HashingRecord::decode(&h.encode()).unwrap(), h);
    }

    #[test]
    fn over_long_and_corrupt_records_are_refused() {
        let long = "m".repeat(MODEL_BYTES + 1);
        assert!(matches!(
            FixedStr::<MODEL_BYTES>::new("model", &long),
            Err(PoolError::TooLong { field: "model", len, max: MODEL_BYTES }) if len == MODEL_BYTES + 1
        ));
        assert!(FixedStr::<MODEL_BYTES>::new("model", &long[1..]).is_ok(), "exactly the capacity fits");
        assert!(matches!(HashingRecord::new("sha256", &[0; 33], None), Err(PoolError::TooLong { .. })));
        let mut c = config();
        c.groups = vec![c.groups[0]; MAX_GROUPS + 1];
        assert!(matches!(c.check(), Err(PoolError::TooMany { count: 17, .. })));
        let mut w = config().encode();
        w[0] = MODEL_BYTES as u64 + 1;
        assert!(ConfigRecord::decode(&w).unwrap_err().contains("model"));
        let mut w = config().encode();
        *w.last_mut().unwrap() = 2;
        assert!(ConfigRecord::decode(&w).unwrap_err().contains("replicated_layout"));
    }

    #[test]
    fn the_first_differing_field_is_named() {
        let a = config();
        let mut b = config();
        assert_eq!(first_difference(&a.fields(), &b.fields()), None);
        b.kv_dtype = FixedStr::new("dtype", "float16").unwrap();
        b.world_size = 4;
        assert_eq!(
            first_difference(&a.fields(), &b.fields()),
            Some(("dtype".into(), "bfloat16".into(), "float16".into()))
        );
        let mut c = config();
        c.groups.push(c.groups[0]);
        assert_eq!(first_difference(&a.fields(), &c.fields()), Some(("groups".into(), "1".into(), "2".into())));
    }

    #[test]
    fn part_words_round_trip() {
        for state in [PartState::Unset, PartState::Filling, PartState::Set, PartState::Invalid] {
            let w = PartWord { state, generation: GEN30 as u32, pid: u32::MAX };
            assert_eq!(PartWord::decode(w.encode()), w);
        }
        assert_eq!(PartWord::decode(0), PartWord { state: PartState::Unset, generation: 0, pid: 0 });
        assert_eq!(PartWord::next_generation(GEN30 as u32), 0);
    }
}
