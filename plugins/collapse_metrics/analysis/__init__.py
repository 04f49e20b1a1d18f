"""Offline analysis of collapse-metrics runs, never imported by the training-time plugin: the run
reader and outcome judge (``outcome``, ``runs``), the stage-1 measurement at initialisation and its
theory (``stage1``, ``theory``), and the matplotlib figures (``figures``, the only module importing
matplotlib). May import the plugin's own modules and ``megapost.plugin_api``."""
