"""The scripts that figures come from still run: a figure's command must work when someone reruns it.

- Every benchmark (scripts/bench*.py) runs on the CPU with the tiny model and a few frames, and its
  output holds the figure it exists to produce, a finite number. scripts/bench_e2e.py has its own smoke
  tests (tests/test_bench_e2e.py); scripts/bench_shapes.py needs a CUDA GPU, so it is imported and its
  helpers called instead.
- Every script in scripts/, scripts/probes/ and scripts/fixtures/, and every one README.md, docs/usage.md,
  docs/PERFORMANCE.md or the dated log docs/performance-log.md cites (the docs are read at test time, so a
  newly cited script is covered without a change here), imports and answers --help.
- The GPU machine's entry point (scripts/device/measure.sh, the env.sh it sources, and any .sh the docs
  cite) parses (`bash -n`), and each scripts/*.py a suite runs exists and takes every --flag it passes
  (that script's --help lists it).
- The layout: at most 8 benchmarks (bench*.py) and the user's commands at scripts/'s top, every probe and
  fixture tool named in its folder's README.md index with one line, every suite measure.sh's top comment
  lists in its case statement, and every suite the docs cite listed there.

Numbers are not checked against any speed, only that each was measured.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
from evo_data import EVO_DATA_ENV, evo_data_dir
from helpers import wait_until

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
DOCS = ("README.md", "docs/usage.md", "docs/PERFORMANCE.md", "docs/performance-log.md")
# The dated performance log keeps its entries as they were written, so it cites scripts that were removed,
# moved or merged since (their findings stay in the log). A cited path missing from the repository must be
# one of these, and only the log may cite it.
REMOVED_SCRIPTS_THE_LOG_CITES = frozenset({
    "scripts/bench_attention.py",
    "scripts/device/run_compile_beside.sh",
    "scripts/device/run_rollovers.sh",
    "scripts/device/run_scale_step_ab.sh",
    "scripts/device/run_trace.sh",
    "scripts/gpu/probe_dense_kernels.py",
    "scripts/gpu/probe_few_token_linear.py",
    "scripts/gpu/probe_mlp_gelu.py",
    "scripts/gpu/probe_paged_memory.py",
    "scripts/gpu/probe_qk_norm_rope.py",
    "scripts/gpu/probe_speed.sh",
    "scripts/gpu/probe_triton_attention.py",
    "scripts/gpu/profile_step.py",
    "scripts/gpu/run_fast_path.sh",
    "scripts/gpu/run_gpu_suite.sh",
    "scripts/gpu/run_speed_round.sh",
    "scripts/probe_gemm.py",  # TunableOp and Triton tiles for the blocks' products: tried, not kept
    # the library kernels over the dense layout's ranges, retired with the dense layout
    "scripts/probe_attention_schedule.py", "scripts/probe_library_waves.py",
    "scripts/time_scale_step.py",  # the scale step compiled: tried, not kept
})
# A script the log cites that moved -> where it is now.
MOVED_SCRIPTS_THE_LOG_CITES = {
    **{f"scripts/{name}.py": f"scripts/probes/{name}.py" for name in (
        "long_run", "probe_cold_start", "probe_compile_artifacts", "probe_gluon_attention",
        "probe_prepare", "probe_range_variants", "probe_sm_partition", "probe_triton_builds",
        "profile_step", "scale_step_memory", "trace_rollover")},
    # the GPU machine's scripts, merged into suites of scripts/device/measure.sh
    **{f"scripts/device/{name}.sh": f"scripts/device/measure.sh {suite}" for name, suite in {
        "bench_against": "against", "run_refactor_check": "against", "run_acceptance": "acceptance",
        "run_e2e": "e2e", "run_shapes_e2e": "shapes-e2e", "run_shapes": "shapes", "run_reference": "reference",
        "run_gpu_tests": "gpu-tests", "run_first_prediction": "start", "run_first_start": "start",
        "run_cold_start": "start", "run_compile_auto": "start", "run_kernel_builds": "start", "run_warm_up": "start",
        "run_compiled_code": "start", "run_catchup": "spare", "run_dense_flow": "spare", "run_fit16": "spare",
        "run_spare_fit": "spare", "run_spare_memory": "spare", "run_spare_sms_ab": "spare", "run_variants": "kernel",
        "run_range_probe": "kernel", "run_loop_closure": "loops", "run_never_hang": "soak-a"}.items()},
}
LOG = "docs/performance-log.md"
CITATION = re.compile(r"(?<![\w./$-])(scripts/[\w./-]*\w\.(?:py|sh))\b")


def cited_scripts() -> dict[str, list[str]]:
    """Each scripts/….py or .sh path the docs name -> where: ["README.md:42", ...]."""
    cited: dict[str, list[str]] = {}
    for doc in DOCS:
        for number, line in enumerate((REPO / doc).read_text().splitlines(), start=1):
            for path in CITATION.findall(line):
                cited.setdefault(path, []).append(f"{doc}:{number}")
    return cited


CITED = cited_scripts()
GONE = REMOVED_SCRIPTS_THE_LOG_CITES | set(MOVED_SCRIPTS_THE_LOG_CITES)
TOOL_FOLDERS = ("probes", "fixtures")  # scripts/probes/, scripts/fixtures/: each with a README.md index
PYTHON_SCRIPTS = sorted(({str(p.relative_to(REPO)) for folder in ("", *TOOL_FOLDERS)
                          for p in (SCRIPTS / folder).glob("*.py")}
                         | {p for p in CITED if p.endswith(".py")}) - GONE)
SHELL_SCRIPTS = sorted(({str(p.relative_to(REPO)) for p in (SCRIPTS / "device").glob("*.sh")}
                        | {p for p in CITED if p.endswith(".sh")}) - GONE)


def where_cited(path: str) -> str:
    return ", ".join(CITED.get(path, [])) or "not cited"


def run_script(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """`python ARGS` from the repository root on one torch thread (the tiny model's ops take microseconds:
    threads on a busy 2-core machine only wait on each other); its stdout, after it exited 0."""
    done = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    assert done.returncode == 0, f"python {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


def finite(figures: dict[str, object]) -> dict[str, float]:
    for name, value in figures.items():
        assert isinstance(value, (int, float)) and math.isfinite(value), f"{name} = {value!r}"
    return figures  # type: ignore[return-value]


def number_after(pattern: str, text: str) -> float:
    found = re.search(pattern, text)
    assert found, f"no /{pattern}/ in:\n{text[-3000:]}"
    return float(found.group(1))


# -- the benchmarks, run on the CPU ----------------------------------------------------------------------
def engine_figures(tmp_path: Path) -> dict[str, float]:
    result_file = tmp_path / "bench.json"
    run_script("scripts/bench.py", "--model", "tiny", "--height", "84", "--width", "112", "--scale", "2",
               "--window", "4", "--frames", "4", "--dtype", "fp32", "--no-compile", "--json", str(result_file))
    result = json.loads(result_file.read_text())
    assert result["device"] == "cpu" and result["steady_frames"] == 4 and result["size"] == "112x84"
    keys = ("ms_per_frame_median", "ms_per_frame_wall", "fps", "cold_start_s")
    return finite({key: result[key] for key in keys})


def checkpoint_load_figures(tmp_path: Path, *product: str) -> dict[str, float]:
    printed = run_script("scripts/bench_checkpoint_load.py", "--model", "tiny", "--repeat", "1",
                         "--folder", str(tmp_path), *product)
    loads = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
    assert [load["file"] for load in loads] == ["tiny.pt", "tiny.safetensors"], printed
    assert not list(tmp_path.iterdir())  # the files are deleted without --keep
    keys = ("read_on_host_s", "prepare_s", "peak_rss_mib") if product else ("load_s", "peak_rss_mib")
    return finite({f"{load['file']} {key}": load[key] for load in loads for key in keys})


def loop_closure_figures(tmp_path: Path) -> dict[str, float]:
    result_file = tmp_path / "loop_closure.json"
    run_script("scripts/bench_loop_closure.py", "--model", "tiny", "--device", "cpu", "--frames", "48",
               "--chunk-frames", "12", "--overlap", "4", "--warmup-frames", "12", "--image-width", "112",
               "--video-size", "160x120", "--video-dir", str(tmp_path), "--json", str(result_file), "--refine")
    result = json.loads(result_file.read_text())
    assert [run["mode"] for run in result["runs"]] == ["off", "on"]
    off, on = result["runs"]
    loops = on["loop_closure"]
    assert loops["mode"] == "on" and loops["keyframes_indexed"] > 0, loops
    assert off["rollovers"] >= 2 and on["rollovers"] >= 2  # chunks of 12 frames, 8 apart, over 48 frames
    assert on["refine"]["frames"] == on["frames"] and off["refine"] is None, on["refine"]
    return finite({"on_over_off": result["on_over_off"], "off steady_fps": off["steady_fps"],
                   "on steady_fps": on["steady_fps"], "refine s": on["refine"]["command_s"]})


def pose_graph_figures(tmp_path: Path) -> dict[str, float]:
    data = evo_data_dir()  # skips where the real trajectories cannot be had, as the pose graph's tests do
    printed = run_script("scripts/bench_pose_graph.py", "--seeds", "1", "--sizes", "100",
                         env={EVO_DATA_ENV: str(data)})
    kitti, _, rest = printed.partition("TUM fr1_xyz")
    return finite({
        "KITTI 00 corrected / open": number_after(r"corrected / open: mean ([\d.e+-]+)", kitti),
        "TUM fr1_xyz corrected / open": number_after(r"corrected / open: mean ([\d.e+-]+)", rest),
        "100 chunks optimize s": number_after(r"100 chunks, .*: optimize ([\d.e+-]+) s", rest),
    })


def loop_consistency_figures(tmp_path: Path) -> dict[str, float]:
    data = evo_data_dir()  # skips where the real trajectories cannot be had, as the pose graph's tests do
    printed = run_script("scripts/bench_loop_consistency.py", "--seeds", "1", "--trajectories", "TUM fr1_xyz",
                         env={EVO_DATA_ENV: str(data)})
    figures = {}
    for line in printed.splitlines():
        if "|" in line and "false rejected" in line:
            case, label, _ = (part.strip() for part in line.split("|"))
            figures[f"{case}, {label}: ATE corrected / open"] = number_after(r"ATE corrected/open median ([\d.e+-]+)",
                                                                             line)
            figures[f"{case}, {label}: with / without false loops"] = number_after(
                r"with/without false loops max ([\d.e+-]+)", line)
    assert len(figures) == 30, printed  # five cases, three settings, two figures each
    return finite(figures)


def rollover_figures(tmp_path: Path) -> dict[str, float]:
    printed = run_script("scripts/bench_rollover.py", "--model", "tiny", "--device", "cpu", "--height", "84",
                         "--width", "112", "--scale", "2", "--window", "4", "--frames", "40",
                         "--chunk-frames", "16", "--overlap", "4", "--warmup-frames", "12")
    figures = {}
    for variant in ("in place", "lookahead"):
        section = printed.partition(f"== {variant}: ")[2].partition("==")[0]
        assert section.count("rollover at frame") >= 2, printed  # chunks of 16 frames, 12 apart, over 40
        figures[f"{variant} steady FPS"] = number_after(r"^steady ([\d.]+) FPS", section)
        figures[f"{variant} longest ms"] = number_after(r"longest ([\d.]+) ms", section)
    return finite(figures)


BENCH_RUNS: dict[str, Callable[[Path], dict[str, float]]] = {
    "bench.py": engine_figures,
    "bench_checkpoint_load.py": checkpoint_load_figures,
    "bench_checkpoint_load.py --product": lambda tmp_path: checkpoint_load_figures(tmp_path, "--product"),
    "bench_loop_closure.py": loop_closure_figures,
    "bench_pose_graph.py": pose_graph_figures,
    "bench_loop_consistency.py": loop_consistency_figures,
    "bench_rollover.py": rollover_figures,
}
BENCH_RUN_ELSEWHERE = {"bench_e2e.py": "tests/test_bench_e2e.py"}  # its smoke tests, more than one run
# needs a CUDA GPU to run: imported and its helpers called instead, by the test named
BENCH_NEEDS_A_GPU = {"bench_shapes.py": "test_bench_shapes_imports_and_its_variants_resolve"}


@pytest.mark.slow  # 6-25 s each on a busy 2-core machine: each starts torch in 1-3 processes
@pytest.mark.parametrize("bench", BENCH_RUNS)
def test_bench_script_runs_on_the_cpu_and_measures_its_figures(bench: str, tmp_path: Path) -> None:
    figures = BENCH_RUNS[bench](tmp_path)
    assert figures and all(value >= 0 for value in figures.values()), figures


def test_every_bench_script_has_a_smoke_run() -> None:
    benches = {path.name for path in SCRIPTS.glob("bench*.py")}
    covered = {name.split()[0] for name in BENCH_RUNS} | set(BENCH_RUN_ELSEWHERE) | set(BENCH_NEEDS_A_GPU)
    assert benches == covered, f"no smoke run: {sorted(benches - covered)}; not a script: {sorted(covered - benches)}"
    for script, test_file in BENCH_RUN_ELSEWHERE.items():
        assert f'"{script}"' in (REPO / test_file).read_text(), f"{test_file} does not run scripts/{script}"
    for script, test in BENCH_NEEDS_A_GPU.items():
        assert callable(globals().get(test)), f"no {test} for scripts/{script}"


@pytest.mark.slow
def test_bench_shapes_imports_and_its_variants_resolve() -> None:
    """scripts/bench_shapes.py measures CUDA graphs of compiled blocks and Triton/Gluon kernels at each input
    size, synchronising the device around every push: there is nothing for it to measure on a CPU. What can
    rot without a GPU is checked here, in a process of its own (the variants patch module globals): the
    module imports, its heights parse, each variant its docstring names (`variant`) is set up, which reads
    the kernels, schedules and backends it swaps, and an engine of the variants that change no kernel is
    built on the tiny model. `previous` is left out: its range kernel is a file the device script writes
    from an older commit (cache/triton_attention_previous.py)."""
    check = """
