//! `kvoffload pool ls | rm`: the node pools of a directory (design 1.4).
//!
//! `ls` writes nothing: each pool's index file is opened as an engine
//! opens it (never through a link, only a file of this user) and read.
//! `ls --reclaim` first sweeps each pool's dead engine entries (design
//! 3.6), this process the sweeper, and reports the entries it freed.
//! `rm` removes a pool's index file and its region files, refusing while
//! an engine entry is `LIVE` with a member alive (exit status 1) unless
//! `--force`.

use std::path::PathBuf;

use kvoffload::internal::pool::error::PoolError;
use kvoffload::internal::pool::file::{self, layout::PoolState, PoolSummary};
use kvoffload::internal::region::DEFAULT_SHM_DIR;
use kvoffload::units::fmt_bytes;

#[derive(clap::Subcommand, Debug)]
pub enum Pool {
    /// One line per pool of the directory: name, index bytes, slots, sets
    /// and ways, ranks, the fingerprint's summary (model, dtype, tokens per
    /// block, world size, hash), slots free / writing / readable / held,
    /// engines live / dead, created, last store. Writes nothing unless
    /// --reclaim.
    Ls(LsArgs),
    /// Remove a pool: its index file and its region files. Refused (exit
    /// status 1) while an engine entry is live with a live member, naming
    /// the entry and its pids; --force removes anyway (running engines keep
    /// their mappings).
    Rm(RmArgs),
}

#[derive(clap::Args, Debug)]
pub struct LsArgs {
    /// The pools' directory (a tmpfs or hugetlbfs mount).
    #[arg(long, default_value = DEFAULT_SHM_DIR)]
    dir: PathBuf,
    /// One JSON object per line instead of text.
    #[arg(long)]
    json: bool,
    /// Sweep each pool's dead engine entries first (every member gone:
    /// their holds dropped, their unfinished writes freed, the entry freed),
    /// this process the sweeper, and report the entries freed.
    #[arg(long)]
    reclaim: bool,
}

#[derive(clap::Args, Debug)]
pub struct RmArgs {
    /// The pool's name (`kvo_pool`).
    name: String,
    /// The pools' directory.
    #[arg(long, default_value = DEFAULT_SHM_DIR)]
    dir: PathBuf,
    /// Remove it even while engines use it.
    #[arg(long)]
    force: bool,
}

/// Exit status: 0 done, 1 `rm` refused because the pool is in use, 2
/// anything else (as every subcommand: the error on one line).
pub fn run(p: Pool) -> Result<i32, String> {
    match p {
        Pool::Ls(a) => ls(a),
        Pool::Rm(a) => rm(a),
    }
}

fn ls(a: LsArgs) -> Result<i32, String> {
    let pools = file::list_with(&a.dir, a.reclaim).map_err(|e| e.to_string())?;
    if pools.is_empty() && !a.json {
        println!("no kvoffload pools in {}", a.dir.display());
    }
    for (name, s) in pools {
        let line = match (&s, a.json) {
            (Ok(s), false) => text(s),
            (Ok(s), true) => json(s),
            (Err(e), false) => format!("{name}  unreadable: {e}"),
            (Err(e), true) => format!("{{\"name\":{},\"error\":{}}}", q(&name), q(&e.to_string())),
        };
        println!("{line}");
    }
    Ok(0)
}

fn rm(a: RmArgs) -> Result<i32, String> {
    match file::remove(&a.dir, &a.name, a.force) {
        Ok(r) => {
            for e in &r.forced_over {
                eprintln!("kvoffload: removed while in use by {e} (--force)");
            }
            for f in &r.files {
                println!("removed {}", f.display());
            }
            Ok(0)
        }
        Err(e @ PoolError::InUse { .. }) => {
            eprintln!("kvoffload: {e}");
            Ok(1)
        }
        Err(e) => Err(e.to_string()),
    }
}

fn state(s: &PoolSummary) -> String {
    match s.state {
        PoolState::Ready => format!("ready ({} registered)", s.registered),
        PoolState::Init => "being made".into(),
        PoolState::Closing => match s.closer {
            Some(c) if c.removing => format!("being removed (by pid {})", c.pid),
            Some(c) => format!("closing (pid {} decides)", c.pid),
            None => "closing".into(),
        },
        PoolState::Invalid => "corrupt".into(),
    }
}

fn blocks(s: &PoolSummary) -> String {
    let v: Vec<String> = s.config.groups.iter().map(|g| g.tokens_per_block.to_string()).collect();
    v.join(",")
}

