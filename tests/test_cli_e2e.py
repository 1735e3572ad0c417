"""The CLI end to end on a tiny real checkpoint, in a subprocess (as a user runs it)."""
import os
import subprocess
import sys

import pytest

from tiny_model import make_tiny_qwen2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_qwen2(tmp_path_factory.mktemp("cli"), seed=3)


def run_cli(*args, stdin=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "llaisys", *args], input=stdin, capture_output=True, text=True,
                          env=env, timeout=300)


def test_generate_streams_the_same_text_as_the_engine(tiny):
    from llaisys.engine import Engine

    r = run_cli("generate", "--model", tiny, "--device", "cpu", "--dtype", "f32", "--temperature", "0",
                "--max-new-tokens", "12", "--raw", "hello world")
    assert r.returncode == 0, r.stderr
    want = Engine(tiny, device="cpu", dtype="f32", progress=False).generate("hello world", max_new_tokens=12,
                                                                            temperature=0)
    assert r.stdout.rstrip("\n") == want.text.rstrip("\n")
    assert "tok/s" in r.stderr  # the one-line summary


def test_chat_repl_reset_and_exit(tiny):
    r = run_cli("chat", "--model", tiny, "--device", "cpu", "--max-new-tokens", "4", "--temperature", "0",
                stdin="hi\n/reset\nagain\n/exit\n")
    assert r.returncode == 0, r.stderr


def test_errors_are_one_line_messages_with_exit_code_2(tiny, tmp_path):
    r = run_cli("generate", "--model", str(tmp_path), "hello")  # a directory without config.json
    assert r.returncode == 2 and "llaisys: error:" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--model", tiny, "--device", "cpu", "--top-p", "1.5", "--raw", "hi")
    assert r.returncode == 2 and "top_p" in r.stderr


def test_bench_of_an_installed_package_without_a_checkout_says_what_to_do(tmp_path):
    """The package copied alone into a site folder, as a wheel installs it (no bench/ beside it): `llaisys
    bench` exits 2 with one line, before loading any model."""
    import shutil

    import llaisys
    import llaisys._core

    site = tmp_path / "site"
    shutil.copytree(os.path.dirname(llaisys.__file__), site / "llaisys", ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(site), LLAISYS_BUILD_DIR=os.path.dirname(llaisys._core.__file__))
    env.pop("LLAISYS_BENCH_DIR", None)
    r = subprocess.run([sys.executable, "-m", "llaisys", "bench", "--shape", "qwen2-0.5b", "--device", "cpu"],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("llaisys: error: `llaisys bench` runs the benchmark code of a source checkout")
