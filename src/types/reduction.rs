//! The one reduction type ([`Reduction`]), its byte-level fold and finish for the
//! runtime-typed calls, and the crate's typed fold ([`Fold`]: a reduction or a caller's closure).

use super::{DType, Element, bf16, f16};
use bytemuck::Pod;

/// How a reducing collective combines the ranks' values: the one reduction type of every call,
/// typed ([`Context::allreduce`](crate::Context::allreduce) and its siblings), runtime-typed
/// (`Context::allreduce_bytes`…), the [engine](crate::engine) and the GPU calls. A fold of
/// your own goes to the `*_custom` calls ([`Context::allreduce_custom`](crate::Context::allreduce_custom)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reduction {
    /// Sum (wrapping for integers).
    Sum,
    /// Product (wrapping for integers).
    Product,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// [`Sum`](Self::Sum), then each element of the result multiplied by 1 / (the number of
    /// ranks that contributed), once, on the ranks that hold the result. Floating-point
    /// element types only: an integer type is [`Error::InvalidArgument`](crate::Error).
    Average,
}

impl Reduction {
    /// The name the benchmark and error messages use (`"sum"`, `"product"`, `"min"`, `"max"`,
    /// `"average"`).
    pub const fn name(self) -> &'static str {
        match self {
            Reduction::Sum => "sum",
            Reduction::Product => "product",
            Reduction::Min => "min",
            Reduction::Max => "max",
            Reduction::Average => "average",
        }
    }

    /// Its code in a call's descriptor, which ranks compare (a custom fold is 5).
    pub(crate) const fn code(self) -> u8 {
        match self {
            Reduction::Sum => 1,
            Reduction::Product => 2,
            Reduction::Min => 3,
            Reduction::Max => 4,
            Reduction::Average => 6,
        }
    }

    /// The element-wise fold between two ranks' values: [`Average`](Self::Average) folds as
    /// [`Sum`](Self::Sum) (its division is [`finish_bytes`](Self::finish_bytes)).
    pub(crate) const fn pairwise(self) -> Reduction {
        match self {
            Reduction::Average => Reduction::Sum,
            other => other,
        }
    }

    /// Folds `src` into `acc` element-wise, as a typed collective folds two ranks' values:
    /// [`Average`](Self::Average) folds as a sum (the collectives divide once, at the end). The
    /// lengths must be equal (the shorter one is folded otherwise).
    ///
    /// ```
    /// use ferrogloo::Reduction;
    /// let mut acc = [1u8, 250];
    /// Reduction::Sum.apply(&mut acc, &[2, 10]);
    /// assert_eq!(acc, [3, 4], "integer sums wrap");
    /// ```
    pub fn apply<T: Element>(self, acc: &mut [T], src: &[T]) {
        T::fold(self.pairwise(), acc, src);
    }

    /// Whether this reduction is defined on elements of `dtype`: every one is, except
    /// [`Average`](Self::Average) on integers ([`Error::InvalidArgument`](crate::Error) naming
    /// the type).
    pub fn check(self, dtype: DType) -> crate::Result<()> {
        if self == Reduction::Average && !dtype.is_float() {
            return Err(crate::Error::invalid(format!(
                "average of {dtype} is not defined: floating-point types only (use sum and divide)"
            )));
        }
        Ok(())
    }

    /// Folds `src` into `acc` element-wise, both holding elements of `dtype` as bytes (in native
    /// byte order); [`Average`](Self::Average) folds as a sum (its division is
    /// [`finish_bytes`](Self::finish_bytes)). Errors when the lengths differ or are not whole
    /// elements, or the reduction is not defined on `dtype` ([`check`](Self::check)).
    ///
    /// ```
    /// use ferrogloo::{DType, Reduction};
    /// let mut acc = 2.0f32.to_ne_bytes().to_vec();
    /// Reduction::Max.apply_bytes(DType::F32, &mut acc, &5.0f32.to_ne_bytes())?;
    /// assert_eq!(acc, 5.0f32.to_ne_bytes());
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn apply_bytes(self, dtype: DType, acc: &mut [u8], src: &[u8]) -> crate::Result<()> {
        self.check(dtype)?;
        if acc.len() != src.len() || !acc.len().is_multiple_of(dtype.size()) {
            return Err(crate::Error::invalid(format!(
                "{} of {dtype} bytes: {} and {} bytes are not equal runs of whole {}-byte elements",
                self.name(),
                acc.len(),
                src.len(),
                dtype.size()
            )));
        }
        crate::dispatch_dtype!(dtype, T => {
            let mut a: Vec<T> = bytemuck::pod_collect_to_vec(acc);
            let b: Vec<T> = bytemuck::pod_collect_to_vec(src);
            T::fold(self, &mut a, &b);
            acc.copy_from_slice(bytemuck::cast_slice(&a));
        });
        Ok(())
    }

    /// What the reduction does once, after the fold, to the result of `contributors` ranks'
    /// values (`buf`: elements of `dtype` as bytes, in native byte order):
    /// [`Average`](Self::Average) multiplies each element by `1 / contributors` (computed in
    /// `f64`, rounded once to the type); the others leave it as it is.
    ///
    /// ```
    /// use ferrogloo::{DType, Reduction};
    /// let mut acc = 3.0f32.to_ne_bytes().to_vec();
    /// Reduction::Average.apply_bytes(DType::F32, &mut acc, &5.0f32.to_ne_bytes())?;
    /// Reduction::Average.finish_bytes(DType::F32, &mut acc, 2)?;
    /// assert_eq!(acc, 4.0f32.to_ne_bytes());
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn finish_bytes(self, dtype: DType, buf: &mut [u8], contributors: usize) -> crate::Result<()> {
        self.check(dtype)?;
        if self != Reduction::Average {
            return Ok(());
        }
        if contributors == 0 {
            return Err(crate::Error::invalid(format!("average of {dtype} over no contributing ranks")));
        }
        if !buf.len().is_multiple_of(dtype.size()) {
            return Err(crate::Error::invalid(format!(
                "average of {dtype} bytes: {} bytes are not whole {}-byte elements",
                buf.len(),
                dtype.size()
            )));
        }
        scale_bytes(dtype, buf, 1.0 / contributors as f64)
    }
}

