import numpy as np

from stream_recon.app.geometry import depth_to_camera_points, depth_to_world_points


def test_back_projection_reprojects_to_the_pixel():
    depth = np.full((6, 8), 2.0, dtype=np.float32)
    depth[3, 5] = 4.0
    intrinsics = np.array([[10.0, 0, 4.0], [0, 12.0, 3.0], [0, 0, 1]])
    points = depth_to_camera_points(depth, intrinsics)
    projected = points @ intrinsics.T
    uv = projected[..., :2] / projected[..., 2:]
    v, u = np.mgrid[0:6, 0:8]
    np.testing.assert_allclose(uv[..., 0], u, atol=1e-5)
    np.testing.assert_allclose(uv[..., 1], v, atol=1e-5)
    assert points[3, 5, 2] == 4.0


def test_world_points_use_camera_to_world():
    depth = np.ones((2, 2), dtype=np.float32)
    intrinsics = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1]])
    c2w = np.hstack([np.eye(3), [[1.0], [2.0], [3.0]]])
    world = depth_to_world_points(depth, intrinsics, c2w)
    np.testing.assert_allclose(world[0, 0], [1.0, 2.0, 4.0])
