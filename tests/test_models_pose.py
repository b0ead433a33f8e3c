"""The one rotation <-> quaternion pair (models.stream.pose), used by the decoder, the windowed engine and the app's files."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.models.stream.pose import (
    back_project,
    decode_pose,
    quat_xyzw_to_rotation,
    rotation_to_quat_xyzw,
)

unit_quaternions = st.lists(st.floats(-1, 1), min_size=4, max_size=4).filter(lambda v: np.linalg.norm(v) > 1e-3)


@settings(max_examples=200, deadline=None)
@given(unit_quaternions)
def test_quaternion_round_trip(values):
    q = np.asarray(values) / np.linalg.norm(values)
    q = q if q[3] >= 0 else -q
    rotation = quat_xyzw_to_rotation(q)
    assert rotation.dtype == np.float64
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(3), atol=1e-12)
    np.testing.assert_allclose(np.linalg.det(rotation), 1.0, atol=1e-12)
    back = rotation_to_quat_xyzw(rotation)
    # q and -q are the same rotation; w >= 0 picks one, except on the w = 0 great circle.
    assert np.allclose(back, q, atol=1e-9) or np.allclose(back, -q, atol=1e-9)


def test_numpy_and_torch_inputs_give_the_same_rotation_and_batches_match_single_calls():
    quats = np.random.default_rng(0).normal(size=(5, 7, 4))  # any norm
    batched = quat_xyzw_to_rotation(quats)
    assert batched.shape == (5, 7, 3, 3)
    np.testing.assert_array_equal(batched, quat_xyzw_to_rotation(torch.from_numpy(quats)).numpy())
    quat_back = rotation_to_quat_xyzw(batched)
    assert quat_back.shape == (5, 7, 4) and (quat_back[..., 3] >= 0).all()
    np.testing.assert_array_equal(quat_back[2, 3], rotation_to_quat_xyzw(batched[2, 3]))


def test_host_encodings_decode_in_numpy_as_the_device_decodes_them():
    # The chunk alignment decodes its emissions on the host in numpy (no torch call hands the GIL over).
    pose_enc = np.random.default_rng(1).normal(size=(17, 9)).astype(np.float32)
    pose_enc[:, 7:] = np.abs(pose_enc[:, 7:]) + 0.3  # fields of view, rad
    c2w, intrinsics = decode_pose(pose_enc, 392, 518)
    assert isinstance(c2w, np.ndarray) and c2w.dtype == np.float32 and c2w.shape == (17, 3, 4)
    assert intrinsics.dtype == np.float32 and intrinsics.shape == (17, 3, 3)
    c2w_torch, intrinsics_torch = decode_pose(torch.from_numpy(pose_enc), 392, 518)
    np.testing.assert_array_equal(c2w, c2w_torch.numpy())
    np.testing.assert_allclose(intrinsics, intrinsics_torch.numpy(), rtol=5e-7, atol=0)  # tan may differ by an ulp
    np.testing.assert_array_equal(intrinsics[:, 2], np.tile([0, 0, 1], (17, 1)))
    np.testing.assert_array_equal(intrinsics[:, :2, 2], np.tile([259, 196], (17, 1)))


def test_half_turns_keep_their_axis():
    # w = 0: the trace formula alone would divide by zero here.
    for axis in np.eye(3):
        rotation = 2 * np.outer(axis, axis) - np.eye(3)  # 180 degrees about `axis`
        quat = rotation_to_quat_xyzw(rotation)
        np.testing.assert_allclose(np.abs(quat), [*axis, 0.0], atol=1e-12)
        np.testing.assert_allclose(quat_xyzw_to_rotation(quat), rotation, atol=1e-12)


def test_back_projection_reprojects_to_the_pixel_and_keeps_the_depth():
    v, u = np.mgrid[0:6, 0:8]
    z = np.full((6, 8), 2.0, dtype=np.float32)
    z[3, 5] = 4.0
    intrinsics = np.array([[10.0, 0, 4.0], [0, 12.0, 3.0], [0, 0, 1]])
    for dtype in (np.float32, np.float64):
        x, y = back_project(u, v, z, intrinsics, dtype)
        assert x.dtype == y.dtype == dtype
        points = np.stack([x, y, z], axis=-1)
        projected = points @ intrinsics.T
        uv = projected[..., :2] / projected[..., 2:]
        np.testing.assert_allclose(uv[..., 0], u, atol=1e-5)  # integer pixels, no half-pixel shift
        np.testing.assert_allclose(uv[..., 1], v, atol=1e-5)
        assert points[3, 5, 2] == 4.0
    assert u.dtype.kind == "i" and u[0, 1] == 1  # the caller's pixel arrays are left as they were
