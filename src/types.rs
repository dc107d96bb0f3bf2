//! Element types and reductions.

use bytemuck::Pod;
use std::fmt;
use std::sync::Arc;

pub use half::{bf16, f16};

/// The element types collectives work on, with a wire code so ranks that disagree on the type
/// get [`Error::Mismatch`](crate::Error) instead of reinterpreted bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(u8)]
pub enum DType {
    /// `f32`
    F32 = 1,
    /// `f64`
    F64 = 2,
    /// [`f16`](struct@f16) (IEEE binary16)
    F16 = 3,
    /// [`bf16`] (bfloat16)
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

mod sealed {
    pub trait Sealed {}
}

/// A type collectives can reduce: `f32`, `f64`, [`f16`](struct@f16), [`bf16`], `i8`…`i64`, `u8`…`u64`.
///
/// Integer sums and products wrap on overflow (the same on every rank, never a panic). Float
/// `min`/`max` follow `a < b` / `a > b` comparisons, so a NaN operand yields the other operand
/// or the NaN depending on position; results are still identical on every rank.
pub trait Element: Pod + PartialOrd + Send + Sync + fmt::Debug + sealed::Sealed + 'static {
    /// The wire code of this type.
    const DTYPE: DType;
    /// `a + b` (wrapping for integers).
    fn add(a: Self, b: Self) -> Self;
    /// `a * b` (wrapping for integers).
    fn mul(a: Self, b: Self) -> Self;
}

macro_rules! int_element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
        }
    )*};
}
int_element!(i8 => I8, i16 => I16, i32 => I32, i64 => I64, u8 => U8, u16 => U16, u32 => U32, u64 => U64);

macro_rules! float_element {
    ($($t:ty => $d:ident),*) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline(always)]
            fn add(a: Self, b: Self) -> Self { a + b }
            #[inline(always)]
            fn mul(a: Self, b: Self) -> Self { a * b }
        }
    )*};
}
float_element!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16);

/// A user-supplied reduction: `f(acc, other)` folds `other` into `acc` element-wise. It must
/// give the same result on every rank for the same inputs.
pub type CustomReduce<T> = Arc<dyn Fn(&mut [T], &[T]) + Send + Sync>;

/// How a reducing collective combines values.
#[derive(Clone)]
#[non_exhaustive]
pub enum ReduceOp<T> {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Product,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// A custom element-wise fold; see [`CustomReduce`].
    Custom(CustomReduce<T>),
}

impl<T> fmt::Debug for ReduceOp<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "Sum",
            ReduceOp::Product => "Product",
            ReduceOp::Min => "Min",
            ReduceOp::Max => "Max",
            ReduceOp::Custom(_) => "Custom",
        })
    }
}

impl<T: Element> ReduceOp<T> {
    /// A custom reduction from a closure; see [`CustomReduce`].
    pub fn custom(f: impl Fn(&mut [T], &[T]) + Send + Sync + 'static) -> Self {
        ReduceOp::Custom(Arc::new(f))
    }

    /// A code for the wire descriptor (every custom reduction shares one).
    pub(crate) fn code(&self) -> u64 {
        match self {
            ReduceOp::Sum => 1,
            ReduceOp::Product => 2,
            ReduceOp::Min => 3,
            ReduceOp::Max => 4,
            ReduceOp::Custom(_) => 5,
        }
    }

    /// Folds `src` into `acc` element-wise. The lengths must be equal.
    pub fn apply(&self, acc: &mut [T], src: &[T]) {
        debug_assert_eq!(acc.len(), src.len());
        match self {
            ReduceOp::Sum => zip_with(acc, src, T::add),
            ReduceOp::Product => zip_with(acc, src, T::mul),
            ReduceOp::Min => zip_with(acc, src, |a, b| if b < a { b } else { a }),
            ReduceOp::Max => zip_with(acc, src, |a, b| if b > a { b } else { a }),
            ReduceOp::Custom(f) => f(acc, src),
        }
    }
}

/// The element-wise loop every built-in reduction runs; written so LLVM vectorises it (plain
/// indexable slices of equal length, no early exits).
#[inline(always)]
fn zip_with<T: Copy>(acc: &mut [T], src: &[T], f: impl Fn(T, T) -> T) {
    let n = acc.len().min(src.len());
    let (acc, src) = (&mut acc[..n], &src[..n]);
    for i in 0..n {
        acc[i] = f(acc[i], src[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reductions_on_every_kind_of_type() {
        let mut a = [1i8, 127, -5];
        ReduceOp::Sum.apply(&mut a, &[1, 1, -7]);
        assert_eq!(a, [2, -128, -12], "integer sums wrap");
        let mut b = [2.0f32, -1.0, 3.0];
        ReduceOp::Max.apply(&mut b, &[1.0, 5.0, 3.5]);
        assert_eq!(b, [2.0, 5.0, 3.5]);
        let mut c = [f16::from_f32(1.5), f16::from_f32(2.0)];
        ReduceOp::Product.apply(&mut c, &[f16::from_f32(2.0), f16::from_f32(0.5)]);
        assert_eq!(c, [f16::from_f32(3.0), f16::from_f32(1.0)]);
        let mut d = [bf16::from_f32(4.0)];
        ReduceOp::Min.apply(&mut d, &[bf16::from_f32(-4.0)]);
        assert_eq!(d, [bf16::from_f32(-4.0)]);
        let mut e = [3u64, 4];
        ReduceOp::custom(|acc: &mut [u64], x: &[u64]| acc.iter_mut().zip(x).for_each(|(a, b)| *a = *a * 10 + b))
            .apply(&mut e, &[1, 2]);
        assert_eq!(e, [31, 42]);
    }
}