import re
import sys
import time
sys.path.insert(0, "scripts")
import torch
import bench_shapes
from bench import build_model
from stream_recon.models import prepare_for_inference
from stream_recon.models.stream.steps import PipelinedRunner

assert bench_shapes.parse_heights("280:308:14") == [280, 294, 308], bench_shapes.parse_heights("280:308:14")
assert bench_shapes.parse_heights("378,392") == [378, 392]
model = prepare_for_inference(build_model("tiny")[0], "cpu", torch.float32)
variants = set(re.findall(r"`(\\w+)`", bench_shapes.__doc__)) - {"previous"}
assert {"frames", "balanced", "pdl", "pointers"} <= variants, variants
for variant in sorted(variants):
    bench_shapes.use_variant(model, variant)
bench_shapes.use_variant(model, "frames")
assert callable(PipelinedRunner._heads_stream)  # what the heads_low variant replaces
for variant in ("frames", "synchronous"):
    bench_shapes.new_engine(model, variant).finish()
print("variants resolved")
"""
    assert "variants resolved" in run_script("-c", check)


# -- every script: imports and answers --help ----------------------------------------------------------
@pytest.fixture(scope="module")
def help_texts() -> dict[str, dict]:
    """scripts/X.py -> its --help run (tests/script_help.py: all in one process, torch imported once)."""
    existing = [path for path in PYTHON_SCRIPTS if (REPO / path).is_file()]
    printed = run_script("tests/script_help.py", *existing, timeout=600)
    return json.loads(printed.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("script", PYTHON_SCRIPTS)
def test_script_imports_and_answers_help(script: str, help_texts: dict[str, dict]) -> None:
    assert (REPO / script).is_file(), f"{script} does not exist (cited at {where_cited(script)})"
    result = help_texts[script]
    assert result["error"] is None, f"{script} --help raised:\n{result['error']}"
    assert result["exit"] == 0, f"{script} --help exited {result['exit']}:\n{result['output'][-3000:]}"
    assert "usage:" in result["output"], f"{script} --help printed no usage:\n{result['output'][-3000:]}"


def test_every_script_the_docs_cite_exists() -> None:
    missing = [f"{where}: {path} does not exist" for path, places in CITED.items() if not (REPO / path).exists()
               for where in places if path not in GONE or not where.startswith(LOG)]
    assert not missing, "cited scripts missing from the repository:\n" + "\n".join(missing)
    assert {"scripts/bench.py", "scripts/bench_e2e.py", MEASURE} <= set(CITED)


def test_the_removed_and_moved_scripts_are_gone_and_still_cited() -> None:
    """The lists of removed and moved scripts stay exact: none back in the repository, none the log no longer
    cites, and each moved one where the list says it is now."""
    back = sorted(path for path in GONE if (REPO / path).exists())
    uncited = sorted(GONE - set(CITED))
    assert not back and not uncited, f"in the repository again: {back}; no longer cited: {uncited}"
    lost = sorted(f"{old} -> {new}" for old, new in MOVED_SCRIPTS_THE_LOG_CITES.items()
                  if not (REPO / new.split()[0]).is_file() or (new.startswith(MEASURE) and new.split()[1] not in
                                                                measure_suites()[1]))
    assert not lost, f"moved scripts not where the list says: {lost}"


# -- the layout of scripts/ --------------------------------------------------------------------------------
MAX_BENCHES = 8
USER_COMMANDS = {"setup-env", "stream-recon", "test"}
MEASURE = "scripts/device/measure.sh"


def measure_suites() -> tuple[list[str], list[str]]:
    """The suites measure.sh's top comment lists (`#   SUITE  what it does`) and the ones its last case
    statement (the dispatch) runs."""
    text = (REPO / MEASURE).read_text()
    top = text.partition("\nset -")[0]
    listed = re.findall(r"^#   ([a-z][\w-]*)  ", top, re.MULTILINE)
    dispatch = text.rpartition("\ncase ")[2].partition("\nesac")[0]
    patterns = re.findall(r"^\s*([\w|-]+)\)", dispatch, re.MULTILINE)
    return listed, [suite for pattern in patterns for suite in pattern.split("|")]


def test_scripts_top_holds_the_benchmarks_and_the_users_commands() -> None:
    benches = sorted(path.name for path in SCRIPTS.glob("bench*.py"))
    assert 0 < len(benches) <= MAX_BENCHES, f"{len(benches)} benchmarks at scripts/'s top: {benches}"
    others = sorted(path.name for path in SCRIPTS.glob("*.py") if not path.name.startswith("bench"))
    assert not others, f"Python at scripts/'s top that is not a benchmark (probes/ or fixtures/): {others}"
    files = {path.name for path in SCRIPTS.iterdir() if path.is_file()}
    assert USER_COMMANDS <= files, sorted(USER_COMMANDS - files)
    assert not files - USER_COMMANDS - set(benches), sorted(files - USER_COMMANDS - set(benches))
    folders = {path.name for path in SCRIPTS.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == {*TOOL_FOLDERS, "device"}, sorted(folders)


@pytest.mark.parametrize("folder", TOOL_FOLDERS)
def test_every_tool_is_in_its_folders_index_with_one_line(folder: str) -> None:
    index = (SCRIPTS / folder / "README.md").read_text().splitlines()
    scripts = sorted(path.name for path in (SCRIPTS / folder).glob("*.py"))
    assert scripts, f"nothing in scripts/{folder}/"
    counts = {name: sum(line.startswith(f"- `{name}`: ") for line in index) for name in scripts}
    wrong = {name: count for name, count in counts.items() if count != 1}
    assert not wrong, f"scripts/{folder}/README.md: index lines per script (one each): {wrong}"
    indexed = set(re.findall(r"^- `([\w.]+\.py)`", "\n".join(index), re.MULTILINE))
    assert indexed <= set(scripts), f"indexed but not in scripts/{folder}/: {sorted(indexed - set(scripts))}"


def test_every_suite_measure_sh_lists_is_in_its_case_statement() -> None:
    listed, dispatched = measure_suites()
    assert len(listed) == len(set(listed)) >= 10, listed
    assert set(listed) == set(dispatched), (f"listed, not run: {sorted(set(listed) - set(dispatched))}; "
                                            f"run, not listed: {sorted(set(dispatched) - set(listed))}")
    assert {"acceptance", "start", "spare", "soak-a", "soak-b", "soak-c", "repro", "long"} <= set(listed)
    cited = {suite for doc in DOCS if doc != LOG
             for suite in re.findall(r"measure\.sh ([a-z][\w-]*)", (REPO / doc).read_text())}
    assert cited and cited <= set(listed), f"docs cite suites measure.sh has not: {sorted(cited - set(listed))}"


# -- the GPU machine's shell scripts ---------------------------------------------------------------------
ENV_SCRIPT = "scripts/device/env.sh"
SOURCES_ENV_SCRIPT = re.compile(r"^\s*(source|\.)\s+scripts/device/env\.sh", re.MULTILINE)
SCRIPT_PATH = re.compile(r"(?:^|/)(scripts/[\w/]+\.py)$")
FUNCTION_START = re.compile(r"^\s*(\w+)\(\)\s*\{", re.MULTILINE)
# words before a command's name that are not the command
COMMAND_PREFIXES = {"then", "do", "else", "if", "while", "until", "!", "{", "time", "exec", "local"}


def shell_lines(text: str) -> list[tuple[int, str]]:
    """The script's logical lines, each with the number of its first line: continuations joined, comments
    and heredoc bodies (Python the shell runs) dropped."""
    lines, heredoc_end, joined, first = [], None, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if heredoc_end is not None:
            heredoc_end = None if line.strip() == heredoc_end else heredoc_end
            continue
        first = first or number
        if line.endswith("\\"):
            joined += line[:-1] + " "
            continue
        line, joined = joined + line, ""
        opened = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        heredoc_end = opened.group(1) if opened else None
        lines.append((first, re.sub(r"(^|\s)#.*$", "", line)))
        first = 0
    return lines


def shell_variables(text: str) -> dict[str, str]:
    """NAME -> every value the script assigns it (an array: all its values), space-joined."""
    values: dict[str, list[str]] = {}
    for name, body in re.findall(r"(\w+)=\(([^)]*)\)", text):
        values.setdefault(name, []).extend(re.findall(r"\]=\"([^\"]*)\"", body))
    assignment = r"(?:^|[\s;])(\w+)=(?:\"([^\"]*)\"|'([^']*)'|([^\s;()]*))"
    for name, double, single, bare in re.findall(assignment, text, re.MULTILINE):
        values.setdefault(name, []).append(double or single or bare)
    return {name: " ".join(value) for name, value in values.items()}


def expand(line: str, variables: dict[str, str]) -> str:
    """$NAME, ${NAME} and ${NAME[…]} of the script's own variables replaced by their values."""
    def value(match: re.Match) -> str:
        return variables.get(match.group(1) or match.group(2), match.group(0))
    return re.sub(r"\$\{(\w+)(?:\[[^\]]*\])?\}|\$(\w+)", value, line)


