"""Small, dependency-free helpers shared across megapost."""

from megapost.utils.atomic import atomic_path, atomic_save_npy, atomic_write_bytes, atomic_write_text

__all__ = ["atomic_path", "atomic_save_npy", "atomic_write_bytes", "atomic_write_text"]
