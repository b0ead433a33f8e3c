"""Where the sky network of `--mask-sky` costs the stream least: one product-path run of bench_e2e.py with the
network run as the product runs it, or changed in one way, to compare steady FPS across variants in one call.

    python3 scripts/probes/sky_placement.py VARIANT [bench_e2e.py options, --mask-sky among them]

VARIANT, parts joined by '+':
    product   the product's session (the CUDA provider, channels-last convolutions, float16 behind float32
              input and output, its kernels on a stream confined to SKY_NETWORK_SMS SMs: app/outputs/sky.py)
    fp32      the network in float32 instead (HALF_PRECISION_ON_GPU off)
    whole     the CUDA provider's own stream, on the whole GPU
    smsN      the kernels on a stream confined to N SMs (a green context)

The network is the file in STREAM_RECON_CHECKPOINTS, as for the product.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench_e2e.py"


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
    parser.add_argument("variant", help="product, or '+' of fp32, whole, smsN")
    args = parser.parse_args()
    for part in args.variant.split("+"):
        if part == "fp32":
            from stream_recon.app.outputs import sky

            sky.HALF_PRECISION_ON_GPU = False
        elif part.startswith("sms") and part[3:].isdigit():
            place(int(part[3:]))
        elif part == "whole":
            place(None)
        elif part != "product":
            parser.error(f"no variant {part!r}: product, or '+' of fp32, whole, smsN")
    sys.argv = [str(BENCH), *(a for a in sys.argv[1:] if a != args.variant)]
    bench.main()


if __name__ == "__main__":
    main()
