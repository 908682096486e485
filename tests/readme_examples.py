"""The README's Python examples (issue 20 item 5): every ```python block of README.md is an
example marked ``<!-- example: NAME -->`` (or ``<!-- example: NAME after PREV -->``, run in the
namespace PREV's chain left) on the line before it.  :func:`run_example` runs one (after its
chain) in a fresh interpreter.  Used by tests/house/test_readme_examples.py (every example on
the leg's backend) and the vllm leg (the ``needs vllm`` example)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from children import child_env

# the checkout these tests are in (not the installed kvcm's: a `pip install '.[vllm]'` over an
# editable install puts kvcm in site-packages, where no README.md is)
README = Path(__file__).resolve().parent.parent / "README.md"
MARK = re.compile(r"^<!-- example: ([\w-]+)(?: after ([\w-]+))?(?: needs (vllm))? -->$")
SHELL_MARK = re.compile(r"^<!-- shell: ([\w-]+) -->$")  # a bash block a test runs as written (issue 37)
FENCE = re.compile(r"^```(\w*)\s*$")


def examples(text: str) -> dict[str, tuple[str | None, str, int, str | None]]:
    """``{name: (after, code, line, needs)}`` (``needs``: ``"vllm"`` for an example that runs
    in the vllm leg, tests/engines/test_vllm_connector.py, else None); raises AssertionError for an unmarked python block,
    a marker without a python block, or a chain to an unknown example."""
    lines = text.splitlines()
    out: dict[str, tuple[str | None, str, int, str | None]] = {}
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        lang, start = m.group(1), i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = "\n".join(lines[start + 1 : i]) + "\n"
        i += 1
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(prev.strip())
        if lang == "python":
            assert mark, f"README.md:{start + 1}: a python block without an <!-- example: NAME --> marker"
            name, after, needs = mark.group(1), mark.group(2), mark.group(3)
            assert name not in out, f"README.md:{start + 1}: example {name!r} twice"
            assert after is None or after in out, f"README.md:{start + 1}: {name!r} after unknown {after!r}"
            out[name] = (after, body, start + 1, needs)
        else:
            assert mark is None, f"README.md:{start + 1}: an example marker on a {lang or 'plain'} block"
    return out


EXAMPLES = examples(README.read_text(encoding="utf-8"))


def shell_blocks(text: str) -> dict[str, str]:
    """``{name: script}``: each ```bash block marked ``<!-- shell: NAME -->`` on the line
    before it (the vLLM walk-through: tests/engines/test_vllm_walkthrough.py; the config
    file example: tests/engines/test_vllm_startup.py).  AssertionError for a marker on
    another kind of block, or a name twice."""
    lines = text.splitlines()
    out: dict[str, str] = {}
    for i, line in enumerate(lines):
        m = SHELL_MARK.match(line.strip())
        if m is None:
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip():
            j += 1
        assert j < len(lines) and lines[j].strip() == "```bash", f"README.md:{i + 1}: a shell marker not on a bash block"
        k = j + 1
        while k < len(lines) and lines[k].strip() != "```":
            k += 1
        assert m.group(1) not in out, f"README.md:{i + 1}: shell block {m.group(1)!r} twice"
        out[m.group(1)] = "\n".join(lines[j + 1 : k]) + "\n"
    return out


SHELL = shell_blocks(README.read_text(encoding="utf-8"))


def chain(name: str) -> list[str]:
    after = EXAMPLES[name][0]
    return ([*chain(after)] if after else []) + [name]


# argv: NAME PATH pairs, then "--" and the arguments the examples see as sys.argv[1:]
RUNNER = """
import sys
sep = sys.argv.index("--")
pairs, sys.argv = sys.argv[1:sep], [sys.argv[0], *sys.argv[sep + 1:]]
ns = {"__name__": "__main__"}
for name, path in zip(pairs[0::2], pairs[1::2]):
    print(f"== {name}", flush=True)
    exec(compile(open(path).read(), f"README.md example {name}", "exec"), ns)
"""


def run_example(name: str, tmp_path: Path, argv: tuple[str, ...] = (), timeout: float = 300) -> str:
    """Run example ``name`` (after its chain) in a fresh interpreter; its stdout."""
    args = []
    for n in chain(name):
        path = tmp_path / f"{n}.py"
        path.write_text(EXAMPLES[n][1])
        args += [n, str(path)]
    env = child_env({k: v for k, v in os.environ.items() if k != "KVCM_OPLOG"})  # the kvcm this process runs
    p = subprocess.run([sys.executable, "-c", RUNNER, *args, "--", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=timeout, check=False)
    assert p.returncode == 0, f"README.md:{EXAMPLES[name][2]} ({name}):\n{p.stdout}\n{p.stderr}"
    return p.stdout


__all__ = ["EXAMPLES", "SHELL", "chain", "examples", "run_example", "shell_blocks"]
