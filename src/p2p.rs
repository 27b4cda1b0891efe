//! Point to point between two ranks (pipeline stages): `send` and `recv`, matched by
//! name between the two ranks only, through the engine like every collective.

use crate::engine::request::{Key, Named, OpKind, Submission};
use crate::error::Result;
use crate::handle::{self, Handle};
use crate::ops::{process_set_option, Prepared};
use crate::process_set::ProcessSet;
use crate::runtime::Kolo;
use crate::submit_error::SubmitError;
use crate::tensor::Tensor;

/// Point to point: each returns a builder.
impl Kolo {
    /// Sends `tensor` to rank `dest`, which receives it with [`Kolo::recv`] under the
    /// same name. Matched by name between the two ranks only: other ranks take no
    /// part, and the same name may be in use between other pairs at the same time.
    /// Neither side takes part in the engine's agreement on the order of collectives:
    /// the send's header (and a small tensor inline) leaves as soon as the engine
    /// takes the send in, its bytes follow, and the receive takes the tensors of its
    /// name from that rank in the order they were sent. So sends, receives and
    /// collectives never wait for each other whatever order they are submitted in; a
    /// large send completes once the receiving rank's engine has taken its bytes.
    ///
    /// A CUDA tensor (feature `nccl`) travels through host memory: it is copied there
    /// when the send is posted (waiting for the copy), sent over MPI, and
    /// put on the receiver's device ([`Kolo::cuda_device`]) when it arrives. NCCL's
    /// own send and receive, device to device, are not used yet.
    pub fn send(&self, name: impl Into<String>, tensor: Tensor, dest: usize) -> SendBuilder<'_> {
        SendBuilder {
            kolo: self,
            refused: None,
            name: name.into(),
            tensor,
            dest,
        }
    }

    /// Receives the tensor rank `src` sends under `name` with [`Kolo::send`]; its
    /// shape and dtype come from the sender, and so does its kind of device: a tensor
    /// sent from a CUDA device arrives on this rank's ([`Kolo::cuda_device`]), a CPU
    /// tensor on the CPU.
    pub fn recv(&self, name: impl Into<String>, src: usize) -> RecvBuilder<'_> {
        RecvBuilder {
            kolo: self,
            refused: None,
            name: name.into(),
            src,
        }
    }
}

/// The negotiation key of a pair: the name and both ranks, so that other pairs may
/// use the same name at the same time.
fn pair_key(name: &str, from: usize, to: usize) -> Key {
    // Written by hand: `format!` cost ~1,100 instructions a message, a quarter of a
    // small send's own work.
    let mut key = String::with_capacity(name.len() + 2 * 20 + 3);
    key.push_str(name);
    key.push('@');
    push_decimal(&mut key, from);
    key.push_str("->");
    push_decimal(&mut key, to);
    Key::from(key)
}

/// Appends `n` in decimal.
fn push_decimal(s: &mut String, n: usize) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    let mut n = n;
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    for &d in &digits[at..] {
        s.push(char::from(d));
    }
}

/// Builder for [`Kolo::send`].
#[derive(Debug)]
#[must_use = "a send does nothing until .submit() or .wait()"]
pub struct SendBuilder<'k> {
    kolo: &'k Kolo,
    refused: Option<String>,
    name: String,
    tensor: Tensor,
    dest: usize,
}

impl<'k> SendBuilder<'k> {
    process_set_option!();

    /// Submits the send; the handle completes once the tensor has been handed to the
    /// receiver (its data is sent; the tensor is not given back).
    ///
    /// # Errors
    /// Submit-time errors only (empty or duplicate name, a destination that is not
    /// another rank, engine not running), with the tensor handed back.
    pub fn submit(self) -> Result<Handle<()>, SubmitError> {
        self.prepare().submit()
    }

    /// Submits and waits.
    ///
    /// # Errors
    /// Submit-time errors, and a receiver whose rank left (shut down or died). A
    /// receiver that never receives is no error by itself: a large send waits for it,
    /// is warned about after the stall check time, and fails with
    /// [`Error::Stalled`](crate::Error::Stalled) after
    /// `KOLO_STALL_SHUTDOWN_TIME_SECONDS` when that is set.
    pub fn wait(mut self) -> Result<()> {
        // While the engine is idle, this thread posts the send itself (no queue, no
        // handle): a small send costs little more than its MPI call.
        if self.refused.is_none() {
            let (kolo, rank, dest) = (self.kolo, self.kolo.rank(), self.dest);
            let name = &self.name;
            match kolo.send_now(name, self.tensor, dest, || pair_key(name, rank, dest)) {
                Ok(sent) => return sent,
                Err(t) => self.tensor = t,
            }
        }
        self.prepare().wait()
    }

    fn prepare(self) -> Prepared<'k, ()> {
        let key = pair_key(&self.name, self.kolo.rank(), self.dest);
        let tensors: Named = smallvec::smallvec![(Key::from(self.name), self.tensor)];
        let mut s = Submission::new(OpKind::Send, key, tensors);
        s.root = self.dest;
        Prepared {
            kolo: self.kolo,
            refused: self.refused,
            s,
            convert: handle::to_unit,
        }
    }
}

/// Builder for [`Kolo::recv`].
#[derive(Debug)]
#[must_use = "a recv does nothing until .submit() or .wait()"]
pub struct RecvBuilder<'k> {
    kolo: &'k Kolo,
    refused: Option<String>,
    name: String,
    src: usize,
}

impl<'k> RecvBuilder<'k> {
    process_set_option!();

    /// Submits the receive; the handle gives the tensor the sender sent.
    ///
    /// # Errors
    /// Submit-time errors only (empty or duplicate name, a source that is not another
    /// rank, engine not running).
    pub fn submit(self) -> Result<Handle<Tensor>, SubmitError> {
        self.prepare().submit()
    }

    /// Submits and waits for the tensor.
    ///
    /// # Errors
    /// Submit-time errors, and a sender whose rank left (shut down or died); a second
    /// receive of a name already being received from the same rank
    /// ([`Error::DuplicateName`](crate::Error::DuplicateName)). A sender that never
    /// sends is no error by itself: the receive waits for it, is warned about after
    /// the stall check time, and fails with [`Error::Stalled`](crate::Error::Stalled)
    /// after `KOLO_STALL_SHUTDOWN_TIME_SECONDS` when that is set.
    pub fn wait(self) -> Result<Tensor> {
        // As a send: on this thread while the engine is idle.
        if self.refused.is_none() {
            let (rank, src) = (self.kolo.rank(), self.src);
            let name = &self.name;
            if let Some(got) = self.kolo.recv_now(name, src, || pair_key(name, src, rank)) {
                return got;
            }
        }
        self.prepare().wait()
    }

    fn prepare(self) -> Prepared<'k, Tensor> {
        let refused = self.refused.or_else(|| {
            self.name.is_empty().then(|| {
                "tensor names must not be empty (both ranks must use the same name)".into()
            })
        });
        let key = pair_key(&self.name, self.src, self.kolo.rank());
        let mut s = Submission::new(OpKind::Recv, key, Named::new());
        s.root = self.src;
        Prepared {
            kolo: self.kolo,
            refused,
            s,
            convert: handle::to_tensor,
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pair_keys_read_name_at_from_to() {
        for (from, to) in [(0, 1), (9, 10), (123, 4567), (usize::MAX, 0)] {
            let key = super::pair_key("act.3", from, to);
            assert_eq!(&*key, format!("act.3@{from}->{to}").as_str());
        }
    }
}