/// Multiplies floating-point elements held as bytes (native byte order, any alignment) by `f`,
/// each through `f64` and rounded once back to its type. Other types are an error.
pub(crate) fn scale_bytes(dtype: DType, buf: &mut [u8], f: f64) -> crate::Result<()> {
    fn each<T: Pod>(buf: &mut [u8], g: impl Fn(T) -> T) {
        match bytemuck::try_cast_slice_mut::<u8, T>(buf) {
            Ok(xs) => xs.iter_mut().for_each(|x| *x = g(*x)),
            Err(_) => {
                for c in buf.chunks_exact_mut(std::mem::size_of::<T>()) {
                    let x: T = bytemuck::pod_read_unaligned(c);
                    c.copy_from_slice(bytemuck::bytes_of(&g(x)));
                }
            }
        }
    }
    match dtype {
        DType::F32 => each::<f32>(buf, |x| (f64::from(x) * f) as f32),
        DType::F64 => each::<f64>(buf, |x| x * f),
        DType::F16 => each::<f16>(buf, |x| f16::from_f64(x.to_f64() * f)),
        DType::BF16 => each::<bf16>(buf, |x| bf16::from_f64(x.to_f64() * f)),
        _ => return Err(crate::Error::invalid(format!("cannot scale {dtype} elements (floating-point types only)"))),
    }
    Ok(())
}

impl std::str::FromStr for Reduction {
    type Err = crate::Error;

    /// Parses `sum`, `product` (or `prod`), `min`, `max` or `average` (or `avg`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "sum" => Reduction::Sum,
            "product" | "prod" => Reduction::Product,
            "min" => Reduction::Min,
            "max" => Reduction::Max,
            "average" | "avg" => Reduction::Average,
            other => {
                return Err(crate::Error::invalid(format!(
                    "unknown reduction {other:?} (sum, product, min, max or average)"
                )));
            }
        })
    }
}

/// How a typed collective folds one rank's values into another's, inside the crate: a built-in
/// [`Reduction`] (its [pairwise](Reduction::pairwise) fold), or a fold of the caller's.
#[derive(Clone, Copy)]
pub(crate) enum Fold<'a, T> {
    /// A built-in reduction.
    Builtin(Reduction),
    /// `f(acc, other)` folds `other` into `acc` element-wise.
    Custom(&'a (dyn Fn(&mut [T], &[T]) + Send + Sync)),
}

impl<T: Element> Fold<'_, T> {
    /// The code in a call's descriptor (every custom fold shares one).
    pub(crate) fn code(&self) -> u8 {
        match self {
            Fold::Builtin(r) => r.code(),
            Fold::Custom(_) => 5,
        }
    }

    /// Folds `src` into `acc` element-wise. The lengths must be equal.
    pub(crate) fn apply(&self, acc: &mut [T], src: &[T]) {
        debug_assert_eq!(acc.len(), src.len());
        match self {
            Fold::Builtin(r) => T::fold(r.pairwise(), acc, src),
            Fold::Custom(f) => f(acc, src),
        }
    }
}
