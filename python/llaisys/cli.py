"""The `llaisys` command line: generate, chat, download, models, info, bench.

Heavy modules (the engine, the catalog) are imported inside the commands, so `llaisys --help` is instant and a
missing optional piece only affects the command that needs it. `llaisys bench` runs the benchmark code of a
source checkout (bench/llaisys_bench): the installed package ships none of it.
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import traceback

from .cli_chat import ChatSession, stream_reply, summary_line

# Errors a user can act on (bad argument, missing file, unsupported model...): one line, no traceback.
USER_ERRORS = (ValueError, FileNotFoundError, RuntimeError)
EXIT_USAGE, EXIT_INTERRUPTED = 2, 130

MAIN_EPILOG = """\
examples:
  llaisys generate "Write a haiku about the sea"     stream a reply from the default model
  llaisys chat --system "You are a terse assistant"  talk with it (/reset, /exit)
  llaisys models                                     models you can name with --model
  llaisys bench --shape qwen2-0.5b                   prefill/decode speed on random weights
Run `llaisys COMMAND --help` for the options of one command."""

GENERATE_EPILOG = """\
examples:
  llaisys generate "Explain a mutex in one sentence"
  llaisys generate --temperature 0 --max-new-tokens 64 "def fib(n):" --raw
  echo "Summarise: ..." | llaisys generate -
  llaisys generate --model ./Qwen2.5-0.5B-Instruct --device cpu --stop "\\n\\n" "List three colours"
The reply goes to stdout as it is generated; a summary line (tokens, time to first token, tokens/s and why
generation ended) goes to stderr. Sampling options left out come from the model's generation_config.json."""

CHAT_EPILOG = """\
in the chat:
  /reset   forget the conversation        /exit    quit (so do Ctrl-D and Ctrl-C at the prompt)
  Ctrl-C while a reply is printing stops that reply and returns to the prompt.
example:
  llaisys chat --system "Answer in French" --temperature 0.7"""


def _sampling_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("sampling (left out: the model's generation_config.json)")
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (deterministic); higher = more varied")
    g.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, metavar="P", help="sample from the smallest set with probability >= P")
    g.add_argument("--min-p", type=float, metavar="P", help="drop tokens less likely than P x the top token")
    g.add_argument("--repetition-penalty", type=float, metavar="R", help="> 1 discourages repeating tokens")
    g.add_argument("--presence-penalty", type=float, metavar="P", help="OpenAI's: lowers every generated token by P")
    g.add_argument("--frequency-penalty", type=float, metavar="F",
                   help="OpenAI's: lowers a generated token by F per occurrence")
    g.add_argument("--min-tokens", type=int, metavar="N", help="no EOS/stop token before N tokens")
    g.add_argument("--seed", type=int, metavar="S", help="random seed, for reproducible sampling")
    g.add_argument("--stop", action="append", metavar="STR",
                   help="stop when this text appears (repeat for several; \\n and \\t are understood)")
    return p


def _model_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model")
    g.add_argument("--model", "-m", metavar="M",
                   help="catalog name (see `llaisys models`), HF model directory, .gguf file or HF repo id "
                        "(default: the catalog's default model, downloaded on first use)")
    g.add_argument("--device", default="auto", type=_device, metavar="DEV",
                   help="auto (a GPU when there is one), cpu, cuda or cuda:N (default auto)")
    g.add_argument("--dtype", default="auto", choices=["auto", "quantized", "bf16", "f16", "f32"],
                   help="weights and compute dtype. auto (default): a GGUF file's quantized weights are kept as "
                        "stored, computing in f32 on the CPU and bf16 on CUDA; otherwise bf16. quantized: as auto, "
                        "but only for a GGUF file with quantized weights")
    g.add_argument("--max-seq-len", type=_positive, metavar="N", help="context size to reserve (default: up to 8192)")
    return p


