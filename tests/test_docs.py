"""The user guide (docs/*.md) stays true.

* Every block marked ``<!-- runnable -->`` runs: a page's blocks run in order in one fresh Python
  process (one namespace per page), ```python blocks by ``exec`` and ```bash blocks through the
  shell, in a temporary directory. A block marked ``<!-- file: NAME -->`` is written there as
  NAME when its turn comes. A ```text block marked ``<!-- output -->`` after a runnable block is
  the block's printed output (trailing spaces stripped); ``<!-- output: contains -->`` means each
  of its lines is a line of the real output, where ``...`` stands for any text (a line ``...``: any lines).
* Every message in the error glossary (docs/errors.md) appears in the package's source.
* docs/environment.md lists exactly the TORCH_TPU_* variables the code reads.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARK = re.compile(r"^<!-- (runnable|output|output: contains|file: [\w.\-]+) -->\s*$")
FENCE = re.compile(r"^```(\w*)\s*$")

# Runs one page: argv = blocks.json results.json. Python blocks share one namespace; each block's
# stdout is captured separately. Stops at the first failing block.
RUNNER = r'''
import contextlib, io, json, subprocess, sys, traceback
blocks = json.load(open(sys.argv[1]))
results = []
namespace = {"__name__": "__main__"}
status = 0
for b in blocks:
    out = io.StringIO()
    try:
        if b["kind"] == "file":
            with open(b["name"], "w") as f:
                f.write(b["code"])
        elif b["lang"] == "python":
            code = compile("\n" * (b["line"] - 1) + b["code"], b["page"], "exec")
            with contextlib.redirect_stdout(out):
                exec(code, namespace)
            sys.stderr.flush()
        else:
            r = subprocess.run(b["code"], shell=True, capture_output=True, text=True, timeout=240)
            out.write(r.stdout)
            if r.returncode:
                raise RuntimeError(f"exit status {r.returncode}\n{r.stdout}\n{r.stderr}")
        results.append({"ok": True, "out": out.getvalue()})
    except BaseException:
        results.append({"ok": False, "out": out.getvalue(), "error": traceback.format_exc()})
        status = 1
        break
json.dump(results, open(sys.argv[2], "w"))
sys.stdout.flush()
import os
os._exit(status)
'''


def parse(path: Path) -> list[dict]:
    """The page's steps in order: runnable blocks and files, each with its expected output."""
    lines = path.read_text().splitlines()
    steps: list[dict] = []
    mark = None
    i = 0
    while i < len(lines):
        m = MARK.match(lines[i])
        if m:
            mark = m.group(1)
            i += 1
            continue
        f = FENCE.match(lines[i])
        if f and f.group(1):
            start = i + 1
            end = start
            while not lines[end].startswith("```"):
                end += 1
            code = "\n".join(lines[start:end]) + "\n"
            if mark == "runnable":
                assert f.group(1) in ("python", "bash"), f"{path.name}:{i + 1}: runnable blocks are python or bash"
                steps.append({"kind": "run", "lang": f.group(1), "code": code, "line": start + 1,
                              "page": path.name, "expect": None})
            elif mark and mark.startswith("file: "):
                steps.append({"kind": "file", "name": mark[6:], "code": code, "line": start + 1, "expect": None})
            elif mark and mark.startswith("output"):
                runs = [s for s in steps if s["kind"] == "run"]
                assert runs and runs[-1]["expect"] is None, f"{path.name}:{i + 1}: an output block must follow a run"
                runs[-1]["expect"] = (mark, code)
            mark = None
            i = end + 1
            continue
        if lines[i].strip():
            mark = None
        i += 1
    return steps


def _normalise(text: str) -> list[str]:
    out = [line.rstrip() for line in text.splitlines()]
    while out and not out[0]:
        out.pop(0)
    while out and not out[-1]:
        out.pop()
    return out


