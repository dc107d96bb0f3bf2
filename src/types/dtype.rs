//! [`DType`]: the element types as values, for the runtime-typed calls and the wire.

use std::fmt;

/// The element types collectives work on, with a wire code so ranks that disagree on the type
/// get [`Error::Mismatch`](crate::Error) instead of reinterpreted bytes.
///
/// Also the runtime type of the byte-buffer collectives (`Context::allreduce_bytes` and its
/// siblings), for engines and bindings that learn the type at run time:
///
/// ```
/// use ferrogloo::DType;
/// let t: DType = "bf16".parse()?;
/// assert_eq!((t.size(), t.name()), (2, "bf16"));
/// # Ok::<(), ferrogloo::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum DType {
    /// `f32`
    F32 = 1,
    /// `f64`
    F64 = 2,
    /// [`f16`](half::f16) (IEEE binary16)
    F16 = 3,
    /// [`bf16`](half::bf16) (bfloat16)
    BF16 = 4,
    /// `i8`
    I8 = 5,
    /// `i16`
    I16 = 6,
    /// `i32`
    I32 = 7,
    /// `i64`
    I64 = 8,
    /// `u8`
    U8 = 9,
    /// `u16`
    U16 = 10,
    /// `u32`
    U32 = 11,
    /// `u64`
    U64 = 12,
}

impl DType {
    /// Every element type, in wire-code order.
    pub const ALL: [DType; 12] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::I8 | DType::U8 => 1,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The Rust name of the type (`"f32"`, `"bf16"`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
        }
    }

    /// Whether it is a floating-point type (`f32`, `f64`, `f16`, `bf16`).
    pub(crate) const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    /// The type with wire code `code`.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|d| *d as u8 == code)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;

    /// Parses a type name as [`DType::name`] writes it (`"f32"`, `"bf16"`, ...).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|d| d.name() == s).ok_or_else(|| {
            let names: Vec<&str> = Self::ALL.iter().map(|d| d.name()).collect();
            crate::Error::invalid(format!("unknown element type {s:?} (one of {})", names.join(", ")))
        })
    }
}
