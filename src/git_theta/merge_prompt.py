"""The interactive choice of a merge strategy, one conflicting tensor at a time.

Used only when a terminal is there (``open_terminal``) and no rule names a strategy. Each
question shows the tensor's changes on both sides against the base (changed elements and
relative change norm, as ``git theta diff`` computes them) and takes a line:

    STRATEGY [k=v ...]             this tensor
    all STRATEGY [k=v ...]         this and every remaining tensor
    match GLOB STRATEGY [k=v ...]  every tensor whose name matches GLOB (this one if it does)
    skip                           leave this tensor in conflict (ours kept)
    quit                           leave this and all remaining in conflict
"""

from __future__ import annotations

import fnmatch
import os
from typing import IO

from git_theta.display import escape
from git_theta.errors import ThetaError
from git_theta.merging import Choice, Question

HELP = (
    "answer STRATEGY [k=v ...] | all STRATEGY [k=v ...] | match GLOB STRATEGY [k=v ...] | "
    "skip | quit"
)
MAX_ANSWER = 4096


def open_terminal() -> IO[str] | None:
    """The controlling terminal to read answers from (questions go to stderr), or None
    when there is none, stderr is not a terminal (a script or CI run with a terminal
    around it must not wait for one) or git's prompts are off (GIT_TERMINAL_PROMPT=0).

    git runs the merge driver through sh with its own stdin, stdout and stderr, so the
    answers are read from /dev/tty rather than stdin."""
    if os.environ.get("GIT_TERMINAL_PROMPT", "").strip() == "0" or not os.isatty(2):
        return None
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:
        return None
    return open(fd, encoding="utf-8", errors="replace")


def _side_stats(question: Question, side: int) -> str:
    """'N elements changed (P%), relative change R' of one side against the base."""
    from git_theta.diffing import TensorSide, compare

    base, value = question.values[0], question.values[side]
    entry, base_entry = question.entries[side], question.entries[0]
    if base is None or value is None or entry is None or base_entry is None:
        return "new on both sides"

    old = TensorSide(base_entry.dtype, base_entry.shape, base_entry.hash, "dense", frozenset(),
                     lambda: base)  # fmt: skip
    new = TensorSide(entry.dtype, entry.shape, entry.hash, "dense", frozenset(), lambda: value)
    found = compare("", {"t": old}, {"t": new}).tensors
    if not found:
        return "unchanged"
    diff = found[0]
    share = f" ({100 * diff.changed / diff.numel:.3g}%)" if diff.changed and diff.numel else ""
    rel = f", relative change {diff.rel:.3g}" if diff.rel is not None else ""
    return f"{diff.changed or 0:,} elements changed{share}{rel}"


class Prompt:
    """Asks on ``out``, reads ``answers``; remembers "all" and "match" answers for later tensors."""

    def __init__(self, answers: IO[str], path: str, strategies: list[str], out: IO[str]):
        self.answers = answers
        self.out = out
        self.path = path
        self.strategies = strategies
        self.every: Choice | None = None
        self.patterns: list[tuple[str, Choice]] = []
        self.stopped = False

    def remembered(self, name: str) -> Choice | None:
        for pattern, choice in self.patterns:
            if fnmatch.fnmatchcase(name, pattern):
                return choice
        return self.every

    def __call__(self, question: Question) -> Choice | None:
        if self.stopped:
            return None
        known = self.remembered(question.name)
        if known is not None:
            return known
        say = self.out.write
        entry = question.entries[1] or question.entries[2]
        shape = f" [{', '.join(map(str, entry.shape))}] {entry.dtype}" if entry else ""
        say(f"\ngit-theta: {escape(self.path)}: tensor {escape(question.name)}{shape}: ")
        say(f"{question.reason}\n")
        if question.computable:
            say(f"  ours:   {_side_stats(question, 1)}\n")
            say(f"  theirs: {_side_stats(question, 2)}\n")
            say(f"  changed differently on both sides: {question.both:,} elements\n")
            say(f"  strategies: {', '.join(self.strategies)}\n")
        else:
            say("  only ours, theirs or base can resolve it\n")
        while True:
            say(f"  {HELP}\n> ")
            self.out.flush()
            line = self.answers.readline(MAX_ANSWER)
            if not line:  # end of input: stop asking
                self.stopped = True
                return None
            if len(line) >= MAX_ANSWER and not line.endswith("\n"):
                # The rest of this line must not be read as the next answer.
                while line and not line.endswith("\n"):
                    line = self.answers.readline(MAX_ANSWER)
                say(f"  the answer is over {MAX_ANSWER:,} characters; answer again\n")
                continue
            answer = self._answer(question.name, line.split())
            if answer is not False and answer is not True:
                return answer

    def _answer(self, name: str, words: list[str]) -> Choice | bool | None:
        """The choice for this tensor, None to leave it in conflict, False to ask again."""
        from git_theta.merge_rules import check_choice

        if not words:
            return False
        head = words[0]
        try:
            if head == "skip":
                return None
            if head == "quit":
                self.stopped = True
                return None
            if head == "all" and len(words) > 1:
                self.every = check_choice(words[1], words[2:], "the prompt")
                return self.every
            if head == "match" and len(words) > 2:
                choice = check_choice(words[2], words[3:], "the prompt")
                self.patterns.append((words[1], choice))
                return choice if fnmatch.fnmatchcase(name, words[1]) else False
            return check_choice(head, words[1:], "the prompt")
        except ThetaError as exc:
            self.out.write(f"  {exc}\n")
            return False
