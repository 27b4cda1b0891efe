//! A fingerprint of a model's parameters, which the digits examples print at the
//! end: two runs trained the same parameters exactly when they print the same one
//! (the tests and scripts/chaos-soak.sh compare them).

use anyhow::bail;
use burn::module::Module;
use burn::tensor::Tensor;

/// FNV-1a over the bits of every parameter, in module order.
pub(crate) fn fingerprint<M: Module>(model: &M) -> anyhow::Result<u64> {
    struct Fnv(u64, Option<String>);
    impl burn::module::ModuleVisitor for Fnv {
        fn visit_float<const D: usize>(&mut self, p: &burn::module::Param<Tensor<D>>) {
            match p.val().into_data().convert::<f32>().try_to_vec::<f32>() {
                Ok(v) => {
                    for x in v {
                        for b in x.to_bits().to_le_bytes() {
                            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
                        }
                    }
                }
                Err(e) => self.1 = Some(format!("{e:?}")),
            }
        }
    }
    let mut f = Fnv(0xcbf2_9ce4_8422_2325, None);
    model.visit(&mut f);
    match f.1 {
        Some(e) => bail!("reading a parameter: {e}"),
        None => Ok(f.0),
    }
}
