"""Ready-made reward functions: math accuracy, a think/answer format, a target length, a character mix.

Owns the rewards users pass as `reward_funcs` and how each one reads a completion. Every reward
follows the contract of `agrpo_rollout`: `func(prompts=..., completions=..., completion_ids=...,
**columns)` returns one `float | None` per completion (None: this source does not score that sample)
and ignores columns it does not use. They run in the rollout process (CPU only), in its thread pool,
after being pickled into it, so each is a module-level function or an instance of a module-level class.

A completion is a string, or a list of messages whose last assistant message holds the text scored
(earlier assistant and tool messages of a multi-turn rollout are ignored). Anything else reads as "".

Does not know: tokenizers, the policy, advantages, or how rewards of several sources are summed.

`accuracy_reward` does not call math-verify in the calling thread. math-verify bounds its work with
SIGALRM, which only the main thread may arm; with the timeouts off, `verify` of an answer such as
`\\boxed{9^{9^{9}}}` runs a bignum power that holds the GIL for minutes and freezes the whole rollout
process, heartbeat included. So math-verify runs in child processes of this file (`python -P
rewards.py`, which imports math-verify alone: about 2.5 s of CPU to start one), on their main
thread, where its timeouts (5 s per parse and per comparison) work; the caller kills a child that has
not answered in `_HARD_TIMEOUT_S` (60 s) and starts another. A verdict costs 0.5-1 ms plus a pipe
round trip; at most `_NUM_VERIFIERS` (2) children start, lazily, as concurrent calls need them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import queue
import re
import select
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_CHILD_TIMEOUT_S = 5  # math-verify's own limit per parse and per comparison, in a child (int: SIGALRM)
_HARD_TIMEOUT_S = 60.0  # the caller kills a child silent this long (2 parses and 4 comparisons at 5 s)
_START_TIMEOUT_S = 180.0  # a child imports sympy: about 2.5 s of CPU, far longer on a loaded machine
_NUM_VERIFIERS = 2  # child processes at most per process; each takes about 100 MB


def _content_text(content: Any) -> str:
    """A message's `content` as text: a string, or the text parts of a list of content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _final_text(completion: Any) -> str:
    """The text a reward scores: the string itself, or the last assistant message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, list):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role") == "assistant":
                return _content_text(message.get("content"))
    return ""


# The whole text is `<think>`, the reasoning, `</think>`, the answer (leading whitespace allowed); the
# reasoning and the answer each hold a non-whitespace character and no `<think>` or `</think>` tag. A
# chat template that opens `<think>` in the prompt leaves it out of the completion: that fails here.
THINK_FORMAT = re.compile(
    r"\A\s*<think>(?=\s*(?!</think>)\S)(?P<reasoning>(?:(?!</?think>).)*)"
    r"</think>(?=\s*\S)(?P<answer>(?:(?!</?think>).)*)\Z",
    re.DOTALL,
)


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    """1.0 where the text is `<think>reasoning</think>answer` as `THINK_FORMAT` spells it, else 0.0."""
    return [1.0 if THINK_FORMAT.match(_final_text(c)) else 0.0 for c in completions]


@dataclass(frozen=True, slots=True)
class LengthReward:
    """Rewards a completion's token count for being near `target_tokens`, in [0, 1].

    `max(0, 1 - |num_tokens - target_tokens| / scale_tokens)`, from `completion_ids`; 1.0 exactly on
    target, 0.0 at `scale_tokens` away or further. `scale_tokens` defaults to `target_tokens`.
    """

    target_tokens: int
    """The length rewarded 1.0, in tokens; > 0."""
    scale_tokens: int | None = None
    """How far from the target the reward reaches 0, in tokens; > 0; None means `target_tokens`."""

    def __post_init__(self) -> None:
        if self.target_tokens <= 0:
            raise ValueError(f"LengthReward(target_tokens={self.target_tokens}): set target_tokens > 0")
        if self.scale_tokens is not None and self.scale_tokens <= 0:
            raise ValueError(
                f"LengthReward(scale_tokens={self.scale_tokens}): set scale_tokens > 0, or None for the target"
            )

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        scale = self.scale_tokens or self.target_tokens
        return [max(0.0, 1.0 - abs(len(ids) - self.target_tokens) / scale) for ids in completion_ids]


@dataclass(frozen=True, slots=True)
class CharacterFractionReward:
    """Rewards the fraction of the completion's characters that are in `chars`, in [0, 1]; 0.0 if empty.

    Learnable by a tiny random model in few steps (each character is a few tokens of its own), so the
    demo and the learning test can watch the reward rise; with `chars="0123456789"`, digits.
    """

    chars: str = "0123456789"
    """The characters rewarded; not empty."""

    def __post_init__(self) -> None:
        if not self.chars:
            raise ValueError("CharacterFractionReward(chars=''): give at least one character to reward")

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        wanted = set(self.chars)
        texts = [_final_text(c) for c in completions]
        return [sum(ch in wanted for ch in text) / len(text) if text else 0.0 for text in texts]


# ---- inside a verifier child: math-verify on its main thread, where its SIGALRM timeouts work ----

_PROSE = re.compile(r"[A-Za-z]{2,}")  # a word outside LaTeX commands: the gold is prose, not an expression


@functools.lru_cache(maxsize=4096)
def _parse_solution(solution: str) -> list[Any]:
    """The gold answer parsed by math-verify; [] when nothing in it parses.

    A gold with `$` or `\\boxed` (e.g. a worked solution) is read as it is; a bare expression such as
    `2\\sqrt{3}` or `1,2` is read as LaTeX (math-verify's plain reading would give 2 and 1.2); prose
    such as `10 apples` or `blue` is read as it is, so it yields its number or nothing.
    """
    from math_verify import parse

    text = solution.strip()
    if not text:
        return []
    if "$" in text or "\\boxed" in text or _PROSE.search(re.sub(r"\\[A-Za-z]+", "", text)):
        return parse(text, parsing_timeout=_CHILD_TIMEOUT_S)
    return parse(f"${text}$", parsing_timeout=_CHILD_TIMEOUT_S) or parse(
        text, parsing_timeout=_CHILD_TIMEOUT_S
    )


def _verdict(solution: str, answer_text: str) -> bool | None:
    """Whether `answer_text`'s final answer equals the gold; None when the gold does not parse."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold = _parse_solution(solution)
    if not gold:
        return None
    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]  # \boxed{} first
    answer = parse(answer_text, extraction_config=extraction, parsing_timeout=_CHILD_TIMEOUT_S)
    return bool(answer) and verify(gold, answer, timeout_seconds=_CHILD_TIMEOUT_S)


