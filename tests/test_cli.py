"""The `llaisys` command line, driven through a fake Engine (and fake catalog/bench modules): help texts,
argument errors, streamed output and the stderr summary, the chat loop (/reset, /exit, Ctrl-C), error exits.
End-to-end runs with a real model live in the engine tests."""
import copy
import io
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field

import pytest

import llaisys
from llaisys import cli
from llaisys_bench import throughput as bench_throughput  # bench/ is on sys.path (conftest.py)
from llaisys.chat import render_chat_template


@dataclass
class Chunk:
    text: str
    token_ids: list = field(default_factory=list)
    finish_reason: str = None
    usage: dict = None
    timings: dict = None


class FakeEngine:
    """Records how it was built and called. `script` holds one reply per request: a list of text pieces,
    where an exception instance is raised at that point instead."""

    script: list = []
    instances: list = []
    init_error: Exception = None
    template = "{{ x }}"

    def __init__(self, model, device="auto", dtype="auto", max_seq_len=None):
        if FakeEngine.init_error is not None:
            raise FakeEngine.init_error
        self.args = dict(model=model, device=device, dtype=dtype, max_seq_len=max_seq_len)
        self.source, self.chat_template = model, FakeEngine.template
        self.calls, self.resets, self.closed = [], 0, []
        FakeEngine.instances.append(self)

    def stream(self, prompt, **sampling):
        self.calls.append(("stream", prompt, sampling))
        return self._reply()

    def check_window(self, kv_window, sink_tokens=None):
        if kv_window < 0:
            raise ValueError(f"kv_window must be None or an int >= 0, got {kv_window}")

    def chat(self, messages, stream=False, **sampling):
        assert stream is True
        self.calls.append(("chat", copy.deepcopy(messages), sampling))
        render_chat_template(self.chat_template, messages)  # as the real engine does, before generating
        if self.script and isinstance(self.script[0], ValueError):  # refused before generating
            raise self.script.pop(0)
        return self._reply()

    def reset(self):
        self.resets += 1

    def _reply(self):
        pieces = self.script.pop(0)
        index = len(self.closed)
        self.closed.append(False)
        n = 0
        try:
            for piece in pieces:
                if isinstance(piece, BaseException):
                    raise piece
                n += 1
                yield Chunk(piece, [n])
            yield Chunk("", [], "length", {"prompt_tokens": 9, "completion_tokens": n},
                        {"ttft_s": 0.0123, "decode_tokens_per_s": 34.56, "prefill_tokens_per_s": 700.0})
        finally:
            self.closed[index] = True  # the engine's cleanup ran (generator finished or closed)


@pytest.fixture
def fake(monkeypatch):
    """Installs the fake engine, catalog and bench modules; returns a namespace to script and inspect them."""
    FakeEngine.script, FakeEngine.instances, FakeEngine.init_error = [], [], None
    monkeypatch.setattr(FakeEngine, "template", "{{ x }}")
    ns = types.SimpleNamespace(downloads=[], bench_args=[])

    def download(name, force=False):
        if name == "nope":
            raise ValueError("'nope' is not in the catalog (available: tiny)")
        ns.downloads.append((name, force))
        return f"/cache/models/{name}/model.gguf"

    catalog = types.SimpleNamespace(DEFAULT_MODEL="tiny-default", download=download, cache_dir=lambda: "/cache",
                                    CATALOG={"tiny-default": types.SimpleNamespace(description="A tiny model"),
                                             "other": types.SimpleNamespace(description="Another one")})
    for name, module in (("engine", types.SimpleNamespace(Engine=FakeEngine)), ("catalog", catalog)):
        monkeypatch.setitem(sys.modules, f"llaisys.{name}", module)
        monkeypatch.setattr(llaisys, name, module, raising=False)
    # what `llaisys bench` runs (the real throughput module, imported above, keeps the real engine)
    one_request = types.SimpleNamespace(main=lambda args: ns.bench_args.append(args) or 0)
    monkeypatch.setitem(sys.modules, "llaisys_bench.one_request", one_request)
    return ns


def engine():
    assert len(FakeEngine.instances) == 1
    return FakeEngine.instances[0]


