//! Byte sizes as people write them on command lines.

/// Parses a size: a number with an optional unit. `K`, `M`, `G`, `T` and
/// `KiB` ... `TiB` are powers of 1024; `KB` ... `TB` powers of 1000; no unit
/// or `B` is bytes. Units are case-insensitive; fractions are allowed when
/// the result is a whole number of bytes (`1.5GiB`).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(format!("bad size {s:?}: expected a number and a unit such as 16GiB, 512MiB or 1G"));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "bad size {s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB)"
            ))
        }
    };
    let bytes = if let Ok(n) = num.parse::<u64>() {
        n.checked_mul(mult).ok_or_else(|| format!("bad size {s:?}: too large"))?
    } else {
        let f: f64 = num.parse().map_err(|_| format!("bad size {s:?}: {num:?} is not a number"))?;
        let b = f * mult as f64;
        if !b.is_finite() || b.fract() != 0.0 || b > u64::MAX as f64 {
            return Err(format!("bad size {s:?}: not a whole number of bytes"));
        }
        b as u64
    };
    usize::try_from(bytes).map_err(|_| format!("bad size {s:?}: too large for this machine"))
}

/// `16 GiB`, `1.50 GiB`, `256 MiB`, `12 KiB`, `100 B`.
pub fn fmt_bytes(n: usize) -> String {
    const UNITS: [(usize, &str); 4] = [(1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (u, name) in UNITS {
        if n >= u {
            return if n % u == 0 { format!("{} {name}", n / u) } else { format!("{:.2} {name}", n as f64 / u as f64) };
        }
    }
    format!("{n} B")
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size(" 8 KiB "), Ok(8 << 10));
        assert!(parse_size("").is_err());
        assert!(parse_size("GiB").is_err());
        assert!(parse_size("12XB").unwrap_err().contains("unknown unit"));
        assert!(parse_size("0.3B").unwrap_err().contains("whole number"));
        assert!(parse_size("99999999999T").is_err());
    }
}
