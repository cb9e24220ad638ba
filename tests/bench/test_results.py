"""bench/RESULTS.md is the render of bench/results/*.json (so the page stays what the data says), and every
figure there names its machine, commit, date and command."""
from __future__ import annotations

import json

from bench import results


def test_the_page_is_the_render_of_the_data():
    machines, questions, tried = results.load()
    page = results.render(machines, questions, tried)
    assert results.PAGE.read_text() == page, (
        "bench/RESULTS.md is not the render of bench/results/*.json: put new figures in the JSON (a section added "
        "by hand goes there, its story to bench/JOURNAL.md) and run `python -m bench.results`")
    assert results.main(["--check"]) == 0


def test_every_entry_names_machine_commit_date_and_command():
    machines, questions, tried = results.load()
    assert results.problems(machines, questions, tried) == []
    ids = {m["id"] for m in machines}
    assert len(ids) == len(machines)
    assert len({q["id"] for q in questions}) == len(questions)
    for q in questions:
        assert q["entries"], q["id"]
        for e in q["entries"]:
            assert e["machine"] in ids
            assert all(str(e[f]).strip() for f in results.ENTRY_FIELDS), (q["id"], e)
    for m in machines:
        assert all(k in m for k in ("cpu", "cores", "flags", "avx2", "avx512", "amx")), m


def test_a_missing_field_is_found(tmp_path):
    machines, questions, tried = results.load()
    broken = json.loads(json.dumps(questions))
    del broken[0]["entries"][0]["command"]
    broken[0]["entries"][-1]["machine"] = "nowhere"
    found = results.problems(machines, broken, tried)
    assert any("no command" in p for p in found) and any("'nowhere'" in p for p in found)


def test_check_fails_when_the_page_differs(tmp_path, monkeypatch):
    page = tmp_path / "RESULTS.md"
    page.write_text(results.PAGE.read_text() + "\n## A section added by hand\n")
    monkeypatch.setattr(results, "PAGE", page)
    assert results.main(["--check"]) == 1


def test_every_figure_names_a_section_of_the_journal():
    """The run behind each figure, with its story, stays in bench/JOURNAL.md (append-only): the section named
    is a heading there."""
    machines, questions, tried = results.load()
    headings = {line[3:].strip() for line in (results.HERE / "JOURNAL.md").read_text().splitlines()
                if line.startswith("## ")}
    named = {(q["id"], e["journal"]) for q in questions for e in q["entries"]}
    named |= {("tried", t["journal"]) for t in tried}
    missing = sorted(f"{where}: {section!r}" for where, section in named if section not in headings)
    assert not missing, "append these runs to bench/JOURNAL.md under these headings:\n" + "\n".join(missing)
