"""The in-process engine: answers through the bank, batch invariance at the answer level, usage."""

import pytest

from kev.request.api import Question, ScoreRequest
from kev.engine import Engine
from kev.request.errors import InvalidRequest
from tiny_stack import WORDS, make_tiny_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.from_checkpoint(make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt")), bank_bytes=4 << 20)


def request(seed: int, n_words: int = 40) -> ScoreRequest:
    words = [WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n_words)]
    return ScoreRequest(
        document=" ".join(words),
        questions={
            "yn": Question.noul(" ".join(words[:3])),
            "pick": Question.choice(" ".join(words[3:6]), {WORDS[1]: None, WORDS[2]: WORDS[5], WORDS[3]: None}),
            "level": Question.score(" ".join(words[6:8]), [WORDS[4], WORDS[6], WORDS[8]]),
        },
    )


def test_answers_do_not_depend_on_batch_companions(engine):
    """Bit-identical answers whether a request runs alone or with others (CPU promise)."""
    target = request(1)
    alone = engine.score(target)
    engine.clear()  # the target's document is state-passed again, now batched with others
    mixed = engine.score_many([request(2, 90), target, request(3, 7), request(1)])
    assert mixed[1].answers == alone.answers
    assert mixed[3].answers == alone.answers


def test_usage_counts_cached_state_tokens(engine):
    first = engine.score(request(5))
    again = engine.score(request(5))
    assert first.usage.document_tokens == again.usage.document_tokens > 0
    assert again.usage.cached_state_tokens == again.usage.document_tokens
    assert first.answers == again.answers
    rows = again.usage.input_tokens - again.usage.document_tokens
    assert rows > 0


def test_bad_request_in_a_batch_fails_alone(engine):
    bad = ScoreRequest(document="x", questions={})
    good = request(9)
    out = engine.score_many([bad, good])
    assert isinstance(out[0], InvalidRequest) and out[0].field == "questions"
    assert out[1].answers == engine.score(good).answers


def test_probabilities_are_distributions(engine):
    ans = engine.score(request(11)).answers
    assert 0.0 <= ans["yn"].p_yes <= 1.0
    assert abs(sum(ans["pick"].probabilities.values()) - 1) < 1e-6
    assert abs(sum(ans["level"].probabilities) - 1) < 1e-6
    assert 0.0 <= ans["level"].score <= 2.0


def test_loaded_model_is_the_checkpoint_exactly(engine, tmp_path):
    """The model is built without an init of its own (meta device) and takes the checkpoint's
    tensors: nothing is left on the meta device and every parameter equals the file's."""
    import torch

    from kev.model.checkpoint import read_config, read_weights
    from kev.loading import LoadedModel

    path = make_tiny_checkpoint(tmp_path / "ckpt")
    loaded = LoadedModel.load(path)
    want = read_weights(path, read_config(path))
    got = dict(loaded.model.named_parameters())
    assert not [n for n, p in got.items() if p.is_meta]
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
