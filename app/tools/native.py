"""Native llama.cpp peers: its own ``llama-speculative`` and ``llama-bench`` on the same files.

    python -m app.tools.native --target T.gguf --draft D.gguf [--prompt TEXT] [-n 64] [--threads 2]

Why: our decoding goes through llama-cpp-python's ctypes layer and Python code; the C++ programs
shipped with the same llama.cpp show what the library itself reaches on this machine, so the
benchmark can tell our overhead from llama.cpp's speed. They are built on demand from the
vendored source of the *installed* llama-cpp-python (so both run the same llama.cpp), once,
into a cache folder (``$XDG_CACHE_HOME`` or ``~/.cache``, then
``staged-chat/native/<version>/``). Nothing built here is committed. This module only runs
subprocesses; it never imports ``llama_cpp``.

A cache folder holds ``bin/`` with the programs and ``built.json``, the marker written last (by
an atomic rename) after both programs were built and copied: without it the folder is treated
as unbuilt, so an interrupted build is resumed, never used. The source and build trees are
deleted once the marker is written. Two processes building into one folder at once are not
guarded against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable, Mapping, Sequence
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from speculative.sampling import SamplingParams

log = logging.getLogger(__name__)

PACKAGE = "llama-cpp-python"
# CMake target names, from vendor/llama.cpp/examples/speculative/CMakeLists.txt and
# vendor/llama.cpp/tools/llama-bench/CMakeLists.txt (0.3.36)
TOOLS = ("llama-speculative", "llama-bench")
MARKER = "built.json"
VENDOR = "vendor/llama.cpp"
WORK_DIRS = ("sdist", "src", "build")  # kept while unfinished, so a retry resumes the build
LOG_TAIL = 40  # lines of a failed command's output quoted in NativeUnavailable

# Release build of just the two programs. Examples (llama-speculative) and tools (llama-bench)
# must be on for their targets to exist; tests, server and the unified app are not needed;
# curl (older versions) and OpenSSL are only for downloading models. Static libraries make the
# two programs self-contained, so they can be copied out of the build tree. GGML_NATIVE keeps
# its default (on): pip built the installed llama-cpp-python the same way on this machine.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_EXAMPLES=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
)

Progress = Callable[[str], None]


class NativeUnavailable(RuntimeError):
    """The native programs cannot be built or run here; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class NativeResult:
    """One run of a native program, as that program reported it.

    ``tokens_per_second`` is the program's own figure: for llama-speculative the tokens it
    decoded over the decoding time (prompt processing excluded); for llama-bench the mean over
    its repetitions of n_gen / time of a generation test (one token per decode).
    llama-speculative stops after the step that passes ``n_predict``, so ``tokens`` can exceed
    it by up to ``n_draft``.
    """

    tokens_per_second: float
    tokens: int
    seconds: float
    command: tuple[str, ...]
    tokens_per_second_stddev: float | None = None  # llama-bench: spread over repetitions
    n_draft: int | None = None  # llama-speculative: the most tokens drafted per step
    n_drafted: int | None = None  # draft tokens proposed in all
    n_accept: int | None = None  # of those, accepted by the target
    accept: float | None = None  # n_accept / n_drafted as a fraction (it prints a percentage)
    text: str | None = None  # llama-speculative: what it wrote after the prompt

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- the build -------------------------------------------------------------------------------


def installed_version() -> str:
    return package_version(PACKAGE)


def default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "staged-chat" / "native"