def run(capsys, argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


# ---- help and argument errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv, expected", [
    ([], ["generate", "chat", "download", "models", "info", "bench", "examples:", "Qwen2, Qwen3, Llama, Mistral, GPT-NeoX"]),
    (["generate"], ["PROMPT", "--raw", "--system", "--stop", "--temperature", "--top-k", "--top-p", "--min-p",
                    "--repetition-penalty", "--presence-penalty", "--frequency-penalty", "--min-tokens", "--seed", "--max-new-tokens", "--device", "--dtype", "--model",
                    "from stdin", "examples:", "generation_config.json"]),
    (["chat"], ["/reset", "/exit", "Ctrl-C", "--system", "--temperature", "example:"]),
    (["download"], ["NAME", "--force", "cache"]),
    (["models"], ["catalog"]),
    (["info"], ["devices"]),
    (["bench"], ["--shape", "qwen2-0.5b", "qwen2-1.5b", "--prompt-len", "--new-tokens", "--peers", "--json",
                 "examples:"]),
])
def test_help(capsys, argv, expected):
    with pytest.raises(SystemExit) as e:
        cli.main(argv + ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in expected:
        assert word in out, word


def test_python_dash_m_runs_the_cli():
    r = subprocess.run([sys.executable, "-m", "llaisys", "--help"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0 and "usage: llaisys" in r.stdout and "generate" in r.stdout


@pytest.mark.parametrize("argv, message", [
    ([], "required: COMMAND"),
    (["fly"], "invalid choice: 'fly'"),
    (["generate"], "required: PROMPT"),
    (["generate", "--temperature", "hot", "x"], "argument --temperature: invalid float value: 'hot'"),
    (["generate", "--top-k", "2.5", "x"], "argument --top-k: invalid int value: '2.5'"),
    (["generate", "--dtype", "f8", "x"], "argument --dtype: invalid choice: 'f8'"),
    (["generate", "--device", "gpu", "x"], "argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    (["bench", "--device", "cuda:x"], "argument --device: expected auto, cpu, cuda or cuda:N, got 'cuda:x'"),
    (["generate", "--bogus", "x"], "unrecognized arguments: --bogus"),
    (["chat", "extra"], "unrecognized arguments: extra"),
    (["download"], "required: NAME"),
    (["bench", "--model", "m", "--shape", "qwen2-0.5b"], "not allowed with argument"),
    (["bench", "--shape", "qwen9"], "invalid choice: 'qwen9'"),
    (["bench", "--prompt-len", "0"], "argument --prompt-len: must be >= 1, got 0"),
    (["bench", "--new-tokens", "many"], "argument --new-tokens: expected a whole number, got 'many'"),
    (["generate", "--max-seq-len", "0", "x"], "argument --max-seq-len: must be >= 1, got 0"),
])
def test_argument_errors_exit_2_with_usage(capsys, fake, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: llaisys" in err and message in err
    assert FakeEngine.instances == []


# ---- generate ---------------------------------------------------------------------------------------------

def test_generate_streams_the_chat_reply_and_prints_a_summary(capsys, fake):
    FakeEngine.script = [["Hello", ",", " wor", "ld 😀"]]
    code, out, err = run(capsys, ["generate", "--model", "m", "--device", "cpu", "--dtype", "f32", "--max-seq-len",
                                  "512", "--temperature", "0", "--max-new-tokens", "5", "--top-k", "3", "--top-p",
                                  "0.9", "--min-p", "0.1", "--repetition-penalty", "1.1", "--presence-penalty", "0.5",
                                  "--frequency-penalty", "0.25", "--min-tokens", "2", "--seed", "7", "--stop",
                                  "\\n\\n", "--stop", "END", "Hi there"])
    assert code == 0 and out == "Hello, world 😀\n"
    e = engine()
    assert e.args == dict(model="m", device="cpu", dtype="f32", max_seq_len=512)
    assert e.calls == [("chat", [{"role": "user", "content": "Hi there"}],
                        dict(temperature=0.0, max_new_tokens=5, top_k=3, top_p=0.9, min_p=0.1,
                             repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.25, min_tokens=2,
                             seed=7, stop=["\n\n", "END"]))]
    assert err.strip() == "[4 tokens (prompt 9), TTFT 12 ms, 34.6 tok/s, finish: length]"
    assert e.closed == [True]


def test_generate_writes_each_piece_as_it_arrives(monkeypatch, fake):
    class Recorder(io.StringIO):
        def __init__(self):
            super().__init__()
            self.events = []

        def write(self, s):
            self.events.append(("write", s))
            return super().write(s)

        def flush(self):
            self.events.append(("flush",))

    out = Recorder()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    FakeEngine.script = [["a", "b", "c\n"]]
    assert cli.main(["generate", "x"]) == 0
    assert out.events[:6] == [("write", "a"), ("flush",), ("write", "b"), ("flush",), ("write", "c\n"), ("flush",)]
    assert out.getvalue() == "abc\n"  # it already ends with a newline: none added


def test_generate_defaults_system_raw_and_stdin(capsys, monkeypatch, fake):
    FakeEngine.script = [["ok"], ["ok"], ["ok"]]
    assert run(capsys, ["generate", "--system", "Be brief.", "Hi"])[0] == 0
    e = FakeEngine.instances[0]
    assert e.args == dict(model="tiny-default", device="auto", dtype="auto", max_seq_len=None)  # catalog default
    assert e.calls == [("chat", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                        {})]  # sampling left to the model's generation config
    assert run(capsys, ["generate", "--raw", "--temperature", "0.5", "def f():"])[0] == 0
    assert FakeEngine.instances[1].calls == [("stream", "def f():", {"temperature": 0.5})]
    code, out, _ = run(capsys, ["generate", "-"], stdin="line one\nline two\n", monkeypatch=monkeypatch)
    assert code == 0 and out == "ok\n"
    assert FakeEngine.instances[2].calls[0][1] == [{"role": "user", "content": "line one\nline two"}]


@pytest.mark.parametrize("argv, stdin, message", [
    (["generate", "--raw", "--system", "s", "x"], None,
     "--system needs the chat template, so it cannot be combined with --raw"),
    (["generate", "-"], "\n", "the prompt is empty (nothing on stdin)"),
    (["generate", "  "], None, "the prompt is empty"),
])
def test_generate_argument_problems_are_errors(capsys, monkeypatch, fake, argv, stdin, message):
    code, out, err = run(capsys, argv, stdin=stdin, monkeypatch=monkeypatch)
    assert code == 2 and err == f"llaisys: error: {message}\n" and out == ""


def test_a_model_without_chat_template_needs_raw(capsys, monkeypatch, fake):
    monkeypatch.setattr(FakeEngine, "template", None)
    code, _, err = run(capsys, ["generate", "--model", "base", "hi"])
    assert code == 2
    assert err == "llaisys: error: base has no chat template; pass --raw to send the prompt as plain text\n"
    code, _, err = chat(capsys, monkeypatch, ["hi"], argv=["--model", "base"])
    assert code == 2 and "base has no chat template; it cannot chat; use `llaisys generate --raw`" in err
    FakeEngine.script = [["fine"]]
    assert run(capsys, ["generate", "--model", "base", "--raw", "hi"])[:2] == (0, "fine\n")


def test_stop_escapes(capsys, fake):
    FakeEngine.script = [["x"]]
    run(capsys, ["generate", "--stop", "a\\tb", "--stop", "\\\\n", "--stop", "C:\\dir", "hi"])
    assert engine().calls[0][2] == {"stop": ["a\tb", "\\n", "C:\\dir"]}


@pytest.mark.parametrize("error", [ValueError("x has no chat template; use --raw"),
                                   FileNotFoundError("no config.json in /models/x"),
                                   RuntimeError("CUDA requested but this build is CPU-only")])
def test_errors_the_user_can_act_on_print_one_line_and_exit_2(capsys, fake, error):
    FakeEngine.init_error = error
    code, out, err = run(capsys, ["generate", "hi"])
    assert code == 2 and out == "" and err == f"llaisys: error: {error}\n"
    code, _, err = run(capsys, ["--debug", "generate", "hi"])
    assert code == 2 and "Traceback" in err and err.endswith(f"llaisys: error: {error}\n")
    code, _, err = run(capsys, ["generate", "--debug", "hi"])  # also accepted after the command
    assert code == 2 and "Traceback" in err


def test_error_while_streaming_exits_2(capsys, fake):
    FakeEngine.script = [["partial", RuntimeError("CUDA error: out of memory")]]
    code, out, err = run(capsys, ["generate", "hi"])
    assert code == 2 and out == "partial" and "llaisys: error: CUDA error: out of memory" in err
    assert engine().closed == [True]


def test_ctrl_c_during_generate_stops_cleanly(capsys, fake):
    FakeEngine.script = [["one ", "two ", KeyboardInterrupt()]]
    code, out, err = run(capsys, ["generate", "hi"])
    assert code == 130 and out == "one two " and "interrupted" in err and "Traceback" not in err
    assert engine().closed == [True]


def test_ctrl_c_while_printing_closes_the_generation(monkeypatch, fake):
    class Interrupting(io.StringIO):
        def write(self, s):
            if s == "two":
                raise KeyboardInterrupt
            return super().write(s)

    monkeypatch.setattr(sys, "stdout", Interrupting())
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    FakeEngine.script = [["one", "two", "three"]]
    assert cli.main(["generate", "hi"]) == 130
    assert engine().closed == [True]  # the suspended generator was closed, so the engine could clean up


# ---- chat -------------------------------------------------------------------------------------------------

def chat(capsys, monkeypatch, lines, argv=()):
    return run(capsys, ["chat", *argv], stdin="".join(line + "\n" for line in lines), monkeypatch=monkeypatch)


def test_chat_keeps_the_conversation(capsys, monkeypatch, fake):
    FakeEngine.script = [["Bonjour", " !"], ["Ça va", " bien.\n"]]
    code, out, err = chat(capsys, monkeypatch, ["hello", "", "how are you?"], argv=["--system", "French only",
                                                                                   "--temperature", "0.7"])
    assert code == 0  # EOF (Ctrl-D) ends the chat
    user = lambda t: {"role": "user", "content": t}  # noqa: E731
    system = {"role": "system", "content": "French only"}
    assert [c[1] for c in engine().calls] == [
        [system, user("hello")],
        [system, user("hello"), {"role": "assistant", "content": "Bonjour !"}, user("how are you?")]]
    assert all(c[0] == "chat" and c[2] == {"temperature": 0.7} for c in engine().calls)
    assert out.count(">>> ") == 4 and "Bonjour !\n" in out and "Ça va bien.\n" in out
    assert "/reset" in err and err.count("finish: length") == 2


def test_chat_kv_window_goes_with_every_turn_and_is_checked_first(capsys, monkeypatch, fake):
    FakeEngine.script = [["A"], ["B"]]
    code, out, err = chat(capsys, monkeypatch, ["one", "two"], argv=["--kv-window", "64"])
    assert code == 0
    assert [c[2] for c in engine().calls] == [{"kv_window": 64}] * 2
    FakeEngine.instances.clear()
    code, out, err = chat(capsys, monkeypatch, ["one"], argv=["--kv-window", "-3"])
    assert code == 2 and "kv_window must be None or an int >= 0" in err and not engine().calls


def test_chat_reset_exit_and_commands(capsys, monkeypatch, fake):
    FakeEngine.script = [["A"], ["B"]]
    code, out, err = chat(capsys, monkeypatch, ["first", "/help", "/bogus", "/reset", "second", "/exit", "never"],
                          argv=["--system", "S"])
    assert code == 0
    e = engine()
    assert e.resets == 1
    assert [c[1] for c in e.calls] == [[{"role": "system", "content": "S"}, {"role": "user", "content": "first"}],
                                       [{"role": "system", "content": "S"}, {"role": "user", "content": "second"}]]
    assert "(conversation cleared)" in err and "unknown command /bogus" in err and "commands: /reset" in err
    assert FakeEngine.script == []  # nothing was generated for the line after /exit


def test_a_line_starting_with_a_slash_and_spaces_is_a_message(capsys, monkeypatch, fake):
    FakeEngine.script = [["ok"]]
    chat(capsys, monkeypatch, ["/usr/bin is a directory?"])
    assert engine().calls[0][1] == [{"role": "user", "content": "/usr/bin is a directory?"}]


def test_ctrl_c_during_a_reply_returns_to_the_prompt(capsys, monkeypatch, fake):
    FakeEngine.script = [["Once upon", " a time", KeyboardInterrupt()], [], ["Sure."]]
    code, out, err = chat(capsys, monkeypatch, ["tell a story", "anything?", "shorter"])
    assert code == 0 and "[stopped]" in err
    e = engine()
    assert e.closed == [True, True, True]
    # the interrupted reply is kept as shown; an empty reply is dropped with its question
    assert e.calls[2][1] == [{"role": "user", "content": "tell a story"},
                             {"role": "assistant", "content": "Once upon a time"},
                             {"role": "user", "content": "shorter"}]
    assert "Sure." in out


def test_ctrl_c_or_eof_at_the_prompt_quits(capsys, monkeypatch, fake):
    def interrupted(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    code, _, _ = run(capsys, ["chat"])
    assert code == 0 and engine().calls == []


def test_chat_errors_keep_the_session_alive(capsys, monkeypatch, fake):
    FakeEngine.script = [ValueError("prompt has 9000 tokens but the context holds 8192"), ["fine"]]
    code, out, err = chat(capsys, monkeypatch, ["huge", "small"])
    assert code == 0 and "llaisys: error: prompt has 9000 tokens" in err and "fine" in out
    assert engine().calls[1][1] == [{"role": "user", "content": "small"}]  # the refused turn was dropped


def test_chat_engine_load_error_exits_2(capsys, monkeypatch, fake):
    FakeEngine.init_error = FileNotFoundError("model not found: ./nowhere")
    code, _, err = chat(capsys, monkeypatch, ["hi"])
    assert code == 2 and err == "llaisys: error: model not found: ./nowhere\n"


# ---- download, models, info, bench ------------------------------------------------------------------------

def test_download_prints_the_path(capsys, fake):
    code, out, _ = run(capsys, ["download", "tiny-default"])
    assert code == 0 and out == "/cache/models/tiny-default/model.gguf\n"
    run(capsys, ["download", "other", "--force"])
    assert fake.downloads == [("tiny-default", False), ("other", True)]
    code, out, err = run(capsys, ["download", "nope"])
    assert code == 2 and out == "" and err.startswith("llaisys: error: 'nope' is not in the catalog")


def test_models_lists_the_catalog(capsys, fake):
    code, out, err = run(capsys, ["models"])
    assert code == 0
    assert out.splitlines() == ["tiny-default  A tiny model  (default)", "other         Another one"]
    assert "/cache" in err


def test_info_shows_the_build_and_devices(capsys):
    code, out, _ = run(capsys, ["info"])
    assert code == 0 and f"version: {llaisys.__version__}" in out and "cuda: " in out
    devices = [line for line in out.splitlines() if line.startswith("devices: cpu")]
    assert len(devices) == 1 and devices[0].count("cuda:") == llaisys.cuda_device_count() * \
        bool(llaisys.build_info()["cuda"])


def test_bench_passes_parsed_arguments(capsys, fake):
    assert run(capsys, ["bench", "--shape", "qwen2-1.5b", "--device", "cuda", "--dtype", "f16", "--prompt-len",
                        "64", "--new-tokens", "32", "--peers", "--json", "out.json"])[0] == 0
    (args,) = fake.bench_args
    assert (args.shape, args.model, args.device, args.dtype, args.prompt_len, args.new_tokens, args.peers,
            args.json) == ("qwen2-1.5b", None, "cuda", "f16", 64, 32, True, "out.json")
    run(capsys, ["bench", "--model", "tiny"])
    args = fake.bench_args[1]
    assert (args.model, args.shape, args.device, args.dtype, args.prompt_len, args.new_tokens, args.peers,
            args.json) == ("tiny", None, "auto", "auto", 128, 256, False, None)


@pytest.mark.parametrize("template, message", [
    ("{% for i in range(10**9) %}{% endfor %}", "integer arguments are limited"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ 'x' * 10**10 }}", "repeated a str"),
])
def test_a_failing_chat_template_is_a_one_line_error(capsys, fake, template, message):
    FakeEngine.template = template
    FakeEngine.script = [["never"]]
    code, out, err = run(capsys, ["generate", "hi"])
    assert code == 2 and out == "" and err.startswith("llaisys: error: chat template ")
    assert message in err and len(err.strip().splitlines()) == 1


def test_bench_peers_without_torch_is_a_one_line_error(capsys, fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # what `import torch` meets when torch is not installed
    code, out, err = run(capsys, ["bench", "--shape", "qwen2-0.5b", "--peers"])
    assert code == 2 and fake.bench_args == []
    assert err.startswith("llaisys: error: --peers runs HF transformers on torch, which are not installed")
    assert "pip install 'llaisys[test]'" in err and len(err.strip().splitlines()) == 1


def test_bench_peers_without_torch_runs_llama_cpp_alone_on_a_real_model(capsys, fake, monkeypatch):
    import importlib.util

    monkeypatch.setitem(sys.modules, "torch", None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "llama_cpp" else real_find_spec(name, *a))
    code, out, err = run(capsys, ["bench", "--model", "m.gguf", "--peers"])
    assert code == 0 and err == "" and len(fake.bench_args) == 1 and fake.bench_args[0].peers
    # random weights of a shape have no GGUF file: HF is the only peer, and it is missing
    code, out, err = run(capsys, ["bench", "--shape", "qwen2-0.5b", "--peers"])
    assert code == 2 and err.startswith("llaisys: error: --peers runs HF transformers on torch")


# ---- bench --throughput (issue 17) ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--throughput", "0"], "argument --throughput: must be >= 1, got 0"),
    (["--throughput", "-n", "x"], "argument -n/--num-requests: expected a whole number, got 'x'"),
    (["--throughput", "3", "-n", "4"], "--throughput 3 and --num-requests 4 disagree: give one"),
    (["--throughput", "--min-len", "0"], "argument --min-len: must be >= 1, got 0"),
    (["--throughput", "--min-len", "9", "--max-len", "3"], "--min-len (9) must not exceed --max-len (3)"),
    (["--throughput", "--temperature", "-1"], "argument --temperature: must be a number >= 0, got -1"),
    (["--throughput", "--temperature", "nan"], "argument --temperature: must be a number >= 0, got nan"),
    (["--throughput", "--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
    (["--throughput", "--prompt-len", "8", "--threads", "2"],
     "--prompt-len, --threads: only in the one-request mode, not with --throughput"),
    (["-n", "4"], "--num-requests: only with --throughput"),
    (["--shape", "qwen2-0.5b", "--max-len", "64"], "--max-len: only with --throughput"),
    (["--throughput", "--model", "m", "--gguf-types", "q8_0"], "--gguf-types writes a random GGUF file of --shape"),
])
def test_bench_throughput_argument_errors(capsys, fake, monkeypatch, argv, message):
    monkeypatch.setattr(bench_throughput, "main", lambda *a: pytest.fail("ran despite a bad argument"))
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: llaisys bench" in err and message in err, err
    assert fake.bench_args == []


def test_bench_throughput_passes_its_settings(capsys, fake, monkeypatch):
    seen = []
    monkeypatch.setattr(bench_throughput, "main", lambda args, n: seen.append((args, n)) or 0)
    assert run(capsys, ["bench", "--throughput", "--shape", "qwen2-1.5b", "--device", "cuda"])[0] == 0
    args, n = seen[0]
    assert n == 256 and (args.shape, args.device, args.min_len, args.max_len, args.temperature, args.max_num_seqs,
                         args.peers, args.json) == ("qwen2-1.5b", "cuda", 100, 1024, 0.6, 256, False, None)
    # the CLI's defaults are the protocol's
    assert cli.THROUGHPUT_DEFAULTS == bench_throughput.DEFAULTS
    for argv in (["--throughput", "12"], ["--throughput", "-n", "12"], ["--throughput", "12", "--num-requests", "12"]):
        assert run(capsys, ["bench", *argv, "--min-len", "5", "--max-len", "5", "--temperature", "0",
                            "--max-num-seqs", "3", "--json", "o.json"])[0] == 0
        args, n = seen[-1]
        assert n == args.num_requests == 12 and (args.min_len, args.max_len, args.temperature, args.max_num_seqs,
                                                 args.json) == (5, 5, 0.0, 3, "o.json")
    assert fake.bench_args == []  # the one-request benchmark never ran
    run(capsys, ["bench", "--shape", "qwen2-0.5b"])  # and without --throughput it is what runs
    assert len(seen) == 4 and (fake.bench_args[0].prompt_len, fake.bench_args[0].new_tokens) == (128, 256)


def test_bench_throughput_peers_without_torch_is_a_one_line_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    code, out, err = run(capsys, ["bench", "--throughput", "--shape", "qwen2-0.5b", "--peers"])
    assert code == 2 and out == ""
    assert err.startswith("llaisys: error: --peers runs HF transformers' generate_batch, which needs torch")
    assert len(err.strip().splitlines()) == 1


def test_bench_throughput_runs_the_protocol(capsys, tmp_path):
    """The real protocol from the CLI on the tiny test model: every requested token generated (EOS ignored),
    the one-line summary printed and the result written as JSON."""
    import json

    from tiny_model import make_tiny_qwen2

    path = make_tiny_qwen2(tmp_path / "m", seed=7)
    out = tmp_path / "r.json"
    code, stdout, err = run(capsys, ["bench", "--throughput", "6", "--model", path, "--device", "cpu", "--min-len",
                                     "3", "--max-len", "14", "--max-num-seqs", "4", "--json", str(out)])
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0].startswith("llaisys ") and "6 requests, lengths [3, 14]" in lines[0]
    assert lines[1].startswith("batched: ") and " output tok/s, " in lines[1] and " total tok/s " in lines[1]
    r = json.loads(out.read_text())
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompts, outs = bench_throughput.requests(6, 3, 14, vocab)
    assert r["output_tokens"] == sum(outs) and r["prompt_tokens"] == sum(map(len, prompts))
    assert r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"] and r["steps"] >= max(outs)
    for key in ("seconds", "ms_per_step", "schedule_ms", "arrays_ms", "runner_ms", "postprocess_ms"):
        assert r[key] >= 0, key
    assert (r["num_requests"], r["min_len"], r["max_len"], r["max_num_seqs"], r["temperature"]) == (6, 3, 14, 4, 0.6)


def test_bench_help_names_the_throughput_mode(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for word in ("--throughput [N]", "--num-requests", "--min-len", "--max-len", "--max-num-seqs", "nano-vllm"):
        assert word in out, word


# ---- where `llaisys bench` finds the benchmark code (issue 17: the package ships none) -------------------

def test_bench_without_the_benchmark_code_is_a_one_line_error(capsys, fake, monkeypatch, tmp_path):
    """A wheel install has no bench/ beside its sources: run outside a checkout, each mode says what to do in
    one line, exit 2."""
    import llaisys_bench

    monkeypatch.delenv("LLAISYS_BENCH_DIR", raising=False)
    monkeypatch.setattr(cli, "__file__", str(tmp_path / "site-packages" / "llaisys" / "cli.py"))  # as installed
    monkeypatch.chdir(tmp_path)
    for argv in (["--shape", "qwen2-0.5b"], ["--throughput", "--shape", "qwen2-0.5b"]):
        code, out, err = run(capsys, ["bench", *argv])
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
        assert err.startswith("llaisys: error: `llaisys bench` runs the benchmark code of a source checkout")
        assert "clone the llaisys repository and run it from the clone's root" in err
        assert "or set LLAISYS_BENCH_DIR to the clone's bench/ folder" in err
    monkeypatch.setenv("LLAISYS_BENCH_DIR", str(tmp_path))  # a folder without llaisys_bench/
    code, out, err = run(capsys, ["bench", "--shape", "qwen2-0.5b"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"llaisys: error: LLAISYS_BENCH_DIR={tmp_path} holds no llaisys_bench/")
    assert fake.bench_args == []
    monkeypatch.setenv("LLAISYS_BENCH_DIR", llaisys_bench.BENCH_DIR)  # the override finds a checkout's code
    assert run(capsys, ["bench", "--shape", "qwen2-0.5b"])[0] == 0 and len(fake.bench_args) == 1
    monkeypatch.delenv("LLAISYS_BENCH_DIR")
    monkeypatch.chdir(llaisys_bench.ROOT)  # so does running from a checkout's root
    assert run(capsys, ["bench", "--shape", "qwen2-0.5b"])[0] == 0 and len(fake.bench_args) == 2
