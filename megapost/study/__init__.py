"""The collapse study in one home, torch-free (numpy only): the three outcomes of a run (``events``), the
delayed-collapse hazard law (``hazard``, ``law``, ``fit``), the shipped data (``results``; study/results,
docs/study_results.md), the failure-to-start boundary law (``boundary_law``, ``boundary_fit``) and the
``megapost-law`` command (``__main__``). The planner and the guard import the laws from here."""
