"""bench/RESULTS.md, rendered from the data in bench/results/.

    python -m bench.results            # write bench/RESULTS.md
    python -m bench.results --check    # exit 1 if bench/RESULTS.md is not what the data renders

The data: `machines.json` (the machine table), one JSON file per question (its current figures: for each
machine, the newest run that answers it), and `tried.json` (what was tried and not kept). A figure enters here
when it is measured; the run itself, with its story, goes to bench/JOURNAL.md (append-only). A question file:

    {"id": "...", "order": 10, "title": "...", "question": "...", "goal": "..." (optional),
     "columns": ["value column", ...],
     "entries": [{"machine": "<machines.json id>", "commit": "<hash>", "commit_basis": "measured" | "recorded",
                  "date": "YYYY-MM-DD", "command": "...", "peer": "..." (optional),
                  "rows": [{"value column": value, ...}, ...], "note": "..." (optional),
                  "journal": "<the journal section it comes from>"}],
     "notes": "..." (optional, under the table)}
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "results"
PAGE = HERE / "RESULTS.md"

ENTRY_FIELDS = ("machine", "commit", "date", "command")
COMMIT = re.compile(r"^[0-9a-f]{7,40}$")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")

HEADER = """\
# Benchmark results

The current figures, one section per question, one table each; every run in a table names its machine (the
table below), commit, date and command on its first row (the rows under it, with those cells empty, are the
same run's). Rendered by `python -m bench.results` from
`bench/results/*.json`: edit the JSON, never this page (`tests/bench/test_results.py` fails when the two
differ). The history (every run, in the order the work was done, with what each change was and why) is
`bench/JOURNAL.md`, append-only; a figure here names the journal section it comes from.

A commit marked * is the commit that recorded the figure (the journal does not name the tree measured: it
is that commit's tree or its parent's); unmarked, it is the tree measured. These are 2-core cloud machines
whose speed drifts by 10-50% within minutes: ratios measured side by side (interleaved) are the figures to
trust, absolute rates less; rerun before you rely on one.

To add a figure: append the run to the journal, put the figure in its question's JSON (replacing that
machine's older entry, or adding a question file), add the machine to `machines.json` if it is new, move
anything tried and dropped to `tried.json`, then run `python -m bench.results`.
"""


def load(data: Path = DATA) -> tuple[list[dict], list[dict], list[dict]]:
    machines = json.loads((data / "machines.json").read_text())["machines"]
    tried = json.loads((data / "tried.json").read_text())["tried"]
    questions = [json.loads(p.read_text()) for p in sorted(data.glob("*.json"))
                 if p.name not in ("machines.json", "tried.json")]
    questions.sort(key=lambda q: (q["order"], q["id"]))
    return machines, questions, tried


def problems(machines: list[dict], questions: list[dict], tried: list[dict]) -> list[str]:
    """What is missing or malformed in the data (empty when all is well)."""
    out = []
    ids = {m["id"] for m in machines}
    for q in questions:
        for i, e in enumerate(q["entries"]):
            where = f"{q['id']} entry {i}"
            for f in ENTRY_FIELDS:
                if not str(e.get(f, "")).strip():
                    out.append(f"{where}: no {f}")
            if e.get("machine") not in ids:
                out.append(f"{where}: machine {e.get('machine')!r} is not in machines.json")
            if not COMMIT.match(str(e.get("commit", ""))):
                out.append(f"{where}: commit {e.get('commit')!r} is not a hash")
            if e.get("commit_basis") not in ("measured", "recorded"):
                out.append(f"{where}: commit_basis must be 'measured' or 'recorded'")
            if not DATE.match(str(e.get("date", ""))):
                out.append(f"{where}: date {e.get('date')!r} is not YYYY-MM-DD")
            if not e.get("rows"):
                out.append(f"{where}: no rows")
            for row in e.get("rows", []):
                extra = set(row) - set(q["columns"])
                if extra:
                    out.append(f"{where}: columns {sorted(extra)} are not in the question's columns")
    for i, t in enumerate(tried):
        for f in ("what", "figure", "why", "machine", "date"):
            if not str(t.get(f, "")).strip():
                out.append(f"tried {i}: no {f}")
        if t.get("machine") not in ids:
            out.append(f"tried {i}: machine {t.get('machine')!r} is not in machines.json")
    return out


def _cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v).replace("|", "\\|").replace("\n", " ")


def _code(s: str) -> str:
    s = s.replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def render(machines: list[dict], questions: list[dict], tried: list[dict]) -> str:
    out = [HEADER, "## Machines", ""]
    out += _table(["machine", "CPU", "cores", "AVX2", "AVX-512", "AVX512-BF16", "AMX", "flags", "notes"],
                  [[f"`{m['id']}`", _cell(m["cpu"]), _cell(m["cores"]), _cell(m["avx2"]), _cell(m["avx512"]),
                    _cell(m["avx512_bf16"]), _cell(m["amx"]), _cell(m["flags"]), _cell(m.get("note", ""))]
                   for m in machines])
    out += ["", "## Questions", ""]
    out += [f"- [{q['title']}](#{q['id']})" for q in questions]
    for q in questions:
        out += ["", f'<a id="{q["id"]}"></a>', f"## {q['title']}", "", q["question"]]
        if q.get("goal"):
            out += ["", f"Goal: {q['goal']}"]
        peer = any(e.get("peer") for e in q["entries"])
        head = ["machine", "commit", "date", *(["peer"] if peer else []), *q["columns"], "command"]
        rows = []
        for e in q["entries"]:
            for i, r in enumerate(e["rows"]):
                first = i == 0
                star = "*" if e["commit_basis"] == "recorded" else ""
                rows.append([f"`{e['machine']}`" if first else "", f"`{e['commit']}`{star}" if first else "",
                             e["date"] if first else "", *([_cell(e.get("peer")) if first else ""] if peer else []),
                             *(_cell(r.get(c)) for c in q["columns"]), _code(e["command"]) if first else ""])
        out += [""] + _table(head, rows)
        notes = [f"- `{e['machine']}`, `{e['commit']}`: {e['note']}" for e in q["entries"] if e.get("note")]
        if notes:
            out += ["", *notes]
        if q.get("notes"):
            out += ["", q["notes"]]
        sections = dict.fromkeys(e["journal"] for e in q["entries"])
        out += ["", "Journal: " + "; ".join(f"*{s}*" for s in sections) + "."]
    out += ["", '<a id="tried-and-not-kept"></a>', "## Tried and not kept", "",
            "Decision records: what was tried, what it measured, why it was not kept. The journal section named "
            "has the run.", ""]
    for t in tried:
        out.append(f"- **{t['what']}** ({t['date']}, `{t['machine']}`): {t['figure']}. {t['why']} "
                   f"(journal: {t['journal']})")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.results", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md differs from the render")
    args = ap.parse_args(argv)
    machines, questions, tried = load()
    bad = problems(machines, questions, tried)
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 2
    page = render(machines, questions, tried)
    if args.check:
        if PAGE.read_text() != page:
            print(f"{PAGE} is not the render of {DATA}: run `python -m bench.results`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
