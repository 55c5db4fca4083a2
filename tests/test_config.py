import pytest

from sglang_replayssm.config import ReplayConfig, is_enabled


def test_env_round_trip():
    config = ReplayConfig(enabled=True, buffer_len=8, checkpoint_dtype="bfloat16", fold_dtype="float32",
                          decode_route="split")
    env = {}
    config.to_env(env)
    assert env == {
        "SGLANG_REPLAYSSM_ENABLED": "1",
        "SGLANG_REPLAYSSM_BUFFER_LEN": "8",
        "SGLANG_REPLAYSSM_CHECKPOINT_DTYPE": "bfloat16",
        "SGLANG_REPLAYSSM_FOLD_DTYPE": "float32",
        "SGLANG_REPLAYSSM_DECODE_ROUTE": "split",
    }
    assert ReplayConfig.from_env(env) == config
    assert is_enabled(env)


def test_defaults_from_empty_env():
    assert ReplayConfig.from_env({}) == ReplayConfig()
    assert ReplayConfig() == ReplayConfig(enabled=False, buffer_len=16, checkpoint_dtype="auto", fold_dtype=None)
    assert not is_enabled({})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(buffer_len=0), "--replayssm-buffer-len must be >= 2, got 0"),
        (dict(buffer_len=1), "--replayssm-buffer-len must be >= 2, got 1"),
        (dict(checkpoint_dtype="int8"), "--replayssm-checkpoint-dtype must be one of"),
        (dict(fold_dtype="bfloat16"), "--replayssm-fold-dtype must be 'none' or 'float32'"),
        (dict(checkpoint_dtype="float32", fold_dtype="float32"), "--replayssm-fold-dtype float32 needs"),
        (dict(decode_route="reconstruct"), "--replayssm-decode-route must be one of"),
    ],
)
def test_validate_names_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ReplayConfig(**kwargs).validate()


def test_bad_env_buffer_len():
    with pytest.raises(ValueError, match="SGLANG_REPLAYSSM_BUFFER_LEN must be an integer"):
        ReplayConfig.from_env({"SGLANG_REPLAYSSM_BUFFER_LEN": "x"})