def _debug_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks on errors")
    return p


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="llaisys", formatter_class=fmt, epilog=MAIN_EPILOG,
        description="llaisys: an LLM inference engine for Qwen2, Qwen3, Llama, Mistral, GPT-NeoX (Pythia) and "
                    "Gemma 3 models (HF safetensors or GGUF) on CPU or NVIDIA GPUs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    model, sampling, debug = _model_parent(), _sampling_parent(), _debug_parent()

    g = sub.add_parser("generate", parents=[model, sampling, debug], formatter_class=fmt, epilog=GENERATE_EPILOG,
                       help="complete one prompt, streaming the text",
                       description="Generate a reply to PROMPT and stream it to stdout. By default PROMPT is sent "
                                   "as a user turn through the model's chat template.")
    g.add_argument("prompt", metavar="PROMPT", help='the prompt text, or "-" to read it from stdin')
    g.add_argument("--system", metavar="TEXT", help="a system message before the prompt")
    g.add_argument("--raw", action="store_true", help="send PROMPT as plain text, without the chat template")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", parents=[model, sampling, debug], formatter_class=fmt, epilog=CHAT_EPILOG,
                       help="interactive multi-turn chat", description="Chat with a model in the terminal; "
                       "replies stream as they are generated and the conversation is kept between turns.")
    c.add_argument("--system", metavar="TEXT", help="a system message that starts the conversation")
    c.add_argument("--kv-window", type=int, metavar="N",
                   help="keep the first tokens and the last N in the KV cache (StreamingLLM): the conversation "
                        "never runs out of context (older turns fade from the model's view)")
    c.set_defaults(func=cmd_chat)

    d = sub.add_parser("download", parents=[debug], help="fetch a catalog model into the cache",
                       description="Download a model of the catalog (see `llaisys models`) into the cache "
                                   "($LLAISYS_HOME or ~/.cache/llaisys) and print its path.")
    d.add_argument("name", metavar="NAME", help="catalog name, e.g. qwen2.5-coder-0.5b-instruct")
    d.add_argument("--force", action="store_true", help="download again even if cached")
    d.set_defaults(func=cmd_download)

    sub.add_parser("models", parents=[debug], help="list the model catalog",
                   description="List the models of the catalog: --model accepts their names, and "
                               "`llaisys download NAME` fetches one ahead of time.").set_defaults(func=cmd_models)
    info = sub.add_parser("info", parents=[debug, model], help="show what this build supports and the visible GPUs",
                          description="Print the build (version, CUDA, compiler) and the visible devices; with "
                                      "--model, also load the model and print its weight formats and bytes.")
    info.set_defaults(func=cmd_info)
    _add_bench(sub, fmt, debug)
    from .server.cli import add_serve_parser  # argparse only; FastAPI/uvicorn load when the server starts
    add_serve_parser(sub)
    return parser


def _add_bench(sub, fmt, debug) -> None:
    b = sub.add_parser("bench", parents=[debug], formatter_class=fmt,
                       help="measure prefill and decode speed, or batched throughput",
                       description="Time one prefill and a greedy decode of one sequence and compare decode with "
                                   "the weight-bandwidth roofline. --shape uses random weights of a real model "
                                   "shape (no download); --model a real model. --throughput [N] instead runs "
                                   "nano-vllm's batched protocol: N requests (default 256) with prompt and output "
                                   "lengths uniform in [--min-len, --max-len] (seed 0), EOS ignored; it prints "
                                   "output and total tok/s and the per-step time split.",
                       epilog="examples:\n  llaisys bench --shape qwen2-1.5b --device cuda --json out.json\n"
                              "  llaisys bench --model qwen2.5-coder-0.5b-instruct --peers\n"
                              "  llaisys bench --throughput --shape qwen2-0.5b --device cuda --peers")
    src = b.add_mutually_exclusive_group()
    src.add_argument("--model", "-m", metavar="M", help="a real model (as for generate)")
    src.add_argument("--shape", choices=["qwen2-0.5b", "qwen2-1.5b", "qwen2-7b", "qwen2-72b", "qwen3-0.6b", "llama-3.2-1b",
                                        "llama-3.1-8b", "pythia-1.4b", "gemma-3-1b"], help="random weights of this shape "
                     "(default qwen2-0.5b when --model is not given)")
    b.add_argument("--device", default="auto", type=_device, metavar="DEV",
                   help="auto, cpu, cuda or cuda:N (default auto)")
    b.add_argument("--dtype", default="auto", choices=["auto", "quantized", "bf16", "f16", "f32"], help="as for generate (default auto)")
    one = b.add_argument_group("one request (the default mode)")
    one.add_argument("--prompt-len", type=_positive, metavar="N", help="prompt tokens (default 128)")
    one.add_argument("--new-tokens", type=_positive, metavar="N", help="decode steps (default 256)")
    one.add_argument("--threads", type=_positive, metavar="N",
                     help="CPU threads for llaisys and llama.cpp (default: every core this process may use)")
    b.add_argument("--gguf-types", metavar="PRESET",
                   help="with --shape: a random GGUF file in these block formats (q4_k_m, q8_0, q4_0, q5_0, "
                        "q5_k, q6_k)")
    b.add_argument("--peers", action="store_true",
                   help="also run the peers in the same run: llama.cpp (llama-cpp-python, CPU, GGUF files) and "
                        "HF transformers; with --throughput, HF transformers' generate_batch on the same requests")
    b.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    b.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1, metavar="N",
                   help="split the model over N GPUs (--device's and the next N - 1; default 1)")
    add_node_flags(b)
    t = b.add_argument_group("batched throughput (--throughput)")
    t.add_argument("--throughput", nargs="?", const=0, type=_positive,
                   metavar="N", help="run nano-vllm's throughput protocol on N requests (default 256)")
    t.add_argument("-n", "--num-requests", type=_positive, metavar="N", help="the N of --throughput")
    t.add_argument("--min-len", type=_positive, metavar="L", help="shortest prompt and output (default 100)")
    t.add_argument("--max-len", type=_positive, metavar="L", help="longest prompt and output (default 1024)")
    t.add_argument("--temperature", type=_non_negative, metavar="T", help="sampling temperature (default 0.6)")
    t.add_argument("--max-num-seqs", type=_positive, metavar="N",
                   help="most sequences the engine runs at once (default 256)")
    b.set_defaults(func=functools.partial(cmd_bench, parser=b))


