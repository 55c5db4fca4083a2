"""sglang-replayssm: ReplaySSM decoding for SGLang."""
__version__ = "0.1.0.dev0"
