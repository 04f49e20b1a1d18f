"""``tensorboard --logdir`` as a user sees it: a real TensorBoard server, Debian's headless Chromium, the
rendered page read back (charts drawn, runs ticked, tag names, lines and colours per chart) at 4 and 48
layers, Post beside Pre, and after 20 runs. Screenshots go to $MEGAPOST_TB_SHOTS (else the test's tmp).
-m slow: two tiny trainings, then four TensorBoard servers (about 3-6 min on 2 busy cores). Needs
``apt-get install -y chromium chromium-driver`` and ``pip install selenium``; skips with that line."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from tensorboard_browser import Browser, missing, tensorboard
from tensorboard_utils import chart_lines, custom_charts, runs_and_tags, train_runs

pytestmark = [pytest.mark.slow, pytest.mark.integration,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def views(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Log directories as a user would point --logdir at: one 4-layer run, one 48-layer run, Post beside
    Pre, and 20 runs (the two trained runs copied under 20 names)."""
    root = tmp_path_factory.mktemp("tb_views")
    trained = root / "trained"
    train_runs(tiny_data, trained, {"post48": ("post", 48), "pre4": ("pre", 4)})
    plan = {"layers4": {"pre4": "pre4"}, "layers48": {"post48": "post48"},
            "post_vs_pre": {"post48": "post48", "pre4": "pre4"},
            "runs20": {f"run{i:02d}": ("post48", "pre4")[i % 2] for i in range(1, 21)}}
    for view, runs in plan.items():
        for name, source in runs.items():
            shutil.copytree(trained / source, root / view / name)
    return {view: root / view for view in plan}


@pytest.fixture(scope="module")
def browser():
    b = Browser()
    yield b
    b.close()


@pytest.mark.parametrize("view", ["layers4", "layers48", "post_vs_pre", "runs20"])
def test_tensorboard_opens_with_charts_drawn(views, browser, view, tmp_path) -> None:
    logdir = views[view]
    runs = runs_and_tags(logdir)
    names = sorted(p.name for p in logdir.iterdir())
    assert sorted(runs) == names  # one TensorBoard run per training run
    shots = Path(os.environ.get("MEGAPOST_TB_SHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    charts = {k: v for name in names for k, v in custom_charts(logdir / name).items()}  # TB merges layouts
    wait = 120.0 if len(names) <= 2 else 300.0  # 20 runs: a busy 2-core machine draws slowly
    with tensorboard(logdir, len(names)) as url:
        custom = browser.read(url, "custom_scalars", shots / f"{view}_custom_scalars.png", wait)
        scalars = browser.read(url, "scalars", shots / f"{view}_scalars.png", wait)
        images = browser.read(url, "images", shots / f"{view}_images.png", wait)
    verdict = {"view": view, "tensorboard_runs": len(runs),
               "custom_lines": {c["title"]: c["matches"] for c in custom["cards"]},  # Matches (n)
               **{page: {"charts": len(seen["cards"]), "drawn": sum(bool(c["paths"]) for c in seen["cards"]),
                         "ticked": seen["ticked"],
                         "max_paths": max((c["paths"] for c in seen["cards"]), default=0),
                         "max_matches": max((c["matches"] or 0 for c in seen["cards"]), default=0)}
                  for page, seen in (("custom_scalars", custom), ("scalars", scalars))},
               "images": len(images["images"])}
    (shots / f"{view}_verdict.json").write_text(json.dumps(verdict, indent=1))
    print(f"verdict {json.dumps(verdict)}")
    for page in (custom, scalars):
        assert page["ticked"] == len(names), page["runs"]  # every run ticked: nothing blank
        assert all(name in page["runs"] for name in names), page["runs"]
        assert page["cards"] and all(c["paths"] for c in page["cards"]), page["cards"]  # every chart drawn
        assert all(len(c["colours"]) <= len(names) for c in page["cards"])  # a colour per run
    # Custom Scalars: every chart of the layout, its "Matches" the series TensorBoard's backend serves
    by_title = {c["title"]: c for c in custom["cards"]}
    assert set(by_title) == {title for _, title in charts}, set(by_title) ^ {t for _, t in charts}
    for (_, title), regexes in charts.items():
        served = sum(len(tags) for tags in chart_lines(regexes, runs).values())
        assert by_title[title]["matches"] == served, title
        if len(names) <= 2:
            serving = sum(bool(tags) for tags in chart_lines(regexes, runs).values())  # runs with the tags
            assert served <= 7 and len(by_title[title]["colours"]) == serving, (title, by_title[title])
    titles = " ".join(c["title"] for c in scalars["cards"])  # the first page of each tag group
    assert "collapse/depth/alpha/max" in titles
    assert all("collapse/depth/t_sim_out/mean" in tags["scalars"] for tags in runs.values())  # page 2
    assert len(images["images"]) >= 2 * min(len(names), 2) and all(w >= 800 for w, _ in images["images"])