def check_output(expect: tuple[str, str], actual: str, where: str) -> None:
    mark, shown = expect
    want, got = _normalise(shown), _normalise(actual)
    if mark == "output":
        assert got == want, f"{where}: printed\n" + "\n".join(got) + "\n--- the page shows\n" + "\n".join(want)
    else:
        patterns = [re.compile(".*".join(re.escape(part) for part in w.split("..."))) for w in want if w != "..."]
        missing = [p.pattern for p in patterns if not any(p.fullmatch(g) for g in got)]
        assert not missing, f"{where}: lines not printed: {missing}\n--- printed\n" + "\n".join(got)


PAGES = sorted(p for p in DOCS.glob("*.md") if any(s["kind"] == "run" for s in parse(p)))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_examples_run(page, tmp_path):
    steps = parse(page)
    (tmp_path / "blocks.json").write_text(json.dumps(steps))
    (tmp_path / "runner.py").write_text(RUNNER)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TORCH_TPU_CACHE_DIR": "off", "GLOO_SOCKET_IFNAME": "lo",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT)}
    for k in ("TORCH_TPU_EAGER_MODE", "TORCH_TPU_LAUNCH_BLOCKING", "TORCH_TPU_STRICT", "XLA_FLAGS"):
        env.pop(k, None)
    work = tmp_path / "work"
    work.mkdir()
    r = subprocess.run([sys.executable, str(tmp_path / "runner.py"), str(tmp_path / "blocks.json"),
                        str(tmp_path / "results.json")], cwd=work, env=env, capture_output=True, text=True,
                       timeout=300)
    results_file = tmp_path / "results.json"
    assert results_file.exists(), f"{page.name}: the runner died (exit {r.returncode})\n{r.stderr[-4000:]}"
    results = json.loads(results_file.read_text())
    for step, res in zip(steps, results):
        where = f"{page.name}:{step['line']}"
        assert res["ok"], f"{where}: the block failed\n{res['error']}\n--- stdout\n{res['out']}\n" \
                          f"--- stderr\n{r.stderr[-3000:]}"
        if step.get("expect"):
            check_output(step["expect"], res["out"], where)
    assert r.returncode == 0 and len(results) == len(steps), f"{page.name}: exit {r.returncode}\n{r.stderr[-3000:]}"


def test_error_glossary_matches_the_source():
    """Each message of the glossary's "Raised by torch_tpu" table is in the source: a backticked
    message may hold ``<placeholders>``, and the text between them must appear verbatim."""
    source = "\n".join(p.read_text() for p in (ROOT / "torch_tpu").rglob("*.py"))
    page = (DOCS / "errors.md").read_text()
    section = page.split("## Raised by torch_tpu", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| message")]
    assert len(rows) >= 20, "the glossary lost its rows"
    for row in rows:
        message = row.split(" | ")[0]
        fragments = re.findall(r"`([^`]+)`", message)
        assert fragments, f"no message in row: {row}"
        for frag in fragments:
            for piece in re.split(r"<[^<>]+>", frag):
                assert piece in source, f"the glossary's message {frag!r}: {piece!r} is not in torch_tpu/ any more"


def test_env_var_table_matches_the_code():
    read = set()
    for path in [*(ROOT / "torch_tpu").rglob("*.py"), ROOT / "_torch_tpu_autoload.py"]:
        read |= set(re.findall(r"environ(?:\.get)?[\(\[]\s*\"(TORCH_TPU_[A-Z_]+)\"", path.read_text()))
    page = (DOCS / "environment.md").read_text()
    documented = set(re.findall(r"^\| `(TORCH_TPU_[A-Z_]+)`", page, flags=re.M))
    assert read, "no TORCH_TPU_* variable found in the code"
    assert documented == read, f"undocumented: {sorted(read - documented)}; stale: {sorted(documented - read)}"


def test_docs_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    readme = (ROOT / "README.md").read_text()
    for p in DOCS.glob("*.md"):
        if p.name != "README.md":
            assert f"({p.name})" in index, f"docs/README.md does not link {p.name}"
            assert f"(docs/{p.name})" in readme, f"README.md does not link docs/{p.name}"
