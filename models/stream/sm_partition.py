"""A CUDA stream whose kernels may use only some of the GPU's SMs (a green context, CUDA 12.4+).

Beside the stream, the spare engine's kernels fill every SM the stream's kernels leave, and a stream
kernel launched then waits for SMs until the spare's blocks retire: a ~30 ms step spans 37-76 ms of
device time beside the spare's. A spare whose kernels may use only part of the
SMs leaves the rest free for the stream's next kernel.

The driver's green-context calls are reached through ctypes (libcuda), so that any PyTorch build with
CUDA can use them; the stream is handed to PyTorch as an external stream. Where the driver lacks them
(before CUDA 12.4) or refuses, `partitioned_stream` returns None and the caller uses a plain stream.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

logger = logging.getLogger("stream_recon.models.stream.sm_partition")

_RESOURCE_TYPE_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_GREEN_CTX_DEFAULT_STREAM = 0x1  # CU_GREEN_CTX_DEFAULT_STREAM: required by cuGreenCtxCreate
_STREAM_NON_BLOCKING = 0x1  # CU_STREAM_NON_BLOCKING: required by cuGreenCtxStreamCreate
# CUdevResource is 144 bytes in CUDA 12.4-12.9 and larger in later headers; the SM count sits after the
# type (4 bytes) and 92 bytes of padding. A buffer this large holds any version's struct.
_RESOURCE_BYTES = 1024
_SM_COUNT_OFFSET = 96


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    needed = ("cuDeviceGet", "cuDeviceGetDevResource", "cuDevSmResourceSplitByCount", "cuDevResourceGenerateDesc",
              "cuGreenCtxCreate", "cuGreenCtxStreamCreate")
    return driver if all(hasattr(driver, name) for name in needed) else None


class _Failed(RuntimeError):
    pass


def _check(result: int, call: str) -> None:
    if result != 0:
        raise _Failed(f"{call} returned CUresult {result}")


def device_sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def partitioned_stream(device: torch.device, num_sms: int, priority: int = 0) -> torch.cuda.ExternalStream | None:
    """A stream on `device` whose kernels run on `num_sms` of its SMs (the driver rounds up to its
    partition granularity, 8 on Hopper), with `priority`; None where the driver cannot make one. One
    green context and stream per device, SM count and priority, kept for the process: a batch of runs
    gets a spare engine each, and each takes the same stream."""
    if device.type != "cuda" or _driver() is None:
        return None
    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _partitioned_stream(index, num_sms, priority)


@functools.cache
def _partitioned_stream(index: int, num_sms: int, priority: int) -> torch.cuda.ExternalStream | None:
    driver, device = _driver(), torch.device("cuda", index)
    torch.empty(1, device=device)  # the primary context, current on this thread
    try:
        cu_device = ctypes.c_int()
        _check(driver.cuDeviceGet(ctypes.byref(cu_device), index), "cuDeviceGet")
        whole = ctypes.create_string_buffer(_RESOURCE_BYTES)
        _check(driver.cuDeviceGetDevResource(cu_device, whole, _RESOURCE_TYPE_SM), "cuDeviceGetDevResource")
        part, rest = ctypes.create_string_buffer(_RESOURCE_BYTES), ctypes.create_string_buffer(_RESOURCE_BYTES)
        groups = ctypes.c_uint(1)
        _check(driver.cuDevSmResourceSplitByCount(part, ctypes.byref(groups), whole, rest, 0, num_sms),
               "cuDevSmResourceSplitByCount")
        if groups.value != 1:
            raise _Failed(f"{num_sms} SMs make {groups.value} groups")
        description = ctypes.c_void_p()
        _check(driver.cuDevResourceGenerateDesc(ctypes.byref(description), part, 1), "cuDevResourceGenerateDesc")
        green = ctypes.c_void_p()
        _check(driver.cuGreenCtxCreate(ctypes.byref(green), description, cu_device, _GREEN_CTX_DEFAULT_STREAM),
               "cuGreenCtxCreate")
        handle = ctypes.c_void_p()
        _check(driver.cuGreenCtxStreamCreate(ctypes.byref(handle), green, _STREAM_NON_BLOCKING, priority),
               "cuGreenCtxStreamCreate")
    except _Failed as error:
        logger.info("no stream on part of the SMs (%s): a plain stream instead", error)
        return None
    granted = int.from_bytes(part.raw[_SM_COUNT_OFFSET:_SM_COUNT_OFFSET + 4], "little")
    logger.info("a stream on %d of the device's %d SMs", granted, device_sm_count(device))
    return torch.cuda.ExternalStream(handle.value, device=device)
