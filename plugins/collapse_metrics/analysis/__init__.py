"""Offline analysis of collapse-metrics runs, never imported by the training-time plugin: the run
reader and outcome judge (``outcome``, ``runs``), the stage-1 measurement at initialisation and its
theory (``stage1``, ``theory``), and the figures (``figures``, ``probability_report``: matplotlib
is imported by the functions that draw). May import the plugin's own modules and ``megapost.plugin_api``."""
