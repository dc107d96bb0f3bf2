#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var, WithDType};
use candle_nn::{Optimizer, VarMap};
use ferrogloo::engine::{AllreduceOptions, Engine, Handle, Reduction};
use ferrogloo::types::Element;
use std::collections::HashSet;

/// What can go wrong: candle's errors, ferrogloo's, and this crate's own checks.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A candle operation failed.
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
    /// The communication failed: a peer died or stalled, a deadline passed, the ranks
    /// disagreed on a tensor's shape or type, ... (ferrogloo's message names the rank and the
    /// tensor).
    #[error(transparent)]
    Comm(#[from] ferrogloo::Error),
    /// A tensor of an element type ferrogloo does not carry, or one that cannot be averaged.
    #[error("{what} '{name}': {dtype:?} is not supported here ({supported})")]
    Dtype {
        /// What the tensor is ("gradient of", "parameter", "tensor").
        what: &'static str,
        /// The parameter's or tensor's name.
        name: String,
        /// Its element type.
        dtype: DType,
        /// The types that are.
        supported: &'static str,
    },
    /// Two parameters with the same name (names identify tensors across ranks).
    #[error("two parameters are named '{0}': names identify them across ranks and must be unique")]
    DuplicateName(String),
    /// A gradient whose shape is not its parameter's.
    #[error("the gradient of '{name}' has shape {got:?}, its parameter {want:?}")]
    GradientShape {
        /// The parameter's name.
        name: String,
        /// The gradient's dimensions.
        got: Vec<usize>,
        /// The parameter's dimensions.
        want: Vec<usize>,
    },
}

impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

const FLOATS: &str = "f32, f64, f16 and bf16 can be averaged";
const CARRIED: &str = "ferrogloo carries u8, u32, i16, i32, i64, f16, bf16, f32 and f64";

/// A set of named parameters trained data-parallel over an [`Engine`].
///
/// The names identify the tensors across ranks: every rank must hold the same names, with the
/// same shapes and element types (a rank that differs gets an error from the engine naming
/// the tensor). The order given is the forward order of the model; gradients are submitted in
/// reverse, the order backpropagation produces them (the last layer's first).
pub struct DataParallel {
    engine: Engine,
    params: Vec<(String, Var)>,
    opts: AllreduceOptions,
}

impl DataParallel {
    /// Trains `params` (name, variable), in the model's forward order, over `engine`.
    pub fn new(engine: Engine, params: impl IntoIterator<Item = (String, Var)>) -> Result<Self> {
        let params: Vec<(String, Var)> = params.into_iter().collect();
        let mut seen = HashSet::new();
        for (name, _) in &params {
            if !seen.insert(name.as_str()) {
                return Err(Error::DuplicateName(name.clone()));
            }
        }
        Ok(DataParallel { engine, params, opts: AllreduceOptions::new(Reduction::Average) })
    }

    /// Trains every variable of `varmap`, under its name in the map, in the order of the names
    /// (a `VarMap` keeps no order of its own, and the names are what every rank shares).
    pub fn from_varmap(engine: Engine, varmap: &VarMap) -> Result<Self> {
        let mut params: Vec<(String, Var)> = {
            let data = varmap
                .data()
                .lock()
                .map_err(|_| Error::Candle(candle_core::Error::Msg("the VarMap's lock is poisoned".to_string())))?;
            data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
        };
        params.sort_by(|a, b| a.0.cmp(&b.0));
        Self::new(engine, params)
    }

    /// Sets the allreduce options of the gradients (default: [`Reduction::Average`], no
    /// scaling, no compression), for instance fp16 compression on a slow network.
    pub fn with_options(mut self, opts: AllreduceOptions) -> Self {
        self.opts = opts;
        self
    }

