"""A pass's answers from its head output (kev/request/answers.py): the eager head's [O] option
probabilities and the row graph's [P] probabilities of every pick (`launch_rows`' path, CUDA only
in the services) give the same answers when the options hold the same values."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kev.request.answers import PendingAnswers
from kev.request.api import Question
from kev.request.head import pick_layout


def test_answers_from_every_picks_probabilities_equal_those_from_the_options_alone():
    questions = [Question.noul("is it"), Question.choice("which", ["x", "y", "z"]), Question.score("how", ["lo", "hi"])]
    counts = [2, 3, 2]
    rows = [SimpleNamespace(name=f"q{i}") for i in range(3)]
    prepared = [SimpleNamespace(rows=rows[:2]), SimpleNamespace(rows=rows[2:])]  # two requests share the pass
    options = torch.tensor([0.3, 0.7, 0.1, 0.6, 0.3, 0.8, 0.2])
    owner, table_row, _ = pick_layout(counts)
    every = torch.full((len(owner) + 4,), float("nan"))  # decide and padding picks: whatever the graph left
    option_picks = [i for i, r in enumerate(table_row) if r > 0]
    every[option_picks] = options
    eager = PendingAnswers(prepared, questions, counts, options, None).result()
    graphed = PendingAnswers(prepared, questions, counts, every, None, options=option_picks).result()
    assert graphed == eager
    assert [sorted(r) for r in eager] == [["q0", "q1"], ["q2"]]
    assert eager[0]["q0"].p_yes == 0.699999988079071 and eager[0]["q1"].choice == "y"
