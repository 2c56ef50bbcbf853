import pytest

from agrpo_rollout import RolloutConfig


def test_defaults_follow_the_reference():
    config = RolloutConfig()
    assert (config.num_generations, config.max_completion_length, config.num_sampler_logprobs) == (8, 2048, 8)
    assert (config.temperature, config.top_p, config.top_k, config.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert not config.truncates_vocabulary
    assert config.sampling_fields()["min_p"] == 0.0


@pytest.mark.parametrize(
    ("fields", "fix"),
    [
        ({"top_p": 0.9}, "top_k"),
        ({"min_p": 0.1}, "top_k"),
        ({"top_p": 0.0}, "(0, 1]"),
        ({"num_generations": 0}, "num_generations"),
        ({"temperature": -1.0}, "temperature"),
        ({"max_tool_calling_iterations": -1}, "max_tool_calling_iterations"),
        ({"num_sampler_logprobs": -1}, "num_sampler_logprobs"),
    ],
)
def test_invalid_combinations_name_the_fix(fields, fix):
    with pytest.raises(
        ValueError, match=fix.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        RolloutConfig(**fields)


def test_top_k_with_top_p_truncates():
    config = RolloutConfig(top_p=0.95, top_k=512)
    assert config.truncates_vocabulary
    assert config.sampling_fields()["top_k"] == 512
