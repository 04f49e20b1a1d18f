"""The process around training: distributed start-up, run directories, signals and exits, and
one-line reports of hung or dead ranks.

May import ``megapost.config`` and ``megapost.utils`` only.
"""
