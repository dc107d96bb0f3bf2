//! Sub-groups of a context: [`Context::split`] and [`Context::subgroup`].

use crate::CollectiveOptions;
use crate::comm::fnv;
use crate::context::Context;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Marks the group ids of [`Context::split`] and [`Context::subgroup`] apart.
const SPLIT: u64 = 0x5350_4c49_5400_0001;
const LIST: u64 = 0x4c49_5354_0000_0001;

impl Context {
    /// Splits this context into sub-groups, as `MPI_Comm_split` does: ranks passing the same
    /// `color` form one sub-group, ordered by `key` (ties by rank in this context); a rank
    /// passing `None` joins none and gets `None`. Every rank of this context must call it (it is
    /// a collective, in order with the others of tag 0).
    ///
    /// A sub-group shares this context's connections: it costs one allgather of two words, no
    /// store and no new connection, and its messages carry their own group id so they never
    /// meet this context's or a sibling's. Sub-groups and their parent can run concurrently.
    ///
    /// ```
    /// # use ferrogloo::{Context, Reduction, device::Device, rendezvous::HashStore};
    /// # let ctx = Context::builder(0, 1).connect(&HashStore::new(), &Device::in_process())?;
    /// // Even and odd ranks, each in their own group.
    /// let half = ctx.split(Some(ctx.rank() as u32 % 2), 0)?.expect("every rank has a color");
    /// let mut x = [1u32];
    /// half.allreduce(&mut x, Reduction::Sum)?;
    /// assert_eq!(x[0] as usize, half.size());
    /// # Ok::<(), ferrogloo::Error>(())
    /// ```
    pub fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Context>> {
        let n = self.size();
        let mine = [color.map_or(u64::MAX, u64::from), u64::from(key)];
        let mut all = vec![0u64; 2 * n];
        self.allgather(&mine, &mut all, &CollectiveOptions::default())?;
        // Every rank counts its splits alike (a split is a collective of this context).
        let nth = self.comm().subgroup_id(SPLIT);
        let Some(color) = color else { return Ok(None) };
        let mut chosen: Vec<(u64, usize)> =
            (0..n).filter(|r| all[2 * r] == u64::from(color)).map(|r| (all[2 * r + 1], r)).collect();
        chosen.sort_unstable();
        let members = self.world_ranks(chosen.iter().map(|&(_, r)| r))?;
        let group = crate::transport::group_id(fnv(&[nth, u64::from(color)]));
        Ok(Some(self.child(group, members)))
    }

    /// The sub-group of `ranks` (ranks of this context, in the order they take in the
    /// sub-group), as `MPI_Comm_create_group`: only its members call it, each with the same
    /// list, and they form it together (one barrier among them, within the context's
    /// timeout). A member whose list differs from the others' makes every member time out,
    /// naming the ranks that did not join. Like [`split`](Self::split), it shares this
    /// context's connections.
    pub fn subgroup(&self, ranks: &[usize]) -> Result<Context> {
        let n = self.size();
        if let Some(&bad) = ranks.iter().find(|&&r| r >= n) {
            return Err(Error::invalid(format!("sub-group: rank {bad} is out of range for size {n}")));
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if sorted.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid(format!("sub-group: ranks {ranks:?} name a rank twice")));
        }
        if !ranks.contains(&self.rank()) {
            return Err(Error::invalid(format!(
                "sub-group: this rank ({}) is not in {ranks:?}; only members form a sub-group",
                self.rank()
            )));
        }
        let mut words: Vec<u64> = vec![LIST];
        words.extend(ranks.iter().map(|&r| r as u64));
        let group = self.comm().subgroup_id(fnv(&words));
        let child = self.child(group, self.world_ranks(ranks.iter().copied())?);
        child.barrier().map_err(|e| match e {
            Error::Timeout { ranks: missing, waited, .. } => Error::Timeout {
                op: format!("forming the sub-group of ranks {ranks:?} (do all members pass the same list?)"),
                ranks: missing,
                keys: Vec::new(),
                waited,
            },
            other => other,
        })?;
        Ok(child)
    }

    fn world_ranks(&self, ranks: impl Iterator<Item = usize>) -> Result<Arc<[usize]>> {
        ranks.map(|r| self.world_rank(r).ok_or_else(|| Error::invalid(format!("rank {r} is out of range")))).collect()
    }
}
