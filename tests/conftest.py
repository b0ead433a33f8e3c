"""Shared test fixtures.

Every module's torch runs on one intra-op thread (one_torch_thread, autouse) but the golden modules',
whose full-size model's products are large enough to share between the cores this worker has; NumPy's and
OpenCV's BLAS run on one thread in every test process (one_blas_thread, autouse).

For a test that runs the tiny model:

    def test_something(tiny_model): ...                         # ModelConfig.tiny(), synthetic weights
    def test_streaming(prepared_tiny_model): ...                # the same, ready for StreamingEngine
    def test_cli(tiny_checkpoint): ...                          # the same weights as a .safetensors file

and `build_tiny_model()` where a plain function is needed (a Ray worker's loader, a checkpoint to save).
"""

import os
import sys
from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest
import threadpoolctl
import torch

from stream_recon.models import GCTStream, ModelConfig, prepare_for_inference
from stream_recon.models.checkpoint import convert_to_safetensors
from stream_recon.models.synthetic import load_synthetic_weights

# Golden helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
from golden_utils import GOLDEN, full_size_model  # noqa: E402

# Float32 everywhere: TF32 would break the golden tolerance (fixtures README §5).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def build_tiny_model(config: ModelConfig | None = None) -> GCTStream:
    """The tiny model (`config`, default ModelConfig.tiny()) with the deterministic synthetic weights, in
    eval mode on the CPU: every caller, process and Ray worker gets the same numbers."""
    return load_synthetic_weights(GCTStream(config or ModelConfig.tiny())).eval()


@pytest.fixture(scope="module")
def tiny_model() -> GCTStream:
    """One tiny model per test module (see build_tiny_model)."""
    return build_tiny_model()


@pytest.fixture(scope="module")
def prepared_tiny_model(tiny_model) -> GCTStream:
    """tiny_model prepared for streaming on the CPU in float32 (it shares the weights)."""
    return prepare_for_inference(tiny_model)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's weights (build_tiny_model) as a .safetensors checkpoint carrying its config,
    written by our own converter; the official-format tiny.pt it was converted from lies beside it."""
    folder = tmp_path_factory.mktemp("checkpoint")
    torch.save(build_tiny_model().state_dict(), folder / "tiny.pt")
    return convert_to_safetensors(folder / "tiny.pt", folder / "tiny.safetensors", config=ModelConfig.tiny())


# The files that take over a minute of a worker (a whole pass's --durations, the golden files on the other worker:
# the process files 60-150 s each, test_app_localise_process.py 109 s), longest first: handed out right after
# the golden ones, so that the suite ends on short files on both workers.
LONGEST_FILES = ("test_app_cli_process.py", "test_app_localise_process.py", "test_models_loop_localise.py",
                 "test_scripts_smoke.py", "test_app_faults.py", "test_app_new_user.py", "test_models_chunked.py",
                 "test_app_cli.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The golden tests (the full-size model on the CPU: minutes a file) first, then LONGEST_FILES. On two workers
    (scripts/test) each file goes whole to one worker in this order (`--dist loadfile --no-loadscope-reorder`); by
    xdist's default order, the most tests a file first, the golden files came last, and one worker spent the suite's
    last ~25 minutes on them alone."""
    def rank(item: pytest.Item) -> tuple[bool, int]:
        name = item.path.name
        return item.get_closest_marker("golden") is None, (LONGEST_FILES.index(name) if name in LONGEST_FILES
                                                             else len(LONGEST_FILES))

    items.sort(key=rank)  # (stable: the rest keep their order)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The skipped tests counted by reason, a line a reason: pytest's own list (`-rs`) has a line a test, ~45 of them
    "needs a CUDA GPU" on a CPU machine, where the failures' lines matter (pyproject.toml's -r leaves skips out)."""
    reasons = Counter(str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
                      .removeprefix("Skipped: ") for report in terminalreporter.stats.get("skipped", []))
    if reasons:
        terminalreporter.write_sep("-", f"{sum(reasons.values())} skipped")
        for reason, count in reasons.most_common():
            terminalreporter.write_line(f"{count:4d}  {reason}")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread(request: pytest.FixtureRequest):
    """Torch on one intra-op thread for the module, then back to what it was; a golden module gets this worker's
    share of the cores (cores_per_worker).

    The tiny model's ops take microseconds: two OpenMP threads on a busy 2-core machine only wait on
    each other and a run gets ~15x slower (a 60-frame stream of the tiny model: 95 s of CPU on two
    threads, 2 s on one). One thread also matches Ray workers, which run torch on one thread, so
    in-process and distributed results compare number for number. The full-size model's products
    (tests marked golden) are what the cores share well.
    """
    previous = torch.get_num_threads()
    golden = request.node.get_closest_marker("golden") is not None
    torch.set_num_threads(cores_per_worker() if golden else 1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session", autouse=True)
def one_blas_thread():
    """The BLAS libraries loaded here (NumPy's and OpenCV's OpenBLAS) on one thread for the session, as the loop
    closure child runs them (models/loops/process.py). The tests' matrices are small: a second OpenBLAS thread
    spins between calls on the core the other pytest-xdist worker needs. TUM fr2_desk's localise tests beside a
    busy loop took 43 s with two BLAS threads, 31 s with one (52 s of CPU against 32 s)."""
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        yield


def cores_per_worker() -> int:
    """This process's share of the cores: all of them, or an equal part on each of pytest-xdist's workers. Two
    golden files at once on two cores, two threads each, took 577 and 526 s; one thread each, 335 and 240 s:
    an OpenMP thread that finds its core taken holds up its whole team."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, len(os.sched_getaffinity(0)) // workers)


@pytest.fixture(scope="session")
def gpu_model():
    """The full-size model on deterministic weights as loaded (float32, on the host): each GPU test
    prepares its own copy for the device and precision it runs (prepare_for_inference)."""
    return full_size_model()


@pytest.fixture(scope="session")
def golden_checkpoint(tmp_path_factory) -> Path:
    """The fixtures' weights as an official-format .pt file (a bare state dict)."""
    path = tmp_path_factory.mktemp("checkpoint") / "synthetic-lingbot-map.pt"
    torch.save(full_size_model().state_dict(), path)
    return path


@pytest.fixture(scope="session")
def golden_frame_folder(tmp_path_factory) -> Path:
    """The 14 golden inputs as PNG files: at width 224 the preprocessing is the identity (fixtures §2)."""
    folder = tmp_path_factory.mktemp("golden_frames")
    images = np.load(GOLDEN / "inputs" / "preprocessed.npz")["images_u8"]  # [14, 3, H, W] RGB
    for index, image in enumerate(images):
        cv2.imwrite(str(folder / f"{index:06d}.png"), cv2.cvtColor(image.transpose(1, 2, 0), cv2.COLOR_RGB2BGR))
    return folder



def symlink_and_fifo(folder: Path, target: str, link: str, fifo: str, content: str) -> tuple[Path, Path, Path]:
    """In `folder`: a regular file `target` holding `content`, a symlink `link` to it and a FIFO `fifo`: the
    special paths an output must write through (the link) or refuse (the FIFO), never replace."""
    target_path, link_path, fifo_path = folder / target, folder / link, folder / fifo
    target_path.write_text(content)
    link_path.symlink_to(target_path)
    os.mkfifo(fifo_path)
    return target_path, link_path, fifo_path
