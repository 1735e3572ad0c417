"""The interactive `llaisys chat` session and the streaming output shared with `llaisys generate`."""
from __future__ import annotations

import sys


def stream_reply(chunks, out, pieces: list):
    """Write each chunk's text to `out` as it comes (also appended to `pieces`); return the last chunk.
    On KeyboardInterrupt the generator is closed first, so the engine restores its cache and stays usable."""
    last = None
    try:
        for chunk in chunks:
            if chunk.text:
                out.write(chunk.text)
                out.flush()
                pieces.append(chunk.text)
            last = chunk
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    return last


def summary_line(last) -> str:
    usage = getattr(last, "usage", None) or {}
    t = getattr(last, "timings", None) or {}
    reason = getattr(last, "finish_reason", None) or "?"
    return (f"[{usage.get('completion_tokens', 0)} tokens (prompt {usage.get('prompt_tokens', 0)}), "
            f"TTFT {1e3 * t.get('ttft_s', 0.0):.0f} ms, {t.get('decode_tokens_per_s', 0.0):.1f} tok/s, "
            f"finish: {reason}]")


class ChatSession:
    """The `llaisys chat` loop: read a line, stream the reply, keep the conversation."""

    HELP = "commands: /reset (forget the conversation), /exit (quit), /help"

    def __init__(self, engine, system: list[dict], sampling: dict):
        self.engine, self.system, self.sampling = engine, system, sampling
        self.messages = list(system)

    def run(self) -> int:
        if sys.stdin.isatty():
            try:
                import readline  # noqa: F401  (line editing and history for input())
            except ImportError:
                pass
        name = getattr(self.engine, "source", None) or "the model"
        print(f"Chatting with {name}. /reset clears the conversation, /exit or Ctrl-D quits, "
              f"Ctrl-C stops a reply.", file=sys.stderr)
        while True:
            try:
                line = input(">>> ")
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
                print(file=sys.stdout)
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/") and " " not in text:
                if self.command(text) == "exit":
                    return 0
                continue
            self.turn(text)

    def command(self, text: str) -> str | None:
        if text in ("/exit", "/quit"):
            return "exit"
        if text == "/reset":
            self.messages = list(self.system)
            self.engine.reset()
            print("(conversation cleared)", file=sys.stderr)
        elif text == "/help":
            print(self.HELP, file=sys.stderr)
        else:
            print(f"unknown command {text}; {self.HELP}", file=sys.stderr)
        return None

    def turn(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})
        pieces: list[str] = []
        try:
            last = stream_reply(self.engine.chat(self.messages, stream=True, **self.sampling), sys.stdout, pieces)
        except KeyboardInterrupt:  # stop this reply only; keep what was shown as the assistant's turn
            last = None
            print("\n[stopped]", file=sys.stderr)
        except ValueError as e:  # e.g. the conversation outgrew the context: say so, let the user /reset
            self.messages.pop()
            print(f"\nllaisys: error: {e}", file=sys.stderr)
            return
        reply = "".join(pieces)
        if reply:
            self.messages.append({"role": "assistant", "content": reply})
        else:
            self.messages.pop()
        if last is not None:
            sys.stdout.write("" if reply.endswith("\n") else "\n")
            sys.stdout.flush()
            print(summary_line(last), file=sys.stderr)
