//! CRC32C (Castagnoli), as the `crc32c` package computes it for record_batch.py:
//! `value(data, previous)` continues a checksum, so `value(b, value(a, 0))` is the
//! checksum of `a + b`. SSE 4.2's crc32 instruction where the CPU has it (checked once),
//! else a table, byte by byte.

const POLYNOMIAL: u32 = 0x82F6_3B78; // reflected

const fn table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut index = 0;
    while index < 256 {
        let mut crc = index as u32;
        let mut bit = 0;
        while bit < 8 {
            crc = if crc & 1 != 0 { (crc >> 1) ^ POLYNOMIAL } else { crc >> 1 };
            bit += 1;
        }
        table[index] = crc;
        index += 1;
    }
    table
}

static TABLE: [u32; 256] = table();

fn update_table(mut crc: u32, data: &[u8]) -> u32 {
    for &byte in data {
        crc = TABLE[((crc ^ byte as u32) & 0xFF) as usize] ^ (crc >> 8);
    }
    crc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn update_sse42(crc: u32, data: &[u8]) -> u32 {
    use std::arch::x86_64::{_mm_crc32_u64, _mm_crc32_u8};
    let mut crc = crc as u64;
    let mut chunks = data.chunks_exact(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        crc = _mm_crc32_u64(crc, u64::from_le_bytes(word));
    }
    let mut crc = crc as u32;
    for &byte in chunks.remainder() {
        crc = _mm_crc32_u8(crc, byte);
    }
    crc
}

/// The checksum of `data` continued from `previous` (0 to start).
pub fn value(data: &[u8], previous: u32) -> u32 {
    let crc = !previous;
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("sse4.2") {
            // SAFETY: the CPU was just found to have SSE 4.2.
            return !unsafe { update_sse42(crc, data) };
        }
    }
    !update_table(crc, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        // RFC 3720, B.4: 32 bytes of zeros, and the nine digits.
        assert_eq!(value(&[0u8; 32], 0), 0x8A91_36AA);
        assert_eq!(value(b"123456789", 0), 0xE306_9283);
        assert_eq!(!update_table(!0, b"123456789"), 0xE306_9283);
    }

    #[test]
    fn continues() {
        let whole = value(b"hello, world", 0);
        assert_eq!(value(b", world", value(b"hello", 0)), whole);
    }
}
