"""Every Python code block of README.md and docs/*.md runs as a reader would run it, and prints what it says.

What runs: each fenced block whose info string is ``python`` or ``py`` (indented fences, as in list items,
included), on every page, new pages included. A page's blocks run in order, in one namespace, as a reader
pasting them one after another into one session would: in a fresh interpreter per page (so jax's
configuration, the strategy registry and ``sys.modules`` are a new session's), with 8 simulated CPU
devices, in an empty temporary working directory. One test per page, so a failure names the page; the
error names the line of the block that failed and the traceback the page's own lines.

The namespace is a module named ``docs_<page>``, not ``__main__``: a block that is a script (``cli.md``'s
``train.py``) contributes its definitions, and its ``if __name__ == "__main__":`` entry point is left to
the command line the page gives for it (``tests/test_cli.py`` runs that one).

Markers: an HTML comment (invisible in the rendered page) on the last non-blank line before the fence.

    <!-- docs-test: skip (REASON) -->   illustration only (a fragment, names that stand for the reader's
                                        own, a launch that needs a cluster); REASON is required and reported
    <!-- docs-test: namespace NAME -->  the block runs in a second namespace NAME, shared by the blocks so
                                        marked (migration.md's PyTorch Lightning programs, which a reader
                                        runs apart from their jaxlight ports)

A marker the test does not understand, one without a reason, or one with no python fence after it fails.

Printed values: a ``print(...)`` statement (at any depth) whose last line ends in a comment states its
output there, and every output it printed is compared with that comment:

- the whole comment is the stated output (a comment that explains rather than states goes on a line of
  its own);
- ``...`` stands for any text;
- a decimal number stands for the digits given, and the print may show more: ``0.036`` matches a printed
  ``0.036`` or ``0.03614``, not ``0.0359``, and ``0.001`` does not match ``0.0009999999776482583``; an
  integer matches exactly (``2`` matches neither ``20`` nor ``2.0``);
- runs of whitespace match runs of whitespace.

A stated ``print`` that never ran fails the page too (its claim went unchecked).

The worker half of this file (``python tests/test_docs_run.py PAGE RESULT_JSON``) runs one page; the
test half starts it in a subprocess and checks its report. Measured on a 2-core machine that other jobs
shared (load 3-4): 92 s for the file, 80 s of CPU for all pages together.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# A bound per page, far above what one takes (migration.md, the longest: 21 s of CPU, 37 s on a busy machine).
PAGE_TIMEOUT_S = 300

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`\n]*?)[ \t]*$")
_MARKER = re.compile(r"^[ \t]*<!--[ \t]*docs-test:(?P<body>.*?)-->[ \t]*$")
_SKIP = re.compile(r"^skip[ \t]*\((?P<reason>[^()]*\S[^()]*)\)$")
_NAMESPACE = re.compile(r"^namespace[ \t]+(?P<name>[A-Za-z_]\w*)$")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w.])")
LANGS = ("python", "py")


def pages() -> list[Path]:
    """README.md and every docs/*.md page, new ones included."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    """One fenced Python block: ``line`` is the 1-based line of its first code line in the page."""

    page: str
    line: int
    code: str
    skip: str | None  # the marker's reason, None when the block runs
    namespace: str = ""  # "" for the page's own namespace


class DocMarkerError(ValueError):
    """A ``docs-test`` marker the test cannot honour (unknown, without reason, or not before a fence)."""


def python_blocks(path: Path) -> list[Block]:
    """The page's ``python``/``py`` blocks in order, dedented by their fence's indent, with their markers."""
    rel = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    marker: tuple[int, str] | None = None  # (line, body) of a marker waiting for its fence
    i = 0
    while i < len(lines):
        text = lines[i]
        m = _MARKER.match(text)
        if m:
            if marker is not None:
                raise DocMarkerError(f"{rel}:{marker[0]}: docs-test marker not followed by a code fence")
            marker = (i + 1, m["body"].strip())
            i += 1
            continue
        fence = _FENCE.match(text)
        if not fence:
            if text.strip() and marker is not None:
                raise DocMarkerError(f"{rel}:{marker[0]}: docs-test marker not followed by a code fence")
            i += 1
            continue
        indent, mark = fence["indent"], fence["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(mark[0])}{{{len(mark)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        lang = fence["info"].split()[0] if fence["info"] else ""
        if marker is not None and lang not in LANGS:
            raise DocMarkerError(f"{rel}:{marker[0]}: docs-test marker before a {lang or 'plain'} block")
        if lang in LANGS:
            skip, namespace = None, ""
            if marker is not None:
                s, n = _SKIP.match(marker[1]), _NAMESPACE.match(marker[1])
                if not (s or n):
                    raise DocMarkerError(
                        f"{rel}:{marker[0]}: unknown docs-test marker {marker[1]!r}"
                        " (expected 'skip (REASON)' or 'namespace NAME')"
                    )
                skip, namespace = (s["reason"].strip(), "") if s else (None, n["name"])
            body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : j]]
            blocks.append(Block(rel, i + 2, textwrap.dedent("\n".join(body)) + "\n", skip, namespace))
        marker = None
        i = j + 1
    if marker is not None:
        raise DocMarkerError(f"{rel}:{marker[0]}: docs-test marker not followed by a code fence")
    return blocks


def stated_outputs(block: Block) -> dict[int, str]:
    """{page line of the call: comment} for each ``print(...)`` statement whose last line ends in a comment
    (a print the formatter split over lines carries its comment after the closing parenthesis)."""
    try:
        tree = ast.parse(block.code)
        tokens = list(tokenize.generate_tokens(io.StringIO(block.code).readline))
    except (SyntaxError, tokenize.TokenError):
        return {}  # the block fails to compile and says so when it runs
    comments = {tok.start[0]: tok.string[1:].strip() for tok in tokens if tok.type == tokenize.COMMENT}
    stated = {}
    for node in ast.walk(tree):
        call = node.value if isinstance(node, ast.Expr) else None
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print":
            if node.end_lineno in comments:
                stated[block.line + node.lineno - 1] = comments[node.end_lineno]
    return stated


def output_pattern(stated: str) -> re.Pattern[str]:
    """The regular expression a printed output must match in full to agree with ``stated`` (rules above)."""
    parts = []
    for piece in stated.split("..."):
        out, pos = [], 0
        for num in _NUMBER.finditer(piece):
            out.append(_literal(piece[pos : num.start()]))
            whole, frac, exp = re.fullmatch(r"(-?\d+)(\.\d+)?([eE][-+]?\d+)?", num.group()).groups()
            if frac:  # the digits given: the print may carry more
                out.append(rf"(?<![\d.]){re.escape(whole + frac)}\d*{re.escape(exp or '')}(?!\d)")
            else:
                out.append(rf"(?<![\d.]){re.escape(num.group())}(?![\d.])")
            pos = num.end()
        out.append(_literal(piece[pos:]))
        parts.append("".join(out))
    return re.compile(r".*?".join(parts), flags=re.S)


def _literal(text: str) -> str:
    return r"\s+".join(re.escape(w) for w in re.split(r"\s+", text)) if text else ""


# ---------------------------------------------------------------------------- the worker: one page
def run_page(page: str, result_path: str) -> int:
    """Run the page's blocks in order, each in its namespace; write the report (counts, errors) as JSON."""
    import builtins
    import contextlib
    import resource
    import traceback
    import types

    blocks = python_blocks(ROOT / page)
    filename = str(ROOT / page)
    outputs: dict[int, list[str]] = {}
    real_print = builtins.print

    def recording_print(*args, sep=" ", end="\n", file=None, flush=False):
        frame = sys._getframe(1)
        if frame.f_code.co_filename == filename and file is None:
            buf = io.StringIO()
            real_print(*args, sep=sep, end=end, file=buf)
            outputs.setdefault(frame.f_lineno, []).append(buf.getvalue())
        real_print(*args, sep=sep, end=end, file=file, flush=flush)

    modules: dict[str, types.ModuleType] = {}

    def namespace(name: str) -> dict:
        """The module a namespace's blocks run in, registered in sys.modules (dataclasses and pickle look
        classes up there). Not ``__main__``: a script's ``if __name__ == "__main__":`` entry point is run by
        the command the page gives for it, not by pasting its definitions."""
        if name not in modules:
            mod_name = "docs_" + re.sub(r"\W", "_", Path(page).stem) + (f"_{name}" if name else "")
            modules[name] = sys.modules[mod_name] = types.ModuleType(mod_name)
        return modules[name].__dict__

    builtins.print = recording_print
    report = {"blocks": len(blocks), "run": 0, "skipped": [], "compared": 0, "errors": [], "seconds": []}
    stated: dict[int, str] = {}
    for block in blocks:
        if block.skip is not None:
            report["skipped"].append([block.line, block.skip])
            continue
        stated.update(stated_outputs(block))
        start = time.perf_counter()
        try:
            # padded so that tracebacks name the page's own line numbers
            code = compile("\n" * (block.line - 1) + block.code, filename, "exec")
            exec(code, namespace(block.namespace))
        except BaseException as e:  # SystemExit too: every failure is reported with its block
            tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))  # from the block on
            report["errors"].append(f"{page}: block at line {block.line} raised {type(e).__name__}: {e}\n{tb}")
            break
        report["run"] += 1
        report["seconds"].append([block.line, round(time.perf_counter() - start, 2)])
        with contextlib.suppress(Exception):
            sys.stdout.flush()
    if not report["errors"]:
        for line, text in sorted(stated.items()):
            printed = outputs.get(line)
            if not printed:
                report["errors"].append(f"{page}:{line}: the print stating {text!r} never ran")
                continue
            pattern = output_pattern(text)
            for out in printed:
                report["compared"] += 1
                got = out.rstrip("\n").strip()
                if not pattern.fullmatch(got):
                    report["errors"].append(f"{page}:{line}: printed {got!r}, the comment says {text!r}")
    builtins.print = real_print
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report["cpu_seconds"] = round(usage.ru_utime + usage.ru_stime, 1)
    Path(result_path).write_text(json.dumps(report))
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(run_page(sys.argv[1], sys.argv[2]))


# ---------------------------------------------------------------------------- the tests
import pytest  # noqa: E402 - the worker above needs no pytest

PAGES = [p.relative_to(ROOT).as_posix() for p in pages()]


@pytest.mark.parametrize("page", PAGES)
def test_page_runs_as_written(page, tmp_path):
    """The page's blocks run in a fresh interpreter (8 CPU devices, an empty cwd) and print what they say."""
    blocks = python_blocks(ROOT / page)  # a malformed marker fails here, on any page
    if all(b.skip is not None for b in blocks):
        return  # nothing to run: no python block, or illustrations only (their reasons are in the markers)
    from tests.xla_flags import cpu_xla_flags

    env = dict(os.environ)
    env.update(
        XLA_FLAGS=cpu_xla_flags(8),
        JAX_PLATFORMS="cpu",
        # this checkout's jaxlight, whichever one is installed
        PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    result, work = tmp_path / "result.json", tmp_path / "cwd"
    work.mkdir()
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), page, str(result)],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=PAGE_TIMEOUT_S,
    )
    assert result.exists(), f"{page}: the worker died (rc {r.returncode}):\n{r.stderr[-4000:]}"
    report = json.loads(result.read_text())
    tails = f"\n--- stdout tail:\n{r.stdout[-1500:]}\n--- stderr tail:\n{r.stderr[-1500:]}"
    assert not report["errors"], "\n".join(report["errors"]) + tails
    assert r.returncode == 0, tails
    skipped = [b for b in blocks if b.skip is not None]
    assert (report["run"], len(report["skipped"])) == (len(blocks) - len(skipped), len(skipped)), report


def test_output_rule():
    """The printed-value rule of the module docstring, on the cases it was written for."""
    cases = [
        ("0.001 2", "0.0009999999776482583 2", False),  # the digits given are not the digits printed
        ("0.001 2", "0.001 2", True),
        ("[0.1, 0.05]", "[0.10000000149011612, 0.05000000074505806]", True),  # float32 values as floats
        ("0.036", "0.0359", False),
        ("2", "20", False),
        ("2", "2.0", False),
        ("[{'val_acc': ...}]", "[{'val_acc': 0.125}]", True),
        ("[{'val_acc': ...}]", "[{'val_acc': 0.125, 'val_loss': 1.5}] and more", False),
        ("...2", "12", False),
        ("(4, 4)", "(4,  4)", True),
        ("8 float32", "8 bfloat16", False),
        ("max difference: 1.2e-07", "max difference: 1.2e-07", True),
        ("1.2e-07", "1.2e-06", False),
    ]
    got = [(stated, printed, bool(output_pattern(stated).fullmatch(printed))) for stated, printed, _ in cases]
    assert got == cases


def test_markers(tmp_path, monkeypatch):
    """skip needs a reason; an unknown marker, or one with no python fence after it, is an error."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    page = tmp_path / "page.md"

    def parse(text: str) -> list[Block]:
        page.write_text(text)
        return python_blocks(page)

    body = "```python\nx = 1\n```\n"
    blocks = parse(f"<!-- docs-test: skip (a fragment) -->\n{body}\n<!-- docs-test: namespace other -->\n{body}")
    assert [(b.line, b.skip, b.namespace) for b in blocks] == [(3, "a fragment", ""), (8, None, "other")]
    assert [(b.line, b.code) for b in parse("- item\n\n  ```py\n  if x:\n      y = 2\n  ```\n")] == [
        (4, "if x:\n    y = 2\n")
    ]
    for bad in (
        f"<!-- docs-test: skip -->\n{body}",
        f"<!-- docs-test: skip () -->\n{body}",
        f"<!-- docs-test: skp (typo) -->\n{body}",
        "<!-- docs-test: skip (no fence) -->\ntext\n",
        "<!-- docs-test: skip (a bash block) -->\n```bash\nls\n```\n",
        "<!-- docs-test: skip (at the end) -->\n",
    ):
        with pytest.raises(DocMarkerError, match=r"page\.md:1: "):
            parse(bad)
