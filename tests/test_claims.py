"""The figures the README, BENCHMARKS.md's summary tables and the docs print equal what their raw files give
(bench/claims.py), and the check fails when a figure drifts from its file: a raw file that changes, a doc
figure edited alone, a new figure in a checked table without a claim."""

import json
import shutil
from pathlib import Path

import pytest
from helpers import REPO

from bench import claims


def test_every_figure_equals_its_raw_file():
    assert len(claims.CLAIMS) > 200
    assert claims.failures() == []


def test_every_checked_doc_is_scanned():
    assert set(claims.marked_docs()) >= {"README.md", "BENCHMARKS.md", "docs/testing.md", "docs/memory.md"}


@pytest.fixture
def copy_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the README and the raw files its claims read, as the checker's root."""
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for raw in {claim.raw for claim in claims.README_CLAIMS}:
        (tmp_path / raw).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / raw, tmp_path / raw)
    monkeypatch.setattr(claims, "ROOT", tmp_path)
    claims.load.cache_clear()
    claims.doc_text.cache_clear()
    yield tmp_path
    claims.load.cache_clear()
    claims.doc_text.cache_clear()


def test_the_copy_passes(copy_root):
    assert claims.failures(claims.README_CLAIMS) == []


def test_a_raw_file_that_changes_fails_its_figure(copy_root):
    raw = copy_root / claims.T2I_CACHE
    data = json.loads(raw.read_text())
    next(run for run in data["runs"] if run["cache"] == "off")["s_per_image"] = 10.75
    raw.write_text(json.dumps(data))
    wrong = claims.failures(claims.README_CLAIMS)
    assert wrong == [
        "README.md: '10.55 s per 50-step image': prints 10.55, "
        f"{claims.T2I_CACHE} gives 10.75 (runs[cache=off].s_per_image)"
    ]


def test_a_doc_figure_edited_alone_fails(copy_root):
    readme = copy_root / "README.md"
    readme.write_text(readme.read_text().replace("29.78 s, 1.52x", "28.78 s, 1.52x"))
    wrong = claims.failures(claims.README_CLAIMS)
    assert "README.md: '29.78 s, 1.52x diffusers': not in the doc" in wrong
    assert any("'28.78 s' has no claim" in line for line in wrong)


def test_a_new_figure_in_a_checked_table_needs_a_claim(copy_root):
    readme = copy_root / "README.md"
    readme.write_text(readme.read_text().replace("Turbo-8 0.84 s |", "Turbo-8 0.84 s, Turbo-4 0.45 s |"))
    assert claims.failures(claims.README_CLAIMS) == [
        "README.md: '0.45 s' has no claim (in '| Qwen-Image 2.1 and Turbo, with condition images | "
        "`QwenImage21Pipeline` | `gen')"
    ]


@pytest.mark.parametrize(
    ("text", "found"),
    [
        ("| 4.46 s (2.35x), 17.7 GB, 90%, 14 min |", ["4.46 s", "2.35x", "17.7 GB", "90%", "14 min"]),
        ("| Edit-2511, session14, 2026-12-03, [2.1](x), Qwen-Image 2.1, `--gpu-memory 24GiB` |", []),
        ("| <= 0.40 s; >= 1.3x; 40-step, 1024x1024, 30 of 50 steps |", []),
    ],
)
def test_what_reads_as_a_measured_figure(text, found):
    assert [m.group(0) for m in claims.MEASURED.finditer(claims.without_code(text))] == found


def test_a_figure_must_be_one_number_of_its_quote():
    twice = claims.Claim("README.md", "1.6 / 1.6 ms", "1.6", claims.TIMINGS, "commands.first.median_s")
    assert "not exactly one number of the quote" in claims.check(twice)
    assert claims.printed(0.0245, "+0.02") == "+0.02" and claims.printed(29.51, "29.5") == "29.5"


def test_every_result_folder_has_a_record_and_a_row_naming_known_commits():
    assert claims.record_problems() == []


def test_a_folder_without_a_record_or_with_an_unknown_commit_is_caught(tmp_path, monkeypatch):
    if not claims.known_commit("261013b") or claims.known_commit("0000000"):
        pytest.skip("no full git history here to tell a known commit from an unknown one")
    results = tmp_path / claims.RESULTS
    results.mkdir(parents=True)
    (results / "README.md").write_text(
        "| folder | record names | code that ran | agrees? |\n|---|---|---|---|\n"
        "| 2026-12-06-h200-session20 | 0000000 | 0000000 | yes |\n"
    )
    (results / "2026-12-06-cpu-new").mkdir()
    (results / "2026-12-06-cpu-new" / "timings.json").write_text("{}")
    (results / "2026-12-06-h200-session20").mkdir()
    (results / "2026-12-06-h200-session20" / "call1_machine.txt").write_text("commit 261013b\n")
    monkeypatch.setattr(claims, "ROOT", tmp_path)
    claims.doc_text.cache_clear()
    try:
        assert claims.record_problems() == [
            "2026-12-06-cpu-new: no machine record",
            f"2026-12-06-cpu-new: no row in {claims.RECORDS}",
            "2026-12-06-h200-session20: commit 0000000 is not in the history",
            "2026-12-06-h200-session20: commit 0000000 is not in the history",
        ]
    finally:
        claims.doc_text.cache_clear()


def test_the_quality_table_is_what_its_raw_files_give() -> None:
    """BENCHMARKS.md's table of every lossy option is `bench.quality_table`'s, re-derived from the raw
    files (which refuses a file whose summary does not follow from its pair rows)."""
    from bench.quality_table import OPTIONS, RESULT_FOLDERS, table

    printed = table(RESULT_FOLDERS)
    assert printed.count("\n| ") == len(OPTIONS)  # every option has its row
    assert printed in (REPO / "BENCHMARKS.md").read_text()