    /// The engine, for collectives of your own.
    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// The parameters, in the order given.
    pub fn parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.engine.rank()
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.engine.size()
    }

    /// Sets every parameter on every rank to rank `root`'s value (call it once before
    /// training, so that every rank starts from the same weights).
    pub fn broadcast_parameters(&self, root: usize) -> Result<()> {
        // Every type checked before anything is submitted: a refusal leaves nothing in flight.
        for (name, var) in &self.params {
            if !matches!(
                var.dtype(),
                DType::F32
                    | DType::F64
                    | DType::F16
                    | DType::BF16
                    | DType::U8
                    | DType::U32
                    | DType::I16
                    | DType::I32
                    | DType::I64
            ) {
                return Err(Error::Dtype {
                    what: "parameter",
                    name: name.clone(),
                    dtype: var.dtype(),
                    supported: CARRIED,
                });
            }
        }
        let mut pending: Vec<Pending<'_>> = Vec::with_capacity(self.params.len());
        for (name, var) in &self.params {
            let key = format!("ferrogloo-candle.param.{name}");
            let t = var.as_tensor();
            let p = match t.dtype() {
                DType::F32 => broadcast_one::<f32>(&self.engine, key, var, root)?,
                DType::F64 => broadcast_one::<f64>(&self.engine, key, var, root)?,
                DType::F16 => broadcast_one::<half::f16>(&self.engine, key, var, root)?,
                DType::BF16 => broadcast_one::<half::bf16>(&self.engine, key, var, root)?,
                DType::U8 => broadcast_one::<u8>(&self.engine, key, var, root)?,
                DType::U32 => broadcast_one::<u32>(&self.engine, key, var, root)?,
                DType::I16 => broadcast_one::<i16>(&self.engine, key, var, root)?,
                DType::I32 => broadcast_one::<i32>(&self.engine, key, var, root)?,
                DType::I64 => broadcast_one::<i64>(&self.engine, key, var, root)?,
                dtype => {
                    return Err(Error::Dtype { what: "parameter", name: name.clone(), dtype, supported: CARRIED });
                }
            };
            pending.push(p);
        }
        finish(pending, &mut ())
    }

    /// Replaces the gradient of every parameter in `grads` by its average over the ranks.
    ///
    /// All of them go to the engine at once, one group per element type, in the reverse of the
    /// parameters' order (for a model given in forward order, the order backpropagation
    /// produces them), so they are negotiated together and fused into few messages. A
    /// floating-point parameter without a gradient on this rank (not used in this step's loss)
    /// contributes zeros, and gets the average like the others: every rank ends with the same
    /// gradients. One that no rank used gets none, as in one process (a small allreduce of
    /// which parameters had a gradient goes with the gradients), so that an optimizer with
    /// weight decay or momentum (AdamW) leaves it alone as it would there. Integer parameters
    /// have no gradients and are left out.
    pub fn average_gradients(&self, grads: &mut GradStore) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        let had: Vec<u8> = self.params.iter().map(|(_, v)| u8::from(grads.get(v.as_tensor()).is_some())).collect();
        let anywhere = self.engine.allreduce("ferrogloo-candle.grads.present", had, Reduction::Max)?;
        let mut by_type: [Vec<(usize, Tensor)>; 4] = Default::default();
        for (i, (name, var)) in self.params.iter().enumerate().rev() {
            let g = match grads.get(var.as_tensor()) {
                Some(g) => {
                    if g.dims() != var.dims() {
                        return Err(Error::GradientShape {
                            name: name.clone(),
                            got: g.dims().to_vec(),
                            want: var.dims().to_vec(),
                        });
                    }
                    g.clone()
                }
                // A parameter that cannot have a gradient (an integer counter, say) is not trained.
                None if !var.dtype().is_float() => continue,
                None => var.as_tensor().zeros_like()?,
            };
            let slot = match g.dtype() {
                DType::F32 => 0,
                DType::F64 => 1,
                DType::F16 => 2,
                DType::BF16 => 3,
                dtype => {
                    return Err(Error::Dtype { what: "gradient of", name: name.clone(), dtype, supported: FLOATS });
                }
            };
            by_type[slot].push((i, g));
        }
        let [f32s, f64s, f16s, bf16s] = by_type;
        let pending = vec![
            self.average_group::<f32>("f32", f32s)?,
            self.average_group::<f64>("f64", f64s)?,
            self.average_group::<half::f16>("f16", f16s)?,
            self.average_group::<half::bf16>("bf16", bf16s)?,
        ];
        let averaged = finish(pending.into_iter().flatten().collect(), grads);
        let anywhere = anywhere.wait()?;
        averaged?;
        // The zeros of a parameter no rank used are not a gradient.
        for ((_, var), used) in self.params.iter().zip(&anywhere.data) {
            if *used == 0 {
                grads.remove(var.as_tensor());
            }
        }
        Ok(())
    }

    /// Runs one step: the loss's backward pass, [`average_gradients`](Self::average_gradients),
    /// and the optimizer's step on the averaged gradients.
    pub fn backward_step<O: Optimizer>(&self, optimizer: &mut O, loss: &Tensor) -> Result<()> {
        let mut grads = loss.backward()?;
        self.average_gradients(&mut grads)?;
        optimizer.step(&grads)?;
        Ok(())
    }

    /// The average of `value` over the ranks (a metric: the loss, an accuracy), under `name`
    /// (the same on every rank).
    pub fn allreduce_scalar(&self, name: &str, value: f64) -> Result<f64> {
        self.allreduce_scalar_with(name, value, Reduction::Average)
    }

    /// Like [`allreduce_scalar`](Self::allreduce_scalar) with another reduction (sum, min,
    /// max, ...).
    pub fn allreduce_scalar_with(&self, name: &str, value: f64, op: Reduction) -> Result<f64> {
        let out = self.engine.allreduce(&format!("ferrogloo-candle.metric.{name}"), vec![value], op)?.wait()?;
        Ok(out.data[0])
    }

    /// Reduces a whole tensor (floating point) over the ranks under `name`; every rank gets the
    /// result, on the tensor's device.
    pub fn allreduce_tensor(&self, name: &str, t: &Tensor, op: Reduction) -> Result<Tensor> {
        let key = format!("ferrogloo-candle.tensor.{name}");
        let opts = AllreduceOptions::new(op);
        match t.dtype() {
            DType::F32 => allreduce_one::<f32>(&self.engine, &key, t, &opts),
            DType::F64 => allreduce_one::<f64>(&self.engine, &key, t, &opts),
            DType::F16 => allreduce_one::<half::f16>(&self.engine, &key, t, &opts),
            DType::BF16 => allreduce_one::<half::bf16>(&self.engine, &key, t, &opts),
            dtype => Err(Error::Dtype { what: "tensor", name: name.to_string(), dtype, supported: FLOATS }),
        }
    }

    /// Ends the engine (see [`Engine::shutdown`]).
    pub fn shutdown(self) -> Result<()> {
        Ok(self.engine.shutdown()?)
    }

    /// Submits the gradients of one element type as one group; the returned completion waits
    /// for them and puts the averages into the store.
    fn average_group<T: Element + WithDType>(
        &self,
        tag: &str,
        grads: Vec<(usize, Tensor)>,
    ) -> Result<Option<Pending<'_, GradStore>>> {
        if grads.is_empty() {
            return Ok(None);
        }
        let mut staged = Vec::with_capacity(grads.len());
        for (i, g) in &grads {
            let (name, _) = &self.params[*i];
            staged.push((format!("ferrogloo-candle.grad.{name}"), to_host::<T>(g)?));
        }
        let handles = self.engine.grouped_allreduce(&format!("ferrogloo-candle.grads.{tag}"), staged, &self.opts)?;
        Ok(Some(Box::new(move |store: &mut GradStore| {
            for ((i, g), h) in grads.into_iter().zip(handles) {
                let out = h.wait()?;
                let avg = Tensor::from_vec(out.data, out.shape, g.device())?;
                store.insert(self.params[i].1.as_tensor(), avg);
            }
            Ok(())
        })))
    }
}

