"""iq36: a specialised OpenVINO inference engine and OpenAI-compatible service for
Qwen3.6-35B-A3B int4, batch size 1, one machine."""

__version__ = "0.1.0"
