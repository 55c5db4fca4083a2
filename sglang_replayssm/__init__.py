"""sglang-replayssm: ReplaySSM decoding for SGLang."""
__version__ = "0.1.0.dev0"

# The SGLang release the integration is written and tested against (the
# exact pin of pyproject.toml's dependencies; `sglang-replayssm check`
# compares the installed version with it).
SGLANG_PIN = "0.5.17"
