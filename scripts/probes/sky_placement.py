"""Where the sky network of `--mask-sky` costs the stream least: one product-path run of bench_e2e.py with the
network run as the product runs it, or changed in one way, to compare steady FPS across variants in one call.

    python3 scripts/probes/sky_placement.py VARIANT [bench_e2e.py options, --mask-sky among them]

VARIANT:
    product   the product's session (the CUDA provider, channels-last convolutions, its kernels on a stream
              confined to SKY_NETWORK_SMS SMs: app/outputs/sky.py)
    whole     the CUDA provider's own stream, on the whole GPU
    smsN      the kernels on a stream confined to N SMs (a green context) instead
    fp16      the network's weights and arithmetic in float16, its input and output still float32
              (onnxruntime.transformers.float16 on a copy of the file)
    fp16+X    fp16 and one of the placements above

The network is the file in STREAM_RECON_CHECKPOINTS, as for the product; fp16 writes its copy beside the
probe's temporary folder and points STREAM_RECON_CHECKPOINTS there for this process.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench_e2e.py"


def half_precision_copy(folder: Path) -> Path:
    """skyseg.onnx of `folder` converted to float16 arithmetic in a new folder; returns that folder."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from stream_recon.app.outputs.sky import SKYSEG_FILE

    target = Path(tempfile.mkdtemp(prefix="skyseg_fp16_"))
    model = convert_float_to_float16(onnx.load(str(folder / SKYSEG_FILE)), keep_io_types=True)
    onnx.save(model, str(target / SKYSEG_FILE))
    return target


def place(num_sms: int | None) -> None:
    """The run's sky network on `num_sms` SMs (None: the provider's own stream on the whole GPU)."""
    from stream_recon.app.run import pipeline

    pipeline.SKY_NETWORK_SMS = num_sms
    print(f"sky network on {num_sms or 'all the'} SMs", flush=True)


def bench_e2e():
    """scripts/bench_e2e.py as a module (its parser and its main)."""
    spec = importlib.util.spec_from_file_location("bench_e2e", BENCH)
    module = sys.modules["bench_e2e"] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    bench = bench_e2e()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     parents=[bench.argument_parser()], conflict_handler="resolve")
    parser.add_argument("variant", help="product, whole, smsN, fp16, or fp16+ one of the others")
    args = parser.parse_args()
    for part in args.variant.split("+"):
        if part == "fp16":
            folder = Path(os.environ.get("STREAM_RECON_CHECKPOINTS", "."))
            os.environ["STREAM_RECON_CHECKPOINTS"] = str(half_precision_copy(folder))
        elif part.startswith("sms") and part[3:].isdigit():
            place(int(part[3:]))
        elif part == "whole":
            place(None)
        elif part != "product":
            parser.error(f"no variant {part!r}: product, whole, smsN, fp16 or fp16+ one of the others")
    sys.argv = [str(BENCH), *(a for a in sys.argv[1:] if a != args.variant)]
    bench.main()


if __name__ == "__main__":
    main()
