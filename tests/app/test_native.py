"""``app/native.py`` without building anything: parsers, the build cache, failures."""

from __future__ import annotations

import io
import itertools
import json
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from app.tools import native
from app.tools.native import NativeUnavailable

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'

# The end of llama-speculative's stderr and its stdout (examples/speculative/speculative.cpp,
# llama-cpp-python 0.3.36), from a real run here: the built-in pair, -n 64 -t 2
# --spec-draft-n-max 8 --temp 0, while the models wrote runs of spaces (and another process
# held a core: hence 2 t/s); trailing spaces of the blank log lines dropped.
SPEC_STDERR = """\
0.00.427.701 I cmn          init: llama threadpool init, n_threads = 2
0.01.747.316 I cmn          init: llama threadpool init, n_threads = 2
0.39.689.541 I encoded   24 tokens in    2.335 seconds, speed:   10.278 t/s
0.39.689.568 I decoded   73 tokens in   35.236 seconds, speed:    2.072 t/s
0.39.689.581 I
0.39.689.593 I n_draft   = 8
0.39.689.606 I n_predict = 73
0.39.689.618 I n_drafted = 64
0.39.689.630 I n_accept  = 64
0.39.689.643 I accept    = 100.000%
0.39.689.656 I
0.39.689.668 I draft:

0.39.689.685 I
"""
GENERATED = " " * 73
SPEC_STDOUT = "\n\n" + PROMPT + GENERATED + "\n\n\n\n"

# llama-bench -o json (tools/llama-bench/llama-bench.cpp json_printer), a real run here:
# -m models/builtin/target-q8_0.gguf -p 0 -n 64 -d 0 -t 1 -fa 1 -r 3 -o json
BENCH_JSON = """\
[
  {
    "build_commit": "unknown",
    "build_number": 0,
    "cpu_info": "AMD EPYC",
    "gpu_info": "",
    "backends": "CPU",
    "model_filename": "models/builtin/target-q8_0.gguf",
    "model_type": "gpt2 ?B Q8_0",
    "model_size": 19289616,
    "model_n_params": 17735936,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 1,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": -1,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": 1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "auto",
    "lazy_mode": "auto",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "repack": true,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 64,
    "n_depth": 0,
    "test_time": "2026-12-01T03:25:18Z",
    "avg_ns": 157573235,
    "stddev_ns": 13117619,
    "avg_ts": 408.136423,
    "stddev_ts": 35.609792,
    "samples_ns": [ 142515390, 163681679, 166522637 ],
    "samples_ts": [ 449.074, 391.003, 384.332 ]
  }
]
"""


# --- parsers ---------------------------------------------------------------------------------


def test_parse_speculative_reads_speed_counts_and_text() -> None:
    r = native.parse_speculative(SPEC_STDOUT, SPEC_STDERR, PROMPT, ("llama-speculative",))
    assert (r.tokens, r.seconds, r.tokens_per_second) == (73, 35.236, 2.072)
    assert (r.n_draft, r.n_drafted, r.n_accept) == (8, 64, 64)
    assert r.accept == 1.0
    assert r.text == GENERATED
    assert r.command == ("llama-speculative",)


def test_parse_speculative_nothing_drafted_has_no_acceptance() -> None:
    stderr = SPEC_STDERR.replace("n_drafted = 64", "n_drafted = 0").replace("100.000%", "-nan%")
    r = native.parse_speculative(SPEC_STDOUT, stderr, PROMPT)
    assert r.n_drafted == 0 and r.accept is None


def test_parse_speculative_without_timing_line_raises() -> None:
    with pytest.raises(NativeUnavailable, match="decoded"):
        native.parse_speculative(SPEC_STDOUT, "error: failed to load model\n", PROMPT)


def test_parse_bench_takes_the_generation_test() -> None:
    tests = json.loads(BENCH_JSON)
    prompt_test = {**tests[0], "n_prompt": 512, "n_gen": 0, "avg_ts": 900.0}
    r = native.parse_bench(json.dumps([prompt_test, *tests]))
    assert (r.tokens, r.tokens_per_second, r.tokens_per_second_stddev) == (64, 408.136423,
                                                                             35.609792)
    assert r.seconds == pytest.approx(0.157573235)
    assert r.n_drafted is None and r.accept is None


@pytest.mark.parametrize("out", ["", "| model | t/s |", "[]"])
def test_parse_bench_without_generation_json_raises(out: str) -> None:
    with pytest.raises(NativeUnavailable):
        native.parse_bench(out)


