"""Runs `python SCRIPT --help` for each script named on the command line, all in this one process, and
prints one JSON object: script -> {"exit": its exit status, "output": what it printed, "error": the
traceback of anything it raised, else null}.

One process because each script imports torch (seconds on a busy 2-core machine) and most import much
the same modules after it: a separate process per script would spend minutes importing. Each script runs
as `python SCRIPT` runs it: as __main__, its own folder first on sys.path, sys.argv = [SCRIPT, "--help"].
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
from pathlib import Path


def help_of(script: Path) -> dict:
    printed = io.StringIO()
    argv = sys.argv
    sys.argv = [str(script), "--help"]
    sys.path.insert(0, str(script.parent))
    exit_status, error = 0, None
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        exit_status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, (int, type(None))):
            printed.write(str(stop.code))
    except BaseException:  # noqa: BLE001 (an import error, a TypeError: what the caller is looking for)
        exit_status, error = 1, traceback.format_exc()
    finally:
        sys.argv = argv
        sys.path.remove(str(script.parent))
    return {"exit": exit_status, "output": printed.getvalue(), "error": error}


def main() -> None:
    results = {name: help_of(Path(name)) for name in sys.argv[1:]}
    print(json.dumps(results))


if __name__ == "__main__":
    main()