# `llaisys bench --throughput` defaults (bench/llaisys_bench/throughput.py's DEFAULTS; not imported here: that
# code is a checkout's, and `llaisys --help` stays instant)
THROUGHPUT_DEFAULTS = dict(num_requests=256, min_len=100, max_len=1024, temperature=0.6, max_num_seqs=256)
_THROUGHPUT_ONLY = ("num_requests", "min_len", "max_len", "temperature", "max_num_seqs")
_SINGLE_ONLY = ("prompt_len", "new_tokens", "threads")


NODE_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port")


def add_node_flags(parser) -> None:
    """--nnodes/--node-rank/--master-addr/--master-port (torchrun's and SGLang's names; EngineConfig's fields)."""
    n = parser.add_argument_group("across hosts (torchrun's and SGLang's names): one command per node")
    n.add_argument("--nnodes", type=_positive, metavar="N", help="processes the model spans (default 1); "
                   "-tp counts every node's GPUs (N / nnodes a node)")
    n.add_argument("--node-rank", type=_at_least_zero, metavar="R",
                   help="this node (default 0); node 0 runs the requests, the others only its steps")
    n.add_argument("--master-addr", metavar="ADDR", help="node 0's address, reachable from every node (default "
                   "127.0.0.1)")
    n.add_argument("--master-port", type=_positive, metavar="PORT",
                   help="the port node 0 listens on for the other nodes (default 29500)")


def node_settings(args) -> dict:
    """The node flags given (EngineConfig keywords)."""
    return {k: getattr(args, k) for k in NODE_FLAGS if getattr(args, k, None) is not None}


