"""The device calls' switch picker (``benchmarks/scripts/ab_pick.py``): a variant is picked only where it beats the
baseline at batch 1 by more than the runs' spread and is slower at no batch, in its own file and in the other files'
checks; `apply` sets exactly the named module constant."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.script_loader import load_script

ab_pick = load_script("benchmarks/scripts/ab_pick.py")


def _ab(tmp_path: Path, name: str, b1: dict[str, list[float]], b8: dict[str, list[float]]) -> Path:
    """An ``ab.md`` as ``bench --ab`` writes it (variant table, then one row per batch; medians of the runs)."""
    names = list(b1)
    settings = {"base": "-", "side": "pkg.mod.SIDE=True", "both": "pkg.mod.A=True, pkg.other.B=True"}
    lines = ["Same-machine A/B, baseline `base`", "", "| variant | settings |", "|---|---|"]
    lines += [f"| {n} | {settings[n]} |" for n in names]
    lines += ["", "| layer | batch | context | k | " + " | ".join(names) + " | side vs base |",
              "|---" * (5 + len(names)) + "|"]
    for batch, runs in ((1, b1), (8, b8)):
        cells = [f"{sorted(r)[len(r) // 2]:.1f} [{', '.join(f'{x:.1f}' for x in r)}]" for r in runs.values()]
        lines.append(f"| moe | {batch} | 4096 | 0 | " + " | ".join(cells) + " | -1.0 us (-1 %) faster |")
    path = tmp_path / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_read_ab_takes_settings_and_runs(tmp_path):
    path = _ab(tmp_path, "a", {"base": [100.0, 100.4], "both": [97.0, 97.2]}, {"base": [200.0, 200.0],
                                                                             "both": [199.0, 199.2]})
    settings, rows = ab_pick.read_ab(path)
    assert settings == {"base": [], "both": ["pkg.mod.A=True", "pkg.other.B=True"]}
    assert rows[1]["both"] == (97.2, [97.0, 97.2]) and rows[8]["base"] == (200.0, [200.0, 200.0])


@pytest.mark.parametrize("b1_side, b8_side, picked", [
    ([97.0, 97.2], [200.0, 200.2], True),      # faster at 1, same at 8
    ([99.8, 99.9], [200.0, 200.2], False),     # within the spread at 1
    ([97.0, 97.2], [203.0, 203.1], False),     # slower at 8
    ([99.4, 99.5], [200.0, 200.1], False),     # 0.9 faster: beyond the spread (0.4), under min_us (1.0)
])
def test_pick_rule(tmp_path, b1_side, b8_side, picked):
    path = _ab(tmp_path, "a", {"base": [100.0, 100.4], "side": b1_side}, {"base": [200.0, 200.1], "side": b8_side})
    got = ab_pick.pick("side", [path], [], min_us=1.0)
    assert (got == ["pkg.mod.SIDE=True"]) if picked else got is None


def test_not_slower_checks_another_files_variant_against_its_own_base(tmp_path):
    glm = _ab(tmp_path, "glm", {"base": [100.0, 100.2], "both": [95.0, 95.1]}, {"base": [200.0, 200.1],
                                                                                "both": [199.0, 199.1]})
    dsv_ok = _ab(tmp_path, "dsv_ok", {"base": [90.0, 90.1], "side": [88.0, 88.1], "both": [87.0, 87.2]},
                 {"base": [150.0, 150.1], "side": [149.0, 149.1], "both": [149.0, 149.2]})
    dsv_bad = _ab(tmp_path, "dsv_bad", {"base": [90.0, 90.1], "side": [88.0, 88.1], "both": [89.5, 89.6]},
                  {"base": [150.0, 150.1], "side": [149.0, 149.1], "both": [149.0, 149.2]})
    assert ab_pick.pick("both", [glm], [f"{dsv_ok}:both:side"], 0.5) == ["pkg.mod.A=True", "pkg.other.B=True"]
    assert ab_pick.pick("both", [glm], [f"{dsv_bad}:both:side"], 0.5) is None   # 89.5 > 88.0 + spread
    assert ab_pick.pick("both", [glm], [str(dsv_ok)], 0.5) is not None          # default: both against base
    assert ab_pick.pick("both", [glm], [f"{dsv_ok}:loop"], 0.5) is None          # a variant not there refuses


def test_apply_sets_the_named_constant_only(tmp_path):
    mod = tmp_path / "pkg" / "mod.py"
    mod.parent.mkdir()
    mod.write_text("SIDE = False\nSIDE_NOTE = 'SIDE = False stays'\nA = 1\n")
    ab_pick.apply(["pkg.mod.SIDE=True", "pkg.mod.A=2"], root=tmp_path)
    assert mod.read_text() == "SIDE = True\nSIDE_NOTE = 'SIDE = False stays'\nA = 2\n"
    with pytest.raises(SystemExit, match="exactly once"):
        ab_pick.apply(["pkg.mod.MISSING=1"], root=tmp_path)


def test_an_unfinished_ab_picks_nothing(tmp_path):
    """A bench stopped at its limit writes no ``ab.md``, or one without rows: nothing is picked from it."""
    path = _ab(tmp_path, "a", {"base": [100.0, 100.4], "side": [90.0, 90.1]}, {"base": [200.0, 200.1],
                                                                              "side": [190.0, 190.1]})
    assert ab_pick.pick("side", [path], [], 0.5) == ["pkg.mod.SIDE=True"]
    path.write_text("\n".join(line for line in path.read_text().splitlines() if not line.startswith("| moe")))
    assert ab_pick.pick("side", [path], [], 0.5) is None
    assert ab_pick.pick("side", [tmp_path / "missing.md"], [], 0.5) is None


def test_of_alternatives_the_fastest_passing_is_picked(tmp_path):
    """``pick wide,wide8``: each judged by the rule; of those that pass, the lowest batch-1 median of the first file."""
    glm = _ab(tmp_path, "glm", {"base": [100.0, 100.2], "side": [95.0, 95.1], "both": [93.0, 93.1]},
              {"base": [200.0, 200.1], "side": [199.0, 199.1], "both": [199.5, 199.6]})
    dsv = _ab(tmp_path, "dsv", {"base": [90.0, 90.1], "side": [89.0, 89.1], "both": [92.0, 92.1]},
              {"base": [150.0, 150.1], "side": [149.0, 149.1], "both": [150.0, 150.1]})
    assert ab_pick.pick_best(["side", "both"], [glm], [], 0.5) == ["pkg.mod.A=True", "pkg.other.B=True"]
    # both is slower on the other file: side, though slower on the first, is what passes
    assert ab_pick.pick_best(["side", "both"], [glm], [str(dsv)], 0.5) == ["pkg.mod.SIDE=True"]
    assert ab_pick.pick_best(["both"], [glm], [str(dsv)], 0.5) is None
