//! Element types ([`Element`], [`DType`]), the one reduction type ([`Reduction`]), algorithm
//! names ([`Algorithm`]), the allreduce cost model ([`CostModel`]), and the call descriptor
//! every message carries (crate-internal).

mod algorithm;
pub(crate) mod copy_plan;
pub(crate) mod cost_model;
mod desc;
mod dtype;
mod element;
mod reduction;

pub use algorithm::Algorithm;
pub(crate) use copy_plan::BroadcastPath;
pub use copy_plan::{CopyPlan, SizeRange};
pub use cost_model::CostModel;
pub(crate) use desc::{Call, DESC_LEN, OpDesc};
pub use dtype::DType;
pub use element::Element;
pub(crate) use reduction::Fold;
pub use reduction::Reduction;
pub(crate) use reduction::scale_bytes;

pub use half::{bf16, f16};

/// `bytes` viewed as values of `T`: borrowed where they are aligned for `T` (a received
/// buffer's always are in practice), else an aligned copy. The caller checked that they are a
/// whole number of values.
pub(crate) fn view_or_copy<T: bytemuck::Pod>(bytes: &[u8]) -> std::borrow::Cow<'_, [T]> {
    match bytemuck::try_cast_slice::<u8, T>(bytes) {
        Ok(v) => std::borrow::Cow::Borrowed(v),
        Err(_) => std::borrow::Cow::Owned(bytemuck::pod_collect_to_vec(bytes)),
    }
}

