"""`python -m llaisys.server [serve options]`: the same as `llaisys serve` (before cli.py adds it)."""
import argparse
import sys

from .cli import add_serve_parser, run_serve

_parser = argparse.ArgumentParser(prog="python -m llaisys.server")
add_serve_parser(_parser.add_subparsers(dest="command", required=True))
try:
    raise SystemExit(run_serve(_parser.parse_args(["serve", *sys.argv[1:]])))
except KeyboardInterrupt:  # uvicorn re-raises SIGINT after its graceful shutdown
    raise SystemExit(130)
except (ValueError, FileNotFoundError, RuntimeError) as e:  # as llaisys.cli: one line, no traceback
    print(f"llaisys: error: {e}", file=sys.stderr)
    raise SystemExit(2)
