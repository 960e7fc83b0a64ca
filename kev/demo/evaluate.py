"""Held-out accuracy of a demo checkpoint through the serving path.

    python -m kev.demo.evaluate [--checkpoint kev/demo_model] [--questions 600] [--seed 12345] [--stack]

Generated requests (several questions per document) go through `kev.engine.Engine`: documents
are state-passed into the bank, every question row runs from the stored state, the head answers.
`--stack` sends the same requests through the gRPC stack (Redis, bank and scorer processes).
A question counts as right when the answer's argmax is the gold option (noul: p_yes > 0.5;
choice: `choice`; score: the most probable level, not the expected score).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from kev.request.api import Answer, ChoiceAnswer, NoulAnswer, ScoreAnswer, ScoreRequest
from kev.demo.tasks import as_requests, generate
from kev.engine import Engine

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent.parent / "demo_model"
HELD_OUT_SEED = 12345  # training uses seeds 1 and 2 (+1000 x training seed)


def predicted(answer: Answer) -> int:
    """The argmax option index of an answer, in rendered option order."""
    if isinstance(answer, NoulAnswer):
        return int(answer.p_yes > 0.5)
    if isinstance(answer, ChoiceAnswer):
        return list(answer.probabilities).index(answer.choice)
    if isinstance(answer, ScoreAnswer):
        p = answer.probabilities
        return max(range(len(p)), key=p.__getitem__)
    raise TypeError(f"unknown answer {answer!r}")


@dataclass(frozen=True)
class Report:
    total: int
    correct: int
    by_type: dict[str, tuple[int, int]]  # type -> (correct, total)
    by_kind: dict[str, tuple[int, int]]
    seconds: float

    @property
    def accuracy(self) -> float:
        return self.correct / self.total


def evaluate(checkpoint: str | Path = DEFAULT_CHECKPOINT, questions: int = 600, seed: int = HELD_OUT_SEED,
             requests_per_call: int = 16, engine: Engine | None = None,
             score_many: Callable[[list[ScoreRequest]], list] | None = None) -> Report:
    """Accuracy of the held-out set. `score_many` (requests -> responses or exceptions) is the
    path under test, by default the in-process engine's; `stack_scorer` gives the gRPC stack's."""
    if score_many is None:
        score_many = (engine or Engine.from_checkpoint(checkpoint)).score_many
    examples = generate(questions, seed)
    by_type: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_kind: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    start = time.perf_counter()
    pairs = list(as_requests(examples))
    with torch.no_grad():
        for i in range(0, len(pairs), requests_per_call):
            chunk = pairs[i : i + requests_per_call]
            for (_, group), response in zip(chunk, score_many([r for r, _ in chunk]), strict=True):
                if isinstance(response, Exception):
                    raise response
                for ex in group:
                    ok = predicted(response.answers[ex.name]) == ex.gold
                    for table, key in ((by_type, ex.qtype.value), (by_kind, ex.kind)):
                        table[key][0] += ok
                        table[key][1] += 1
    seconds = time.perf_counter() - start
    correct = sum(c for c, _ in by_type.values())
    return Report(len(examples), correct, {k: tuple(v) for k, v in sorted(by_type.items())},
                  {k: tuple(v) for k, v in sorted(by_kind.items())}, seconds)


def format_report(report: Report) -> str:
    lines = [f"held-out accuracy (serving path): {report.accuracy:.1%} "
             f"({report.correct}/{report.total} questions, {report.seconds:.1f} s)"]
    for title, table in (("type", report.by_type), ("document", report.by_kind)):
        lines.append(f"  by {title}: " + ", ".join(f"{k} {c / t:.1%} ({c}/{t})" for k, (c, t) in table.items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT))
    parser.add_argument("--questions", type=int, default=600)
    parser.add_argument("--seed", type=int, default=HELD_OUT_SEED)
    parser.add_argument("--stack", action="store_true", help="through the gRPC stack (kev.stack) instead of in-process")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if not args.stack:
        print(format_report(evaluate(args.checkpoint, args.questions, args.seed)))
        return
    from kev.rpc.client import KevClient
    from kev.stack import Stack

    with Stack(args.checkpoint) as stack, KevClient(stack.scorer_addr, args.checkpoint) as client:
        print(format_report(evaluate(args.checkpoint, args.questions, args.seed, score_many=stack_scorer(client))))


def stack_scorer(client, timeout_s: float = 120.0) -> Callable[[list[ScoreRequest]], list]:
    """`score_many` through a KevClient: the requests of one call in flight together, so the
    scorer batches their rows across requests as it would under load."""

    def score_many(requests: list[ScoreRequest]) -> list:
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            return list(pool.map(lambda r: client.score(r, timeout=timeout_s), requests))

    return score_many


if __name__ == "__main__":
    main()