def cached_tools(folder: Path) -> dict[str, Path] | None:
    """The programs of a finished build in ``folder``, or None when it is not (fully) built."""
    try:
        marker = json.loads((folder / MARKER).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    tools = {name: folder / rel for name, rel in marker.get("tools", {}).items()}
    complete = set(tools) >= set(TOOLS) and all(
        p.is_file() and os.access(p, os.X_OK) for p in tools.values())
    return tools if complete else None


def native_tools(cache_dir: Path | None = None, progress: Progress = print,
                 jobs: int | None = None) -> dict[str, Path]:
    """Paths of ``llama-speculative`` and ``llama-bench``, built once for the installed version.

    ``cache_dir`` is the root; the build lives in ``cache_dir/<version>/``. ``jobs`` is the
    number of parallel compile jobs (default: all cores). Raises ``NativeUnavailable``.
    """
    version = installed_version()
    folder = (Path(cache_dir) if cache_dir is not None else default_cache_root()) / version
    tools = cached_tools(folder)
    if tools is not None:
        return tools
    check_toolchain()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).unlink(missing_ok=True)
    tools = build_tools(version, folder, progress, jobs or os.cpu_count() or 1)
    write_marker(folder, version, tools)
    # the sources and objects only a rebuild needs (a failed build keeps them: a retry resumes)
    for work in WORK_DIRS:
        shutil.rmtree(folder / work, ignore_errors=True)
    progress(f"llama.cpp tools of {PACKAGE} {version} are in {folder / 'bin'}")
    return tools


def check_toolchain() -> None:
    if shutil.which("cmake") is None:
        raise NativeUnavailable("cmake is not on PATH (needed to build llama.cpp's tools)")
    compilers = [os.environ.get("CXX", ""), "c++", "g++", "clang++", "cl"]
    if not any(c and shutil.which(c) for c in compilers):
        raise NativeUnavailable("no C++ compiler on PATH (tried $CXX, c++, g++, clang++, cl)")


def build_tools(version: str, folder: Path, progress: Progress, jobs: int) -> dict[str, Path]:
    """Download the sdist, extract vendor/llama.cpp, configure, build, copy the programs."""
    src, build, log_path = folder / "src", folder / "build", folder / "build.log"
    if not (src / ".extracted").exists():
        sdist = download_sdist(version, folder / "sdist", progress)
        progress(f"extracting {VENDOR} from {sdist.name}")
        shutil.rmtree(src, ignore_errors=True)
        extract_vendor(sdist, src)
        (src / ".extracted").touch()
    progress("configuring llama.cpp (cmake)")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_logged(["cmake", "-S", str(src), "-B", str(build), *generator, *CMAKE_OPTIONS],
               log_path, progress, "cmake configure")
    progress(f"building {', '.join(TOOLS)} with {jobs} job(s); this takes minutes")
    run_logged(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
                "--target", *TOOLS], log_path, progress, "cmake build")
    return install_binaries(build, folder / "bin")


def download_sdist(version: str, dest: Path, progress: Progress) -> Path:
    found = sorted(dest.glob("*.tar.gz"))
    if found:
        return found[0]
    progress(f"downloading the {PACKAGE} {version} source distribution (pip download)")
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--dest", str(dest), f"{PACKAGE}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(dest.glob("*.tar.gz"))
    if proc.returncode != 0 or not found:
        raise NativeUnavailable(f"pip could not download the {PACKAGE} {version} source "
                                f"(offline?):\n{tail(proc.stdout + proc.stderr)}")
    return found[0]


def extract_vendor(sdist: Path, dest: Path) -> None:
    """Extract only ``<top>/vendor/llama.cpp/`` of the sdist into ``dest``."""
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            _, _, rest = m.name.partition("/")
            if rest == VENDOR or not rest.startswith(VENDOR + "/"):
                continue
            m.name = rest[len(VENDOR) + 1:]
            members.append(m)
        if not members:
            raise NativeUnavailable(f"{sdist.name} holds no {VENDOR}")
        dest.mkdir(parents=True)
        # the "data" filter refuses absolute paths, links out of dest and device files
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(dest, members=members, **extra)


