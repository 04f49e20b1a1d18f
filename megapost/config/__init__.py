"""Configuration: the command-line flags, Megatron-LM's flag mapping, presets and ``ConfigError``.

Everything a run is told lives here, parsed and validated before any heavy work. May import
``megapost.model`` (for ``ModelConfig`` and the placement table) and ``megapost.utils`` only.
"""
