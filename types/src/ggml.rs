//! The weight types a model file may hold ([`GgmlType`]: ggml's element types, by ggml's
//! names) and their format facts: values per block, bytes per block, ggml's type id.
//!
//! | type   | values/block | bytes/block | ggml id | layout (reference crate)          |
//! |--------|--------------|-------------|---------|-----------------------------------|
//! | F32    | 1            | 4           | 0       | IEEE binary32                     |
//! | F16    | 1            | 2           | 1       | IEEE binary16                     |
//! | BF16   | 1            | 2           | 30      | upper 16 bits of a binary32       |
//! | Q8_0   | 32           | 34          | 8       | `ggml.rs`                         |
//! | Q4_0   | 32           | 18          | 2       | `ggml.rs`                         |
//! | Q4_1   | 32           | 20          | 3       | `ggml.rs`                         |
//! | Q5_0   | 32           | 22          | 6       | `ggml_more.rs`                    |
//! | Q5_1   | 32           | 24          | 7       | `ggml_more.rs`                    |
//! | IQ4_NL | 32           | 18          | 20      | `ggml_more.rs`                    |
//! | Q2_K   | 256          | 84          | 10      | `ggml_more.rs`                    |
//! | Q3_K   | 256          | 110         | 11      | `ggml_more.rs`                    |
//! | Q4_K   | 256          | 144         | 12      | `ggml_more.rs`                    |
//! | Q5_K   | 256          | 176         | 13      | `ggml_more.rs`                    |
//! | Q6_K   | 256          | 210         | 14      | `ggml_more.rs`                    |
//! | IQ4_XS | 256          | 136         | 23      | `ggml_more.rs`                    |
//!
//! The byte layouts of the blocks are spelled out with the reference's dequantisers
//! (`reference/src/ggml.rs`, `reference/src/ggml_more.rs`); how the engine holds and
//! multiplies each type is its weight-kernel table (`src/wkernels/mod.rs`). Every `match`
//! on [`GgmlType`] in both crates lists every variant (no wildcard arm), so adding a type
//! makes the compiler name each place that must learn it (docs/contributing.md).

/// Values per block of the 32-wide block types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL).
pub const QK: usize = 32;

/// Values per super-block of the K-quants and IQ4_XS.
pub const QK_K: usize = 256;

/// The 16 levels of IQ4_NL and IQ4_XS codes (ggml's `kvalues_iq4nl`): nibble `n` stands
/// for `IQ4_VALUES[n]`.
pub const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The element types of weight tensors (ggml's types; the ggml type ids are
/// [`GgmlType::ggml_id`]). Variants carry ggml's own names (`Q4_K`, `IQ4_XS`), as every
/// tool prints them. The engine names this type `DType`.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    IQ4_NL,
    IQ4_XS,
}

impl GgmlType {
    /// Every type, in the order declared (the order error messages list them in).
    pub const ALL: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
    ];

    /// Values per block (1 for the plain types).
    pub const fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q8_0
            | GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q5_0
            | GgmlType::Q5_1
            | GgmlType::IQ4_NL => QK,
            GgmlType::Q2_K
            | GgmlType::Q3_K
            | GgmlType::Q4_K
            | GgmlType::Q5_K
            | GgmlType::Q6_K
            | GgmlType::IQ4_XS => QK_K,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q8_0 => 2 + QK,
            GgmlType::Q4_0 => 2 + QK / 2,
            GgmlType::Q4_1 => 4 + QK / 2,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::IQ4_NL => 18,
            GgmlType::Q2_K => 84,
            GgmlType::Q3_K => 110,
            GgmlType::Q4_K => 144,
            GgmlType::Q5_K => 176,
            GgmlType::Q6_K => 210,
            GgmlType::IQ4_XS => 136,
        }
    }

    /// ggml's type id (the `type` field of a GGUF tensor).
    pub const fn ggml_id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2_K => 10,
            GgmlType::Q3_K => 11,
            GgmlType::Q4_K => 12,
            GgmlType::Q5_K => 13,
            GgmlType::Q6_K => 14,
            GgmlType::IQ4_NL => 20,
            GgmlType::IQ4_XS => 23,
            GgmlType::BF16 => 30,
        }
    }

    /// The type of a ggml type id, if it is one of these.
    pub fn from_ggml_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    /// The type named `name` (ggml's spelling, as [`GgmlType::name`]).
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.name() == name)
    }

    /// ggml's name of the type (`"Q4_1"`).
    pub const fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::BF16 => "BF16",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q2_K => "Q2_K",
            GgmlType::Q3_K => "Q3_K",
            GgmlType::Q4_K => "Q4_K",
            GgmlType::Q5_K => "Q5_K",
            GgmlType::Q6_K => "Q6_K",
            GgmlType::IQ4_NL => "IQ4_NL",
            GgmlType::IQ4_XS => "IQ4_XS",
        }
    }

    /// Bytes needed for `n` values (`None` unless `n` is a whole number of blocks, or on
    /// overflow).
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// True for the block-quantised types.
    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Checks that `bytes` holds exactly `n` values of this type (the error names the
    /// lengths); the dequantisers of both crates call this first.
    pub fn check_len(self, n: usize, bytes: usize) -> Result<(), DequantError> {
        let block = self.block_len();
        let need = self
            .bytes_for(n)
            .ok_or(DequantError::PartialBlock { ty: self, n, block })?;
        if bytes != need {
            return Err(DequantError::Length {
                ty: self,
                n,
                need,
                got: bytes,
            });
        }
        Ok(())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a row could not be dequantised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    #[error("{ty:?}: {n} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n: usize,
        block: usize,
    },
    #[error("{ty:?}: {n} elements need {need} bytes, got {got}")]
    Length {
        ty: GgmlType,
        n: usize,
        need: usize,
        got: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_facts() {
        assert_eq!(GgmlType::Q8_0.block_bytes(), 34);
        assert_eq!(GgmlType::Q4_0.block_bytes(), 18);
        assert_eq!(GgmlType::Q4_1.block_bytes(), 20);
        assert_eq!(GgmlType::Q4_K.block_bytes(), 144);
        assert_eq!(GgmlType::BF16.block_len(), 1);
        assert_eq!(GgmlType::IQ4_XS.block_len(), 256);
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_for(300), None);
        assert_eq!(GgmlType::Q8_0.bytes_for(usize::MAX / 32 * 32), None); // overflow
    }

    #[test]
    fn ids_and_names_round_trip() {
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.ggml_id()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), GgmlType::ALL.len(), "one id per type");
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_ggml_id(t.ggml_id()), Some(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
            assert_eq!(t.to_string(), t.name());
        }
        assert_eq!(GgmlType::from_ggml_id(16), None); // IQ2_XXS
        assert_eq!(GgmlType::from_name("Q8_1"), None);
    }

    #[test]
    fn check_len_names_the_lengths() {
        assert_eq!(GgmlType::Q8_0.check_len(64, 68), Ok(()));
        assert_eq!(
            GgmlType::Q8_0.check_len(31, 34),
            Err(DequantError::PartialBlock {
                ty: GgmlType::Q8_0,
                n: 31,
                block: 32
            })
        );
        assert_eq!(
            GgmlType::Q4_1.check_len(32, 19),
            Err(DequantError::Length {
                ty: GgmlType::Q4_1,
                n: 32,
                need: 20,
                got: 19
            })
        );
    }
}
