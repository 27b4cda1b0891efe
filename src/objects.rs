//! Any serde value as a collective: [`Kolo::broadcast_object`] and
//! [`Kolo::allgather_object`], framed as `u8` tensors (postcard) over the
//! ordinary broadcast and allgather.

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::runtime::Kolo;
use crate::tensor::Tensor;

/// The cause given when another rank could not serialise its object.
fn remote_failure(rank: usize) -> Box<dyn std::error::Error + Send + Sync> {
    format!("rank {rank} could not serialise its object; its own error says why").into()
}

impl Kolo {
    /// Sends `root`'s `object` to every rank (serialised with `postcard`); the value
    /// passed on other ranks is ignored.
    ///
    /// # Errors
    /// Root out of range, serialisation failing on the root (reported on every rank),
    /// or the errors of [`Kolo::broadcast`].
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        name: impl Into<String>,
        object: T,
        root: usize,
    ) -> Result<T> {
        let name = name.into();
        const OP: &str = "broadcast_object";
        if root >= self.size() {
            return Err(crate::validate::bad_root(OP, &name, root, self.size()));
        }
        let mut failure = None;
        let bytes = if self.rank() == root {
            postcard::to_stdvec(&object).unwrap_or_else(|e| {
                failure = Some(e);
                Vec::new()
            })
        } else {
            Vec::new()
        };
        // Only its bytes are needed from here: an object of gigabytes is not held twice.
        drop(object);
        // The length goes first so that every rank can size its buffer; -1 tells the
        // others that the root could not serialise, so nobody waits for bytes.
        let len = if failure.is_some() {
            -1
        } else {
            bytes.len() as i64
        };
        let len_t = Tensor::from_vec(vec![len], &[1])?;
        let len = self
            .broadcast(format!("{name}.len"), len_t, root)
            .wait()?
            .into_vec::<i64>()?[0];
        if let Some(source) = failure {
            return Err(Error::Serialization {
                op: OP,
                name,
                rank: root,
                source: std::sync::Arc::new(source),
            });
        }
        let Ok(len) = usize::try_from(len) else {
            return Err(Error::Serialization {
                op: OP,
                name,
                rank: root,
                source: remote_failure(root).into(),
            });
        };
        let data = if self.rank() == root {
            bytes
        } else {
            vec![0u8; len]
        };
        let data = Tensor::from_vec(data, &[len])?;
        let data = self
            .broadcast(format!("{name}.data"), data, root)
            .wait()?
            .into_vec::<u8>()?;
        postcard::from_bytes(&data).map_err(|source| Error::Serialization {
            op: OP,
            name,
            rank: root,
            source: std::sync::Arc::new(source),
        })
    }

    /// Gathers every rank's `object` (serialised with `postcard`), in rank order.
    ///
    /// # Errors
    /// An object that fails to (de)serialise, naming its rank (reported on every rank),
    /// or the errors of [`Kolo::allgather`].
    pub fn allgather_object<T: Serialize + DeserializeOwned>(
        &self,
        name: impl Into<String>,
        object: T,
    ) -> Result<Vec<T>> {
        const OP: &str = "allgather_object";
        let name = name.into();
        // Each rank's bytes are prefixed with the length and a status byte, so that a
        // rank whose object cannot be serialised still takes part and is named.
        let mut failure = None;
        let payload = match postcard::to_stdvec(&object) {
            Ok(b) => b,
            Err(e) => {
                failure = Some(e);
                Vec::new()
            }
        };
        let mut framed = Vec::with_capacity(payload.len() + 9);
        framed.push(u8::from(failure.is_none()));
        framed.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        framed.extend_from_slice(&payload);
        let n = framed.len();
        let all = self
            .allgather(name.clone(), Tensor::from_vec(framed, &[n])?)
            .wait()?
            .into_vec::<u8>()?;
        let mut out = Vec::with_capacity(self.size());
        let mut at = 0;
        for rank in 0..self.size() {
            let header = all.get(at..at + 9).ok_or_else(|| {
                Error::Internal(format!("{OP} {name:?}: short frame from rank {rank}"))
            })?;
            let ok = header[0] == 1;
            let mut len_bytes = [0u8; 8];
            len_bytes.copy_from_slice(&header[1..9]);
            let len = u64::from_le_bytes(len_bytes) as usize;
            let body = all.get(at + 9..at + 9 + len).ok_or_else(|| {
                Error::Internal(format!("{OP} {name:?}: short frame from rank {rank}"))
            })?;
            at += 9 + len;
            if !ok {
                let source = match failure.take() {
                    Some(e) if rank == self.rank() => e.into(),
                    _ => remote_failure(rank),
                };
                return Err(Error::Serialization {
                    op: OP,
                    name,
                    rank,
                    source: source.into(),
                });
            }
            out.push(
                postcard::from_bytes(body).map_err(|source| Error::Serialization {
                    op: OP,
                    name: name.clone(),
                    rank,
                    source: std::sync::Arc::new(source),
                })?,
            );
        }
        Ok(out)
    }
}
