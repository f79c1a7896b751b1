"""``subspec chat``: an interactive multi-turn conversation that keeps its KV cache between turns."""
from __future__ import annotations

import sys

from .options import SigintScope, add_model_options, add_sampling_options, load_runtime, say, stats_line


def add_parser(sub, common) -> None:
    p = sub.add_parser("chat", parents=[common], help="interactive multi-turn chat",
                       description="Interactive chat. The conversation's KV cache is kept between turns, so each "
                                   "turn only processes the new message. Commands: /reset (new conversation), "
                                   "/stats (statistics of the last answer), /quit. Ctrl-C stops an answer; Ctrl-C "
                                   "or Ctrl-D at the prompt exits.")
    add_model_options(p)
    add_sampling_options(p, "the most tokens to generate per answer")
    p.set_defaults(run=run)


class _DeferredInterrupt(SigintScope):
    """While active (main thread only), the first Ctrl-C only sets :attr:`pending`, so an answer stops between
    rounds instead of in the middle of a forward; a second Ctrl-C raises KeyboardInterrupt as usual."""

    def __init__(self):
        super().__init__()
        self.pending = False

    def handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True


class ChatSession:
    """A multi-turn conversation on one runtime: the message history, templated whole for every turn.

    The engine's prefix reuse (:meth:`~subspec.engine.Engine.stream_context`) keeps the K/V of everything it already
    holds, so a turn only processes its new message (and the previous answer's last token, whose K/V are computed
    by the next forward); an answer stopped by Ctrl-C stays in the history as far as it was shown. A model without
    a chat template continues one raw text.
    """

    def __init__(self, rt, params):
        self.rt, self.params = rt, params
        self.history: list[dict] = []
        self.last_ids: list[int] = []  # tokens of the last answer
        self.templated = bool(getattr(rt.tokenizer, "chat_template", None))

    def reset(self) -> None:
        self.rt.engine.reset()
        self.history = []

    def context(self, text: str) -> list[int]:
        """The token ids of the whole conversation with ``text`` as the next user message."""
        if self.templated:
            return self.rt.encode(text, chat=True, history=self.history)
        return self.rt.engine.tokens + self.rt.encode(text, chat=False)

    def turn(self, text: str, out=None) -> bool:
        """Answer ``text``, streaming to ``out`` (default stdout); return False when interrupted by Ctrl-C.

        Raises:
            SubspecError: the conversation would outgrow the context (the conversation is left unchanged).
        """
        out = out or sys.stdout
        stream = self.rt.stream_text(self.context(text), self.params)
        ids: list[int] = []
        shown = ""
        interrupted = False
        with _DeferredInterrupt() as ctrl_c:
            try:
                for chunk, new in stream:
                    ids += chunk
                    shown += new
                    out.write(new)
                    out.flush()
                    if ctrl_c.pending:  # stop between rounds: every forward (and the offload stream) is complete
                        interrupted = True
                        break
            except KeyboardInterrupt:
                interrupted = True
            finally:
                stream.close()
        out.write("\n")
        out.flush()
        self.last_ids = ids
        if ids or not interrupted:
            self.history += [{"role": "user", "content": text}, {"role": "assistant", "content": shown}]
        return not interrupted


def run(args) -> int:
    from ..errors import SubspecError

    rt, params = load_runtime(args)
    session = ChatSession(rt, params)
    tty = sys.stdin.isatty()
    say(f"chat with {rt.opts.model} ({rt.placement.summary()}). Commands: /reset, /stats, /quit; "
        f"Ctrl-C stops an answer, Ctrl-D exits.")
    try:
        while True:
            try:
                line = input("> " if tty else "")
            except (EOFError, KeyboardInterrupt):
                if tty:
                    print()
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/quit", "/exit"):
                return 0
            if text == "/reset":
                session.reset()
                say("conversation reset")
                continue
            if text == "/stats":
                print(stats_line(rt.engine.last_stats, rt.placement, rt.exactness), file=sys.stderr, flush=True)
                continue
            if text.startswith("/"):
                say(f"unknown command {text.split()[0]}: use /reset, /stats or /quit")
                continue
            try:
                done = session.turn(line)
            except SubspecError as e:  # e.g. the conversation outgrew the context: the conversation is unchanged
                say(f"error: {e}" + (" (use /reset to start over)" if "context" in str(e) else ""))
                continue
            if not done:
                say("answer interrupted")
    finally:
        rt.close()