/// Runs `$body` with `$t` bound to the Rust type of the [`DType`] `$d`.
#[doc(hidden)]
#[macro_export]
macro_rules! dispatch_dtype {
    ($d:expr, $t:ident => $body:block) => {
        match $d {
            $crate::DType::F32 => {
                type $t = f32;
                $body
            }
            $crate::DType::F64 => {
                type $t = f64;
                $body
            }
            $crate::DType::F16 => {
                type $t = $crate::f16;
                $body
            }
            $crate::DType::BF16 => {
                type $t = $crate::bf16;
                $body
            }
            $crate::DType::I8 => {
                type $t = i8;
                $body
            }
            $crate::DType::I16 => {
                type $t = i16;
                $body
            }
            $crate::DType::I32 => {
                type $t = i32;
                $body
            }
            $crate::DType::I64 => {
                type $t = i64;
                $body
            }
            $crate::DType::U8 => {
                type $t = u8;
                $body
            }
            $crate::DType::U16 => {
                type $t = u16;
                $body
            }
            $crate::DType::U32 => {
                type $t = u32;
                $body
            }
            $crate::DType::U64 => {
                type $t = u64;
                $body
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_chunked_folds_match_the_scalar_operations_bit_for_bit() {
        let a: Vec<f16> = (0..1000).map(|i| f16::from_f32((i as f32 * 0.37).sin() * 100.0)).collect();
        let b: Vec<f16> = (0..1000).map(|i| f16::from_f32((i as f32 * 0.11).cos() * 3.0)).collect();
        for (op, scalar) in [(Reduction::Sum, f16::add as fn(f16, f16) -> f16), (Reduction::Product, f16::mul)] {
            let mut acc = a.clone();
            op.apply(&mut acc, &b);
            let want: Vec<u16> = a.iter().zip(&b).map(|(&x, &y)| scalar(x, y).to_bits()).collect();
            assert_eq!(acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
        }
        let x: Vec<bf16> = (0..777).map(|i| bf16::from_f32(i as f32 * 1.5 - 300.0)).collect();
        let y: Vec<bf16> = (0..777).map(|i| bf16::from_f32(300.0 - i as f32)).collect();
        let mut acc = x.clone();
        Reduction::Max.apply(&mut acc, &y);
        assert!(acc.iter().zip(x.iter().zip(&y)).all(|(r, (a, b))| *r == if b > a { *b } else { *a }));
        let mut acc = x.clone();
        Reduction::Sum.apply(&mut acc, &y);
        assert!(acc.iter().zip(x.iter().zip(&y)).all(|(r, (a, b))| r.to_bits() == (*a + *b).to_bits()));
    }

    #[test]
    fn reductions_on_every_kind_of_type() {
        let mut a = [1i8, 127, -5];
        Reduction::Sum.apply(&mut a, &[1, 1, -7]);
        assert_eq!(a, [2, -128, -12], "integer sums wrap");
        let mut b = [2.0f32, -1.0, 3.0];
        Reduction::Max.apply(&mut b, &[1.0, 5.0, 3.5]);
        assert_eq!(b, [2.0, 5.0, 3.5]);
        let mut c = [f16::from_f32(1.5), f16::from_f32(2.0)];
        Reduction::Product.apply(&mut c, &[f16::from_f32(2.0), f16::from_f32(0.5)]);
        assert_eq!(c, [f16::from_f32(3.0), f16::from_f32(1.0)]);
        let mut d = [bf16::from_f32(4.0)];
        Reduction::Min.apply(&mut d, &[bf16::from_f32(-4.0)]);
        assert_eq!(d, [bf16::from_f32(-4.0)]);
        let mut e = [3u64, 4];
        let digits = |acc: &mut [u64], x: &[u64]| acc.iter_mut().zip(x).for_each(|(a, b)| *a = *a * 10 + b);
        Fold::Custom(&digits).apply(&mut e, &[1, 2]);
        assert_eq!(e, [31, 42]);
    }

    #[test]
    fn reduction_names_parse_back_and_unknown_ones_are_refused() {
        for r in [Reduction::Sum, Reduction::Product, Reduction::Min, Reduction::Max, Reduction::Average] {
            assert_eq!(r.name().parse::<Reduction>().ok(), Some(r));
        }
        assert_eq!("avg".parse::<Reduction>().ok(), Some(Reduction::Average));
        assert_eq!("prod".parse::<Reduction>().ok(), Some(Reduction::Product));
        let e = "mean".parse::<Reduction>().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("\"mean\"") && e.contains("average"), "{e}");
    }

    #[test]
    fn average_folds_as_a_sum_and_divides_once_on_every_float_type() {
        fn run<T: Element>(xs: [f64; 3], to: impl Fn(f64) -> T, back: impl Fn(T) -> f64) {
            let ranks: Vec<Vec<u8>> = xs.iter().map(|&x| bytemuck::bytes_of(&to(x)).to_vec()).collect();
            let mut acc = ranks[0].clone();
            for r in &ranks[1..] {
                Reduction::Average.apply_bytes(T::DTYPE, &mut acc, r).unwrap();
            }
            let mut sum = ranks[0].clone();
            for r in &ranks[1..] {
                Reduction::Sum.apply_bytes(T::DTYPE, &mut sum, r).unwrap();
            }
            assert_eq!(acc, sum, "{}: the fold of an average is the sum", T::DTYPE);
            // The same bits as the sum scaled once by 1/3 through f64, at any alignment.
            let want = to(back(bytemuck::pod_read_unaligned(&sum)) * (1.0 / 3.0));
            let mut padded = vec![0u8; acc.len() + 1];
            padded[1..].copy_from_slice(&acc);
            Reduction::Average.finish_bytes(T::DTYPE, &mut padded[1..], 3).unwrap();
            Reduction::Average.finish_bytes(T::DTYPE, &mut acc, 3).unwrap();
            assert_eq!(acc, bytemuck::bytes_of(&want), "{}", T::DTYPE);
            assert_eq!(&padded[1..], bytemuck::bytes_of(&want), "{} unaligned", T::DTYPE);
            // The others finish with nothing.
            for r in [Reduction::Sum, Reduction::Product, Reduction::Min, Reduction::Max] {
                let mut b = sum.clone();
                r.finish_bytes(T::DTYPE, &mut b, 3).unwrap();
                assert_eq!(b, sum);
            }
        }
        let xs = [1.5, -4.25, 10.0];
        run::<f32>(xs, |x| x as f32, f64::from);
        run::<f64>([0.1, 0.2, 0.7], |x| x, |x| x);
        run::<f16>(xs, f16::from_f64, f16::to_f64);
        run::<bf16>(xs, bf16::from_f64, bf16::to_f64);
        let mut two = 7.0f64.to_ne_bytes().to_vec();
        Reduction::Average.finish_bytes(DType::F64, &mut two, 2).unwrap();
        assert_eq!(two, 3.5f64.to_ne_bytes());
    }

    #[test]
    fn average_of_integers_is_an_invalid_argument_naming_the_type() {
        for d in DType::ALL {
            let mut b = vec![0u8; d.size()];
            let src = b.clone();
            let results = [
                Reduction::Average.check(d),
                Reduction::Average.apply_bytes(d, &mut b, &src),
                Reduction::Average.finish_bytes(d, &mut b, 2),
            ];
            for r in results {
                match (d.is_float(), r) {
                    (true, r) => assert!(r.is_ok(), "{d}: {r:?}"),
                    (false, Err(crate::Error::InvalidArgument(m))) => {
                        assert!(m.contains(&format!("average of {d}")), "{m}")
                    }
                    (false, r) => panic!("{d}: {r:?}"),
                }
            }
            for r in [Reduction::Sum, Reduction::Product, Reduction::Min, Reduction::Max] {
                assert!(r.check(d).is_ok() && r.finish_bytes(d, &mut b, 2).is_ok(), "{r:?} of {d}");
            }
        }
        let mut b = 1.0f32.to_ne_bytes().to_vec();
        assert!(Reduction::Average.finish_bytes(DType::F32, &mut b, 0).is_err(), "no contributors");
        assert!(Reduction::Average.finish_bytes(DType::F32, &mut b[..3], 2).is_err(), "a cut element");
        // The typed fold of an average is the sum; the typed calls divide once afterwards.
        let (mut x, mut y) = ([1.0f32, 2.0], [1.0f32, 2.0]);
        Reduction::Average.apply(&mut x, &[3.0, 4.0]);
        Reduction::Sum.apply(&mut y, &[3.0, 4.0]);
        assert_eq!(x, y);
    }
}
