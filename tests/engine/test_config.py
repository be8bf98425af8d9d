"""Validation at the boundary: EngineConfig (pydantic) and SamplingParams (dataclass)."""

import pydantic
import pytest

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.sampling_params import SamplingParams


def test_engine_config_defaults_and_frozen_settings():
    config = EngineConfig()
    settings = config.to_settings()
    assert (settings.mode, settings.budget, settings.max_num_seqs) == (
        "ddtree",
        config.budget,
        config.max_num_seqs,
    )
    assert config.default_sampling_params().greedy
    assert all(field.description for field in EngineConfig.model_fields.values())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"device": "gpu"}, "device"),
        ({"mode": "beam"}, "mode"),
        ({"budget": 0}, "budget"),
        ({"dtype": "int8"}, "dtype"),
        ({"drafter": "/d"}, "needs its own target"),
        ({"target": "/t"}, "needs `drafter`"),
        ({"unknown": 1}, "unknown"),
        ({"target": "", "mode": "ar"}, "an empty path"),
        ({"target": "/t", "drafter": "  "}, "an empty path"),
        ({"cost_curve": ""}, "an empty path"),
        ({"max_seq_len": 33}, r"no room for a prompt beside one step's tree \(budget \+ 1 = 33"),
        ({"max_seq_len": 64, "budget": 64}, "raise max_seq_len or lower budget"),
    ],
)
def test_engine_config_rejects_bad_values(overrides, message):
    with pytest.raises(pydantic.ValidationError, match=message):
        EngineConfig(**overrides)


def test_custom_target_alone_is_fine_for_plain_decoding():
    assert EngineConfig(target="/t", mode="ar").drafter is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"draft_budget": 0}, "draft_budget"),
        ({"seed": -1}, "seed must be in"),
        ({"seed": 2**64}, "seed must be in"),
    ],
)
def test_sampling_params_reject_bad_values(overrides, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**overrides)


def test_sampling_params_normalise_lists_to_tuples():
    params = SamplingParams(stop=["\n\n"], stop_token_ids=[5])
    assert params.stop == ("\n\n",) and params.stop_token_ids == (5,)


def test_vanishing_temperature_counts_as_greedy() -> None:
    assert SamplingParams(temperature=1e-9).greedy
    assert not SamplingParams(temperature=0.01).greedy
