"""The decision head's maths, answers and file format, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from kev.request.api import ChoiceAnswer, NoulAnswer, Question, ScoreAnswer
from kev.model.config import CheckpointError
from kev.request.head import DecisionHead, answer, answers, load_head, pick_layout, save_head

LN2, LN3 = math.log(2.0), math.log(3.0)


def make_head(temperature=1.0, bias=False) -> DecisionHead:
    """d = 2, R = 256. W_q rows 0/1 are e0/e1, W_k rows 0/1 are 16 e0/16 e1, other rows zero, so
    without bias z_i = (16 h_i . h_d) / sqrt(256) / T = (h_i . h_d) / T.
    With bias: b_q[1] = 1 (q1 = hd1 + 1) and b_q[2] = 2, b_k[2] = 8 (adds 2 * 8 / 16 = 1 to every z).
    """
    w_q, w_k = torch.zeros(256, 2), torch.zeros(256, 2)
    w_q[0, 0] = w_q[1, 1] = 1.0
    w_k[0, 0] = w_k[1, 1] = 16.0
    b_q = b_k = None
    if bias:
        b_q, b_k = torch.zeros(256), torch.zeros(256)
        b_q[1], b_q[2], b_k[2] = 1.0, 2.0, 8.0
    return DecisionHead(w_q, w_k, b_q, b_k, temperature)


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def test_logits_hand_computed():
    h_d, h_o = t([[1.0, 0.0]]), t([[0.0, 5.0], [LN3, 7.0]])
    # z = h_i . h_d = [0, ln 3]; softmax = [1, 3] / 4
    torch.testing.assert_close(make_head().logits(h_d, h_o, [2]), t([0.0, LN3]))
    torch.testing.assert_close(make_head().probabilities(h_d, h_o, [2]), t([0.25, 0.75]))
    # T = 2 with h_d doubled gives the same logits.
    torch.testing.assert_close(make_head(temperature=2.0).logits(2 * h_d, h_o, [2]), t([0.0, LN3]))


def test_logits_with_bias_and_temperature():
    h_d, h_o = t([[1.0, 0.0]]), t([[0.0, 2.0], [1.0, 0.0]])
    # q = [1, 0 + 1, 2], k_0 = [0, 32, 8], k_1 = [16, 0, 8]
    # z_0 = (0 + 32 + 16) / 16 = 3, z_1 = (16 + 0 + 16) / 16 = 2
    torch.testing.assert_close(make_head(bias=True).logits(h_d, h_o, [2]), t([3.0, 2.0]))
    torch.testing.assert_close(make_head(temperature=0.5, bias=True).logits(h_d, h_o, [2]), t([6.0, 4.0]))


def test_segment_softmax_over_a_batch():
    # Question 0 (2 options) reads h_d = e0, question 1 (3 options) reads h_d = e1.
    h_d = t([[1.0, 0.0], [0.0, 1.0]])
    h_o = t([[0.0, 9.0], [LN3, 9.0], [9.0, LN2], [9.0, 0.0], [9.0, 0.0]])
    # q0: z = [0, ln 3] -> [1/4, 3/4]; q1: z = [ln 2, 0, 0] -> [2, 1, 1] / 4
    probs = make_head().probabilities(h_d, h_o, [2, 3])
    torch.testing.assert_close(probs, t([0.25, 0.75, 0.5, 0.25, 0.25]))
    # A huge logit in question 0 neither overflows nor leaks into question 1.
    h_o[0, 0] = 1000.0
    torch.testing.assert_close(make_head().probabilities(h_d, h_o, [2, 3]), t([1.0, 0.0, 0.5, 0.25, 0.25]))


def test_pick_layout_by_hand():
    owner, row, col = pick_layout([2, 1, 3])
    # picks: [d0 o o] [d1 o] [d2 o o o] at 0..8; decide picks go to row 0, options to 1 + their decide pick
    assert owner == [0, 0, 0, 3, 3, 5, 5, 5, 5]
    assert row == [0, 1, 1, 0, 4, 0, 6, 6, 6]
    assert col == [0, 0, 1, 0, 0, 0, 0, 1, 2]
    assert pick_layout([]) == ([], [], [])


def test_pick_probabilities_equal_the_segment_softmax():
    """The static-shape head (every pick projected, a fixed-width table, padding picks after the
    real ones) gives each option the probability `probabilities` gives it, on random fp32 inputs."""
    g = torch.Generator().manual_seed(0)
    d, R = 24, 16
    head = DecisionHead(torch.randn(R, d, generator=g), torch.randn(R, d, generator=g), torch.randn(R, generator=g),
                        torch.randn(R, generator=g), 0.7)
    counts = [3, 1, 5, 2]
    owner, row, col = pick_layout(counts)
    P, pad = len(owner), 7
    hidden = torch.randn(P + pad, d, generator=g)
    full = lambda xs: torch.tensor(xs + [0] * pad)  # noqa: E731  (padding picks: zeros, as a graph's fill)
    got = head.pick_probabilities(hidden, full(owner), full(row), full(col), width=8)
    decide = [i for i, r in enumerate(row) if r == 0]
    options = [i for i, r in enumerate(row) if r > 0]
    want = head.probabilities(hidden[decide], hidden[options], counts)
    torch.testing.assert_close(got[options], want, rtol=1e-6, atol=1e-7)
    hidden[P:] = 1e4  # what padding picks hold changes nothing real
    torch.testing.assert_close(head.pick_probabilities(hidden, full(owner), full(row), full(col), width=8), got,
                               rtol=0, atol=0)


def test_single_option_and_bf16_inputs_run_in_fp32():
    h_d = t([[1.0, 0.0], [1.0, 0.0]]).bfloat16()
    h_o = t([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]]).bfloat16()
    probs = make_head().probabilities(h_d, h_o, [2, 1])
    assert probs.dtype == torch.float32
    # z = [0, 1] -> [1, e] / (1 + e); a lone option has probability 1
    e = math.e
    torch.testing.assert_close(probs, t([1 / (1 + e), e / (1 + e), 1.0]))


@pytest.mark.parametrize(
    "counts", [[3], [1, 1], [0, 3]], ids=["too-few-questions", "sum-mismatch", "zero-options"]
)
def test_counts_must_match(counts):
    h_d, h_o = t([[1.0, 0.0], [0.0, 1.0]]), t([[0.0, 0.0]] * 3)
    with pytest.raises(ValueError, match="option_counts"):
        make_head().logits(h_d, h_o, counts)


def test_hidden_size_must_match():
    with pytest.raises(ValueError, match=r"\[Q, 2\]"):
        make_head().logits(t([[1.0, 0.0, 0.0]]), t([[1.0, 0.0, 0.0]]), [1])


def test_head_construction_checks():
    head = make_head()
    with pytest.raises(ValueError, match="temperature"):
        DecisionHead(head.w_q, head.w_k, None, None, 0.0)
    with pytest.raises(ValueError, match="w_k"):
        DecisionHead(head.w_q, head.w_k[:3], None, None, 1.0)
    with pytest.raises(ValueError, match="float32"):
        DecisionHead(head.w_q.double(), head.w_k.double(), None, None, 1.0)


# --- answers --------------------------------------------------------------------------------------


def test_noul_answer():
    assert answer(Question.noul("late"), [0.25, 0.75]) == NoulAnswer(p_yes=0.75)


def test_choice_answers():
    q = Question.choice("team", {"a": None, "b": None, "c": None})
    got = answer(q, torch.tensor([0.5, 0.25, 0.25]))
    # confidence = (0.5 - 1/3) / (1 - 1/3) = (1/6) / (2/3) = 0.25
    assert got == ChoiceAnswer("a", {"a": 0.5, "b": 0.25, "c": 0.25}, pytest.approx(0.25))
    # tie -> first listed; (0.4 - 1/3) / (2/3) = (1/15) / (2/3) = 0.1
    tie = answer(q, [0.2, 0.4, 0.4])
    assert tie.choice == "b" and tie.confidence == pytest.approx(0.1)
    assert answer(Question.choice("team", {"only": None}), [1.0]).confidence == 1.0  # K = 1


def test_score_answers():
    q = Question.score("late", ["calm", "annoyed", "angry"])
    got = answer(q, [0.2, 0.5, 0.3])
    # score = 0*0.2 + 1*0.5 + 2*0.3 = 1.1; mode 1; E|l - 1| = 0.2 + 0.3 = 0.5; conf = 1 - 0.5/2 = 0.75
    assert isinstance(got, ScoreAnswer)
    assert got.score == pytest.approx(1.1) and got.confidence == pytest.approx(0.75)
    assert got.legend == ("calm", "annoyed", "angry") and got.probabilities == (0.2, 0.5, 0.3)
    # L = 4: score = 0.2 + 0.6 + 1.2 = 2.0; mode 3; E|l - 3| = 0.3 + 0.4 + 0.3 = 1.0; conf = 1 - 1/3
    four = answer(Question.score("late", ["a", "b", "c", "d"]), [0.1, 0.2, 0.3, 0.4])
    assert four.score == pytest.approx(2.0) and four.confidence == pytest.approx(2 / 3)
    # tie -> lowest level as mode: E|l - 0| = 0.5; conf = 1 - 0.5/1
    assert answer(Question.score("late", ["a", "b"]), [0.5, 0.5]).confidence == pytest.approx(0.5)
    one = answer(Question.score("late", ["only"]), [1.0])  # L = 1
    assert (one.score, one.confidence) == (0.0, 1.0)


def test_answer_checks_lengths_and_answers_split_a_pass():
    with pytest.raises(ValueError):
        answer(Question.noul("late"), [1.0])
    with pytest.raises(ValueError):
        answer(Question.score("late", ["a", "b"]), [1.0])
    qs = [Question.noul("late"), Question.choice("team", {"a": None, "b": None, "c": None})]
    out = answers(qs, t([0.25, 0.75, 0.5, 0.25, 0.25]), [2, 3])
    assert out[0] == NoulAnswer(0.75) and out[1].choice == "a"


# --- head.safetensors -----------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_save_load_round_trip(tmp_path, bias):
    head = make_head(temperature=0.7, bias=bias)
    save_head(tmp_path / "head.safetensors", head)
    loaded = load_head(tmp_path / "head.safetensors", hidden_size=2)
    for name in ("w_q", "w_k", "b_q", "b_k"):
        a, b = getattr(head, name), getattr(loaded, name)
        assert (a is None and b is None) or torch.equal(a, b)
    assert loaded.temperature == pytest.approx(0.7)


def valid_tensors(**changes):
    tensors = {"w_q": torch.zeros(256, 2), "w_k": torch.zeros(256, 2), "temperature": torch.tensor([1.5])}
    tensors.update(changes)
    return {k: v for k, v in tensors.items() if v is not None}


def test_load_accepts_bf16_and_no_metadata(tmp_path):
    path = tmp_path / "head.safetensors"
    save_file(valid_tensors(w_q=torch.ones(256, 2, dtype=torch.bfloat16), b_k=torch.ones(256)), str(path))
    head = load_head(path, hidden_size=2)
    assert head.w_q.dtype == torch.float32 and head.b_k is not None and head.temperature == 1.5


@pytest.mark.parametrize(
    "tensors, metadata, message",
    [
        (valid_tensors(w_k=None), None, "missing tensor 'w_k'"),
        (valid_tensors(temperature=None), None, "missing tensor 'temperature'"),
        (valid_tensors(extra=torch.zeros(1)), None, "unexpected tensor 'extra'"),
        (valid_tensors(w_q=torch.zeros(256, 3)), None, r"'w_q' has shape \[256, 3\], expected \[R, 2\]"),
        (valid_tensors(w_k=torch.zeros(128, 2)), None, r"'w_k' has shape \[128, 2\], expected \[256, 2\]"),
        (valid_tensors(b_q=torch.zeros(2)), None, r"'b_q' has shape \[2\]"),
        (valid_tensors(temperature=torch.tensor(0.0)), None, "'temperature' is 0.0"),
        (valid_tensors(temperature=torch.tensor(-1.0)), None, "'temperature' is -1.0"),
        (valid_tensors(temperature=torch.tensor(float("nan"))), None, "'temperature' is nan"),
        (valid_tensors(temperature=torch.ones(2)), None, r"'temperature' has shape \[2\]"),
        (valid_tensors(w_q=torch.zeros(256, 2, dtype=torch.int32)), None, "'w_q' has dtype torch.int32"),
        (valid_tensors(), {"format": "something-else"}, "metadata"),
        (valid_tensors(), {"format": "kev-decision-head", "version": "2"}, "metadata"),
    ],
    ids=[
        "missing-w_k", "missing-temperature", "extra-tensor", "hidden-size", "w_k-rank", "bias-shape",
        "temperature-zero", "temperature-negative", "temperature-nan", "temperature-shape", "int-dtype",
        "other-format", "other-version",
    ],
)
def test_load_errors_name_file_and_tensor(tmp_path, tensors, metadata, message):
    path = tmp_path / "head.safetensors"
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(CheckpointError, match=message) as e:
        load_head(path, hidden_size=2)
    assert str(path) in str(e.value)


def test_load_missing_or_garbage_file(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_head(tmp_path / "nope.safetensors", hidden_size=2)
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_head(tmp_path / "bad.safetensors", hidden_size=2)