# Charged to start-up rather than to a verdict: a first verdict takes ~1 s, a later one ~1 ms.
_WARM_UP = [("x^2+1", "\\boxed{1 + x^2}"), ("2\\sqrt{3}", "$2$"), ("1/2", "The answer is 0.5")]


def _serve() -> None:
    """A verifier child's loop: `[solution, answer_text]` JSON per stdin line, a verdict JSON line out."""
    logging.disable(logging.WARNING)  # math-verify logs each of its timeouts with the whole answer
    channel, sys.stdout = sys.stdout, sys.stderr  # only verdicts go to the parent; stray prints to stderr
    for solution, answer_text in _WARM_UP:  # sympy's first simplify imports and caches for ~0.5 s
        _verdict(solution, answer_text)
    channel.write("ready\n")
    channel.flush()
    for line in sys.stdin:  # EOF when the parent closes the pipe or dies
        solution, answer_text = json.loads(line)
        channel.write(json.dumps(_verdict(solution, answer_text)) + "\n")
        channel.flush()


# ---- in the calling process: children started, fed, timed out and restarted ----


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes:
    """One line from the child's stdout, or b"" at EOF or after `timeout_s` without one."""
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if readable else b""


class _Verifier:
    """One verifier child, started on first use and again after it dies or is killed."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        # -P: the script's folder (agrpo_trainer/) stays off sys.path, so its modules shadow nothing
        proc = subprocess.Popen(
            [sys.executable, "-P", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        if _read_line(proc, _START_TIMEOUT_S) != b"ready\n":
            proc.kill()
            proc.wait()
            raise RuntimeError(
                f"the math-verify process of accuracy_reward did not start within {_START_TIMEOUT_S:.0f} s "
                f"(exit code {proc.returncode}; its error is on stderr above); is math-verify installed "
                "in this environment? `pip install math-verify`"
            )
        return proc

    def verdict(self, solution: str, answer_text: str) -> bool | None:
        """The child's verdict; False (logged) when it dies or stays silent `_HARD_TIMEOUT_S`."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps([solution, answer_text]).encode() + b"\n")
            self._proc.stdin.flush()
            line = _read_line(self._proc, _HARD_TIMEOUT_S)
        except BrokenPipeError:
            line = b""
        if line:
            return json.loads(line)
        logger.warning(
            "accuracy_reward: math-verify gave no verdict within %.0f s (its process is restarted); "
            "scoring 0.0 for the answer ending %r",
            _HARD_TIMEOUT_S,
            answer_text[-200:],
        )
        self.close()
        return False

    def close(self) -> None:
        """Stop the child, if any: it gets EOF and exits; killed if it is still busy 2 s later."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # already dead; wait() below reaps it
                proc.stdin.close()
        try:
            proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _VerifierPool:
    """`size` verifiers lent to one calling thread at a time; last returned, first lent again, so
    children start only as concurrency needs them."""

    def __init__(self, size: int) -> None:
        self._verifiers = [_Verifier() for _ in range(size)]
        self._idle: queue.LifoQueue[_Verifier] = queue.LifoQueue()
        for verifier in self._verifiers:
            self._idle.put(verifier)

    def verdicts(self, pairs: list[tuple[str, str]]) -> list[bool | None]:
        """Verdicts for `(solution, answer_text)` pairs, in order, from one borrowed verifier."""
        verifier = self._idle.get()
        try:
            return [verifier.verdict(solution, text) for solution, text in pairs]
        finally:
            self._idle.put(verifier)

    def close(self) -> None:
        """Stop every child (at exit)."""
        for verifier in self._verifiers:
            verifier.close()


_pool: tuple[int, _VerifierPool] | None = None  # (pid, pool): a forked child builds its own
_pool_lock = threading.Lock()
_warned_unparsed_solution = False


def _verifier_pool() -> _VerifierPool:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), _VerifierPool(_NUM_VERIFIERS))
            atexit.register(_pool[1].close)
        return _pool[1]


def _answer_text(completion: Any) -> str:
    """The part of the final text that holds the answer: what follows the last `</think>`, if any."""
    return _final_text(completion).rpartition("</think>")[2]


def _warn_unparsed_solution(solution: Any) -> None:
    global _warned_unparsed_solution
    if not _warned_unparsed_solution:
        _warned_unparsed_solution = True
        logger.warning(
            "accuracy_reward: math-verify finds no answer in the solution %r, so its samples are not scored "
            "(None); give the dataset's `solution` column a number, a LaTeX expression or a \\boxed{} answer "
            "(reported once)",
            solution,
        )


def accuracy_reward(completions: Sequence[Any], solution: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """1.0 where the completion's final answer equals the `solution` column's, else 0.0; None where the
    solution has no answer math-verify can parse (the sample is not scored; warned once).

    The answer is read after the last `</think>`: a `\\boxed{}` first, else a final "answer is 7",
    `$\\frac{1}{2}$` or plain expression; equal means equal as mathematics (1/2 = 0.5 = \\frac{2}{4}).
    A malformed completion scores 0.0; nothing here raises on one.
    """
    if len(solution) != len(completions):
        raise ValueError(f"accuracy_reward got {len(completions)} completions but {len(solution)} solutions")
    golds = ["" if s is None else str(s) for s in solution]
    verdicts = _verifier_pool().verdicts(
        [(g, _answer_text(c)) for g, c in zip(golds, completions, strict=True)]
    )
    rewards: list[float | None] = []
    for gold, verdict in zip(solution, verdicts, strict=True):
        if verdict is None:
            _warn_unparsed_solution(gold)
        rewards.append(None if verdict is None else float(verdict))
    return rewards


if __name__ == "__main__":  # the verifier child that `_Verifier` starts
    _serve()
