"""Faults for the fault-injection tests (tests/test_app_faults.py), in real processes.

Python imports `sitecustomize` at start-up from the path, so every process of a run started with this
folder on PYTHONPATH (the CLI's and its helper children) reads three variables:

- STREAM_RECON_TEST_FAULT="module:Class.method:kind:call" makes the `call`-th call (1 = the first) of
  that function, in whichever process makes it, raise (`raise`), kill its process (`kill`: SIGKILL),
  stop it (`stop`: SIGSTOP), block its thread for good (`block`) or send its process SIGTERM and go on
  (`term`: the signal lands inside the call, as a user's can);
- STREAM_RECON_TEST_DEADLINES="module:NAME=seconds,..." shortens a module's deadline constants;
- STREAM_RECON_TEST_IMPORTED=FILE writes, as the process exits, the top-level names of the modules it imported
  (a JSON list) to FILE: what a command refused before torch was imported never imported it.

Both take effect when the module is first imported, so nothing is imported here that the process
would not import anyway.
"""

from __future__ import annotations

import functools
import importlib.abc
import os
import signal
import sys
import threading

FAULT = os.environ.get("STREAM_RECON_TEST_FAULT", "")
DEADLINES = os.environ.get("STREAM_RECON_TEST_DEADLINES", "")
IMPORTED = os.environ.get("STREAM_RECON_TEST_IMPORTED", "")


class InjectedFault(RuntimeError):
    pass


def _faulty(function, kind: str, call: int):
    calls = [0]

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            if kind == "raise":
                raise InjectedFault(f"injected into {function.__qualname__}")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if kind == "block":
                threading.Event().wait()
            if kind == "term":
                os.kill(os.getpid(), signal.SIGTERM)
        return function(*args, **kwargs)

    return wrapper


def _patches() -> dict[str, list]:
    """module -> [callable(module)] to apply once it is imported."""
    patches: dict[str, list] = {}
    if FAULT:
        module, qualname, kind, call = FAULT.split(":")

        def inject(loaded, qualname=qualname, kind=kind, call=int(call)):
            owner_name, _, name = qualname.rpartition(".")
            owner = loaded if not owner_name else getattr(loaded, owner_name)
            setattr(owner, name, _faulty(getattr(owner, name), kind, call))

        patches.setdefault(module, []).append(inject)
    for item in filter(None, DEADLINES.split(",")):
        target, seconds = item.split("=")
        module, name = target.split(":")
        patches.setdefault(module, []).append(lambda loaded, name=name, value=float(seconds): setattr(loaded, name, value))
    return patches


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def __init__(self, patches: dict[str, list]) -> None:
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        execute = spec.loader.exec_module

        def exec_then_patch(module):
            execute(module)
            for patch in self.patches.pop(fullname):
                patch(module)

        spec.loader.exec_module = exec_then_patch
        return spec


if FAULT or DEADLINES:
    import importlib.util

    sys.meta_path.insert(0, _PatchOnImport(_patches()))


def _record_imported() -> None:
    with open(IMPORTED, "w") as record:
        record.write(json.dumps(sorted({name.partition(".")[0] for name in list(sys.modules)})))


if IMPORTED:
    import atexit
    import json

    atexit.register(_record_imported)