def _whole_at_least(low: int):
    """An argparse type: a whole number >= low."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    return parse


_at_least_zero = _whole_at_least(0)


def check_bench_args(args, parser) -> int | None:
    """Cross-flag checks of `llaisys bench` (parser.error on a bad mix); fills the defaults of the mode in use.
    Returns the number of requests in throughput mode (also set as args.throughput and args.num_requests),
    else None."""
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    if (args.nnodes or 1) > 1 and (args.peers or args.threads is not None):
        parser.error("--nnodes: not with --peers or --threads (those runs are processes of their own)")
    if (args.nnodes or 1) > 1 and args.tensor_parallel_size % args.nnodes:
        parser.error(f"--tensor-parallel-size {args.tensor_parallel_size} does not split over --nnodes "
                     f"{args.nnodes}: -tp counts every node's GPUs")
    if args.throughput is None:
        given = [flag(k) for k in _THROUGHPUT_ONLY if getattr(args, k) is not None]
        if given:
            parser.error(f"{', '.join(given)}: only with --throughput (the batched protocol)")
        args.prompt_len = 128 if args.prompt_len is None else args.prompt_len
        args.new_tokens = 256 if args.new_tokens is None else args.new_tokens
        return None
    given = [flag(k) for k in _SINGLE_ONLY if getattr(args, k) is not None]
    if given:
        parser.error(f"{', '.join(given)}: only in the one-request mode, not with --throughput")
    n = args.throughput or args.num_requests or THROUGHPUT_DEFAULTS["num_requests"]  # 0: --throughput alone
    if args.num_requests is not None and n != args.num_requests:
        parser.error(f"--throughput {n} and --num-requests {args.num_requests} disagree: give one")
    args.throughput = args.num_requests = n
    for k in _THROUGHPUT_ONLY[1:]:
        if getattr(args, k) is None:
            setattr(args, k, THROUGHPUT_DEFAULTS[k])
    if args.min_len > args.max_len:
        parser.error(f"--min-len ({args.min_len}) must not exceed --max-len ({args.max_len})")
    if args.gguf_types is not None and args.model:
        parser.error("--gguf-types writes a random GGUF file of --shape; it cannot be combined with --model")
    return n


def _device(text: str) -> str:
    if re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


_positive = _whole_at_least(1)


# ---- commands ---------------------------------------------------------------------------------------------

def cmd_generate(args) -> int:
    if args.raw and args.system is not None:
        raise ValueError("--system needs the chat template, so it cannot be combined with --raw")
    prompt = read_prompt(args.prompt)
    eng = make_engine(args)
    if not args.raw:
        require_chat_template(eng, "pass --raw to send the prompt as plain text")
    if args.raw:
        chunks = eng.stream(prompt, **sampling_kwargs(args))
    else:
        chunks = eng.chat(conversation(args.system) + [{"role": "user", "content": prompt}], stream=True,
                          **sampling_kwargs(args))
    pieces: list[str] = []
    last = stream_reply(chunks, sys.stdout, pieces)  # KeyboardInterrupt propagates: exit 130
    if not "".join(pieces).endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary_line(last), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    eng = make_engine(args)
    require_chat_template(eng, "it cannot chat; use `llaisys generate --raw`")
    sampling = sampling_kwargs(args)
    if args.kv_window is not None:
        sampling["kv_window"] = args.kv_window  # checked by the engine with the first turn's other values
        eng.check_window(args.kv_window)
    return ChatSession(eng, conversation(args.system), sampling).run()


def cmd_download(args) -> int:
    from . import catalog

    print(catalog.download(args.name, force=args.force))
    return 0


def cmd_models(args) -> int:
    from . import catalog

    entries = getattr(catalog, "CATALOG", {})
    width = max((len(name) for name in entries), default=0)
    for name, entry in entries.items():
        marks = ["default"] if name == catalog.DEFAULT_MODEL else []
        if hasattr(catalog, "model_path") and os.path.exists(catalog.model_path(name)):
            marks.append("downloaded")
        note = f"  ({', '.join(marks)})" if marks else ""
        print(f"{name:<{width}}  {getattr(entry, 'description', '')}{note}")
    if hasattr(catalog, "cache_dir"):
        print(f"cache: {catalog.cache_dir()}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    from . import build_info, cuda_device_count

    info = build_info()
    for key, value in info.items():
        print(f"{key}: {value}")
    n = cuda_device_count() if info.get("cuda") else 0
    devices = ["cpu"] + [f"cuda:{i}" for i in range(n)]
    print(f"devices: {', '.join(devices)}" + ("" if info.get("cuda") else "  (CPU-only build)"))
    if args.model:
        with make_engine(args) as eng:
            d = eng.describe()
        print(f"model: {d['source']}\n  device {d['device']}, compute dtype {d['dtype']}, "
              f"weights {d['weight_bytes'] / 2**20:.1f} MiB")
        for fmt, v in sorted(d["weight_formats"].items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"  {fmt:>5}: {v['tensors']:4d} tensors, {v['bytes'] / 2**20:8.1f} MiB")
        if d["decode_scratch_bytes"]:
            print(f"  decode scratch {d['decode_scratch_bytes'] / 2**20:.1f} MiB besides the weights ({d['dtype']}: "
                  f"multi-row steps decode one quantized weight at a time into it)")
    return 0


def cmd_bench(args, parser=None) -> int:
    n = check_bench_args(args, parser or build_parser())
    if n is not None:
        throughput = bench_module("throughput")
        if args.peers:  # before the llaisys run, so a missing peer costs no waiting
            throughput.require_hf()
        return throughput.main(args, n) or 0
    one_request = bench_module("one_request")
    if args.peers:
        require_peers(args)
    return one_request.main(args) or 0


BENCH_DIR_VARIABLE = "LLAISYS_BENCH_DIR"


def bench_dir() -> str:
    """The folder holding the benchmark code (llaisys_bench/): $LLAISYS_BENCH_DIR, else the bench/ beside this
    package's sources (a checkout run with PYTHONPATH=python or installed with pip install -e), else ./bench (a
    checkout's root, where an installed package is run, as its CI runs the tests). A wheel ships no benchmark
    code: RuntimeError (a one-line error, exit 2) saying what to do."""
    holds_code = lambda d: os.path.isfile(os.path.join(d, "llaisys_bench", "__init__.py"))  # noqa: E731
    override = os.environ.get(BENCH_DIR_VARIABLE)
    if override:
        if not holds_code(override):
            raise RuntimeError(f"{BENCH_DIR_VARIABLE}={override} holds no llaisys_bench/: point it at the bench/ "
                               f"folder of a llaisys source checkout")
        return os.path.abspath(override)
    beside_sources = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
    found = next((d for d in (beside_sources, "bench") if holds_code(d)), None)
    if found is None:
        raise RuntimeError(f"`llaisys bench` runs the benchmark code of a source checkout (bench/llaisys_bench), "
                           f"which this installed package does not include: clone the llaisys repository and run "
                           f"it from the clone's root, or set {BENCH_DIR_VARIABLE} to the clone's bench/ folder")
    return os.path.abspath(found)


def bench_module(name: str):
    """llaisys_bench.NAME of bench_dir(), put on sys.path (last: its scripts must not shadow other modules)."""
    import importlib

    where = bench_dir()
    if where not in sys.path:
        sys.path.append(where)
    return importlib.import_module(f"llaisys_bench.{name}")


def require_peers(args) -> None:
    """--peers needs a peer that can run: HF transformers (on torch), or llama.cpp (llama-cpp-python) when a
    real model or a random GGUF (--gguf-types) is benchmarked; the other is then skipped with a note."""
    import importlib.util

    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        gguf_run = bool(args.model or getattr(args, "gguf_types", None))
        if gguf_run and importlib.util.find_spec("llama_cpp") is not None:
            return
        raise RuntimeError(f"--peers runs HF transformers on torch, which are not installed ({e}); "
                           f"pip install 'llaisys[test]', or leave out --peers") from None


# ---- prompts ---------------------------------------------------------------------------------------------

def read_prompt(arg: str) -> str:
    """PROMPT itself, or stdin for "-" (less the newline `echo` adds)."""
    text = sys.stdin.read() if arg == "-" else arg
    if arg == "-" and text.endswith("\n"):
        text = text[:-2] if text.endswith("\r\n") else text[:-1]
    if not text.strip():
        raise ValueError("the prompt is empty" + (" (nothing on stdin)" if arg == "-" else ""))
    return text


# ---- helpers ----------------------------------------------------------------------------------------------

def make_engine(args):
    from . import catalog
    from .engine import Engine

    model = args.model or catalog.DEFAULT_MODEL
    return Engine(model, device=args.device, dtype=args.dtype, max_seq_len=args.max_seq_len)


def require_chat_template(eng, advice: str) -> None:
    if not getattr(eng, "chat_template", None):
        raise ValueError(f"{getattr(eng, 'source', 'the model')} has no chat template; {advice}")


def conversation(system: str | None) -> list[dict]:
    return [{"role": "system", "content": system}] if system is not None else []


def sampling_kwargs(args) -> dict:
    """The sampling options the user gave (None ones are left to the model's generation config)."""
    names = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "min_tokens", "seed")
    out = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if args.stop:
        out["stop"] = [_unescape(s) for s in args.stop]
    return out


_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}


def _unescape(text: str) -> str:
    """Shell users type `--stop '\\n'`: understand \\n, \\t, \\r and \\\\ (other text is left alone)."""
    return re.sub(r"\\[ntr\\]", lambda m: _ESCAPES[m.group()], text)


def _silence_stdout() -> None:
    # Later writes (and the flush at exit) to a closed pipe would raise again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    debug = getattr(args, "debug", False)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("\nllaisys: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `llaisys generate ... | head -1`: the reader left, nothing to report
        _silence_stdout()
        return 0
    except USER_ERRORS as e:
        if debug:
            traceback.print_exc()
        print(f"llaisys: error: {e}", file=sys.stderr)
        return EXIT_USAGE
