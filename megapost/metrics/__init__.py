"""What the trainer measures about itself: the TensorBoard writer and console line, tokens/s, MFU
and the peak FLOP/s it divides by, and memory (device peaks and counted tensor bytes).

May import ``megapost.config`` and ``megapost.utils`` only.
"""