/// A submission's completion: waits for its result and applies it.
type Pending<'a, S = ()> = Box<dyn FnOnce(&mut S) -> Result<()> + 'a>;

/// Completes every pending submission, even after one failed (so that none is left waiting on
/// the engine), and returns the first error.
fn finish<S>(pending: Vec<Pending<'_, S>>, state: &mut S) -> Result<()> {
    let mut first = Ok(());
    for p in pending {
        let r = p(state);
        if first.is_ok() {
            first = r;
        }
    }
    first
}

/// The elements of `t` (on any device) in row-major order, as the engine's tensor.
fn to_host<T: Element + WithDType>(t: &Tensor) -> Result<ferrogloo::engine::Tensor<T>> {
    let data = t.flatten_all()?.to_vec1::<T>()?;
    Ok(ferrogloo::engine::Tensor::new(data, t.dims().to_vec())?)
}

fn broadcast_one<'a, T: Element + WithDType>(
    engine: &Engine,
    key: String,
    var: &'a Var,
    root: usize,
) -> Result<Pending<'a>> {
    let h: Handle<ferrogloo::engine::Tensor<T>> = engine.broadcast(&key, to_host::<T>(var.as_tensor())?, root)?;
    Ok(Box::new(move |_: &mut ()| {
        let out = h.wait()?;
        var.set(&Tensor::from_vec(out.data, out.shape, var.device())?)?;
        Ok(())
    }))
}

fn allreduce_one<T: Element + WithDType>(
    engine: &Engine,
    key: &str,
    t: &Tensor,
    opts: &AllreduceOptions,
) -> Result<Tensor> {
    let out = engine.allreduce_with(key, to_host::<T>(t)?, opts)?.wait()?;
    Ok(Tensor::from_vec(out.data, out.shape, t.device())?)
}
