"""Checkpoints: every rank writes its own safetensors shard (``sharded``, ``stream_write``; ``saver``:
sync or async, publishing, ``retention``), any layout reads them back (``layout_free``), DeepSpeed's
files on request (``io``), loading that never runs code (the allowlist unpickler), the finite-state guard, and
Hugging Face interchange (with the ``hf_remote`` files copied into exports).

May import ``megapost.optim``, ``megapost.parallel``, ``megapost.model``, ``megapost.config``,
``megapost.runtime`` and ``megapost.utils``; never ``megapost.train``.
"""