fn hash(s: &PoolSummary) -> String {
    s.hashing.as_ref().map_or_else(|| "-".into(), |h| h.algorithm.as_str().into_owned())
}

fn live_pids(s: &PoolSummary) -> String {
    s.engines.live.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ")
}

fn text(s: &PoolSummary) -> String {
    let g = s.geometry;
    let c = &s.config;
    let sl = s.slots;
    let mut line = format!(
        "{}  {}  index {}  {} slots ({} sets x {} ways)  {} ranks x {} a row  model {}  dtype {}  block {}  world {}  hash {}  \
         slots free {} writing {} readable {} held {}  engines live {} sweeping {} dead {}  created {}  last store {}",
        s.name,
        state(s),
        fmt_bytes(s.index_bytes as usize),
        g.slots,
        g.sets(),
        g.ways,
        g.ranks,
        fmt_bytes(s.row_bytes as usize),
        c.model.as_str(),
        c.kv_dtype.as_str(),
        blocks(s),
        c.world_size,
        hash(s),
        sl.free,
        sl.writing,
        sl.readable,
        sl.held,
        s.engines.live.len(),
        s.engines.sweeping.len(),
        s.engines.dead,
        utc(s.created_unix_nanos / 1_000_000_000),
        s.last_store_unix_ms.map_or_else(|| "-".into(), |ms| utc(ms / 1000)),
    );
    if sl.corrupt > 0 {
        line += &format!("  CORRUPT slots {}", sl.corrupt);
    }
    if !s.engines.live.is_empty() {
        line += &format!("  ({})", live_pids(s));
    }
    if !s.same_boot {
        line += "  (made in another boot)";
    }
    if let Some(r) = &s.reclaimed {
        line += &match r.as_slice() {
            [] => "  reclaimed none".to_string(),
            r => format!("  reclaimed engines {}", entries(r)),
        };
    }
    line
}

/// Entry indices, comma-separated.
fn entries(r: &[u8]) -> String {
    r.iter().map(u8::to_string).collect::<Vec<_>>().join(",")
}

/// A JSON string.
fn q(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for ch in s.chars() {
        match ch {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            c if (c as u32) < 0x20 => o.push_str(&format!("\\u{:04x}", c as u32)),
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn json(s: &PoolSummary) -> String {
    let g = s.geometry;
    let c = &s.config;
    let sl = s.slots;
    let live: Vec<String> = s
        .engines
        .live
        .iter()
        .map(|e| {
            let pids: Vec<String> = e.pids.iter().map(u32::to_string).collect();
            format!("{{\"index\":{},\"pids\":[{}]}}", e.index, pids.join(","))
        })
        .collect();
    format!(
        "{{\"name\":{},\"path\":{},\"state\":{},\"index_bytes\":{},\"slots\":{},\"sets\":{},\"ways\":{},\"ranks\":{},\
         \"row_bytes\":{},\"model\":{},\"dtype\":{},\"tokens_per_block\":[{}],\"world_size\":{},\"hash\":{},\
         \"free\":{},\"writing\":{},\"readable\":{},\"held\":{},\"corrupt\":{},\"engines_live\":[{}],\"engines_sweeping\":{},\"engines_dead\":{},\
         \"created_unix\":{},\"last_store_unix_ms\":{},\"same_boot\":{}{}}}",
        q(&s.name),
        q(&s.path.display().to_string()),
        q(&state(s)),
        s.index_bytes,
        g.slots,
        g.sets(),
        g.ways,
        g.ranks,
        s.row_bytes,
        q(&c.model.as_str()),
        q(&c.kv_dtype.as_str()),
        blocks(s),
        c.world_size,
        s.hashing.as_ref().map_or_else(|| "null".into(), |h| q(&h.algorithm.as_str())),
        sl.free,
        sl.writing,
        sl.readable,
        sl.held,
        sl.corrupt,
        live.join(","),
        s.engines.sweeping.len(),
        s.engines.dead,
        s.created_unix_nanos / 1_000_000_000,
        s.last_store_unix_ms.map_or_else(|| "null".into(), |v| v.to_string()),
        s.same_boot,
        s.reclaimed.as_ref().map_or_else(String::new, |r| format!(",\"reclaimed\":[{}]", entries(r))),
    )
}

/// Unix seconds as `YYYY-MM-DDTHH:MM:SSZ` (the civil calendar of days since
/// 1970, Howard Hinnant's algorithm).
fn utc(secs: u64) -> String {
    let days = (secs / 86400) as i64;
    let rem = secs % 86400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates_and_json_strings() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(q("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
