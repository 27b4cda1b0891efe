//! The simulated steps: ResNet-50 and BERT-large gradients, backward order, with
//! compute times from published per-GPU throughput.

use kolo::sim::Workload;

/// Every ResNet-50 parameter (torchvision layout, 161 tensors, 25.56 M values), in
/// forward order; the same set as kolo's benchmarks.
fn resnet50_forward() -> Vec<(String, usize)> {
    let mut out = Vec::new();
    let mut push = |name: String, n: usize| out.push((name, n));
    push("conv1.weight".into(), 64 * 3 * 7 * 7);
    push("bn1.weight".into(), 64);
    push("bn1.bias".into(), 64);
    let mut inp = 64;
    for (stage, (blocks, width)) in [(3, 64), (4, 128), (6, 256), (3, 512)]
        .into_iter()
        .enumerate()
    {
        for b in 0..blocks {
            let p = format!("layer{}.{b}", stage + 1);
            for (name, n) in [
                ("conv1.weight", inp * width),
                ("bn1.weight", width),
                ("bn1.bias", width),
                ("conv2.weight", width * width * 9),
                ("bn2.weight", width),
                ("bn2.bias", width),
                ("conv3.weight", width * 4 * width),
                ("bn3.weight", width * 4),
                ("bn3.bias", width * 4),
            ] {
                push(format!("{p}.{name}"), n);
            }
            if b == 0 {
                push(format!("{p}.downsample.0.weight"), inp * width * 4);
                push(format!("{p}.downsample.1.weight"), width * 4);
                push(format!("{p}.downsample.1.bias"), width * 4);
            }
            inp = width * 4;
        }
    }
    push("fc.weight".into(), 2048 * 1000);
    push("fc.bias".into(), 1000);
    out
}

/// BERT-large (24 layers, hidden 1024, 16 heads, FFN 4096, 30522-word vocabulary,
/// 512 positions) with its pre-training heads, in forward order: 335 M values.
fn bert_large_forward() -> Vec<(String, usize)> {
    let (h, ffn, vocab) = (1024usize, 4096usize, 30522usize);
    let mut out: Vec<(String, usize)> = vec![
        ("embeddings.word".into(), vocab * h),
        ("embeddings.position".into(), 512 * h),
        ("embeddings.token_type".into(), 2 * h),
        ("embeddings.norm.weight".into(), h),
        ("embeddings.norm.bias".into(), h),
    ];
    for l in 0..24 {
        for (name, n) in [
            ("attention.query.weight", h * h),
            ("attention.query.bias", h),
            ("attention.key.weight", h * h),
            ("attention.key.bias", h),
            ("attention.value.weight", h * h),
            ("attention.value.bias", h),
            ("attention.output.weight", h * h),
            ("attention.output.bias", h),
            ("attention.norm.weight", h),
            ("attention.norm.bias", h),
            ("intermediate.weight", h * ffn),
            ("intermediate.bias", ffn),
            ("output.weight", ffn * h),
            ("output.bias", h),
            ("output.norm.weight", h),
            ("output.norm.bias", h),
        ] {
            out.push((format!("layer.{l}.{name}"), n));
        }
    }
    for (name, n) in [
        ("pooler.weight", h * h),
        ("pooler.bias", h),
        ("mlm.transform.weight", h * h),
        ("mlm.transform.bias", h),
        ("mlm.norm.weight", h),
        ("mlm.norm.bias", h),
        ("mlm.decoder.bias", vocab),
        ("nsp.weight", 2 * h),
        ("nsp.bias", 2),
    ] {
        out.push((name.into(), n));
    }
    out
}

/// The workload called `name` (`resnet50`, `bert-large`, `tensor-64mib`) with `step` seconds of compute per step (a third
/// forward and optimizer, two thirds backward), or the published default.
///
/// Defaults, from NVIDIA's DeepLearningExamples performance tables for A100 80 GB
/// with mixed precision: ResNet-50 v1.5 about 2,600 images/s per GPU at batch 256
/// (98 ms a step); BERT-large pre-training phase 1 (sequence 128) about 850
/// sequences/s per GPU at batch 64 (75 ms a step).
pub(crate) fn named(name: &str, step: Option<f64>) -> Option<Workload> {
    let (tensors, default_step) = match name {
        "resnet50" => (resnet50_forward(), 256.0 / 2600.0),
        "bert-large" => (bert_large_forward(), 64.0 / 850.0),
        // The benchmark's one large tensor, submitted at once.
        "tensor-64mib" => (vec![("tensor".to_string(), 16 << 20)], 0.0),
        _ => return None,
    };
    let step = step.unwrap_or(default_step);
    Some(Workload {
        name: name.into(),
        tensors: tensors.into_iter().rev().collect(),
        forward: step / 3.0,
        backward: step * 2.0 / 3.0,
    })
}

#[cfg(test)]
mod tests {
    use super::named;

    #[test]
    fn the_published_models_have_their_parameter_counts() {
        let count = |w: &str| {
            named(w, None)
                .unwrap()
                .tensors
                .iter()
                .map(|t| t.1)
                .sum::<usize>()
        };
        let resnet = named("resnet50", None).unwrap();
        assert_eq!(resnet.tensors.len(), 161);
        assert_eq!(count("resnet50"), 25_557_032);
        // BERT-large: 335 M with the pre-training heads (334 M without).
        let bert = count("bert-large");
        assert!((334_000_000..337_000_000).contains(&bert), "{bert}");
        // Backward order: the classifier first, the stem last.
        assert_eq!(resnet.tensors[0].0, "fc.bias");
        assert_eq!(resnet.tensors[160].0, "conv1.weight");
        assert!(named("vgg", None).is_none());
    }
}
