"""No Markdown file of the repository cites evidence a reader cannot open, or names a stale thing.

The rule, over every tracked ``*.md`` file (``git ls-files``), anywhere in its text: prose,
tables, inline code and fenced code blocks alike:

* ``../shared`` (the folder outside the repository that the sessions which built this project
  shared) and any absolute path under ``/work/`` (that machine's checkout and shared folder) are
  refused: a reader of the repository has neither. Evidence is cited by its path in the
  repository (``docs/results/...``, a test, an ``experiments/`` script) or its figures are
  written out in the doc.
* any absolute path under ``/tmp/`` is refused, in a command too: a run directory or log under
  ``/tmp`` is machine-local, so a doc that names one either cites a result nobody else can read
  (prose, a table) or gives an example command whose output a reader might take for the record.
  Example commands write to a placeholder: ``RUN_DIR``, ``runs/NAME``, ``$OUT``, ``DIR``. A path
  that merely contains ``/tmp/`` after a name (``runs/tmp/x``) is a relative path and allowed.
  A doc that must describe where the code itself writes temporary files says "the system
  temporary directory" or ``$TMPDIR``.
* stale names: ``recover_hsdp/resume.py`` (the segment loop is ``recover_hsdp/launcher/resume.py``)
  and the old key in use, ``run.resume=...`` (it is ``checkpoint.resume``; the old key is still
  accepted, and docs/cli.md's map of old keys may name it without a value).

Each hit is reported as ``file:line: the match`` so the fix is one look away. The index pages a
new user starts from (README.md, docs/README.md, docs/getting_started.md) must also point only at
what exists: every relative Markdown link ``[..](path#anchor)`` and every path under ``docs/``,
``launch/``, ``examples/``, ``conf/``, ``tests/``, ``experiments/``, ``recover_hsdp/`` or ``csrc/``
they name resolves to a file or folder of the checkout. No torch, no processes; a planted case for every rule shows the check can fail.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick  # the quick tier (make test-quick)

ROOT = Path(__file__).resolve().parents[2]

#: (name, pattern): each a reason a line of a Markdown file is refused
RULES: list[tuple[str, re.Pattern]] = [
    ("../shared: a folder outside the repository", re.compile(r"\.\./shared\b")),
    ("/work/...: a machine-local absolute path", re.compile(r"(?<![\w.~$/-])/work/\S*")),
    ("/tmp/...: a machine-local result or output directory (use RUN_DIR, runs/NAME)",
     re.compile(r"(?<![\w.~$/-])/tmp/\S*")),
    ("recover_hsdp/resume.py: stale (recover_hsdp/launcher/resume.py)",
     re.compile(r"(?<![\w/])recover_hsdp/resume\.py")),
    ("run.resume=: stale key (checkpoint.resume)", re.compile(r"(?<![\w.])run\.resume=\S*")),
]


def hits(text: str, name: str = "<text>") -> list[str]:
    """Every refused match in ``text``, as ``name:line: match (rule)``."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for why, pat in RULES:
            for m in pat.finditer(line):
                out.append(f"{name}:{i}: {m.group(0)}  ({why})")
    return out


def tracked_markdown() -> list[Path]:
    r = subprocess.run(["git", "ls-files", "-z", "*.md"], cwd=ROOT, capture_output=True,
                       check=False)
    if r.returncode != 0:                      # not a git checkout (an sdist): every .md file
        return sorted(p for p in ROOT.rglob("*.md")
                      if not any(part.startswith(".") or part in ("build", "runs")
                                 for part in p.relative_to(ROOT).parts))
    return [ROOT / n for n in r.stdout.decode().split("\0") if n]


def test_no_markdown_cites_evidence_outside_the_repository_or_a_stale_name():
    files = tracked_markdown()
    assert len(files) >= 20, f"found only {len(files)} Markdown files: the listing is broken"
    found = []
    for p in files:
        if p.is_file():                        # tracked but deleted in the work tree: skip
            found += hits(p.read_text(encoding="utf-8", errors="replace"),
                          str(p.relative_to(ROOT)))
    assert not found, ("docs cite evidence outside the repository or a stale name "
                       "(tests/unit/test_docs_citations.py has the rule):\n  "
                       + "\n  ".join(found))


@pytest.mark.parametrize("text, rule", [
    ("torchft is tuned as in ../shared/notes/peers.md", "../shared"),
    ("| S=1 (/tmp/j15m2) | 0.59 s |", "/tmp/"),
    ("report in /tmp/soak41.log", "/tmp/"),
    ("`--out /tmp/soak29`: 16/16 OK", "/tmp/"),
    ("```\nrecover-hsdp verify /tmp/b/honest\n```", "/tmp/"),
    ("measured (/work/shared/notes/feasibility.md)", "/work/"),
    ("the segment loop, recover_hsdp/resume.py, ends", "recover_hsdp/resume.py"),
    ("the requeued job adds `run.resume=true`", "run.resume="),
])
def test_each_rule_catches_its_planted_case(text, rule):
    found = hits(text)
    assert len(found) == 1 and rule in found[0], found


@pytest.mark.parametrize("text", [
    "recover-hsdp verify RUN_DIR --keep-going",
    "python -m experiments.longrun --runs runs/longrun --out docs/results",
    "a relative runs/tmp/x is in the checkout",
    "`launch/bench_gpu.sh` makes a venv in the system temporary directory ($TMPDIR)",
    "the segment loop (recover_hsdp/launcher/resume.py)",
    "`checkpoint.resume=true` continues the run",
    "`run.keep_every`, `run.resume` -> `checkpoint.*` (the map of old keys)",
    "see docs/results/peers/tiny_r1.json and tests/e2e/test_slurm.py",
])
def test_placeholders_and_repository_paths_pass(text):
    assert hits(text) == []


#: the pages a new user starts from: every path they name must exist
INDEX_PAGES = ["README.md", "docs/README.md", "docs/getting_started.md"]
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w./-])((?:docs|launch|examples|conf|tests|experiments|recover_hsdp|csrc)/[\w./-]*\w)")


def dangling(text: str, page: Path, root: Path = ROOT) -> list[str]:
    """Relative links and repository paths named in ``text`` (the page ``page``) that do not exist."""
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in _LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                out.append(f"{page.name}:{i}: link {m.group(1)}")
        for m in _PATH.finditer(line):
            path = m.group(1).rstrip(".")
            if any(c in path for c in "*<>{}") or path.endswith("/NAME"):
                continue
            if not (root / path).exists() and not (root / path.split("::")[0]).exists():
                out.append(f"{page.name}:{i}: path {path}")
    return out


def test_index_pages_name_only_what_exists():
    found = []
    for name in INDEX_PAGES:
        page = ROOT / name
        assert page.is_file(), f"{name} is missing"
        found += dangling(page.read_text(encoding="utf-8"), page)
    assert not found, "the index pages name what does not exist:\n  " + "\n  ".join(found)


def test_a_dangling_link_or_path_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "gpu.md").write_text("x")
    page = tmp_path / "docs" / "README.md"
    ok = "[gpu](gpu.md#your-own-gpus) and docs/gpu.md and [web](https://example.org/x)"
    assert dangling(ok, page, tmp_path) == []
    bad = dangling("[gone](gone.md) and docs/nothere.md", page, tmp_path)
    assert len(bad) == 2 and "gone.md" in bad[0] and "docs/nothere.md" in bad[1], bad
