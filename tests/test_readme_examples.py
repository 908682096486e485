"""Issue 20 item 5: the README's Python runs as written.  Every ```python block of README.md
is an example marked ``<!-- example: NAME -->`` (or ``<!-- example: NAME after PREV -->``,
run in the namespace PREV's chain left) on the line before it; each chain runs in a fresh
interpreter, on the CPU, on this leg's backend (KVCM_BACKEND), in a scratch directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import kvcm
import pytest

PKG_ROOT = Path(kvcm.__file__).resolve().parent.parent
README = PKG_ROOT.parent / "README.md"
MARK = re.compile(r"^<!-- example: ([\w-]+)(?: after ([\w-]+))? -->$")
FENCE = re.compile(r"^```(\w*)\s*$")


def examples(text: str) -> dict[str, tuple[str | None, str, int]]:
    """``{name: (after, code, line)}``; raises AssertionError for an unmarked python block,
    a marker without a python block, or a chain to an unknown example."""
    lines = text.splitlines()
    out: dict[str, tuple[str | None, str, int]] = {}
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
            name, after = mark.group(1), mark.group(2)
            assert name not in out, f"README.md:{start + 1}: example {name!r} twice"
            assert after is None or after in out, f"README.md:{start + 1}: {name!r} after unknown {after!r}"
            out[name] = (after, body, start + 1)
        else:
            assert mark is None, f"README.md:{start + 1}: an example marker on a {lang or 'plain'} block"
    return out


EXAMPLES = examples(README.read_text(encoding="utf-8"))


def chain(name: str) -> list[str]:
    after, _, _ = EXAMPLES[name]
    return ([*chain(after)] if after else []) + [name]


def test_readme_has_examples_and_the_parser_refuses_unmarked_blocks():
    assert {"engine-loop", "copy-error", "decode-batch", "publisher", "shared-tier"} <= set(EXAMPLES)
    with pytest.raises(AssertionError, match="without an <!-- example"):
        examples("text\n```python\nprint(1)\n```\n")


RUNNER = """
import sys
ns = {"__name__": "__main__"}
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    print(f"== {name}", flush=True)
    exec(compile(open(path).read(), f"README.md example {name}", "exec"), ns)
"""


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_readme_example_runs_as_written(name, tmp_path):
    args = []
    for n in chain(name):
        path = tmp_path / f"{n}.py"
        path.write_text(EXAMPLES[n][1])
        args += [n, str(path)]
    env = {k: v for k, v in os.environ.items() if k != "KVCM_OPLOG"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PKG_ROOT), env.get("PYTHONPATH")) if p)
    p = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert p.returncode == 0, f"README.md:{EXAMPLES[name][2]} ({name}):\n{p.stdout}\n{p.stderr}"
    out = p.stdout
    if "engine-loop" in chain(name):
        assert "\n96\n" in out, out  # the system prompt is reusable: chunked commits snapshot the ssm state
    if name == "shared-tier":
        assert "first reuses 0 tokens" in out and "second reuses 320 tokens" in out, out
