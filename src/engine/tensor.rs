//! The values a user hands the engine: tensors, allreduce options, wire compression.

use crate::error::{Error, Result};
use crate::types::{DType, Element, Reduction};

/// Wire compression of `f32` allreduces: the tensor travels and is summed as 16-bit floats
/// (half the bytes, less precision), and comes back as `f32`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Compression {
    /// Full precision.
    #[default]
    None,
    /// IEEE binary16 ([`f16`](crate::f16)).
    F16,
    /// bfloat16 ([`bf16`](crate::bf16)).
    BF16,
}

impl Compression {
    pub(crate) fn code(self) -> u8 {
        match self {
            Compression::None => 0,
            Compression::F16 => 1,
            Compression::BF16 => 2,
        }
    }

    pub(crate) fn from_code(c: u8) -> Option<Self> {
        [Compression::None, Compression::F16, Compression::BF16].into_iter().find(|x| x.code() == c)
    }

    /// The element type on the wire.
    pub(crate) fn wire(self) -> Option<DType> {
        match self {
            Compression::None => None,
            Compression::F16 => Some(DType::F16),
            Compression::BF16 => Some(DType::BF16),
        }
    }
}

/// The options of an allreduce: the reduction, scale factors and wire compression.
///
/// ```
/// use ferrogloo::engine::{AllreduceOptions, Compression, Reduction};
/// // Horovod's "divide by N before summing" for fp16 gradients:
/// let opts = AllreduceOptions::new(Reduction::Sum).prescale(0.25).compression(Compression::F16);
/// assert_eq!(opts.op, Reduction::Sum);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AllreduceOptions {
    /// The reduction.
    pub op: Reduction,
    /// Each rank's tensor is multiplied by this before the reduction (floating-point types
    /// only when not 1).
    pub prescale: f64,
    /// The result is multiplied by this (after [`Reduction::Average`]'s division).
    pub postscale: f64,
    /// Wire compression (`f32` tensors only).
    pub compression: Compression,
}

impl AllreduceOptions {
    /// `op`, no scaling, no compression.
    pub fn new(op: Reduction) -> Self {
        AllreduceOptions { op, prescale: 1.0, postscale: 1.0, compression: Compression::None }
    }

    /// Sets the factor applied before the reduction.
    pub fn prescale(mut self, f: f64) -> Self {
        self.prescale = f;
        self
    }

    /// Sets the factor applied after the reduction.
    pub fn postscale(mut self, f: f64) -> Self {
        self.postscale = f;
        self
    }

    /// Sets the wire compression.
    pub fn compression(mut self, c: Compression) -> Self {
        self.compression = c;
        self
    }
}

/// A tensor: elements in row-major order and a shape. A `Vec<T>` converts into a
/// one-dimensional tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    /// The elements.
    pub data: Vec<T>,
    /// The dimensions (their product is `data.len()`).
    pub shape: Vec<usize>,
}

impl<T: Element> Tensor<T> {
    /// A tensor of `shape` over `data`; errors when the shape's product is not `data.len()`.
    pub fn new(data: Vec<T>, shape: Vec<usize>) -> Result<Self> {
        let count = shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
        // Dimensions whose product overflows are refused even beside a zero.
        if shape.iter().filter(|&&d| d != 0).try_fold(1usize, |a, &d| a.checked_mul(d)).is_none() {
            return Err(Error::invalid(format!(
                "a tensor of shape {} has more elements than usize holds",
                fmt_shape(&shape)
            )));
        }
        if count != Some(data.len()) {
            return Err(Error::invalid(format!(
                "a tensor of shape {} needs {} elements, got {}",
                fmt_shape(&shape),
                count.map_or("more than usize::MAX".to_string(), |c| c.to_string()),
                data.len()
            )));
        }
        Ok(Tensor { data, shape })
    }
}

impl<T> From<Vec<T>> for Tensor<T> {
    fn from(data: Vec<T>) -> Self {
        let shape = vec![data.len()];
        Tensor { data, shape }
    }
}

/// `[64, 3]`
pub(crate) fn fmt_shape(shape: &[usize]) -> String {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", dims.join(", "))
}