def run_logged(cmd: list[str], log_path: Path, progress: Progress, what: str) -> None:
    """Run ``cmd`` appending its output to ``log_path``; report the build's tenths of progress."""
    shown = -1
    with log_path.open("a", encoding="utf-8", buffering=1) as logf:  # line-buffered: tail -f
        logf.write(f"$ {' '.join(cmd)}\n")
        logf.flush()
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                logf.write(line)
                step = re.match(r"\[\s*(\d+)/(\d+)\]", line)  # ninja's "[12/345] ..."
                if step and int(step[2]) and (tenth := 10 * int(step[1]) // int(step[2])) > shown:
                    shown = tenth
                    progress(f"  {what}: {10 * tenth}%")
    if proc.returncode != 0:
        lines = log_path.read_text("utf-8", errors="replace")
        raise NativeUnavailable(f"{what} failed (exit {proc.returncode}); full log in "
                                f"{log_path}; its end:\n{tail(lines)}")


def install_binaries(build: Path, bin_dir: Path) -> dict[str, Path]:
    bin_dir.mkdir(parents=True, exist_ok=True)
    tools = {}
    for name in TOOLS:
        exe = name + (".exe" if os.name == "nt" else "")
        built = next((p for p in (build / "bin" / exe, build / "bin" / "Release" / exe)
                      if p.is_file()), None)
        if built is None:
            raise NativeUnavailable(f"the build finished but {exe} is not in {build / 'bin'}")
        tools[name] = Path(shutil.copy2(built, bin_dir / exe))
    return tools


def write_marker(folder: Path, version: str, tools: dict[str, Path]) -> None:
    tmp = folder / (MARKER + ".tmp")
    body = {"package": PACKAGE, "version": version,
            "tools": {n: str(p.relative_to(folder)) for n, p in tools.items()}}
    tmp.write_text(json.dumps(body, indent=2) + "\n", "utf-8")
    os.replace(tmp, folder / MARKER)  # atomic: the marker is either absent or whole


def tail(text: str, n: int = LOG_TAIL) -> str:
    return "\n".join(text.rstrip().splitlines()[-n:])


# --- running ---------------------------------------------------------------------------------


def has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """True on x86 CPUs with AMX, where Q8_0 crashes in the repacked (extra buffer) kernels."""
    try:
        return "amx_int8" in cpuinfo.read_text("utf-8", errors="replace").split()
    except OSError:
        return False


def run_native_speculative(target: Path, draft: Path, prompt: str, n_predict: int, threads: int,
                           draft_max: int, *, ctx: int = 0, batch: int | None = None,
                           flash_attn: bool | None = None, parallel: int = 1,
                           sampling: SamplingParams | None = None,
                           tools: dict[str, Path] | None = None,
                           timeout: float | None = None,
                           env: Mapping[str, str] | None = None) -> NativeResult:
    """Speculative decoding by llama.cpp's ``llama-speculative``.

    ``draft_max`` is ``--spec-draft-n-max`` (draft tokens per step); ``parallel`` > 1 lets it
    split the draft into a tree of that many branches (``-np``). ``flash_attn`` None leaves
    llama.cpp's default (auto: on for CPU). ``ctx`` 0 is llama.cpp's "the model's trained
    context", which is also what our engine shrinks a larger window to; the draft gets the same.
    ``sampling``: the sampler chain as ours (``sampler_args``); None is greedy, no penalties.
    """
    exe = (tools or native_tools())["llama-speculative"]
    cmd = [str(exe), "-m", str(target), "-md", str(draft), "-p", prompt, "-n", str(n_predict),
           "-c", str(ctx), "-t", str(threads), "-td", str(threads), "-tb", str(threads),
           "-tbd", str(threads), "--spec-draft-n-max", str(draft_max), "-np", str(parallel),
           *sampler_args(sampling or SamplingParams()), "--color", "off"]
    if batch is not None:
        cmd += ["-b", str(batch), "-ub", str(batch)]
    if flash_attn is not None:
        cmd += ["-fa", "on" if flash_attn else "off"]
    if has_amx():
        cmd.append("-nr")  # Q8_0 would crash in the AMX kernels of the repacked buffers
    out, err = run_tool(cmd, timeout, env)
    return parse_speculative(out, err, prompt, shell_form(cmd, env))


def sampler_args(p: SamplingParams) -> list[str]:
    """llama.cpp's sampler options for our chain ``p``, in our order (``SamplingParams``):
    penalties (``e``), DRY (``d``), min-p (``m``), temperature (``t``), top-k (``k``), top-p
    (``p``). Greedy is temperature 0 and a top-k of 1, so every sampled token is the argmax
    of the penalised logits, and llama-speculative verifies by equality. What differs by
    design: llama-speculative's penalties and DRY see the tokens it generated, not the prompt
    (it never passes the prompt to its sampler); ours see the whole text."""
    seq, args = "", []
    if p.token_penalties:
        seq += "e"
        args += ["--repeat-penalty", f"{p.repeat_penalty:g}", "--repeat-last-n",
                 str(p.repeat_last_n), "--presence-penalty", f"{p.presence_penalty:g}",
                 "--frequency-penalty", f"{p.frequency_penalty:g}"]
    if p.dry_multiplier > 0.0:
        seq += "d"
        args += ["--dry-multiplier", f"{p.dry_multiplier:g}", "--dry-base", f"{p.dry_base:g}",
                 "--dry-allowed-length", str(p.dry_allowed_length)]
        if p.dry_last_n:  # ours 0 is the whole text: llama.cpp's default (-1, the context)
            args += ["--dry-penalty-last-n", str(p.dry_last_n)]
        for breaker in p.dry_breakers or ("none",):
            args += ["--dry-sequence-breaker", breaker]
    if p.greedy:
        return [*args, "--sampling-seq", seq + "k", "--top-k", "1", "--temp", "0", "-s", "0"]
    if p.min_p > 0.0:
        seq += "m"
        args += ["--min-p", f"{p.min_p:g}"]
    seq += "tk"
    args += ["--temp", f"{p.temperature:g}", "--top-k", str(p.top_k)]
    if p.top_p < 1.0:
        seq += "p"
        args += ["--top-p", f"{p.top_p:g}"]
    seed = p.seed if p.seed is not None else 0
    return [*args, "--sampling-seq", seq, "-s", str(seed)]


def run_native_bench(model: Path, n_gen: int, threads: int, flash_attn: bool, *,
                     n_prompt: int = 0, depth: int = 0, batch: int | None = None,
                     repetitions: int = 5, tools: dict[str, Path] | None = None,
                     timeout: float | None = None,
                     env: Mapping[str, str] | None = None) -> NativeResult:
    """llama.cpp's ``llama-bench`` generation test (``-n``) of one model, parsed from its JSON.

    ``depth`` tokens are in the KV cache before the test (``-d``), like a prompt.
    """
    exe = (tools or native_tools())["llama-bench"]
    cmd = [str(exe), "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-d", str(depth),
           "-t", str(threads), "-fa", "1" if flash_attn else "0", "-r", str(repetitions),
           "-o", "json"]
    if batch is not None:
        cmd += ["-b", str(batch), "-ub", str(batch)]
    if has_amx():
        cmd += ["--repack", "0"]  # llama-bench's spelling of -nr
    out, _ = run_tool(cmd, timeout, env)
    return parse_bench(out, shell_form(cmd, env))


def shell_form(cmd: list[str], env: Mapping[str, str] | None) -> tuple[str, ...]:
    """The command as a shell would take it: ``K=V`` for each extra variable, then argv."""
    return (*(f"{k}={v}" for k, v in (env or {}).items()), *cmd)


def run_tool(cmd: list[str], timeout: float | None,
             env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Run a native program with ``env`` added to ours (e.g. OMP_WAIT_POLICY, which decides
    whether its threads spin or sleep between tasks)."""
    log.info("running %s", " ".join(shell_form(cmd, env)))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=timeout, check=False,
                              env={**os.environ, **env} if env else None)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeUnavailable(f"{Path(cmd[0]).name} could not run: {e}") from e
    if proc.returncode != 0:
        raise NativeUnavailable(f"{Path(cmd[0]).name} failed (exit {proc.returncode}):\n"
                                f"{tail(proc.stderr + proc.stdout)}")
    return proc.stdout, proc.stderr


# --- parsing ---------------------------------------------------------------------------------

# examples/speculative/speculative.cpp prints to stderr after generating, each line behind
# common_log's prefix (e.g. "0.39.689.568 I "), which is why nothing is anchored at line start:
#   decoded   73 tokens in   35.236 seconds, speed:    2.072 t/s
#   n_draft   = 8 / n_predict = 73 / n_drafted = 64 / n_accept  = 64 / accept    = 100.000%
_DECODED = re.compile(r"\bdecoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
_COUNT = re.compile(r"\b(n_draft|n_drafted|n_accept)\s*=\s*(\d+)\s*$", re.M)
_ACCEPT = re.compile(r"\baccept\s*=\s*(-?nan|-?inf|[\d.]+)%")  # nan when nothing was drafted


def parse_speculative(stdout: str, stderr: str, prompt: str,
                      command: tuple[str, ...] = ()) -> NativeResult:
    """Figures from llama-speculative's stderr and its text from stdout."""
    decoded = _DECODED.search(stderr)
    if decoded is None:
        raise NativeUnavailable(f"no 'decoded ... t/s' line in llama-speculative's output:\n"
                                f"{tail(stderr)}")
    counts = {k: int(v) for k, v in _COUNT.findall(stderr)}
    accept = _ACCEPT.search(stderr)
    rate = float(accept[1]) / 100 if accept else None
    if rate is not None and not math.isfinite(rate):
        rate = None  # nothing was drafted
    return NativeResult(
        tokens_per_second=float(decoded[3]), tokens=int(decoded[1]), seconds=float(decoded[2]),
        command=command, n_draft=counts.get("n_draft"), n_drafted=counts.get("n_drafted"),
        n_accept=counts.get("n_accept"), accept=rate,
        text=generated_text(stdout, prompt))


def generated_text(stdout: str, prompt: str) -> str:
    """stdout is "\\n\\n", the prompt's pieces, the generated pieces, then "\\n\\n" twice."""
    return stdout.removeprefix("\n\n").removeprefix(prompt).removesuffix("\n\n\n\n")


def parse_bench(stdout: str, command: tuple[str, ...] = ()) -> NativeResult:
    """The generation test (n_gen > 0, n_prompt 0) of llama-bench's ``-o json`` array."""
    try:
        tests = json.loads(stdout)
    except ValueError as e:
        raise NativeUnavailable(f"llama-bench did not print JSON: {e}\n{tail(stdout)}") from e
    gen = [t for t in tests if t.get("n_gen", 0) > 0 and t.get("n_prompt", 0) == 0]
    if not gen:
        raise NativeUnavailable("llama-bench printed no generation test")
    t = gen[0]
    return NativeResult(tokens_per_second=float(t["avg_ts"]), tokens=int(t["n_gen"]),
                        seconds=float(t["avg_ns"]) / 1e9, command=command,
                        tokens_per_second_stddev=float(t["stddev_ts"]))


# --- command line ----------------------------------------------------------------------------

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app.tools.native",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, required=True)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=0, help="context window (0: the model's trained one)")
    p.add_argument("--draft-max", type=int, nargs="+", default=[8],
                   help="llama-speculative --spec-draft-n-max values, one run each")
    p.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                   help="for llama-speculative; llama-bench runs with it on and off")
    p.add_argument("--repetitions", type=int, default=5, help="llama-bench -r")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="build cache root (default: $XDG_CACHE_HOME or ~/.cache, then "
                        "staged-chat/native); the build goes into its <version>/ folder")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    try:
        tools = native_tools(args.cache_dir, lambda m: print(m, file=sys.stderr), args.jobs)
        fa = {"auto": None, "on": True, "off": False}[args.flash_attn]
        report = {
            "version": installed_version(), "amx": has_amx(), "threads": args.threads,
            "bench": {("fa_on" if on else "fa_off"): run_native_bench(
                args.target, args.n_predict, args.threads, on,
                repetitions=args.repetitions, tools=tools).to_json() for on in (True, False)},
            "speculative": [run_native_speculative(
                args.target, args.draft, args.prompt, args.n_predict, args.threads, m,
                ctx=args.ctx, flash_attn=fa, tools=tools).to_json() for m in args.draft_max],
        }
    except NativeUnavailable as e:
        print(f"native llama.cpp unavailable: {e}", file=sys.stderr)
        return 1
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
