"""A stub of vLLM 0.33.0 for qscheme's Marlin tests (see tests/fake_vllm/README.md)."""

__version__ = "0.33.0"
