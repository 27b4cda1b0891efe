use super::*;

#[test]
fn round_trip_keeps_the_allocation() {
    let v = vec![1i64, 2, 3, 4, 5, 6];
    let ptr = v.as_ptr();
    let t = Tensor::from_vec(v, &[2, 3]).unwrap();
    assert_eq!(t.len(), 6);
    assert_eq!(t.num_bytes(), 48);
    let back: Vec<i64> = t.into_vec().unwrap();
    assert_eq!(back.as_ptr(), ptr);
}

#[test]
fn issue53_a_size_that_cannot_be_allocated_is_an_error_not_an_abort() {
    let e = Tensor::try_zeros(DType::U8, &[1 << 62]).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("cannot allocate 4611686018427387904 bytes"),
        "{e}"
    );
    assert_eq!(Tensor::try_zeros(DType::F32, &[3]).unwrap().len(), 3);
}

#[test]
fn wrong_dtype_and_shape_are_errors() {
    let t = Tensor::from_vec(vec![f16::ONE; 4], &[4]).unwrap();
    let err = t.into_vec::<f32>().unwrap_err();
    assert_eq!(err.to_string(), "tensor holds F16 elements, not F32");
    let err = Tensor::from_vec(vec![0u8; 5], &[2, 3]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "shape [2, 3] needs 6 elements but 5 were given"
    );
}

#[test]
fn reshape_keeps_the_elements_and_refuses_another_count() {
    let v = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    let ptr = v.as_ptr();
    let mut t = Tensor::from_vec(v, &[2, 3]).unwrap();
    t.reshape(&[6]).unwrap();
    assert_eq!(t.shape(), &[6]);
    t.reshape(&[3, 2]).unwrap();
    assert_eq!(
        t.as_slice::<f32>().unwrap(),
        &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    let err = t.reshape(&[4]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "shape [4] needs 4 elements but 6 were given"
    );
    assert_eq!(t.shape(), &[3, 2]);
    let back: Vec<f32> = t.into_vec().unwrap();
    assert_eq!(back.as_ptr(), ptr);
}

/// A buffer owned elsewhere, as another framework's tensor memory would be.
struct Foreign(Vec<u64>);

impl HostBuffer for Foreign {
    fn bytes(&self) -> &[u8] {
        bytemuck::cast_slice(&self.0)
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.0)
    }
}

#[test]
fn host_buffer_is_used_in_place_and_given_back() {
    // 4 f32 in 2 u64 words: another element type than the tensor's, 8-aligned.
    let foreign = Foreign(vec![0; 2]);
    let ptr = foreign.0.as_ptr() as usize;
    let mut t = Tensor::from_host_buffer(foreign, DType::F32, &[2, 2]).unwrap();
    t.as_mut_slice::<f32>()
        .unwrap()
        .copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
    assert_eq!(t.as_slice::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(t.host_bytes_mut().as_ptr() as usize, ptr);
    assert_eq!(t.clone().into_vec::<f32>().unwrap(), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(t.clone(), t);
    assert!(t.as_slice::<f64>().is_err());
    // Issue 53 item 24: another framework's buffer is never kept for reuse.
    assert!(!t.reusable() && Tensor::zeros(DType::F32, &[4]).reusable());
    let back: Foreign = t.into_host_buffer().unwrap();
    assert_eq!(back.0.as_ptr() as usize, ptr);
    assert_eq!(
        bytemuck::cast_slice::<u64, f32>(&back.0),
        [1.0, 2.0, 3.0, 4.0]
    );
    let err = Tensor::from_host_buffer(Foreign(vec![0; 3]), DType::F32, &[2, 2]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "shape [2, 2] needs 4 elements but 6 were given"
    );
    let owned = Tensor::from_vec(vec![1.0f32], &[1]).unwrap();
    assert!(owned.into_host_buffer::<Foreign>().is_err());
}

/// Issue 31 item 6: a refused conversion hands its input back, unchanged.
#[test]
fn refused_conversions_hand_the_value_back() {
    let t = Tensor::from_vec(vec![1.5f32, 2.5], &[2]).unwrap();
    let err = t.into_vec::<f64>().unwrap_err();
    assert_eq!(err.to_string(), "tensor holds F32 elements, not F64");
    let back = err.into_inner();
    assert_eq!(back.into_vec::<f32>().unwrap(), [1.5, 2.5]);

    // A buffer of the wrong length comes back with its contents.
    let err = Tensor::from_host_buffer(Foreign(vec![9; 3]), DType::F32, &[2, 2]).unwrap_err();
    assert_eq!(
        err.error().to_string(),
        "shape [2, 2] needs 4 elements but 6 were given"
    );
    assert_eq!(err.into_inner().0, [9, 9, 9]);
    // `?` still gives kolo's Error.
    let as_error: Error = Tensor::from_host_buffer(Foreign(vec![0; 1]), DType::F64, &[2])
        .unwrap_err()
        .into();
    assert!(matches!(as_error, Error::ShapeMismatch { .. }));
}

/// Issue 31 item 11: shape products that overflow are errors, not a wrapped length
/// (release) or a panic (debug).
#[test]
fn overflowing_shapes_are_refused() {
    let huge = [1usize << 32, 1 << 32];
    let err = Tensor::from_vec(Vec::<f32>::new(), &huge).unwrap_err();
    assert!(matches!(err, Error::ShapeOverflow { .. }), "{err}");
    assert_eq!(
            err.to_string(),
            "shape [4294967296, 4294967296] of f32 elements is too large: its size in bytes overflows usize"
        );
    // The element count fits, its size in bytes does not.
    let bytes_only = [usize::MAX / 2];
    assert!(Tensor::from_vec(Vec::<u8>::new(), &bytes_only).is_err());
    assert!(Tensor::try_zeros(DType::F64, &bytes_only).is_err());
    let err = Tensor::from_host_buffer(Foreign(vec![]), DType::F32, &huge).unwrap_err();
    assert!(matches!(err.error(), Error::ShapeOverflow { .. }));
    // A zero dimension makes any shape empty, not an overflow.
    assert_eq!(
        Tensor::try_zeros(DType::F32, &[0, usize::MAX])
            .unwrap()
            .len(),
        0
    );
}

#[test]
fn scalar_has_one_element() {
    let t = Tensor::from_vec(vec![7i32], &[]).unwrap();
    assert_eq!(t.shape(), &[] as &[usize]);
    assert_eq!(t.len(), 1);
    assert_eq!(Tensor::zeros(DType::BF16, &[3, 0]).len(), 0);
}

#[test]
fn large_zeros_are_zero_in_every_dtype() {
    // Above the size marked for huge pages: still all zeros, of the right length.
    for dtype in DType::ALL {
        let len = (5 << 20) / dtype.size_of() + 3;
        let t = Tensor::zeros(dtype, &[len]);
        assert_eq!(t.len(), len, "{dtype}");
        assert_eq!(t.num_bytes(), len * dtype.size_of(), "{dtype}");
        assert!(t.host_bytes().iter().all(|&b| b == 0), "{dtype}");
    }
}
