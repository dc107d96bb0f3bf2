//! The machine's last-level cache, as the kernel reports it (what `--cold` must overflow).

use std::sync::OnceLock;

/// The size in bytes of the largest cache CPU 0 sees (its last level), from
/// `/sys/devices/system/cpu/cpu0/cache`; `None` where the kernel does not say.
pub(super) fn last_level() -> Option<usize> {
    static LLC: OnceLock<Option<usize>> = OnceLock::new();
    *LLC.get_or_init(|| {
        let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        dir.filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with("index"))
            .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
            .filter_map(|s| parse(s.trim()))
            .max()
    })
}

/// "32768K" or "1M" or "512" (bytes) as sysfs writes cache sizes.
fn parse(s: &str) -> Option<usize> {
    let (num, mul) = match s.as_bytes().last()? {
        b'K' => (&s[..s.len() - 1], 1 << 10),
        b'M' => (&s[..s.len() - 1], 1 << 20),
        b'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

#[cfg(test)]
mod tests {
    #[test]
    fn sysfs_sizes_parse() {
        assert_eq!(super::parse("32768K"), Some(32 << 20));
        assert_eq!(super::parse("1M"), Some(1 << 20));
        assert_eq!(super::parse("512"), Some(512));
        assert_eq!(super::parse("K"), None);
        assert_eq!(super::parse(""), None);
    }
}
