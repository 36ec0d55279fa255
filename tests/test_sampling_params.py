"""SamplingParams: defaults, normalisation, and a ValueError naming the field for bad input."""

import pytest

from weir.sampling_params import SamplingParams


def test_defaults_follow_openai_and_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.seed, params.max_tokens, params.min_tokens, params.logprobs) == (None, 16, 0, None)
    assert params.stop == [] and params.stop_token_ids == []
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.skip_special_tokens is True and params.ignore_eos is False
    assert not params.is_greedy and not params.uses_penalties


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_is_greedy_and_uses_penalties():
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.8, top_k=1).is_greedy
    assert not SamplingParams(temperature=0.8, top_k=2).is_greedy
    # Logits over a denormal temperature overflow to inf: such temperatures mean greedy.
    assert SamplingParams(temperature=1e-40).is_greedy and SamplingParams(temperature=1e-40).temperature == 0
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(presence_penalty=0.5).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -1),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", None),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("seed", 1.0),
        ("seed", "42"),
        ("max_tokens", 0),
        ("max_tokens", "16"),
        ("min_tokens", -1),
        ("min_tokens", 17),  # above the default max_tokens of 16
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", 7),
        ("ignore_eos", "yes"),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.1),
        ("frequency_penalty", 3),
        ("frequency_penalty", "x"),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", -1),
        ("logprobs", 1.5),
        ("skip_special_tokens", 1),
    ],
)
def test_invalid_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_error_message_states_range():
    with pytest.raises(ValueError, match=r"temperature must be >= 0, got -1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=2)


def test_boundaries_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(max_tokens=5, min_tokens=5, logprobs=0, seed=-(2**70), stop_token_ids=[0])
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_clone_applies_changes_validates_and_copies_lists():
    params = SamplingParams(stop=["x"], stop_token_ids=[3], seed=7)
    copy = params.clone(temperature=0.5)
    assert copy.temperature == 0.5 and copy.seed == 7 and copy.stop == ["x"]
    copy.stop.append("y")
    copy.stop_token_ids.append(4)
    assert params.stop == ["x"] and params.stop_token_ids == [3]
    assert params.clone() == params
    with pytest.raises(ValueError, match="top_k"):
        params.clone(top_k=-5)
