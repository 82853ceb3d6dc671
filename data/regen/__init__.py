"""The regenerate stage: the target answers every training prompt (regenerate.py, the stage) through a backend
(backends.py: in-process HF, a vLLM or SGLang server, the sources' own answers)."""