def test_has_amx_reads_cpu_flags(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("flags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8 avx512_fp16\n")
    assert native.has_amx(info)
    info.write_text("flags\t\t: fpu avx512f avx512_vnni\n")
    assert not native.has_amx(info)
    assert not native.has_amx(tmp_path / "missing")


# --- the build cache -------------------------------------------------------------------------


def fake_build(folder: Path) -> dict[str, Path]:
    """What a finished build leaves: executables in bin/."""
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    tools = {}
    for name in native.TOOLS:
        exe = folder / "bin" / name
        exe.write_text("#!/bin/sh\n")
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
        tools[name] = exe
    return tools


@pytest.fixture
def no_build(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record (and refuse) any attempt to download or build."""
    calls: list[str] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append("build")
        raise AssertionError("must not build")

    monkeypatch.setattr(native, "build_tools", refuse)
    monkeypatch.setattr(native, "download_sdist", refuse)
    return calls


def test_finished_cache_is_used_without_building(tmp_path: Path, no_build: list[str]) -> None:
    folder = tmp_path / native.installed_version()
    expected = fake_build(folder)
    native.write_marker(folder, native.installed_version(), expected)
    assert native.native_tools(tmp_path, progress=no_build.append) == expected
    assert no_build == []


def test_default_cache_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   no_build: list[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "staged-chat" / "native" / native.installed_version()
    native.write_marker(folder, native.installed_version(), fake_build(folder))
    assert native.native_tools()["llama-bench"] == folder / "bin" / "llama-bench"


def test_unfinished_build_is_not_taken_as_built(tmp_path: Path) -> None:
    folder = tmp_path / "v"
    tools = fake_build(folder)
    assert native.cached_tools(folder) is None  # binaries, but no marker
    native.write_marker(folder, "v", tools)
    assert native.cached_tools(folder) == tools
    tools["llama-bench"].unlink()  # marker, but a program is missing
    assert native.cached_tools(folder) is None
    (folder / native.MARKER).write_text('{"tools": {')  # a torn marker
    assert native.cached_tools(folder) is None


def test_missing_marker_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    builds: list[Path] = []

    def build(version: str, folder: Path, progress: object, jobs: int) -> dict[str, Path]:
        builds.append(folder)
        return fake_build(folder)

    monkeypatch.setattr(native, "check_toolchain", lambda: None)
    monkeypatch.setattr(native, "build_tools", build)
    folder = tmp_path / native.installed_version()
    fake_build(folder)  # a previous build stopped before writing the marker
    (folder / "build" / "bin").mkdir(parents=True)
    first = native.native_tools(tmp_path, progress=lambda m: None)
    second = native.native_tools(tmp_path, progress=lambda m: None)
    assert first == second and builds == [folder]
    assert not (folder / "build").exists()  # work trees go once the marker is written
    assert json.loads((folder / native.MARKER).read_text())["version"] == native.installed_version()


def test_no_cmake_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(NativeUnavailable, match="cmake"):
        native.native_tools(tmp_path / "cache", progress=lambda m: None)
    assert not (tmp_path / "cache").exists()


def test_failed_download_is_unavailable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert "download" in cmd and "--no-binary" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution\n")

    monkeypatch.setattr(native.subprocess, "run", offline)
    with pytest.raises(NativeUnavailable, match="No matching distribution"):
        native.download_sdist("0.3.36", tmp_path, progress=lambda m: None)


def test_failed_build_step_quotes_the_log_tail(tmp_path: Path) -> None:
    cmd = [sys.executable, "-c", "print('[1/2] cc a.c'); print('a.c:1: error: boom'); exit(3)"]
    seen: list[str] = []
    with pytest.raises(NativeUnavailable, match=r"(?s)exit 3.*a\.c:1: error: boom"):
        native.run_logged(cmd, tmp_path / "build.log", seen.append, "cmake build")
    assert seen == ["  cmake build: 50%"]
    assert "boom" in (tmp_path / "build.log").read_text()


def make_sdist(path: Path, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_vendor_takes_only_llama_cpp(tmp_path: Path) -> None:
    sdist = tmp_path / "llama_cpp_python-0.3.36.tar.gz"
    make_sdist(sdist, {"llama_cpp_python-0.3.36/CMakeLists.txt": "python binding",
                       "llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt": "llama",
                       "llama_cpp_python-0.3.36/vendor/llama.cpp/examples/a.cpp": "int x;",
                       "llama_cpp_python-0.3.36/vendor/llama.cppx/b": "no"})
    native.extract_vendor(sdist, tmp_path / "src")
    files = sorted(str(p.relative_to(tmp_path / "src")) for p in (tmp_path / "src").rglob("*"))
    assert files == ["CMakeLists.txt", "examples", "examples/a.cpp"]
    assert (tmp_path / "src" / "CMakeLists.txt").read_text() == "llama"

    bare = tmp_path / "bare.tar.gz"
    make_sdist(bare, {"x-1/setup.py": ""})
    with pytest.raises(NativeUnavailable, match=r"vendor/llama\.cpp"):
        native.extract_vendor(bare, tmp_path / "src2")


# --- running (a stand-in program instead of the built one) -----------------------------------


def stand_in(tmp_path: Path, stdout: str, stderr: str, code: int = 0) -> Path:
    """An executable that records its arguments and prints the given output."""
    (tmp_path / "out.txt").write_text(stdout)
    (tmp_path / "err.txt").write_text(stderr)
    script = tmp_path / "tool"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n"
        f"open({str(tmp_path / 'omp.txt')!r}, 'w').write(os.environ.get('OMP_WAIT_POLICY', ''))\n"
        f"sys.stdout.write(open({str(tmp_path / 'out.txt')!r}).read())\n"
        f"sys.stderr.write(open({str(tmp_path / 'err.txt')!r}).read())\n"
        f"sys.exit({code})\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def test_speculative_command_is_greedy_and_parsed(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "has_amx", lambda: True)
    tool = stand_in(tmp_path, SPEC_STDOUT, SPEC_STDERR)
    r = native.run_native_speculative(Path("t.gguf"), Path("d.gguf"), PROMPT, 64, 2, 8,
                                      ctx=512, flash_attn=False,
                                      tools={"llama-speculative": tool})
    argv = json.loads((tmp_path / "argv.json").read_text())
    opts = dict(itertools.pairwise(argv))  # each argument -> the next
    assert opts["-m"] == "t.gguf" and opts["-md"] == "d.gguf" and opts["-p"] == PROMPT
    assert (opts["-n"], opts["-c"], opts["-t"], opts["-td"]) == ("64", "512", "2", "2")
    assert (opts["--spec-draft-n-max"], opts["--temp"], opts["--top-k"]) == ("8", "0", "1")
    assert opts["-fa"] == "off" and "-nr" in argv
    assert r.command[1:] == tuple(argv) and r.tokens_per_second == 2.072


def test_bench_command_and_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "has_amx", lambda: False)
    tool = stand_in(tmp_path, BENCH_JSON, "")
    r = native.run_native_bench(Path("t.gguf"), 64, 2, True, tools={"llama-bench": tool},
                                env={"OMP_WAIT_POLICY": "passive"})
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert r.command[:2] == ("OMP_WAIT_POLICY=passive", str(tool))
    assert (tmp_path / "omp.txt").read_text() == "passive"
    assert argv[argv.index("-fa") + 1] == "1" and argv[argv.index("-o") + 1] == "json"
    assert argv[argv.index("-p") + 1] == "0" and "--repack" not in argv
    assert r.tokens_per_second == 408.136423

    broken = stand_in(tmp_path, "", "llama_model_load: error loading model\n", code=1)
    with pytest.raises(NativeUnavailable, match="error loading model"):
        native.run_native_bench(Path("t.gguf"), 64, 2, True, tools={"llama-bench": broken})


def test_cli_prints_both_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "s").mkdir()
    bench = stand_in(tmp_path / "b", BENCH_JSON, "")
    spec = stand_in(tmp_path / "s", SPEC_STDOUT, SPEC_STDERR)
    tools = {"llama-bench": bench, "llama-speculative": spec}
    monkeypatch.setattr(native, "native_tools", lambda *a, **k: tools)
    assert native.main(["--target", "t.gguf", "--draft", "d.gguf", "--draft-max", "4", "8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["bench"]) == {"fa_on", "fa_off"}
    assert [s["command"][s["command"].index("--spec-draft-n-max") + 1]
            for s in report["speculative"]] == ["4", "8"]
    assert report["speculative"][0]["accept"] == 1.0


def test_cli_reports_unavailable(monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    def unavailable(*args: object, **kwargs: object) -> dict[str, Path]:
        raise NativeUnavailable("cmake is not on PATH")

    monkeypatch.setattr(native, "native_tools", unavailable)
    assert native.main(["--target", "t.gguf", "--draft", "d.gguf"]) == 1
    assert "cmake is not on PATH" in capsys.readouterr().err


def test_module_never_imports_llama_cpp() -> None:
    source = Path(native.__file__).read_text()
    assert "import llama_cpp" not in source and "from llama_cpp" not in source


def test_sampler_args_follow_our_chain() -> None:
    from speculative.sampling import SamplingParams

    assert native.sampler_args(SamplingParams()) == [
        "--sampling-seq", "k", "--top-k", "1", "--temp", "0", "-s", "0"]
    args = native.sampler_args(SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=7, presence_penalty=0.5,
        dry_multiplier=0.8, dry_last_n=128, dry_breakers=("\n",)))
    opts = dict(itertools.pairwise(args))
    assert opts["--sampling-seq"] == "edmtkp"  # penalties, DRY, min-p, temp, top-k, top-p
    assert (opts["--temp"], opts["--top-k"], opts["--top-p"], opts["--min-p"]) == (
        "0.7", "40", "0.9", "0.05")
    assert (opts["--presence-penalty"], opts["--repeat-penalty"]) == ("0.5", "1")
    assert (opts["--dry-penalty-last-n"], opts["--dry-sequence-breaker"], opts["-s"]) == (
        "128", "\n", "7")
    none = native.sampler_args(SamplingParams(dry_multiplier=0.8, dry_breakers=()))
    assert none[none.index("--dry-sequence-breaker") + 1] == "none"
    assert "--dry-penalty-last-n" not in none  # ours 0 is the whole text: llama.cpp's default