def simple_commands(line: str) -> list[list[str]]:
    """A logical line's simple commands, as words (split at |, ;, &&, ||, &, redirections and parentheses)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.commenters = ""
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote in a line shlex does not follow (the shell does; bash -n says so)
        words = line.split()
    commands, current = [], []
    for word in words:
        if word and set(word) <= set("();<>|&"):
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [command for command in commands + [current] if command]


def command_name(words: list[str]) -> str | None:
    """The first word past variable assignments, keywords and `timeout N`."""
    after_timeout = False
    for word in words:
        if after_timeout or word == "timeout":
            after_timeout = word == "timeout"
            continue
        if not (re.fullmatch(r"\w+=.*", word) or word in COMMAND_PREFIXES):
            return word
    return None


def python_calls(script: str, sourced: str = "") -> list[tuple[str, set[str], int]]:
    """(scripts/X.py, the --flags passed, line) for each run of a Python script in the shell script `script`
    (its text), directly or through a shell function that passes its arguments on ("$@"), the functions
    and variables of `sourced` (the text of a script it sources) included."""
    cleaned = "\n".join(line for text in (sourced, script) for _, line in shell_lines(text))
    variables = shell_variables(cleaned)
    bodies = []
    for match in FUNCTION_START.finditer(cleaned):
        depth, end = 0, match.end() - 1
        for end in range(match.end() - 1, len(cleaned)):
            depth += {"{": 1, "}": -1}.get(cleaned[end], 0)
            if depth == 0:
                break
        bodies.append((match.group(1), cleaned[match.end():end]))
    passing_on = [(name, [words for _, line in shell_lines(body) for words in simple_commands(expand(line, variables))])
                  for name, body in bodies if "$@" in body]  # each body read once: shlex is most of the time
    functions: dict[str, str] = {}  # a function that runs a script with its own arguments -> that script
    found = True
    while found:  # until nothing new: one that calls another needs the other's first
        found = False
        for name, commands in passing_on:
            if name in functions:
                continue
            for words in commands:
                called = [SCRIPT_PATH.search(word) for word in words]
                script_path = next((m.group(1) for m in called if m), functions.get(command_name(words) or ""))
                if script_path:
                    functions[name], found = script_path, True
                    break
    calls = []
    for number, line in shell_lines(script):
        line = FUNCTION_START.sub("", line)  # a function's definition is not a call of it
        for words in simple_commands(expand(line, variables)):
            paths = [i for i, word in enumerate(words) if SCRIPT_PATH.search(word)]
            if paths:
                script_path, after = SCRIPT_PATH.search(words[paths[0]]).group(1), words[paths[0] + 1:]
            elif command_name(words) in functions:
                name = command_name(words)
                script_path, after = functions[name], words[words.index(name) + 1:]
            else:
                continue
            flags = {part.split("=")[0] for word in after for part in word.split()
                     if re.fullmatch(r"--[\w-]+(=.*)?", part)}
            calls.append((script_path, flags, number))
    return calls


@cache  # each of measure.sh's ~20 suites asks for its calls
def device_script_calls(path: str) -> tuple[tuple[str, frozenset[str], int], ...]:
    text = (REPO / path).read_text()
    sources_env = path != ENV_SCRIPT and SOURCES_ENV_SCRIPT.search(text)
    return tuple((called, frozenset(flags), line)
                 for called, flags, line in python_calls(text, (REPO / ENV_SCRIPT).read_text() if sources_env else ""))


def test_shell_scripts_are_read_as_the_shell_runs_them() -> None:
    """The reading of the device scripts finds what the shell would run: calls through functions (its own
    and a sourced script's) and variables, flags in arrays and continued lines, nothing from heredocs or
    comments, nothing past a pipe."""
    sourced = 'e2e() { local name=$1; shift; python3 scripts/bench_e2e.py --video-dir /tmp "$@"; }\n'
    script = """#!/usr/bin/env bash
# python3 scripts/in_a_comment.py --commented
source scripts/device/env.sh
FLOW="--keyframes flow --max-gap 3"
declare -A rows=([dense]="--flow-threshold 4" [sparse]="--compile on")
run() { local name=$1; shift
  timeout 100 python3 scripts/bench_e2e.py "$@" --json "$OUT/$name.json" 2>&1 | tail -3; }
twice() { run "$@"; run "$@"; }
show() { python3 - "$1" <<'PY'
print({"a heredoc's brace": "{"})  # python3 scripts/in_a_heredoc.py --heredoc
PY
}
twice all --frames 10 $FLOW \\
  --viewer
MODE=x timeout 5 run one ${rows[$row]} --client | grep -v Warn --line-buffered
python3 scripts/bench.py --frames 5 > "$OUT/log" 2>&1 && python3 scripts/probes/probe_range_variants.py --rows=all
e2e cold --frames 3
"""
    assert python_calls(script, sourced) == [
        ("scripts/bench_e2e.py", {"--json"}, 7),
        ("scripts/bench_e2e.py", set(), 8),  # twice() runs run() twice, passing on what it was given
        ("scripts/bench_e2e.py", set(), 8),
        ("scripts/bench_e2e.py", {"--frames", "--keyframes", "--max-gap", "--viewer"}, 13),
        ("scripts/bench_e2e.py", {"--flow-threshold", "--compile", "--client"}, 15),
        ("scripts/bench.py", {"--frames"}, 16),
        ("scripts/probes/probe_range_variants.py", {"--rows"}, 16),
        ("scripts/bench_e2e.py", {"--frames"}, 17),
    ]
    called = {path for script in SHELL_SCRIPTS for path, _, _ in device_script_calls(script)}
    assert {"scripts/bench.py", "scripts/bench_e2e.py", "scripts/bench_shapes.py"} <= called, called


def top_functions(text: str) -> dict[str, tuple[int, int, str]]:
    """Each function defined at a script's top level -> its first and last line and its body."""
    functions, depth, current, start, body = {}, 0, None, 0, []
    for number, line in shell_lines(text):
        opened = FUNCTION_START.match(line)
        if opened and depth == 0:
            current, start, body = opened.group(1), number, []
        depth += line.count("{") - line.count("}")
        if current:
            body.append(line)
            if depth == 0:
                functions[current], current = (start, number, "\n".join(body)), None
    return functions


def measure_suite_calls(suite: str) -> list[tuple[str, set[str], int]]:
    """(scripts/X.py, flags, line) of each run of a Python script in measure.sh's suite: in its function
    (suite_NAME, - as _; the never-hang suites share suite_never_hang) and the functions it calls."""
    functions = top_functions((REPO / MEASURE).read_text())
    never_hang = suite in ("repro", "soak-a", "soak-b", "soak-c", "long")
    reached, todo = set(), ["suite_never_hang" if never_hang else "suite_" + suite.replace("-", "_")]
    while todo:
        name = todo.pop()
        if name in reached or name not in functions:
            continue
        reached.add(name)
        todo += [word for word in re.findall(r"[\w]+", functions[name][2]) if word in functions]
    spans = [functions[name][:2] for name in reached]
    return [call for call in device_script_calls(MEASURE) if any(first <= call[2] <= last for first, last in spans)]


@pytest.mark.slow
@pytest.mark.parametrize("suite", measure_suites()[0])
def test_measure_suite_runs_existing_scripts_with_flags_they_take(suite: str, help_texts: dict[str, dict]) -> None:
    calls = measure_suite_calls(suite)
    # gpu-tests runs pytest; probe the script its arguments name
    assert calls or suite in ("gpu-tests", "probe"), f"measure.sh {suite} runs no script"
    problems = []
    for called, flags, line in calls:
        if not (REPO / called).is_file():
            problems.append(f"measure.sh {suite}:{line}: runs {called}, which does not exist")
            continue
        taken = set(re.findall(r"--[\w-]+", help_texts[called]["output"]))
        problems += [f"measure.sh {suite}:{line}: {called} takes no {flag}" for flag in sorted(flags - taken)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_parses(script: str) -> None:
    assert (REPO / script).is_file(), f"{script} does not exist (cited at {where_cited(script)})"
    done = subprocess.run(["bash", "-n", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"bash -n {script}:\n{done.stderr}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_script_runs_existing_scripts_with_flags_they_take(script: str, help_texts: dict[str, dict]
                                                                 ) -> None:
    assert (REPO / script).is_file(), f"{script} does not exist (cited at {where_cited(script)})"
    problems = []
    for called, flags, line in device_script_calls(script):
        if not (REPO / called).is_file():
            problems.append(f"{script}:{line}: runs {called}, which does not exist")
            continue
        taken = set(re.findall(r"--[\w-]+", help_texts[called]["output"]))
        problems += [f"{script}:{line}: {called} takes no {flag}" for flag in sorted(flags - taken)]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_the_viewer_comparison_of_bench_refuses_too_few_frames_in_one_line():
    done = subprocess.run([sys.executable, "scripts/bench.py", "--model", "tiny", "--viewer", "--frames", "5"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "bench.py: error: --viewer compares blocks of 10 frames with and without the viewer: --frames must be at "
        "least 20, got 5")


# -- scripts/test stops at Ctrl-C ------------------------------------------------------------------------
def processes_of_session(session: int | None = None) -> dict[int, str]:
    """pid -> command line of every live process of `session` (None: of any session) (Linux's /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if session is None or os.getsid(int(entry.name)) == session:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
    return found


def as_in_a_terminal() -> None:
    """Ctrl-C's signal as a terminal's shell leaves it to a command: a suite started in the background of a
    script (`nohup ... &`) hands its processes SIGINT ignored, and bash cannot trap a signal ignored at its start."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def ctrl_c_in_scripts_test(arguments: list[str], ready: Callable[[int], bool]) -> tuple[subprocess.Popen, str, float]:
    """scripts/test ARGUMENTS in a terminal of its own, Ctrl-C once `ready(its session)` holds: the process, what it
    printed, and the seconds from the Ctrl-C to its end."""
    suite = subprocess.Popen([str(SCRIPTS / "test"), *arguments, "-p", "no:cacheprovider"], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True,  # a terminal of its own: its Ctrl-C reaches its group only
                             preexec_fn=as_in_a_terminal)
    try:
        wait_until(lambda: ready(suite.pid), 300, process=suite, what="the moment to press Ctrl-C")
        os.killpg(suite.pid, signal.SIGINT)  # what the terminal does at Ctrl-C: its foreground group
        stopped = time.monotonic()
        printed, _ = suite.communicate(timeout=30)
        return suite, printed, time.monotonic() - stopped
    finally:
        if suite.poll() is None:
            os.killpg(suite.pid, signal.SIGKILL)


@pytest.mark.slow  # a pytest session of its own, with a stream-recon run in it: 20-40 s on a busy machine
def test_ctrl_c_in_scripts_test_stops_the_whole_suite_at_once() -> None:
    # each Ctrl-C in a terminal running scripts/test failed one test (its stream-recon process got the signal
    # too and exited 130) and the suite went on
    # several tests that run stream-recon, so that the Ctrl-C finds the suite mid-way even when a loaded machine
    # sees the first run late
    suite, printed, took_s = ctrl_c_in_scripts_test(
        ["tests/test_app_cli_process.py", "-k", "closed_terminal or a_second_run_into or sigterm or stopped"],
        lambda session: any("stream-recon" in line and "--checkpoint" in line
                            for line in processes_of_session(session).values()))
    assert suite.returncode == 130, printed
    assert took_s < 5.0, printed
    assert processes_of_session(suite.pid) == {}  # nothing of the suite left running
    assert "passed" not in printed.splitlines()[-1], printed


@pytest.mark.slow
def test_ctrl_c_in_scripts_test_also_stops_what_a_test_started_in_a_session_of_its_own(tmp_path) -> None:
    """A test's process in a session of its own (a terminal's stand-in) is outside pytest's group: it is still
    stopped with the suite, and no longer holds the suite's output open (the Ctrl-C test above waited for one)."""
    (tmp_path / "test_holds_a_process.py").write_text(
        "import subprocess, sys, time\n"
        "def test_holds_a_process():\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True)\n"
        "    time.sleep(300)\n")

    def holding() -> bool:
        return any("time.sleep(300)" in line and "-c" in line for line in processes_of_session().values())

    suite, printed, took_s = ctrl_c_in_scripts_test([str(tmp_path / "test_holds_a_process.py")], lambda _: holding())
    assert suite.returncode == 130 and took_s < 5.0, printed
    wait_until(lambda: not holding(), 5, what="its end")
